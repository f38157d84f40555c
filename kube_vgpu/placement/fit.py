"""The fit rules: can a pod's containers be placed on one node's GPUs, and on which.

Fit is per GPU, never a node sum. For every container it needs ``count`` distinct GPUs, each
healthy, allowed by the pod's constraints, with a free vGPU slot, enough free memory (MiB) and
cores (percent); an exclusive request (cores 100 or memory 100%) needs an idle GPU, and a GPU whose
compute is fully booked takes no request with cores 0. Init containers are fitted one at a time on
the node as it is; app containers are fitted together on an accumulating copy, so two app
containers never double-book a GPU beyond its capacity. The pod then holds, per GPU,
``max(init peak, sum of app containers)``.

A pod that does not fit gets a :class:`~kube_vgpu.placement.status.FitFailure` (code and
numbers, no text). Pure functions over a :class:`NodeState`; they never mutate it.

A GPU in dynamic-MIG mode (:attr:`~kube_vgpu.model.GPUDevice.mig`) serves a container asking for
one GPU with one MIG instance: the smallest allowed profile that holds the container's memory and
has a free start on the GPU's geometry, at the start that keeps the most large profiles possible
(:func:`kube_vgpu.mig.place`, over the instances booked or promised on the GPU and those of the
pod's earlier app containers). The booking holds the profile's memory and the whole instance's
compute (:func:`kube_vgpu.mig.instance_cores`); the compute a container asks for does not choose
the profile. Containers asking for several GPUs are not served by dynamic-MIG GPUs.

These are the reference rules. :mod:`kube_vgpu.placement.vector` is their vectorised twin (all
nodes at once, for the first decision of a new pod shape); a property test holds the two equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..mig import TABLES, Instance, MigError, allowed_profiles, choose_profile, instance_cores, place
from ..model import Constraints, ContainerRequest, GPUDevice, PodRequest
from ..policyregistry import GPU_BINPACK, GPU_SPREAD
from ..topology import best_connected, weakest
from .state import NodeState
from .status import Code, FitFailure

#: per container: tuple of (gpu index on node, MiB, cores)
ContainerPlan = tuple[tuple[int, int, int], ...]
#: the dynamic-MIG instances of a plan: (container position in the plan, gpu index, profile, start)
MigPlan = tuple[tuple[int, int, str, int], ...]
#: ordering of candidate GPU indexes for one container (policy decides)
GpuOrder = Callable[[NodeState, list[int], list[int], list[int], ContainerRequest], list[int]]


@dataclass(frozen=True, slots=True)
class Plan:
    """A feasible placement on one node: per container (init first, then app) its GPU plan, and
    the dynamic-MIG instances it places (:data:`MigPlan`; empty when none)."""

    containers: tuple[ContainerPlan, ...]
    mig: MigPlan = ()

    def instance(self, k: int, i: int) -> tuple[str, int] | None:
        """(profile, first memory slice) of container ``k``'s MIG instance on GPU ``i``, or None."""
        for kk, ii, profile, start in self.mig:
            if kk == k and ii == i:
                return profile, start
        return None

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


def _excluded(pod: PodRequest, d: GPUDevice) -> Code | None:
    """Why the pod may not use ``d`` at all (unhealthy, type or uuid constraints), or None."""
    if not d.healthy:
        return Code.GPU_UNHEALTHY
    c = pod.constraints
    if not c.empty and not c.allows(d):
        if (c.use_uuids and d.uuid not in c.use_uuids) or d.uuid in c.nouse_uuids:
            if not (c.use_types or c.nouse_types) or Constraints(c.use_types, c.nouse_types).allows(d):
                return Code.UUID_EXCLUDED
        return Code.TYPE_EXCLUDED
    if pod.gpu_spec and d.model not in pod.gpu_spec:
        return Code.TYPE_EXCLUDED
    return None


def _fail(code: Code, req: ContainerRequest, need: int = 0, have: int = 0, gpu: int = -1,
          detail: str = "") -> FitFailure:
    return FitFailure(code, req.name, req.init, req.count, req.memory_mib, req.memory_percent, req.cores,
                      need, have, gpu, detail)


