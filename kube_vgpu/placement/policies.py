"""Placement policies: one small scorer class each. Higher score is better.

* ``binpack`` / ``spread`` (HAMi-style): node score from current usage
  (used/total slots + cores + memory), GPUs chosen by the GPU policy (binpack or spread).
* ``fgd``: fragmentation gradient descent (Weng et al., USENIX ATC'23): choose the node and GPU
  whose placement least increases the expected fragmentation of the node under the target
  workload, scored as the artifact does (:func:`fgd_score`); ties go to the lower node index.
* ``fgd-bestfit``: kube-vgpu's variant: FGD with BestFit breaking ties.
* ``bestfit``: the FGD artifact's BestFit (least leftover CPU and GPU, weights 0.5/0.5,
  normalised by 128,000 mCPU and 8,000 milli-GPU), smallest fitting GPU.
* ``dotprod``: the artifact's DotProd: 1 - dot(free, request)/2 over max-normalised
  [CPU, GPU-milli], smallest fitting GPU.
"""

from __future__ import annotations

import bisect
import importlib
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from ..model import ContainerRequest, PodRequest
from ..policyregistry import GPU_SPREAD
from ..policyregistry import node_policy as policy_spec
from .fit import ORDER_BESTFIT, ORDER_INDEX, GpuOrder, Plan, fit_pod, gpu_order, order_kind
from .memo import BoundedMemo
from .state import NodeState
from .status import FitFailure

MAX_CPU_MILLI = 128_000  #: BestFit/DotProd normalisation (artifact's max node spec)
MAX_GPU_MILLI = 8_000


@dataclass(frozen=True, slots=True)
class TaskShape:
    """A typical task of the target workload (FGD's M): host CPU millicores, per-GPU milli-GPU,
    GPU count, allowed GPU models (empty = any), probability."""

    cpu_milli: int
    milli: int
    num: int
    types: frozenset[str]
    p: float


def typical_shapes(tasks: Iterable[tuple[int, int, int, tuple[str, ...]]], coverage: float = 0.95
                   ) -> list[TaskShape]:
    """FGD's typical pods: group tasks ``(cpu_milli, gpu_milli, num_gpu, gpu_spec)``, sort by count
    (descending, then by shape for determinism), keep the smallest prefix covering ``coverage`` of
    tasks, renormalise to probabilities. Raises ValueError on an empty workload."""
    counts = Counter((c, m, n, tuple(sorted(s))) for c, m, n, s in tasks)
    total = sum(counts.values())
    if not total:
        raise ValueError("workload is empty: cannot build FGD task shapes")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = []
    acc = 0
    for shape, cnt in ranked:
        kept.append((shape, cnt))
        acc += cnt
        if acc >= coverage * total:
            break
    s = sum(c for _, c in kept)
    return [TaskShape(c, m, n, frozenset(t), cnt / s) for (c, m, n, t), cnt in kept]


class FragModel:
    """Expected fragmentation F(n) of a node under the typical shapes, in milli-GPU (memoised)."""

    def __init__(self, shapes: list[TaskShape]):
        self.shapes = shapes
        self.cpu_levels = sorted({s.cpu_milli for s in shapes})
        self._rank = [bisect.bisect_left(self.cpu_levels, s.cpu_milli) for s in shapes]
        self._memo: BoundedMemo[tuple[int, tuple[int, ...], str], float] = BoundedMemo(500_000, lru=False)

    def cpu_class(self, node: NodeState, cpu_free: int) -> int:
        """How many CPU thresholds ``cpu_free`` meets (all of them when CPU is not modelled)."""
        if not node.cpu_total:
            return len(self.cpu_levels)
        return bisect.bisect_right(self.cpu_levels, cpu_free)

    def frag(self, cpu_cls: int, g: tuple[int, ...], model: str) -> float:
        """F for a node with CPU class ``cpu_cls``, free milli per GPU ``g`` (sorted), model."""
        key = (cpu_cls, g, model)
        v = self._memo.get(key)
        if v is not None:
            return v
        total_free = sum(g)
        acc = 0.0
        for s, rank in zip(self.shapes, self._rank, strict=True):
            if s.milli == 0 or (s.types and model not in s.types):
                acc += s.p * total_free
                continue
            fit = 0
            small = 0
            for x in g:
                if x >= s.milli:
                    fit += 1
                else:
                    small += x
            if fit >= s.num and rank < cpu_cls:
                acc += s.p * small
            else:
                acc += s.p * total_free
        return self._memo.put(key, acc)

    def node_frag(self, node: NodeState) -> float:
        """F(n) of the node as it is now."""
        g = tuple(sorted(node.gpu_milli_free(i) for i in range(len(node.devices))))
        return self.frag(self.cpu_class(node, node.cpu_free), g, node.model)


