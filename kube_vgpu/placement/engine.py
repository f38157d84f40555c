"""The placement engine: filter, score and choose over an incremental :class:`ClusterState`.

Decisions are cached per (policy, pod shape) and node: a node's cached result is recomputed only
when that node changed since (its version moved), so a decision costs one vector compare over the
nodes plus the work on the few nodes that changed. Hot path: no I/O.

Changed nodes are evaluated one by one with the reference rules (:mod:`.fit`, the policy's
``score``), shared between nodes in the same state, when few changed; when many did (a new pod
shape: all of them) and the policy is vectorised (:func:`.vector.kinds`: binpack, spread,
bestfit, dotprod; not FGD), all at once by :mod:`.vector`, whose answers are the same. A node
evaluated that way holds :data:`.vector.FEASIBLE` until its Plan is needed (choose, plan_for,
assume_on), which the reference rules then make for that one node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..model import ContainerAllocation, DeviceBooking, PodAllocation, PodRequest
from ..policyregistry import GPU_SPREAD, NODE_POLICIES
from .fit import Plan, topology_plan
from .memo import BoundedMemo
from .policies import Policy, TaskShape, make_policy
from .state import Assumption, Booking, ClusterState, NodeState
from .status import NO_INVENTORY, FitFailure
from .vector import FEASIBLE, kinds
from .vector import evaluate as evaluate_vector

NEG_INF = -math.inf


def pod_shape(pod: PodRequest, host: bool = True) -> tuple[object, ...]:
    """What a placement decision for ``pod`` depends on: per container its name (failures name
    it), init flag, GPU count, MiB or percent per GPU and cores; the GPU constraints (type and uuid
    selectors, the replay's exact model list); and, with ``host``, the pod's host CPU (millicores)
    and memory (MiB). Pod name, namespace, uid and priorities are not part of it.

    ``host=False`` is the right key when no node models host CPU or memory (the live extender:
    kube-scheduler checks those itself): then neither the fit nor any policy's score reads them,
    and pods that differ only in their CPU or memory requests share one cached decision."""
    gpu = (tuple((c.name, c.init, c.count, c.memory_mib, c.memory_percent, c.cores) for c in pod.containers),
           pod.constraints, pod.gpu_spec)
    return (gpu, pod.cpu_milli, pod.memory_mib) if host else (gpu,)


class _Entry:
    __slots__ = ("key", "versions", "scores", "results")

    def __init__(self, key: tuple[object, ...], n: int):
        self.key = key
        self.versions = np.full(n, -1, dtype=np.int64)
        self.scores = np.full(n, NEG_INF, dtype=np.float64)
        #: per node: its Plan when feasible, else its FitFailure (shared by nodes in the same
        #: state); None until the node is first evaluated
        self.results: np.ndarray = np.full(n, None, dtype=object)


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen node and plan for a pod, with the policy score: ``node`` the node's name, ``plan``
    the GPUs each container gets there, ``score`` the node policy's score (higher is better)."""

    node: str
    plan: Plan
    score: float


@dataclass(frozen=True, slots=True)
class NodeResults:
    """One pod evaluated on many nodes (:meth:`Engine.evaluate_nodes`), aligned with the node
    indexes asked about: ``scores`` (float64; the policy score, -inf where the pod does not fit)
    and ``outcomes`` (object array: the FitFailure where the pod does not fit; where it fits, its
    Plan or :data:`~kube_vgpu.placement.vector.FEASIBLE` when the Plan is made on demand by
    :meth:`Engine.choose` / :meth:`Engine.plan_for`). Both are the caller's own copies."""

    scores: np.ndarray
    outcomes: np.ndarray

    @property
    def feasible(self) -> np.ndarray:
        """Bool mask: where the pod fits (exactly where the score is above -inf)."""
        return self.scores > NEG_INF


class Engine:
    """Filter / prioritize / choose / book over a ClusterState.

    node_policy / gpu_policy: defaults (pod annotations override); shapes: FGD's target workload;
    cache_entries: how many (policy, pod shape) decisions are kept (least recently used dropped);
    memo_entries: how many (shape, node state) results nodes in the same state share;
    vector_min: from how many changed nodes on a decision is evaluated with :mod:`.vector` (0:
    always, when the policy is vectorised; a very large number: never).
    """

    def __init__(self, state: ClusterState, node_policy: str = NODE_POLICIES[0], gpu_policy: str = GPU_SPREAD.name,
                 shapes: list[TaskShape] | None = None, cache_entries: int = 512, memo_entries: int = 300_000,
                 vector_min: int = 24):
        self.state = state
        self.vector_min = vector_min
        self.node_policy = node_policy
        self.gpu_policy = gpu_policy
        self.shapes = shapes
        self._policies: dict[tuple[str, str], Policy] = {}
        self._cache: BoundedMemo[tuple[object, ...], _Entry] = BoundedMemo(cache_entries)
        self._generation = state.generation
        #: (policy, shape, node signature) -> (score, Plan | FitFailure): nodes in the same state
        #: share it
        self._memo: BoundedMemo[tuple[object, ...], tuple[float, Plan | FitFailure]] = \
            BoundedMemo(memo_entries, lru=False)
        make_policy(node_policy, gpu_policy, shapes)  # validate now

    # -- configuration --------------------------------------------------------------------------
    def configure(self, node_policy: str, gpu_policy: str, shapes: list[TaskShape] | None = None) -> None:
        """Change the default policies (and FGD shapes); drops cached decisions.
        Raises ValueError for an unknown policy."""
        make_policy(node_policy, gpu_policy, shapes if shapes is not None else self.shapes)
        self.node_policy, self.gpu_policy = node_policy, gpu_policy
        if shapes is not None:
            self.shapes = shapes
        self._policies.clear()
        self._cache.clear()
        self._memo.clear()

    def policy(self, pod: PodRequest) -> Policy:
        """The scorer for a pod (its annotations override the defaults)."""
        key = (pod.node_policy or self.node_policy, pod.gpu_policy or self.gpu_policy)
        p = self._policies.get(key)
        if p is None:
            p = make_policy(key[0], key[1], self.shapes)
            self._policies[key] = p
        return p

    @property
    def cached_shapes(self) -> int:
        """How many (policy, pod shape) decisions are cached (see :func:`pod_shape`)."""
        return len(self._cache)

    # -- evaluation -----------------------------------------------------------------------------
    def _entry(self, pod: PodRequest) -> tuple[_Entry, Policy]:
        if self._generation != self.state.generation:
            self._cache.clear()
            self._generation = self.state.generation
        pol = self.policy(pod)
        key = (pol.name, pod.gpu_policy or self.gpu_policy, pod_shape(pod, self.state.models_host))
        e = self._cache.get(key)
        if e is None:
            e = self._cache.put(key, _Entry(key, len(self.state.node_list)))
        return e, pol

    def _refresh(self, e: _Entry, pol: Policy, pod: PodRequest, idx: np.ndarray | None) -> None:
        versions = self.state.versions
        if idx is None:
            dirty = np.flatnonzero(e.versions != versions)
        else:
            dirty = idx[e.versions[idx] != versions[idx]]
        if len(dirty) and len(dirty) >= self.vector_min and not pod.constraints.min_link:
            vk = kinds(pol)  # (the vectorised fit does not evaluate interconnect requirements)
            if vk is not None:
                # nor dynamic-MIG geometry: nodes with such GPUs take the reference path below
                mig = self.state.table.mig[dirty] != 0
                vec = dirty[~mig] if mig.any() else dirty
                if len(vec):
                    sc, out = evaluate_vector(self.state.table, vec, pod, *vk)
                    e.scores[vec] = sc
                    e.results[vec] = out
                    e.versions[vec] = versions[vec]
                if len(vec) == len(dirty):
                    return
                dirty = dirty[mig]
        nodes = self.state.node_list
        memo = self._memo
        results = e.results
        c = pod.constraints
        by_uuid = bool(c.use_uuids or c.nouse_uuids)  # then two nodes in one state differ by their GPUs' uuids
        for i in dirty.tolist():
            node = nodes[i]
            mkey = (e.key, node.signature(), tuple(d.uuid for d in node.devices)) if by_uuid \
                else (e.key, node.signature())
            hit = memo.get(mkey)
            if hit is None:
                r = pol.evaluate(node, pod)
                hit = memo.put(mkey, (NEG_INF, r) if isinstance(r, FitFailure) else r)
            results[i] = hit[1]
            e.scores[i] = hit[0]
            e.versions[i] = versions[i]

    def evaluate_nodes(self, pod: PodRequest, idx: np.ndarray) -> NodeResults:
        """Evaluate ``pod`` on many nodes at once: ``idx`` holds node indexes (positions in
        ``state.node_list``, int64, each in range; repeats allowed). Decisions are cached per
        pod shape inside the engine; only nodes that changed since are evaluated again.
        Raises IndexError for an index out of range."""
        e, pol = self._entry(pod)
        self._refresh(e, pol, pod, idx)
        return NodeResults(e.scores[idx], e.results[idx])

    def evaluate(self, pod: PodRequest, names: Sequence[str] | None = None
                 ) -> tuple[list[str], dict[str, FitFailure], dict[str, float]]:
        """Per candidate node: feasible names (in input order), the typed failure of the others,
        and the policy score of each feasible node. Unknown node names fail with
        :data:`~kube_vgpu.placement.status.NO_INVENTORY`."""
        nodes = self.state.nodes
        failed: dict[str, FitFailure] = {}
        if names is None:
            cand = [n.name for n in self.state.node_list]
            idx = np.arange(len(cand), dtype=np.int64)
        else:
            cand = []
            ids = []
            for name in names:
                n = nodes.get(name)
                if n is None:
                    failed[name] = NO_INVENTORY
                else:
                    cand.append(name)
                    ids.append(n.idx)
            idx = np.array(ids, dtype=np.int64)
        res = self.evaluate_nodes(pod, idx)
        ok: list[str] = []
        scores: dict[str, float] = {}
        for name, s, r in zip(cand, res.scores.tolist(), res.outcomes.tolist(), strict=True):
            if isinstance(r, FitFailure):
                failed[name] = r
            else:
                ok.append(name)
                scores[name] = s
        return ok, failed, scores

    def _outcome(self, e: _Entry, pol: Policy, pod: PodRequest, i: int) -> Plan | FitFailure:
        """Node ``i``'s refreshed outcome in entry ``e``, its Plan made now if it was evaluated
        with the others (:data:`.vector.FEASIBLE`)."""
        r = e.results[i]
        assert r is not None  # refreshed by the caller
        if r is FEASIBLE:
            made = pol.evaluate(self.state.node_list[i], pod)
            assert not isinstance(made, FitFailure), "vectorised fit disagrees with the reference"
            r = e.results[i] = made[1]
        return r  # type: ignore[no-any-return]

    def choose(self, pod: PodRequest, names: Sequence[str] | None = None) -> Decision | None:
        """The best node (highest score; ties to the lowest node index) among ``names`` (or all),
        or None if it fits nowhere."""
        e, pol = self._entry(pod)
        if names is None:
            self._refresh(e, pol, pod, None)
            if not len(e.scores):
                return None
            i = int(np.argmax(e.scores))
        else:
            idx = np.array(sorted(self.state.nodes[n].idx for n in names if n in self.state.nodes),
                           dtype=np.int64)
            if not len(idx):
                return None
            self._refresh(e, pol, pod, idx)
            i = int(idx[int(np.argmax(e.scores[idx]))])
        s = float(e.scores[i])
        if s == NEG_INF:
            return None
        r = self._outcome(e, pol, pod, i)
        if not isinstance(r, Plan):
            return None
        n = self.state.node_list[i]
        return Decision(n.name, topology_plan(n, pod, r), s)

    def _on(self, pod: PodRequest, node: NodeState) -> Plan | FitFailure:
        e, pol = self._entry(pod)
        self._refresh(e, pol, pod, np.array([node.idx], dtype=np.int64))
        return self._outcome(e, pol, pod, node.idx)

    def plan_for(self, pod: PodRequest, node: str) -> Plan | FitFailure:
        """The plan for ``pod`` on one node (fresh, respecting the current state), or why not.
        This is the bind's step: the pod's own assumption (:meth:`assume`), wherever it is, is
        released first, so a pod never competes with its own promise and the plan is made
        against the books and the other pods' promises."""
        self.state.forget_assumed(pod.key)
        n = self.state.nodes.get(node)
        if n is None:
            return NO_INVENTORY
        r = self._on(pod, n)
        return topology_plan(n, pod, r) if isinstance(r, Plan) else r

    def assume_on(self, pod: PodRequest, uid: str, node: str, expires: float) -> Assumption | None:
        """Promise ``pod`` its current plan on ``node`` until ``expires`` (its previous promise
        ends first); None when it does not fit there (nothing promised)."""
        self.state.forget_assumed(pod.key)
        n = self.state.nodes.get(node)
        if n is None:
            return None
        r = self._on(pod, n)
        if not isinstance(r, Plan):
            return None
        return self.assume(pod, uid, node, topology_plan(n, pod, r), expires)

    def assume(self, pod: PodRequest, uid: str, node: str, plan: Plan, expires: float) -> Assumption | None:
        """Promise ``plan`` on ``node`` to ``pod`` until ``expires`` (see
        :meth:`ClusterState.assume`): the next pods' decisions see that capacity as taken."""
        n = self.state.nodes.get(node)
        if n is not None and plan.mig:  # dynamic-MIG instances: accounted as the booking will be
            alloc = self.allocation(pod, node, plan, 0.0)
            return self.state.assume(pod.key, uid, node, self.state.usage_for(n, alloc), expires,
                                     self.state.mig_of(n, alloc))
        usage = tuple((i, m, c, s) for i, (m, c, s) in sorted(plan.usage(len(pod.init)).items()))
        return self.state.assume(pod.key, uid, node, usage, expires)

    # -- booking --------------------------------------------------------------------------------
    def allocation(self, pod: PodRequest, node: str, plan: Plan, now: float | None = None) -> PodAllocation:
        """The allocation record of ``plan`` on ``node``, containers named from ``pod``."""
        n: NodeState = self.state.nodes[node]
        conts = []
        for k, (req, cp) in enumerate(zip(pod.containers, plan.containers, strict=True)):
            devs = []
            for i, mem, cores in cp:
                inst = plan.instance(k, i) if plan.mig else None
                devs.append(DeviceBooking(n.devices[i].uuid, mem, cores) if inst is None else
                            DeviceBooking(n.devices[i].uuid, mem, cores, inst[0], inst[1]))
            conts.append(ContainerAllocation(name=req.name, init=req.init, devices=tuple(devs)))
        return PodAllocation(node=node, containers=tuple(conts), time=time.time() if now is None else now)

    def book(self, pod: PodRequest, alloc: PodAllocation, check: bool = True) -> Booking:
        """Book an allocation for ``pod`` (see ClusterState.book). Raises OvercommitError."""
        return self.state.book(pod.key, alloc, pod.cpu_milli, pod.memory_mib, check=check)

    def place(self, pod: PodRequest, now: float = 0.0) -> PodAllocation | None:
        """Choose the best node over the whole cluster and book it (the replay's step).
        Returns the allocation, or None if the pod fits nowhere (nothing is booked)."""
        d = self.choose(pod)
        if d is None:
            return None
        alloc = self.allocation(pod, d.node, d.plan, now)
        self.state.book(pod.key, alloc, pod.cpu_milli, pod.memory_mib, check=False)
        return alloc

    def release(self, pod_key: str) -> Booking | None:
        """Release a pod's booking (no-op if none)."""
        return self.state.release(pod_key)


def normalise_scores(scores: dict[str, float], top: int = 10) -> dict[str, int]:
    """Map policy scores to the extender's integer range 0..top (best = top, worst = 0; all equal =
    top). Used by prioritize (``MaxExtenderPriority`` = 10)."""
    if not scores:
        return {}
    lo = min(scores.values())
    hi = max(scores.values())
    if hi - lo < 1e-12:
        return {k: top for k in scores}
    return {k: int(round((v - lo) / (hi - lo) * top)) for k, v in scores.items()}
