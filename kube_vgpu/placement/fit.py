"""The fit rules: can a pod's containers be placed on one node's GPUs, and on which.

Fit is per GPU, never a node sum. For every container it needs ``count`` distinct GPUs, each
healthy, allowed by the pod's constraints, with a free vGPU slot, enough free memory (MiB) and
cores (percent); an exclusive request (cores 100 or memory 100%) needs an idle GPU, and a GPU whose
compute is fully booked takes no request with cores 0. Init containers are fitted one at a time on
the node as it is; app containers are fitted together on an accumulating copy, so two app
containers never double-book a GPU beyond its capacity. The pod then holds, per GPU,
``max(init peak, sum of app containers)``.

Pure functions over a :class:`NodeState`; they never mutate it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..model import ContainerRequest, PodRequest
from .state import NodeState

#: per container: tuple of (gpu index on node, MiB, cores)
ContainerPlan = tuple[tuple[int, int, int], ...]
#: ordering of candidate GPU indexes for one container (policy decides)
GpuOrder = Callable[[NodeState, list[int], list[int], list[int], ContainerRequest], list[int]]


@dataclass(frozen=True, slots=True)
class Plan:
    """A feasible placement on one node: per container (init first, then app) its GPU plan."""

    containers: tuple[ContainerPlan, ...]

    def usage(self, n_init: int) -> dict[int, tuple[int, int, int]]:
        """Per GPU index: (MiB, cores, slots) the pod would hold (init collapsed into app)."""
        app: dict[int, list[int]] = {}
        ini: dict[int, list[int]] = {}
        for k, cp in enumerate(self.containers):
            for i, mem, cores in cp:
                if k < n_init:
                    cur = ini.setdefault(i, [0, 0, 1])
                    cur[0] = max(cur[0], mem)
                    cur[1] = max(cur[1], cores)
                else:
                    cur = app.setdefault(i, [0, 0, 0])
                    cur[0] += mem
                    cur[1] += cores
                    cur[2] += 1
        out = {}
        for i in set(app) | set(ini):
            a = app.get(i, [0, 0, 0])
            b = ini.get(i, [0, 0, 0])
            out[i] = (max(a[0], b[0]), max(a[1], b[1]), max(a[2], b[2]))
        return out


def order_by_index(node: NodeState, cands: list[int], mem: list[int], cores: list[int],
                   req: ContainerRequest) -> list[int]:
    """GPU order: by index."""
    return cands


def _used_score(node: NodeState, i: int, mem: list[int], cores: list[int], slots: list[int]) -> float:
    d = node.devices[i]
    return ((d.split - slots[i]) / d.split + (d.cores - cores[i]) / max(d.cores, 1)
            + (d.memory_mib - mem[i]) / max(d.memory_mib, 1))


def _short(uuid: str) -> str:
    return uuid if len(uuid) <= 12 else uuid[:12]


def _fit_container(node: NodeState, req: ContainerRequest, mem: list[int], cores: list[int],
                   slots: list[int], pod: PodRequest, order: GpuOrder) -> ContainerPlan | str:
    devs = node.devices
    n = len(devs)
    if req.count > n:
        hint = " (nvidia.com/gpu counts physical GPUs per container, not vGPU slots)" if n else ""
        return f"container {req.name} needs {req.count} GPUs, node has {n}{hint}"
    cands: list[int] = []
    excluded: list[str] = []
    best_mem = (-1, "")
    best_cores = (-1, "")
    n_slots = n_excl = n_exh = 0
    for i, d in enumerate(devs):
        if not d.healthy:
            excluded.append(f"{_short(d.uuid)} unhealthy")
            continue
        why = pod.constraints.why_not(d) if not pod.constraints.empty else None
        if why is None and pod.gpu_spec and d.model not in pod.gpu_spec:
            why = f"model {d.model} not in {'|'.join(pod.gpu_spec)}"
        if why is not None:
            excluded.append(f"{_short(d.uuid)} {why}")
            continue
        if slots[i] <= 0:
            n_slots += 1
            continue
        gpu_mem = req.memory_on(d)
        gpu_cores = req.cores_on(d)
        if req.exclusive and slots[i] < d.split:
            n_excl += 1
            continue
        if cores[i] <= 0 and gpu_cores == 0 and d.cores > 0:
            n_exh += 1
            continue
        if mem[i] > best_mem[0]:
            best_mem = (mem[i], d.uuid)
        if cores[i] > best_cores[0]:
            best_cores = (cores[i], d.uuid)
        if mem[i] < gpu_mem or cores[i] < gpu_cores:
            continue
        cands.append(i)
    if len(cands) >= req.count:
        chosen = order(node, cands, mem, cores, req)[: req.count]
        return tuple((i, req.memory_on(devs[i]), req.cores_on(devs[i])) for i in chosen)
    # Build the most useful reason.
    who = f"container {req.name}"
    if len(excluded) == n:
        return f"{who}: no usable GPU ({'; '.join(excluded[:3])})"
    per_gpu = "per GPU" if req.count > 1 else "on one GPU"
    if req.exclusive and n_excl:
        return f"{who} needs {req.count} idle GPU(s) (exclusive request); {n_excl} of {n} GPUs are in use"
    if n_slots and n_slots + len(excluded) == n:
        return f"{who}: all vGPU slots of the node's GPUs are taken"
    need_mem: int | None = req.memory_mib or None
    if best_mem[0] >= 0:
        sample = devs[node.by_uuid[best_mem[1]]]
        nm = req.memory_on(sample)
        if best_mem[0] < nm:
            return (f"{who} needs {need_mem or nm} MiB {per_gpu}; largest free is {best_mem[0]} MiB "
                    f"on {_short(best_mem[1])}")
        nc = req.cores_on(sample)
        if best_cores[0] < nc:
            return (f"{who} needs {nc}% cores {per_gpu}; most free is {best_cores[0]}% "
                    f"on {_short(best_cores[1])}")
    if n_exh:
        return f"{who}: compute of {n_exh} GPU(s) is fully booked (exclusive holder)"
    return (f"{who} needs {req.count} GPUs with {need_mem or req.memory_percent}"
            f"{' MiB' if need_mem else '% memory'} and {req.cores}% cores free, only {len(cands)} qualify"
            + (f" ({'; '.join(excluded[:2])})" if excluded else ""))


def fit_pod(node: NodeState, pod: PodRequest, order: GpuOrder = order_by_index) -> Plan | str:
    """Fit ``pod`` on ``node``; returns a Plan or a human-readable reason (str) why not.

    order: picks the GPUs among the candidates for each container (the GPU policy).
    """
    if node.cpu_total and pod.cpu_milli > node.cpu_free:
        return f"needs {pod.cpu_milli}m CPU, node has {node.cpu_free}m free"
    if node.memory_total and pod.memory_mib > node.memory_free:
        return f"needs {pod.memory_mib} MiB host memory, node has {node.memory_free} MiB free"
    plans: list[ContainerPlan] = []
    for c in pod.init:
        r = _fit_container(node, c, node.free_mem, node.free_cores, node.free_slots, pod, order)
        if isinstance(r, str):
            return f"init {r}"
        plans.append(r)
    if pod.app:
        mem = list(node.free_mem)
        cores = list(node.free_cores)
        slots = list(node.free_slots)
        for c in pod.app:
            r = _fit_container(node, c, mem, cores, slots, pod, order)
            if isinstance(r, str):
                return r
            for i, m, k in r:
                mem[i] -= m
                cores[i] -= k
                slots[i] -= 1
            plans.append(r)
    return Plan(tuple(plans))


def gpu_order(kind: str) -> GpuOrder:
    """The GPU ordering for a GPU policy name: ``binpack`` (most used first), ``spread`` (least
    used first), ``bestfit`` (smallest free share that fits first), ``index``."""
    if kind == "index":
        return order_by_index

    if kind == "bestfit":
        def bestfit(node: NodeState, cands: list[int], mem: list[int], cores: list[int],
                    req: ContainerRequest) -> list[int]:
            return sorted(cands, key=lambda i: (min(cores[i] * 1000 // max(node.devices[i].cores, 1),
                                                    mem[i] * 1000 // max(node.devices[i].memory_mib, 1)), i))
        return bestfit

    sign = -1.0 if kind == "binpack" else 1.0

    def used(node: NodeState, cands: list[int], mem: list[int], cores: list[int],
             req: ContainerRequest) -> list[int]:
        slots = node.free_slots
        return sorted(cands, key=lambda i: (sign * _used_score(node, i, mem, cores, slots), i))
    return used


def plan_gpus(plan: Plan) -> Sequence[int]:
    """All GPU indexes a plan touches (sorted, unique)."""
    return sorted({i for cp in plan.containers for i, _, _ in cp})