def _plan_state(node: NodeState, pod: PodRequest, plan: Plan) -> tuple[int, tuple[int, ...]]:
    """(cpu_free, sorted free milli per GPU) after applying ``plan``."""
    g = [node.gpu_milli_free(i) for i in range(len(node.devices))]
    for i, (mem, cores, slots) in plan.usage(len(pod.init)).items():
        d = node.devices[i]
        fs = node.free_slots[i] - slots
        if not d.healthy or fs <= 0:
            g[i] = 0
        else:
            g[i] = min((node.free_cores[i] - cores) * 1000 // d.cores,
                       (node.free_mem[i] - mem) * 1000 // d.memory_mib)
    return node.cpu_free - pod.cpu_milli, tuple(sorted(g))


def pod_gpu_milli(node: NodeState, pod: PodRequest, plan: Plan) -> int:
    """The pod's GPU demand in milli-GPU on this node (per GPU the larger of the cores and memory
    shares, summed over GPUs)."""
    total = 0
    for i, (mem, cores, _) in plan.usage(len(pod.init)).items():
        d = node.devices[i]
        total += max(cores * 1000 // max(d.cores, 1), -(-mem * 1000 // max(d.memory_mib, 1)))
    return total


class Policy:
    """A scorer: ``evaluate(node, pod)`` returns (score, Plan) or the :class:`FitFailure`.
    ``order_kind``: the GPU ordering (:func:`~kube_vgpu.placement.fit.order_kind`)."""

    name = "base"

    def __init__(self, gpu_policy: str = GPU_SPREAD.name):
        self.order: GpuOrder = gpu_order(gpu_policy)
        self.order_kind = order_kind(gpu_policy)

    def evaluate(self, node: NodeState, pod: PodRequest) -> tuple[float, Plan] | FitFailure:
        plan = fit_pod(node, pod, self.order)
        if isinstance(plan, FitFailure):
            return plan
        return self.score(node, pod, plan), plan

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        raise NotImplementedError


class Binpack(Policy):
    """Node binpack: prefer the most used node (HAMi formula, usage before this pod)."""

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        return node.used_fraction()


class Spread(Policy):
    """Node spread: prefer the least used node."""

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        return -node.used_fraction()


class _Baseline(Policy):
    """The FGD artifact's baselines: GPUs are chosen best-fit whatever ``gpu_policy`` says."""

    def __init__(self, gpu_policy: str = GPU_SPREAD.name):
        self.order = gpu_order(ORDER_BESTFIT)
        self.order_kind = ORDER_BESTFIT

    @staticmethod
    def node_milli_free(node: NodeState) -> int:
        """Free milli-GPU summed over the node's GPUs."""
        return sum(node.gpu_milli_free(i) for i in range(len(node.devices)))


class BestFit(_Baseline):
    """The FGD artifact's BestFit baseline (see module docstring)."""

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        gfree = self.node_milli_free(node)
        cpu_left = (node.cpu_free - pod.cpu_milli) / MAX_CPU_MILLI if node.cpu_total else 0.0
        gpu_left = (gfree - pod_gpu_milli(node, pod, plan)) / MAX_GPU_MILLI
        return -(0.5 * cpu_left + 0.5 * gpu_left)


class DotProd(_Baseline):
    """The FGD artifact's DotProd baseline (see module docstring)."""

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        gfree = self.node_milli_free(node)
        cpu = (node.cpu_free / MAX_CPU_MILLI) * (pod.cpu_milli / MAX_CPU_MILLI) if node.cpu_total else 0.0
        gpu = (gfree / MAX_GPU_MILLI) * (pod_gpu_milli(node, pod, plan) / MAX_GPU_MILLI)
        return 1.0 - (cpu + gpu) / 2.0


def fgd_score(before: float, after: float) -> int:
    """The FGD artifact's node score for a fragmentation change: ``int(100 * sigmoid(-Δ/1000))``
    with Δ = after - before in milli-GPU (``calculateGpuShareFragExtendScore``). The integer
    truncation acts as a tolerance (≈40 milli-GPU near Δ = 0): near-equal changes tie, and the
    tie-break decides. Ranking on the raw float Δ with a lowest-index tie-break loses ~2.5 points
    of allocation on the default trace (see docs/placement.md)."""
    x = (before - after) / 1000.0
    if x >= 0:
        sig = 1.0 / (1.0 + math.exp(-x))
    else:
        e = math.exp(x)
        sig = e / (1.0 + e)
    return int(sig * 100)


class FGD(Policy):
    """Fragmentation gradient descent (ATC'23): least growth of expected fragmentation.

    Score = fgd_score(F(n), F(n')) (higher is better); the GPU for a shared request is the one
    with the best score, lowest index on ties, as in the artifact (``fgd-bestfit``: the GPU with
    the smallest raw change). ``tie_break``: ``index`` (the
    engine's lowest node index, the artifact-faithful replay) or ``bestfit`` (BestFit's score
    breaks ties: kube-vgpu's ``fgd-bestfit`` policy).
    """

    def __init__(self, shapes: list[TaskShape], gpu_policy: str = GPU_SPREAD.name, tie_break: str = ORDER_INDEX):
        self.model = FragModel(shapes)
        self.order = self._order
        self.tie_break = BestFit() if tie_break == ORDER_BESTFIT else None

    def _order(self, node: NodeState, cands: list[int], mem: list[int], cores: list[int],
               req: ContainerRequest) -> list[int]:
        if len(cands) <= 1 or req.exclusive:
            return cands
        # Each candidate GPU i: the node's free milli with this container on i (others as now).
        base = [node.gpu_milli_free(i) for i in range(len(node.devices))]
        cls = self.model.cpu_class(node, node.cpu_free)
        before = self.model.frag(cls, tuple(sorted(base)), node.model)
        keyed = []
        for i in cands:
            d = node.devices[i]
            g = list(base)
            g[i] = 0 if node.free_slots[i] - 1 <= 0 else min(
                (cores[i] - req.cores_on(d)) * 1000 // d.cores, (mem[i] - req.memory_on(d)) * 1000 // d.memory_mib)
            after = self.model.frag(cls, tuple(sorted(g)), node.model)
            # fgd: the artifact's quantised choice; fgd-bestfit: the raw change (finer).
            keyed.append((after if self.tie_break is not None else -fgd_score(before, after), i))
        keyed.sort()
        return [i for _, i in keyed]

    def evaluate(self, node: NodeState, pod: PodRequest) -> tuple[float, Plan] | FitFailure:
        plan = fit_pod(node, pod, self.order)
        if isinstance(plan, FitFailure):
            return plan
        before = self.model.node_frag(node)
        cpu_after, g_after = _plan_state(node, pod, plan)
        after = self.model.frag(self.model.cpu_class(node, cpu_after), g_after, node.model)
        score = float(fgd_score(before, after))
        if self.tie_break is not None:
            # BestFit's score lies in (-1, 1): scaled so it only orders equal FGD scores.
            score = score * 10.0 + self.tie_break.score(node, pod, plan)
        return score, plan


def make_policy(node_policy: str, gpu_policy: str = GPU_SPREAD.name, shapes: list[TaskShape] | None = None) -> Policy:
    """Build the scorer of a node policy declared in :mod:`kube_vgpu.policyregistry` (its class,
    its options, its name). A policy that needs shapes gets ``shapes`` (the target workload).

    Raises: ValueError for an unknown name, or a policy that needs shapes without them.
    """
    spec = policy_spec(node_policy)
    kwargs = dict(spec.options)
    if spec.needs_shapes:
        if not shapes:
            raise ValueError(f"policy {node_policy} needs the target workload's task shapes")
        kwargs["shapes"] = shapes
    if "." in spec.scorer:  # a scorer in another module of this package (e.g. the DRA-path models)
        module, cls = spec.scorer.rsplit(".", 1)
        scorer = getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    else:
        scorer = globals()[spec.scorer]
    p: Policy = scorer(gpu_policy=gpu_policy, **kwargs)
    p.name = spec.name
    return p
