"""GPU-aware preemption: which lower-priority pods to evict from one node so that a pod fits.

kube-scheduler's own preemption cannot see vGPU resources (they are ``ignoredByScheduler``), so it
cannot tell which pods free the right GPU. This module answers that question for one node, with
the same fit rules as placement (:func:`~kube_vgpu.placement.fit.fit_pod`), on a what-if copy of
the node: the live :class:`~kube_vgpu.placement.state.NodeState` is never changed.

The choice, in this order of preference:

1. only pods with a *lower* priority than the preemptor are candidates (equal or higher never);
2. pods that must go anyway (``forced``: kube-scheduler's own victims, needed by its own filters)
   are removed first and always stay in the answer;
3. the lowest priority level that is enough: if evicting every candidate of priority <= p makes
   the pod fit, nothing above p is touched;
4. the fewest pods: the smallest set, searched exactly by increasing size among the pods on the
   GPUs the preemptor could use (a budget of fit checks bounds the work; beyond it a greedy
   reprieve gives a set that is still minimal by inclusion);
5. then the lowest highest priority, the lowest sum of priorities, the least GPU memory and
   compute freed (least disruption), and the pod keys (deterministic).

A node where even every candidate together does not make room is dropped (:func:`select_victims`
returns None). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import combinations

from ..model import PodRequest
from .fit import GpuOrder, Plan, fit_pod, order_by_index
from .state import NodeState

#: per GPU index on the node: (MiB, cores, slots), as :attr:`~kube_vgpu.placement.state.Booking.usage`
Usage = tuple[tuple[int, int, int, int], ...]

#: default number of fit checks the exact search may spend on one node before falling back to a
#: greedy reprieve (one fit check is a few tens of microseconds)
DEFAULT_BUDGET = 6000


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod that holds GPUs on the node and might be evicted.

    key: ``namespace/name``; uid: its uid; priority: its ``spec.priority``; usage: what it holds per
    GPU index (MiB, cores, slots); cpu_milli / memory_mib: host CPU (millicores) and memory (MiB)
    it holds where the node models them (0 otherwise)."""

    key: str
    uid: str
    priority: int
    usage: Usage
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def footprint(self) -> tuple[int, int]:
        """(MiB, cores) it holds over all GPUs: what evicting it disrupts."""
        return sum(u[1] for u in self.usage), sum(u[2] for u in self.usage)

    def touches(self, gpus: Collection[int]) -> bool:
        """Whether it holds anything on one of ``gpus`` (indexes on the node)."""
        return any(u[0] in gpus for u in self.usage)


@dataclass(frozen=True, slots=True)
class VictimSet:
    """The pods to evict (``victims``: the forced ones and those added, highest priority first)
    and the ``plan`` the pod gets once they are gone. ``added``: the victims beyond the forced
    ones; ``checks``: fit checks spent; ``exact``: True when the smallest set was proven smallest
    (False: the budget ran out and a greedy reprieve chose a set minimal by inclusion)."""

    victims: tuple[Holder, ...]
    added: tuple[Holder, ...]
    plan: Plan
    checks: int
    exact: bool


def what_if(node: NodeState, freed: Sequence[Holder], give_back: Usage = ()) -> NodeState:
    """A copy of ``node`` with what ``freed`` hold (and ``give_back``: e.g. the preemptor's own
    promise on the node) free again. ``node`` itself is not changed."""
    n = NodeState(node.name, node.idx, node.devices, node.cpu_total, node.memory_total, node.heartbeat)
    mem, cores, slots = list(node.free_mem), list(node.free_cores), list(node.free_slots)
    cpu, hmem = node.cpu_free, node.memory_free
    for usage in [h.usage for h in freed] + [give_back]:
        for i, m, c, s in usage:
            if 0 <= i < len(mem):
                mem[i] += m
                cores[i] += c
                slots[i] += s
    for h in freed:
        cpu += h.cpu_milli
        hmem += h.memory_mib
    n.free_mem, n.free_cores, n.free_slots = mem, cores, slots
    n.cpu_free, n.memory_free = cpu, hmem
    # dynamic-MIG instances stay held (conservative: evicting their holders is not modelled, so a
    # preemption never counts on a MIG instance being freed)
    n.mig_used = [list(u) for u in node.mig_used]
    return n


def _cost(victims: Sequence[Holder]) -> tuple[object, ...]:
    """Lower is better: count, highest priority, sum of priorities, GPU memory and compute freed,
    keys."""
    mib = sum(h.footprint[0] for h in victims)
    cores = sum(h.footprint[1] for h in victims)
    return (len(victims), max((h.priority for h in victims), default=-(2**63)),
            sum(h.priority for h in victims), mib, cores, tuple(sorted(h.key for h in victims)))


def _gpus_needed(pod: PodRequest, n_gpus: int) -> int:
    """The most distinct GPUs the pod's plan can touch on a node of ``n_gpus`` GPUs."""
    return max(1, min(n_gpus, sum(c.count for c in pod.containers)))


