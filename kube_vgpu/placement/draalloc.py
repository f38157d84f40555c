"""Models of kube-scheduler's own placement on the DRA path, for the trace replay.

On the DRA path (``resource.k8s.io/v1`` claims with consumable capacity) kube-scheduler places GPU
slices itself; kube-vgpu's scorers do not run. These scorers reproduce what it does, so the
replay can put a number on the difference (docs/dra-placement.md). The model, restated from
Kubernetes v1.36's scheduler and its structured-parameters allocator:

* **Devices: first fit.** For one node the allocator walks the node's pools sorted by (driver,
  pool name), each pool's slices sorted by name, each slice's devices in published order (the
  kube-vgpu driver publishes one pool per node with its GPUs sorted by index), and takes the first
  device whose CEL selectors match and whose remaining capacity holds the request; a request for N
  devices takes the first N such devices. It stops at the first complete solution: nothing scores
  devices. So a GPU order on a node is ``index`` unless the driver publishes another order.
* **Nodes: GPU-blind scores.** The DynamicResources plugin scores a node only by which
  ``firstAvailable`` subrequest its allocation used (``8 - position``, normalised to 0..100 over
  the nodes, weight 2); a claim with ``exactly`` requests scores 0 everywhere. NodeResourcesFit
  (LeastAllocated, CPU and memory, weight 1) and NodeResourcesBalancedAllocation (weight 1) score
  host CPU and memory only: a claim's GPU consumption is not an extended resource they see. The
  other default scores (taints, affinity, spreading, images) are equal for the replay's pods.
  The highest total wins; ties go to the first node in kube-scheduler's scan order.
* **The scan window.** kube-scheduler stops filtering once it has ``numFeasibleNodesToFind``
  feasible nodes (``percentageOfNodesToScore``; 0 = adaptive: ``max(5, 50 - nodes/125)`` percent,
  at least 100 nodes, all of them under 100 nodes), starting where the previous pod's scan ended.
  :func:`nodes_to_find` computes the count; the replay applies the window (``replay/dra.py``)
  to the models whose registry options name ``nodes_to_score``.

Scorers:

* :class:`DraAllocator`: GPU-blind node scores (NodeResourcesFit's LeastAllocated, or the
  MostAllocated strategy an admin can configure), devices first fit in index order (or, with
  ``device_order="bestfit"``, in the order a driver that republishes its slice least free GPU
  first would give: first fit then is best fit). With ``prefer_in_use`` the claim asks with two
  ``firstAvailable`` subrequests, the first selecting GPUs the driver marks as in use (a
  published attribute), the second any GPU: devices come from in-use GPUs when N of them fit,
  and the DynamicResources score (weight 2) favours the nodes where they do.
* :class:`DraExtenderFGD`: kube-vgpu's extender still chooses the node for pods that carry
  claims (filter answering the best node), by FGD's score of the allocator's own first-fit
  choice on each node, which it can predict; the allocator then picks the devices first fit.

Units: CPU in millicores, memory in MiB, scores as kube-scheduler's integers (0..100 per plugin).
"""

from __future__ import annotations

from ..model import ContainerRequest, PodRequest
from .engine import pod_shape
from .fit import ORDER_BESTFIT, ORDER_INDEX, Plan, fit_pod, gpu_order
from .memo import BoundedMemo
from .policies import FGD, Policy, TaskShape
from .state import NodeState
from .status import Code, FitFailure

#: kube-scheduler's MaxNodeScore
MAX_NODE_SCORE = 100
#: the largest ``firstAvailable`` list (resourceapi.FirstAvailableDeviceRequestMaxSize)
FIRST_AVAILABLE_MAX = 8
#: default score plugin weights (kube-scheduler's default profile)
WEIGHT_FIT, WEIGHT_BALANCED, WEIGHT_DRA = 1, 1, 2
#: kube-scheduler's floor on the nodes to find, and on the adaptive percentage
MIN_FEASIBLE_NODES, MIN_FEASIBLE_PERCENT = 100, 5
#: LeastAllocated's defaults for a pod that requests no CPU / memory: 100 millicores, 200 MB
NONZERO_CPU_MILLI, NONZERO_MEMORY_MIB = 100, 200 * 1000 * 1000 // (1024 * 1024)
#: the device orders a driver may publish (:class:`DraAllocator` ``device_order``)
DEVICE_ORDERS = (ORDER_INDEX, ORDER_BESTFIT)
#: NodeResourcesFit's scoring strategies modelled (:class:`DraAllocator` ``fit_strategy``)
LEAST_ALLOCATED, MOST_ALLOCATED = "LeastAllocated", "MostAllocated"
FIT_STRATEGIES = (LEAST_ALLOCATED, MOST_ALLOCATED)