@dataclass(slots=True)
class _MigTally:
    """What the dynamic-MIG GPUs of a node said to one container: the instance placed per GPU,
    and why the others refused (request, largest allowed profile, smallest that holds it)."""

    placed: dict[int, tuple[str, int, int, int]]  # gpu -> (profile, start, MiB, cores)
    no_profile: int = 0
    no_place: int = 0
    want: int = 0
    largest: int = 0
    table: str = ""
    first: str = ""


def _mig_try(d: GPUDevice, i: int, req: ContainerRequest, used: list[tuple[str, int]], t: _MigTally) -> bool:
    """Place ``req`` on dynamic-MIG GPU ``d`` (index ``i``) beside the instances ``used``; True
    (and ``t.placed[i]`` set) when it fits, else the refusal counted in ``t``."""
    table = TABLES[d.mig]
    want = req.memory_on(d)
    t.want = want
    try:
        first = choose_profile(want, table, d.mig_profiles)
    except MigError:
        t.no_profile += 1
        t.largest = max((p.memory_mib for p in allowed_profiles(table, d.mig_profiles)), default=0)
        t.table = table.key
        return False
    try:
        pl = place(want, table, [Instance(p, s) for p, s in used], d.mig_profiles)
    except MigError:
        t.no_place += 1
        t.first = first.name
        return False
    t.placed[i] = (pl.profile.name, pl.start, pl.profile.memory_mib, instance_cores(pl.profile, d.cores))
    return True


def _linked(node: NodeState, req: ContainerRequest, ordered: list[int], pod: PodRequest
            ) -> ContainerPlan | FitFailure:
    """The best-connected ``req.count`` of the candidates ``ordered`` when every pair reaches the
    pod's required link class, else why not: ``LINK_UNAVAILABLE`` when some set of the node's usable
    GPUs reaches it (busy now), ``LINK_ABSENT`` when none does or the node publishes no topology."""
    devs = node.devices
    need = pod.constraints.min_link
    if not all(len(d.links) == len(devs) for d in devs):
        return _fail(Code.LINK_ABSENT, req, need, 0)
    links = [d.links for d in devs]
    best = best_connected(ordered, req.count, links)
    have = weakest(links, best)
    if have >= need:
        return tuple((i, req.memory_on(devs[i]), req.cores_on(devs[i])) for i in best)
    usable = [i for i, d in enumerate(devs) if _excluded(pod, d) is None]
    whole = best_connected(usable, req.count, links) if len(usable) >= req.count else []
    code = Code.LINK_UNAVAILABLE if whole and weakest(links, whole) >= need else Code.LINK_ABSENT
    return _fail(code, req, need, have)