class _Search:
    def __init__(self, node: NodeState, pod: PodRequest, order: GpuOrder, give_back: Usage, budget: int):
        self.node, self.pod, self.order, self.give_back = node, pod, order, give_back
        self.budget = budget
        self.checks = 0
        # the simple shape (one app container, no init): an optimistic per-GPU bound prunes sizes
        # that cannot work before any fit check
        self.simple = pod.app[0] if len(pod.app) == 1 and not pod.init else None

    def fit(self, freed: Sequence[Holder]) -> Plan | None:
        self.checks += 1
        r = fit_pod(what_if(self.node, freed, self.give_back), self.pod, self.order)
        return r if isinstance(r, Plan) else None

    def may_fit(self, forced: Sequence[Holder], pool: Sequence[Holder], k: int) -> bool:
        """False only when no ``k`` pods of ``pool`` (with ``forced``) can free enough: per GPU,
        the k largest frees of memory, cores and slots, each taken on its own (an upper bound)."""
        c = self.simple
        if c is None:
            return True
        node = self.what_if_forced(forced)
        ok = 0
        for i, d in enumerate(node.devices):
            frees = [(m, co, s) for h in pool for j, m, co, s in h.usage if j == i]
            top = [sum(sorted((f[r] for f in frees), reverse=True)[:k]) for r in range(3)]
            mem, cores, slots = node.free_mem[i] + top[0], node.free_cores[i] + top[1], node.free_slots[i] + top[2]
            if c.exclusive and slots < d.split:
                continue
            if mem >= c.memory_on(d) and cores >= c.cores_on(d) and slots >= 1:
                ok += 1
        return ok >= c.count

    def what_if_forced(self, forced: Sequence[Holder]) -> NodeState:
        return what_if(self.node, forced, self.give_back)


def select_victims(node: NodeState, pod: PodRequest, priority: int, holders: Sequence[Holder],
                   forced: Collection[str] = (), order: GpuOrder = order_by_index, give_back: Usage = (),
                   budget: int = DEFAULT_BUDGET) -> VictimSet | None:
    """The pods of ``holders`` (those on ``node``) to evict so that ``pod`` (its priority
    ``priority``) fits on ``node``, chosen as the module docstring says, or None when no set of
    lower-priority holders makes room.

    forced: keys of holders that are evicted anyway (kube-scheduler's own victims); those with a
    priority lower than ``priority`` are removed first and kept in the answer, any other is ignored.
    order: the GPU ordering of the pod's GPU policy (:func:`~kube_vgpu.placement.fit.gpu_order`).
    give_back: usage on the node that is the preemptor's own (its promise), counted as free.
    budget: fit checks the exact smallest-set search may spend (>= 0).
    The result can be empty (``victims == ()``) when the pod fits without evicting anything.
    """
    s = _Search(node, pod, order, give_back, budget)
    eligible = [h for h in holders if h.priority < priority]
    must = [h for h in eligible if h.key in forced]
    must_keys = {h.key for h in must}
    others = [h for h in eligible if h.key not in must_keys]

    def answer(added: Sequence[Holder], plan: Plan, exact: bool) -> VictimSet:
        victims = sorted([*must, *added], key=lambda h: (-h.priority, h.key))
        return VictimSet(tuple(victims), tuple(sorted(added, key=lambda h: (-h.priority, h.key))), plan,
                         s.checks, exact)

    plan = s.fit(must)
    if plan is not None:
        return answer((), plan, True)
    # 3. the lowest priority level that is enough
    pool: list[Holder] = []
    for level in sorted({h.priority for h in others}):
        pool = [h for h in others if h.priority <= level]
        if s.fit([*must, *pool]) is not None:
            break
    else:
        return None
    # 4. the fewest pods, searched among the pods on each set of GPUs the pod could use
    pool.sort(key=lambda h: (h.priority, h.footprint, h.key))
    n_gpus = len(node.devices)
    groups: list[tuple[Holder, ...]] = []
    seen_groups: set[frozenset[str]] = set()
    for size in range(1, _gpus_needed(pod, n_gpus) + 1):
        for gpus in combinations(range(n_gpus), size):
            g = tuple(h for h in pool if h.touches(gpus))
            keys = frozenset(h.key for h in g)
            if g and keys not in seen_groups:
                seen_groups.add(keys)
                groups.append(g)
    groups.sort(key=len)
    tried: set[frozenset[str]] = set()
    for k in range(1, len(pool) + 1):
        best: tuple[tuple[object, ...], tuple[Holder, ...], Plan] | None = None
        for g in groups:
            if len(g) < k or not s.may_fit(must, g, k):
                continue
            for combo in combinations(g, k):
                ck = frozenset(h.key for h in combo)
                if ck in tried:
                    continue
                tried.add(ck)
                if s.checks >= budget:
                    return _greedy(s, must, pool, answer)
                p = s.fit([*must, *combo])
                if p is not None:
                    c = _cost(combo)
                    if best is None or c < best[0]:
                        best = (c, combo, p)
        if best is not None:
            return answer(best[1], best[2], True)
    # every group fell short (the pod needs pods on more GPUs than it uses: cannot happen with
    # monotone fit rules); the greedy reprieve over the whole pool still gives a minimal set
    return _greedy(s, must, pool, answer)


def _greedy(s: _Search, must: list[Holder], pool: list[Holder],
            answer: Callable[[Sequence[Holder], Plan, bool], VictimSet]) -> VictimSet | None:
    """Start from the whole ``pool`` (known to make room) and give back each pod, the most
    important and largest first, whenever the pod still fits without it: the set left is minimal by
    inclusion (no single victim can be spared)."""
    chosen = list(pool)
    for h in sorted(pool, key=lambda h: (-h.priority, tuple(-x for x in h.footprint), h.key)):
        trial = [x for x in chosen if x is not h]
        if s.fit([*must, *trial]) is not None:
            chosen = trial
    plan = s.fit([*must, *chosen])
    if plan is None:  # cannot happen: ``pool`` made room and every step kept that
        return None
    return answer(chosen, plan, False)