def nodes_to_find(percentage: int, n_nodes: int) -> int:
    """kube-scheduler's ``numFeasibleNodesToFind``: how many feasible nodes it collects before it
    stops filtering. ``percentage``: ``percentageOfNodesToScore`` (0 = adaptive, 1..100).
    Raises ValueError outside 0..100."""
    if not 0 <= percentage <= 100:
        raise ValueError(f"percentageOfNodesToScore: {percentage} is out of range; allowed 0..100")
    if n_nodes < MIN_FEASIBLE_NODES:
        return n_nodes
    pct = percentage or max(MIN_FEASIBLE_PERCENT, 50 - n_nodes // 125)
    return max(MIN_FEASIBLE_NODES, n_nodes * pct // 100)


def least_allocated(node: NodeState, pod: PodRequest, most: bool = False) -> int:
    """NodeResourcesFit's LeastAllocated score on host CPU and memory (weights 1:1), 0..100, or
    with ``most`` its MostAllocated strategy; a resource the node does not model is left out
    (100 when neither is)."""
    parts = []
    for cap, free, want, floor in ((node.cpu_total, node.cpu_free, pod.cpu_milli, NONZERO_CPU_MILLI),
                                   (node.memory_total, node.memory_free, pod.memory_mib, NONZERO_MEMORY_MIB)):
        if cap <= 0:
            continue
        requested = cap - free + (want or floor)
        if most:
            parts.append(min(requested, cap) * MAX_NODE_SCORE // cap)
        else:
            parts.append(0 if requested > cap else (cap - requested) * MAX_NODE_SCORE // cap)
    return sum(parts) // len(parts) if parts else MAX_NODE_SCORE


def balanced_allocation(node: NodeState, pod: PodRequest) -> int:
    """NodeResourcesBalancedAllocation on host CPU and memory: 50 + (50 + with - without) / 2,
    where with/without are ``int((1 - |f_cpu - f_mem| / 2) * 100)`` for the fractions requested
    with and without the pod (capped at 1). 100 when the node models neither resource."""
    if node.cpu_total <= 0 or node.memory_total <= 0:
        return MAX_NODE_SCORE

    def score(cpu: int, mem: int) -> int:
        fc = min(1.0, cpu / node.cpu_total)
        fm = min(1.0, mem / node.memory_total)
        return int((1 - abs(fc - fm) / 2) * MAX_NODE_SCORE)

    used_cpu, used_mem = node.cpu_total - node.cpu_free, node.memory_total - node.memory_free
    without = score(used_cpu, used_mem)
    with_pod = score(used_cpu + pod.cpu_milli, used_mem + pod.memory_mib)
    half = MAX_NODE_SCORE // 2
    return half + (half + with_pod - without) // 2


def in_use(node: NodeState, i: int) -> bool:
    """Whether GPU ``i`` of ``node`` has any capacity consumed (what a published in-use
    attribute would say)."""
    d = node.devices[i]
    return node.free_mem[i] < d.memory_mib or node.free_cores[i] < d.cores or node.free_slots[i] < d.split


class DraAllocator(Policy):
    """kube-scheduler on the DRA path (module docstring): GPU-blind node score, devices first fit.

    device_order: ``index`` (the published order) or ``bestfit`` (a driver republishing least
    free GPU first). prefer_in_use: claims ask in-use GPUs first (two ``firstAvailable``
    subrequests) and the DynamicResources score rewards the nodes where that subrequest fits.
    nodes_to_score: ``percentageOfNodesToScore`` of the scheduler modelled (0 = adaptive,
    100 = every feasible node), applied by the replay. fit_strategy: NodeResourcesFit's scoring
    strategy, ``LeastAllocated`` (the default) or ``MostAllocated``. Raises ValueError for
    another order or strategy.
    """

    def __init__(self, gpu_policy: str = ORDER_INDEX, device_order: str = ORDER_INDEX,
                 prefer_in_use: bool = False, nodes_to_score: int = 0, fit_strategy: str = LEAST_ALLOCATED):
        if device_order not in DEVICE_ORDERS:
            raise ValueError(f"device_order: {device_order!r} is not known; allowed: {', '.join(DEVICE_ORDERS)}")
        if fit_strategy not in FIT_STRATEGIES:
            raise ValueError(f"fit_strategy: {fit_strategy!r} is not known; allowed: {', '.join(FIT_STRATEGIES)}")
        self.most_allocated = fit_strategy == MOST_ALLOCATED
        nodes_to_find(nodes_to_score, 0)  # validate the percentage
        self.first_fit = gpu_order(device_order)
        self.order = self._in_use_first if prefer_in_use else self.first_fit
        self.order_kind = device_order
        self.prefer_in_use = prefer_in_use
        self.nodes_to_score = nodes_to_score
        #: (GPU request, node GPU state) -> first-fit plan or failure: the GPU fit does not depend
        #: on the pod's host CPU and memory, which the engine's cache keys on
        self._fits: BoundedMemo[tuple[object, ...], Plan | FitFailure] = BoundedMemo(300_000, lru=False)

    def evaluate(self, node: NodeState, pod: PodRequest) -> tuple[float, Plan] | FitFailure:
        """The host check, then the allocator's plan (memoised on the GPU state), then the score."""
        if node.cpu_total and pod.cpu_milli > node.cpu_free:
            return FitFailure(Code.HOST_CPU, need=pod.cpu_milli, have=node.cpu_free)
        if node.memory_total and pod.memory_mib > node.memory_free:
            return FitFailure(Code.HOST_MEMORY, need=pod.memory_mib, have=node.memory_free)
        if not pod.constraints.empty:  # uuid selectors: the GPUs' identity matters, not only their state
            plan: Plan | FitFailure | None = fit_pod(node, pod, self.order)
        else:
            key = (pod_shape(pod, host=False), node.devclass, tuple(node.free_mem), tuple(node.free_cores),
                   tuple(node.free_slots))
            plan = self._fits.get(key)
            if plan is None:
                plan = self._fits.put(key, fit_pod(node, pod, self.order))
        assert plan is not None
        if isinstance(plan, FitFailure):
            return plan
        return self.score(node, pod, plan), plan

    def _in_use_first(self, node: NodeState, cands: list[int], mem: list[int], cores: list[int],
                      req: ContainerRequest) -> list[int]:
        # subrequest 0 selects in-use GPUs: used when ``count`` of them fit; else subrequest 1
        # (any GPU) in the published order
        used = [i for i in cands if in_use(node, i)]
        if len(used) >= req.count:
            return self.first_fit(node, used, mem, cores, req)
        return self.first_fit(node, cands, mem, cores, req)

    def dra_score(self, node: NodeState, pod: PodRequest, plan: Plan) -> int:
        """The DynamicResources score, weighted, as it stands after normalisation when any node
        used the first subrequest: 2 x 100 where this node did, 2 x int(7 * 100 / 8) where it
        used the second. Without ``prefer_in_use`` it is 0 (``exactly`` requests). When no node
        used the first subrequest every node gets the same value, so the choice is unchanged."""
        if not self.prefer_in_use:
            return 0
        chosen = [i for cp in plan.containers for i, _, _ in cp]
        first = bool(chosen) and all(in_use(node, i) for i in chosen)
        raw = FIRST_AVAILABLE_MAX if first else FIRST_AVAILABLE_MAX - 1
        return WEIGHT_DRA * (raw * MAX_NODE_SCORE // FIRST_AVAILABLE_MAX)

    def score(self, node: NodeState, pod: PodRequest, plan: Plan) -> float:
        return float(WEIGHT_FIT * least_allocated(node, pod, self.most_allocated)
                     + WEIGHT_BALANCED * balanced_allocation(node, pod)
                     + self.dra_score(node, pod, plan))


class DraExtenderFGD(FGD):
    """kube-vgpu's extender choosing the node of a pod that carries claims (FGD with BestFit
    breaking ties, scored on the allocator's first-fit choice on each node); the allocator then
    places the devices first fit in index order. Every feasible node is scored (kube-vgpu's chart
    sets ``percentageOfNodesToScore: 100``; the extender's filter answers the best node).
    predict: the extender scores the allocator's first-fit choice (True) or FGD's own (False)."""

    def __init__(self, shapes: list[TaskShape], gpu_policy: str = ORDER_INDEX, tie_break: str = ORDER_BESTFIT,
                 predict: bool = True):
        super().__init__(shapes, gpu_policy, tie_break)
        self.first_fit = gpu_order(ORDER_INDEX)
        self.predict = predict
        if predict:
            self.order = self.first_fit
            self.order_kind = ORDER_INDEX

    def evaluate(self, node: NodeState, pod: PodRequest) -> tuple[float, Plan] | FitFailure:
        """FGD's score of the node; the plan is the allocator's first fit. With ``predict`` the
        score is of that plan; without, of FGD's own GPU choice (an extender that does not know
        the allocator's order)."""
        r = super().evaluate(node, pod)
        if self.predict or isinstance(r, FitFailure):
            return r
        plan = fit_pod(node, pod, self.first_fit)
        assert isinstance(plan, Plan), "the same GPUs qualify whatever their order"
        return r[0], plan


def first_fit_plan(node: NodeState, pod: PodRequest) -> Plan | FitFailure:
    """The allocator's first-fit plan for ``pod`` on ``node`` (devices in index order)."""
    return fit_pod(node, pod, gpu_order(ORDER_INDEX))


__all__ = ["DEVICE_ORDERS", "FIT_STRATEGIES", "LEAST_ALLOCATED", "MOST_ALLOCATED", "DraAllocator", "DraExtenderFGD", "balanced_allocation", "first_fit_plan", "in_use",
           "least_allocated", "nodes_to_find"]