def _fit_container(node: NodeState, req: ContainerRequest, mem: list[int], cores: list[int],
                   slots: list[int], pod: PodRequest, order: GpuOrder,
                   used: list[list[tuple[str, int]]] | None = None, mig: _MigTally | None = None
                   ) -> ContainerPlan | FitFailure:
    """One container on the node (free ``mem``, ``cores``, ``slots`` per GPU; ``used``: the
    dynamic-MIG instances per GPU). The instances placed are left in ``mig.placed``."""
    devs = node.devices
    if used is None:
        used = node.mig_used
    if mig is None:
        mig = _MigTally({})
    n_plain = 0
    n = len(devs)
    if req.count > n:
        return _fail(Code.TOO_FEW_GPUS, req, req.count, n)
    cands: list[int] = []
    excluded: dict[Code, int] = {}
    n_excluded = 0
    best_mem = best_cores = -1
    best_mem_i = best_cores_i = -1
    n_slots = n_excl = n_exh = 0
    for i, d in enumerate(devs):
        why = _excluded(pod, d) if not d.healthy or not pod.constraints.empty or pod.gpu_spec else None
        if why is not None:
            excluded[why] = excluded.get(why, 0) + 1
            n_excluded += 1
            continue
        if slots[i] <= 0:
            n_slots += 1
            continue
        if d.mig:  # dynamic MIG: one instance for a one-GPU container, where the geometry has room
            if req.count == 1 and _mig_try(d, i, req, used[i], mig):
                cands.append(i)
            continue
        n_plain += 1
        gpu_mem = req.memory_on(d)
        gpu_cores = req.cores_on(d)
        if req.exclusive and slots[i] < d.split:
            n_excl += 1
            continue
        if cores[i] <= 0 and gpu_cores == 0 and d.cores > 0:
            n_exh += 1
            continue
        if mem[i] > best_mem:
            best_mem, best_mem_i = mem[i], i
        if cores[i] > best_cores:
            best_cores, best_cores_i = cores[i], i
        if mem[i] < gpu_mem or cores[i] < gpu_cores:
            continue
        cands.append(i)
    if len(cands) >= req.count:
        ordered = order(node, cands, mem, cores, req)
        if pod.constraints.min_link and req.count >= 2:
            return _linked(node, req, ordered, pod)
        if mig.placed:
            out = []
            for i in ordered[: req.count]:
                p = mig.placed.get(i)
                out.append((i, p[2], p[3]) if p is not None else (i, req.memory_on(devs[i]), req.cores_on(devs[i])))
            mig.placed = {i: p for i, p in mig.placed.items() if i in ordered[: req.count]}
            return tuple(out)
        return tuple((i, req.memory_on(devs[i]), req.cores_on(devs[i])) for i in ordered[: req.count])
    # The most useful reason, as a code and its numbers.
    if n_excluded == n:
        for code in (Code.TYPE_EXCLUDED, Code.UUID_EXCLUDED, Code.GPU_UNHEALTHY):
            if code in excluded:
                return _fail(code, req, n, excluded[code])
    if not n_plain and (mig.no_place or mig.no_profile):  # only dynamic-MIG GPUs could take it
        if mig.no_place:
            return _fail(Code.MIG_NO_PLACEMENT, req, mig.want, mig.no_place, detail=mig.first)
        return _fail(Code.MIG_NO_PROFILE, req, mig.want, mig.largest, detail=mig.table)
    if req.exclusive and n_excl:
        return _fail(Code.EXCLUSIVE_BUSY, req, req.count, n_excl)
    if n_slots and n_slots + n_excluded == n:
        return _fail(Code.NO_FREE_SLOT, req, req.count, n_slots)
    if best_mem >= 0:
        sample = devs[best_mem_i]
        nm = req.memory_on(sample)
        if best_mem < nm:
            return _fail(Code.INSUFFICIENT_MEMORY, req, nm, best_mem, best_mem_i)
        nc = req.cores_on(sample)
        if best_cores < nc:
            return _fail(Code.INSUFFICIENT_CORES, req, nc, best_cores, best_cores_i)
    if n_exh:
        return _fail(Code.COMPUTE_FULL, req, req.count, n_exh)
    return _fail(Code.TOO_FEW_QUALIFY, req, req.count, len(cands))


def fit_pod(node: NodeState, pod: PodRequest, order: GpuOrder = order_by_index) -> Plan | FitFailure:
    """Fit ``pod`` on ``node``; returns a Plan or the typed reason (:class:`FitFailure`) why not
    (render it with :mod:`kube_vgpu.placement.render`).

    order: picks the GPUs among the candidates for each container (the GPU policy).
    """
    if node.cpu_total and pod.cpu_milli > node.cpu_free:
        return FitFailure(Code.HOST_CPU, need=pod.cpu_milli, have=node.cpu_free)
    if node.memory_total and pod.memory_mib > node.memory_free:
        return FitFailure(Code.HOST_MEMORY, need=pod.memory_mib, have=node.memory_free)
    plans: list[ContainerPlan] = []
    migs: list[tuple[int, int, str, int]] = []
    for c in pod.init:
        t = _MigTally({})
        r = _fit_container(node, c, node.free_mem, node.free_cores, node.free_slots, pod, order, node.mig_used, t)
        if isinstance(r, FitFailure):
            return r
        migs += [(len(plans), i, p[0], p[1]) for i, p in t.placed.items()]
        plans.append(r)
    if pod.app:
        mem = list(node.free_mem)
        cores = list(node.free_cores)
        slots = list(node.free_slots)
        used = [list(u) for u in node.mig_used] if node.has_mig else node.mig_used
        for c in pod.app:
            t = _MigTally({})
            r = _fit_container(node, c, mem, cores, slots, pod, order, used, t)
            if isinstance(r, FitFailure):
                return r
            for i, m, k in r:
                mem[i] -= m
                cores[i] -= k
                slots[i] -= 1
            for i, p in t.placed.items():
                used[i].append((p[0], p[1]))
                migs.append((len(plans), i, p[0], p[1]))
            plans.append(r)
    return Plan(tuple(plans), tuple(sorted(migs)))


