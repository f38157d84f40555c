"""The one place where fit failures (:class:`~kube_vgpu.placement.status.FitFailure`) become text.

* :func:`summary` - what kube-scheduler gets in ``FailedNodes``: no GPU names and no per-node
  measurements (largest free, how many GPUs qualify), so nodes that fail for the same reason give
  the same string and kube-scheduler's ``0/50 nodes are available: 50 insufficient GPU memory: ...``
  groups them.
* :func:`detail` - the summary plus the numbers behind it and the GPU they were measured on: the
  extender's debug log, ``kubectl vgpu simulate`` and bind errors.
* :func:`aggregate` - a kube-scheduler style one-line summary of many nodes' failures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ..topology import link_class
from .state import NodeState
from .status import Code, FitFailure

#: what the GPU count of a request means, added to the too-few-GPUs text
GPU_COUNT_HINT = "the GPU count is physical GPUs per container, not vGPU slots"


def _who(f: FitFailure) -> str:
    return f"{'init container' if f.init else 'container'} {f.container}"


def _per(f: FitFailure) -> str:
    return "per GPU" if f.count > 1 else "on one GPU"


def _mem(f: FitFailure) -> str:
    return f"{f.mem_mib} MiB" if f.mem_mib or not f.mem_percent else f"{f.mem_percent}% memory"


#: each code's text for kube-scheduler: the code in words and the request behind it (equal
#: failures on different nodes give equal text); every code has one (tested)
_SUMMARY: dict[Code, Callable[[FitFailure], str]] = {
    Code.INSUFFICIENT_MEMORY: lambda f: f"insufficient GPU memory: {_who(f)} needs {f.need} MiB {_per(f)}",
    Code.INSUFFICIENT_CORES: lambda f: f"insufficient GPU compute: {_who(f)} needs {f.need}% cores {_per(f)}",
    Code.NO_FREE_SLOT: lambda f: f"no free vGPU slot: {_who(f)} needs {f.count} GPU(s) with a free slot",
    Code.TOO_FEW_GPUS: lambda f: f"too few GPUs on the node: {_who(f)} needs {f.count} GPUs ({GPU_COUNT_HINT})",
    Code.TOO_FEW_QUALIFY: lambda f: (
        f"not enough GPUs with room: {_who(f)} needs {f.count} GPUs with {_mem(f)} and {f.cores}% cores free"),
    Code.EXCLUSIVE_BUSY: lambda f: f"no idle GPU: {_who(f)} needs {f.count} idle GPU(s) (exclusive request)",
    Code.COMPUTE_FULL: lambda f: (
        f"GPU compute fully booked: {_who(f)} reserves no compute and the GPUs with room have their compute "
        "fully booked by an exclusive holder"),
    Code.GPU_UNHEALTHY: lambda f: f"no usable GPU: {_who(f)}: the node's GPUs are unhealthy or cordoned",
    Code.TYPE_EXCLUDED: lambda f: f"no usable GPU: {_who(f)}: GPU model excluded by the pod's GPU type constraints",
    Code.UUID_EXCLUDED: lambda f: f"no usable GPU: {_who(f)}: GPUs excluded by the pod's GPU uuid constraints",
    Code.HOST_CPU: lambda f: f"insufficient host CPU: needs {f.need}m",
    Code.HOST_MEMORY: lambda f: f"insufficient host memory: needs {f.need} MiB",
    Code.NO_INVENTORY: lambda f: "node has no vGPU inventory (device plugin not running or stale)",
    Code.STALE_INVENTORY: lambda f: f"vGPU inventory heartbeat is stale (older than {f.need}s; device plugin down?)",
    Code.BAD_INVENTORY: lambda f: "vGPU inventory annotation is invalid",
    Code.NO_ALLOCATABLE: lambda f: (
        f"node allocatable {f.detail} is 0 (device plugin not registered with the kubelet)"),
    Code.INVALID_REQUEST: lambda f: f.detail,
    Code.ALREADY_BOUND: lambda f: f"pod is already bound to {f.detail}",
    Code.QUOTA_EXCEEDED: lambda f: f"GPU quota exceeded: {f.detail}",
    Code.LINK_UNAVAILABLE: lambda f: (
        f"no free GPUs linked by {link_class(f.need)}: {_who(f)} needs {f.count} GPUs linked by "
        f"{link_class(f.need)}"),
    Code.LINK_ABSENT: lambda f: f"no GPUs linked by {link_class(f.need)} on the node: {_who(f)} needs {f.count}",
    Code.MIG_NO_PROFILE: lambda f: (
        f"no allowed MIG profile holds the request: {_who(f)} needs {f.need} MiB; the largest allowed MIG "
        f"profile of {f.detail} has {f.have} MiB"),
    Code.MIG_NO_PLACEMENT: lambda f: (
        f"no free MIG placement: {_who(f)} needs {f.need} MiB (MIG profile {f.detail} or a larger allowed one) "
        "and the MIG GPUs' free memory slices cannot hold it"),
}


def summary(f: FitFailure) -> str:
    """The text for kube-scheduler (:data:`_SUMMARY`)."""
    return _SUMMARY[f.code](f)


def _gpu(f: FitFailure, node: NodeState | None) -> str:
    if f.gpu < 0:
        return ""
    if node is not None and f.gpu < len(node.devices):
        return f" on {node.devices[f.gpu].uuid}"
    return f" on the node's GPU #{f.gpu}"


#: what each code's detail adds to its summary: the numbers behind it, given the failure and the
#: GPU they were measured on (" on GPU-..." or ""); codes without numbers add nothing
_DETAIL: dict[Code, Callable[[FitFailure, str], str]] = {
    Code.INSUFFICIENT_MEMORY: lambda f, on: f"; largest free is {f.have} MiB{on}",
    Code.INSUFFICIENT_CORES: lambda f, on: f"; most free is {f.have}%{on}",
    Code.NO_FREE_SLOT: lambda f, on: f"; all vGPU slots of the node's {f.have} usable GPU(s) are taken",
    Code.TOO_FEW_GPUS: lambda f, on: f"; the node has {f.have}",
    Code.TOO_FEW_QUALIFY: lambda f, on: f"; only {f.have} qualify",
    Code.EXCLUSIVE_BUSY: lambda f, on: f"; {f.have} of the node's GPUs are in use",
    Code.COMPUTE_FULL: lambda f, on: f"; {f.have} GPU(s)",
    Code.GPU_UNHEALTHY: lambda f, on: f" ({f.have} of {f.need} GPUs)",
    Code.TYPE_EXCLUDED: lambda f, on: f" ({f.have} of {f.need} GPUs)",
    Code.UUID_EXCLUDED: lambda f, on: f" ({f.have} of {f.need} GPUs)",
    Code.HOST_CPU: lambda f, on: f", node has {f.have}m free",
    Code.HOST_MEMORY: lambda f, on: f", node has {f.have} MiB free",
    Code.BAD_INVENTORY: lambda f, on: f": {f.detail}",
    Code.LINK_UNAVAILABLE: lambda f, on: f"; the best set reaches {link_class(f.have)}",
    Code.LINK_ABSENT: lambda f, on: f"; the best set reaches {link_class(f.have)}",
    Code.MIG_NO_PLACEMENT: lambda f, on: f" ({f.have} MIG GPU(s) tried)",
}


def detail(f: FitFailure, node: NodeState | None = None) -> str:
    """The summary with the numbers behind it (largest free, how many GPUs qualify, ...) and,
    given the ``node`` the failure is about, the uuid of the GPU they were measured on."""
    more = _DETAIL.get(f.code)
    return summary(f) + (more(f, _gpu(f, node)) if more is not None else "")


def aggregate(reasons: Iterable[str], total: int, top: int = 5) -> str:
    """kube-scheduler style summary: ``"0/5 nodes are available: 3 <reason>; 2 <reason>."``.

    reasons: one text per failed node; total: number of candidate nodes. Identical texts are
    grouped, the ``top`` largest groups listed (most frequent first), the rest counted."""
    counts: dict[str, int] = {}
    n = 0
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
        n += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{k} {r}" for r, k in ranked[:top]]
    rest = sum(k for _, k in ranked[top:])
    if rest:
        parts.append(f"{rest} other (different reasons)")
    return f"{total - n}/{total} nodes are available: " + "; ".join(parts) + "."


def summaries(failed: Mapping[str, FitFailure]) -> tuple[dict[str, str], dict[str, str]]:
    """node -> failure into (resolvable, unresolvable) node -> :func:`summary`: the extender's
    ``FailedNodes`` and ``FailedAndUnresolvableNodes``. Each distinct failure object is rendered
    once (nodes in the same state share one)."""
    texts: dict[int, tuple[str, bool]] = {}
    res: dict[str, str] = {}
    unres: dict[str, str] = {}
    for name, f in failed.items():
        hit = texts.get(id(f))
        if hit is None:
            hit = texts[id(f)] = (summary(f), f.resolvable)
        (res if hit[1] else unres)[name] = hit[0]
    return res, unres
