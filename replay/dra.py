"""kube-scheduler's scan window for the replay's DRA-path models (docs/dra-placement.md).

kube-scheduler does not score every node: it filters nodes starting where the previous pod's
scan stopped and stops once it holds ``numFeasibleNodesToFind`` feasible ones
(:func:`kube_vgpu.placement.draalloc.nodes_to_find`), then picks the best score among those, ties
to the first in scan order, and the next scan starts after the last node it examined. The engine
answers every node (cached per pod shape); the window is applied over its answers here, which
gives the same choice as a sequential scan. (kube-scheduler filters in parallel, so the nodes it
examines past the last feasible one it keeps vary by a few; the model takes the sequential scan.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kube_vgpu.model import PodAllocation, PodRequest
from kube_vgpu.placement import Engine, Plan
from kube_vgpu.placement.draalloc import nodes_to_find
from kube_vgpu.policyregistry import node_policy

#: the registry option naming a model's ``percentageOfNodesToScore``
WINDOW_OPTION = "nodes_to_score"


class ScanWindow:
    """Place pods as kube-scheduler does with a ``percentage`` scan window (0 = adaptive) over
    ``engine``'s per-node scores. ``start``: the next scan's first node (position in
    ``engine.state.node_list``)."""

    def __init__(self, engine: Engine, percentage: int):
        self.engine = engine
        self.percentage = percentage
        self.start = 0
        nodes_to_find(percentage, 0)  # validate

    def choose(self, pod: PodRequest) -> tuple[str, Plan] | None:
        """The node and plan kube-scheduler would pick for ``pod`` now (None: fits nowhere), and
        move the scan's start past the nodes examined."""
        n = len(self.engine.state.node_list)
        if n == 0:
            return None
        k = nodes_to_find(self.percentage, n)
        idx = (np.arange(n, dtype=np.int64) + self.start) % n
        res = self.engine.evaluate_nodes(pod, idx)
        feasible = np.flatnonzero(res.feasible)  # positions in scan order
        kept = feasible[:k]
        examined = int(kept[-1]) + 1 if len(feasible) >= k else n
        self.start = (self.start + examined) % n
        if not len(kept):
            return None
        best = int(kept[int(np.argmax(res.scores[kept]))])  # first of the best, in scan order
        name = self.engine.state.node_list[int(idx[best])].name
        plan = self.engine.plan_for(pod, name)
        if not isinstance(plan, Plan):  # the engine answered feasible a moment ago
            raise RuntimeError(f"node {name} refused the plan it was scored with: {plan}")
        return name, plan

    def place(self, pod: PodRequest, now: float = 0.0) -> PodAllocation | None:
        """Choose as :meth:`choose` and book (the replay's step); None when it fits nowhere."""
        got = self.choose(pod)
        if got is None:
            return None
        alloc = self.engine.allocation(pod, got[0], got[1], now)
        self.engine.state.book(pod.key, alloc, pod.cpu_milli, pod.memory_mib, check=False)
        return alloc


def window_of(policy: str) -> int | None:
    """The ``percentageOfNodesToScore`` a replay policy's model declares, or None (every node
    is scored). Raises ValueError for an unknown policy."""
    v = node_policy(policy).options.get(WINDOW_OPTION)
    return None if v is None else int(v)


def placer(engine: Engine, policy: str, percentage: int | None = None) -> Callable[[PodRequest], PodAllocation | None]:
    """The replay's placement step for ``policy``: :meth:`Engine.place` (every node scored), or a
    :class:`ScanWindow` for a model with a window. ``percentage`` overrides the model's window
    (only for models that declare one). Raises ValueError for a percentage outside 0..100."""
    pct = window_of(policy)
    if pct is None:
        return engine.place
    if percentage is not None:
        pct = percentage
    return ScanWindow(engine, pct).place


__all__ = ["ScanWindow", "WINDOW_OPTION", "placer", "window_of"]
