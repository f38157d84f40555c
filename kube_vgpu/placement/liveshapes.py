"""FGD's target workload in live operation.

FGD scores a placement by how much it raises the expected fragmentation of a node under the
*typical task shapes* of the workload. Offline (``simulate``) these come from the trace; the
running extender derives them from the pods it currently knows (its bookings) with
:func:`shapes_from_state`, and falls back to :data:`DEFAULT_TASKS` while fewer than
``min_pods`` pods are known. Shapes are (host CPU millicores, milli-GPU per GPU, GPU count, models);
CPU is not modelled by the extender (kube-scheduler owns it), so it is always 0.
"""

from __future__ import annotations

from .policies import TaskShape, typical_shapes
from .state import ClusterState

#: a sensible default mix (cpu_milli, milli-GPU per GPU, GPUs, models) x weight: mostly whole and
#: fractional single-GPU pods, a few multi-GPU jobs (shares in the spirit of the Alibaba 2023 trace)
DEFAULT_TASKS: tuple[tuple[tuple[int, int, int, tuple[str, ...]], int], ...] = (
    ((0, 1000, 1, ()), 35),
    ((0, 500, 1, ()), 20),
    ((0, 250, 1, ()), 15),
    ((0, 100, 1, ()), 10),
    ((0, 1000, 2, ()), 10),
    ((0, 1000, 4, ()), 5),
    ((0, 1000, 8, ()), 5),
)


def default_shapes() -> list[TaskShape]:
    """The default task shapes (see :data:`DEFAULT_TASKS`)."""
    tasks = [shape for shape, weight in DEFAULT_TASKS for _ in range(weight)]
    return typical_shapes(tasks, coverage=1.0)


def shapes_from_state(state: ClusterState, min_pods: int = 20, quantum: int = 50) -> list[TaskShape]:
    """Typical shapes of the currently booked pods (one task per pod: its largest container).

    milli-GPU per GPU = max(cores share, memory share) x 1000 of the GPU it sits on, rounded up to
    ``quantum`` so near-identical pods group; fewer than ``min_pods`` pods -> :func:`default_shapes`.
    """
    tasks: list[tuple[int, int, int, tuple[str, ...]]] = []
    for b in state.bookings.values():
        node = state.nodes.get(b.node)
        if node is None:
            continue
        best: tuple[int, int] | None = None  # (milli, count)
        for c in b.allocation.containers:
            if not c.devices:
                continue
            milli = 0
            for d in c.devices:
                i = node.by_uuid.get(d.uuid)
                if i is None:
                    continue
                dev = node.devices[i]
                m = max(d.cores * 1000 // max(dev.cores, 1), -(-d.memory_mib * 1000 // max(dev.memory_mib, 1)))
                milli = max(milli, min(1000, m))
            cand = (-(-milli // quantum) * quantum, len(c.devices))
            if best is None or cand[0] * cand[1] > best[0] * best[1]:
                best = cand
        if best is not None and best[0] > 0:
            tasks.append((0, best[0], best[1], ()))
    if len(tasks) < min_pods:
        return default_shapes()
    return typical_shapes(tasks)
