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

from collections.abc import Iterable, Mapping

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


def summary(f: FitFailure) -> str:
    """The text for kube-scheduler: the code in words and the request behind it (equal failures
    on different nodes give equal text)."""
    c = f.code
    if c is Code.INSUFFICIENT_MEMORY:
        return f"insufficient GPU memory: {_who(f)} needs {f.need} MiB {_per(f)}"
    if c is Code.INSUFFICIENT_CORES:
        return f"insufficient GPU compute: {_who(f)} needs {f.need}% cores {_per(f)}"
    if c is Code.NO_FREE_SLOT:
        return f"no free vGPU slot: {_who(f)} needs {f.count} GPU(s) with a free slot"
    if c is Code.TOO_FEW_GPUS:
        return f"too few GPUs on the node: {_who(f)} needs {f.count} GPUs ({GPU_COUNT_HINT})"
    if c is Code.TOO_FEW_QUALIFY:
        return (f"not enough GPUs with room: {_who(f)} needs {f.count} GPUs with {_mem(f)} and "
                f"{f.cores}% cores free")
    if c is Code.EXCLUSIVE_BUSY:
        return f"no idle GPU: {_who(f)} needs {f.count} idle GPU(s) (exclusive request)"
    if c is Code.COMPUTE_FULL:
        return (f"GPU compute fully booked: {_who(f)} reserves no compute and the GPUs with room have "
                "their compute fully booked by an exclusive holder")
    if c is Code.GPU_UNHEALTHY:
        return f"no usable GPU: {_who(f)}: the node's GPUs are unhealthy or cordoned"
    if c is Code.TYPE_EXCLUDED:
        return f"no usable GPU: {_who(f)}: GPU model excluded by the pod's GPU type constraints"
    if c is Code.UUID_EXCLUDED:
        return f"no usable GPU: {_who(f)}: GPUs excluded by the pod's GPU uuid constraints"
    if c is Code.HOST_CPU:
        return f"insufficient host CPU: needs {f.need}m"
    if c is Code.HOST_MEMORY:
        return f"insufficient host memory: needs {f.need} MiB"
    if c is Code.NO_INVENTORY:
        return "node has no vGPU inventory (device plugin not running or stale)"
    if c is Code.STALE_INVENTORY:
        return f"vGPU inventory heartbeat is stale (older than {f.need}s; device plugin down?)"
    if c is Code.BAD_INVENTORY:
        return "vGPU inventory annotation is invalid"
    if c is Code.NO_ALLOCATABLE:
        return f"node allocatable {f.detail} is 0 (device plugin not registered with the kubelet)"
    if c is Code.INVALID_REQUEST:
        return f.detail
    if c is Code.ALREADY_BOUND:
        return f"pod is already bound to {f.detail}"
    if c is Code.QUOTA_EXCEEDED:
        return f"GPU quota exceeded: {f.detail}"
    if c is Code.LINK_UNAVAILABLE:
        return f"no free GPUs linked by {link_class(f.need)}: {_who(f)} needs {f.count} GPUs linked by {link_class(f.need)}"
    if c is Code.LINK_ABSENT:
        return f"no GPUs linked by {link_class(f.need)} on the node: {_who(f)} needs {f.count}"
    if c is Code.MIG_NO_PROFILE:
        return (f"no allowed MIG profile holds the request: {_who(f)} needs {f.need} MiB; the largest "
                f"allowed MIG profile of {f.detail} has {f.have} MiB")
    if c is Code.MIG_NO_PLACEMENT:
        return (f"no free MIG placement: {_who(f)} needs {f.need} MiB (MIG profile {f.detail} or a larger "
                f"allowed one) and the MIG GPUs' free memory slices cannot hold it")
    return str(c.value)  # pragma: no cover - every code is listed above


def _gpu(f: FitFailure, node: NodeState | None) -> str:
    if f.gpu < 0:
        return ""
    if node is not None and f.gpu < len(node.devices):
        return f" on {node.devices[f.gpu].uuid}"
    return f" on the node's GPU #{f.gpu}"


def detail(f: FitFailure, node: NodeState | None = None) -> str:
    """The summary with the numbers behind it (largest free, how many GPUs qualify, ...) and,
    given the ``node`` the failure is about, the uuid of the GPU they were measured on."""
    s = summary(f)
    c = f.code
    if c is Code.INSUFFICIENT_MEMORY:
        return f"{s}; largest free is {f.have} MiB{_gpu(f, node)}"
    if c is Code.INSUFFICIENT_CORES:
        return f"{s}; most free is {f.have}%{_gpu(f, node)}"
    if c is Code.NO_FREE_SLOT:
        return f"{s}; all vGPU slots of the node's {f.have} usable GPU(s) are taken"
    if c is Code.TOO_FEW_GPUS:
        return f"{s}; the node has {f.have}"
    if c is Code.TOO_FEW_QUALIFY:
        return f"{s}; only {f.have} qualify"
    if c is Code.EXCLUSIVE_BUSY:
        return f"{s}; {f.have} of the node's GPUs are in use"
    if c is Code.COMPUTE_FULL:
        return f"{s}; {f.have} GPU(s)"
    if c in (Code.GPU_UNHEALTHY, Code.TYPE_EXCLUDED, Code.UUID_EXCLUDED):
        return f"{s} ({f.have} of {f.need} GPUs)"
    if c is Code.HOST_CPU:
        return f"{s}, node has {f.have}m free"
    if c is Code.HOST_MEMORY:
        return f"{s}, node has {f.have} MiB free"
    if c is Code.BAD_INVENTORY:
        return f"{s}: {f.detail}"
    if c in (Code.LINK_UNAVAILABLE, Code.LINK_ABSENT):
        return f"{s}; the best set reaches {link_class(f.have)}"
    if c is Code.MIG_NO_PLACEMENT:
        return f"{s} ({f.have} MIG GPU(s) tried)"
    return s


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