def topology_plan(node: NodeState, pod: PodRequest, plan: Plan) -> Plan:
    """``plan`` with its GPUs re-picked for interconnect (:func:`kube_vgpu.topology.best_connected`)
    when the pod has one GPU container asking for 2 or more GPUs and the node publishes its
    topology: among the GPUs that container could use, the best-connected set, the policy's own
    choice first when it is as good. Feasibility is unchanged (the same candidates), so node
    choice and scores do not depend on it; pods with several GPU containers keep ``plan``."""
    conts = pod.containers
    if plan.mig or len(conts) != 1 or conts[0].count < 2 or len(plan.containers) != 1 \
            or not all(len(d.links) == len(node.devices) for d in node.devices):
        return plan
    req = conts[0]
    chosen = [i for i, _, _ in plan.containers[0]]
    cands: list[int] = []

    def capture(node_: NodeState, c: list[int], mem: list[int], cores: list[int], r: ContainerRequest) -> list[int]:
        cands.extend(c)
        return c
    if not isinstance(fit_pod(node, pod, capture), Plan):
        return plan
    ordered = chosen + [i for i in cands if i not in chosen]
    best = best_connected(ordered, req.count, [list(d.links) for d in node.devices])
    return Plan((tuple((i, req.memory_on(node.devices[i]), req.cores_on(node.devices[i])) for i in best),))


#: the GPU orderings (:func:`order_kind`): the two GPU policies' (named by them) and two of the
#: FGD artifact's (node index order, best fit)
ORDER_BINPACK, ORDER_SPREAD = GPU_BINPACK.name, GPU_SPREAD.name
ORDER_INDEX, ORDER_BESTFIT = "index", "bestfit"


def order_kind(kind: str) -> str:
    """The GPU ordering a GPU policy name stands for: ``index``, ``bestfit``, ``binpack``, or
    ``spread`` (any other name)."""
    return kind if kind in (ORDER_INDEX, ORDER_BESTFIT, ORDER_BINPACK) else ORDER_SPREAD


def gpu_order(kind: str) -> GpuOrder:
    """The GPU ordering for a GPU policy name (see :func:`order_kind`): ``binpack`` (most used
    first), ``spread`` (least used first), ``bestfit`` (smallest free share that fits first),
    ``index``. :mod:`kube_vgpu.placement.vector` has the vectorised twin of each."""
    kind = order_kind(kind)
    if kind == ORDER_INDEX:
        return order_by_index

    if kind == ORDER_BESTFIT:
        def bestfit(node: NodeState, cands: list[int], mem: list[int], cores: list[int],
                    req: ContainerRequest) -> list[int]:
            return sorted(cands, key=lambda i: (min(cores[i] * 1000 // max(node.devices[i].cores, 1),
                                                    mem[i] * 1000 // max(node.devices[i].memory_mib, 1)), i))
        return bestfit

    sign = -1.0 if kind == ORDER_BINPACK else 1.0

    def used(node: NodeState, cands: list[int], mem: list[int], cores: list[int],
             req: ContainerRequest) -> list[int]:
        slots = node.free_slots
        return sorted(cands, key=lambda i: (sign * _used_score(node, i, mem, cores, slots), i))
    return used


def plan_gpus(plan: Plan) -> Sequence[int]:
    """All GPU indexes a plan touches (sorted, unique)."""
    return sorted({i for cp in plan.containers for i, _, _ in cp})
