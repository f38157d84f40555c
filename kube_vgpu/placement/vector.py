"""The fit rules and the node scores, vectorised: one pod shape on many nodes at once.

The first decision for a pod shape the engine has not seen must evaluate every candidate node.
Per node in Python (:func:`kube_vgpu.placement.fit.fit_pod` and a policy's ``score``) that is
about 40-50 us a node, 200+ ms at 5,000 nodes. :func:`evaluate` computes the same answers for all
the nodes at once with numpy over the per-GPU arrays that :class:`~kube_vgpu.placement.state.ClusterState`
keeps up to date (:class:`~kube_vgpu.placement.state.GpuTable`): feasibility, the policy score and,
where the pod does not fit, the very :class:`~kube_vgpu.placement.status.FitFailure` the reference
rules give (same code, numbers, GPU and container). The GPUs a feasible node would give the pod
(the Plan) are not built here: the engine makes them with the reference rules for the one node
that is chosen, promised or bound.

Every rule below mirrors one in :mod:`kube_vgpu.placement.fit` (fit, failure reasons, GPU orders)
or :mod:`kube_vgpu.placement.policies` (Binpack, Spread, BestFit and DotProd scores), with the
same integer arithmetic and the same float operations in the same order, so the scores are equal
bit for bit. A property test (tests/placement/test_vector.py) holds the two equal on random
clusters and requests. FGD (fragmentation under a workload model, memoised per node state) is
not vectorised: :func:`kinds` returns None for it and the engine keeps it on the reference path.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from ..model import Constraints, ContainerRequest, GPUDevice, PodRequest
from .fit import ORDER_BESTFIT, ORDER_BINPACK, ORDER_INDEX, ORDER_SPREAD
from .policies import MAX_CPU_MILLI, MAX_GPU_MILLI, BestFit, Binpack, DotProd, Policy, Spread
from .state import GpuTable
from .status import Code, FitFailure

__all__ = ["FEASIBLE", "evaluate", "kinds"]


class _Feasible:
    """The outcome of a node where the pod fits and whose Plan is made on demand."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FEASIBLE"


FEASIBLE: Final = _Feasible()

#: the policy classes whose node score :func:`evaluate` computes (exact types: a subclass may
#: score differently)
_SCORERS: tuple[type[Policy], ...] = (Binpack, Spread, BestFit, DotProd)
_ORDERS = (ORDER_INDEX, ORDER_BESTFIT, ORDER_BINPACK, ORDER_SPREAD)

#: failure codes by small integer (0: none), for the per-node code arrays
_CODES: tuple[Code, ...] = (Code.INSUFFICIENT_MEMORY, *Code)
_ID = {c: i for i, c in enumerate(_CODES) if i}
_TYPE, _UUID, _UNHEALTHY = _ID[Code.TYPE_EXCLUDED], _ID[Code.UUID_EXCLUDED], _ID[Code.GPU_UNHEALTHY]
_HOST = -1  #: container index of a node-level (host CPU / memory) failure


def kinds(policy: Policy) -> tuple[type[Policy], str] | None:
    """(scorer class, GPU order kind: :func:`~kube_vgpu.placement.fit.order_kind`) when
    :func:`evaluate` computes exactly ``policy``'s answers, else None (FGD and any policy it does
    not know)."""
    cls = type(policy)
    order = getattr(policy, "order_kind", None)
    if cls not in _SCORERS or order not in _ORDERS:
        return None
    return cls, order


class _Failures:
    """Per node: failed yet, and (container index, code id, need, have, gpu) of its failure."""

    def __init__(self, m: int):
        self.done = np.zeros(m, dtype=bool)
        self.rec = np.zeros((m, 5), dtype=np.int64)

    def set(self, sel: np.ndarray, k: int, code: int | np.ndarray, need: int | np.ndarray,
            have: int | np.ndarray, gpu: int | np.ndarray = -1) -> None:
        """Record a failure for the nodes in ``sel`` (bool mask, none failed before)."""
        if not sel.any():
            return
        rows = np.flatnonzero(sel)
        self.set_rows(rows, k, *(v[rows] if isinstance(v, np.ndarray) else v for v in (code, need, have, gpu)))

    def set_rows(self, rows: np.ndarray, k: int, code: int | np.ndarray, need: int | np.ndarray,
                 have: int | np.ndarray, gpu: int | np.ndarray = -1) -> None:
        """Record a failure for the nodes at ``rows`` (indexes, none failed before); array values
        are aligned with ``rows``."""
        rec = self.rec
        rec[rows, 0] = k
        rec[rows, 1] = code
        rec[rows, 2] = need
        rec[rows, 3] = have
        rec[rows, 4] = gpu
        self.done[rows] = True

    def objects(self, pod: PodRequest) -> np.ndarray:
        """One FitFailure per failed node (equal failures share one object); FEASIBLE elsewhere."""
        out = np.full(len(self.done), FEASIBLE, dtype=object)
        rows = np.flatnonzero(self.done)
        if not len(rows):
            return out
        rec = self.rec[rows]
        # equal records -> one id: one sort of the records, a new id where a record differs from
        # the one before it
        order = np.lexsort(rec.T[::-1])
        ranked = rec[order]
        new = np.ones(len(ranked), dtype=bool)
        np.any(ranked[1:] != ranked[:-1], axis=1, out=new[1:])
        inv = np.empty(len(ranked), dtype=np.int64)
        inv[order] = np.cumsum(new) - 1
        first = order[new]
        conts = pod.containers
        objs = np.empty(len(first), dtype=object)
        for j, (k, code, need, have, gpu) in enumerate(rec[first].tolist()):
            if k == _HOST:
                objs[j] = FitFailure(_CODES[code], need=need, have=have)
            else:
                r = conts[k]
                objs[j] = FitFailure(_CODES[code], r.name, r.init, r.count, r.memory_mib, r.memory_percent,
                                     r.cores, need, have, gpu)
        out[rows] = objs[inv]
        return out


def _member(uuids: np.ndarray, listed: tuple[str, ...]) -> np.ndarray:
    """Per GPU: is its uuid in ``listed`` (a tenant's annotation list). A set lookup per GPU:
    ``np.isin`` on object arrays compares every GPU with every listed uuid, and a few thousand
    uuids in one annotation held the event loop for over a second per filter on 8,000 GPUs."""
    wanted = frozenset(listed)
    return np.fromiter((u in wanted for u in uuids.flat), dtype=bool, count=uuids.size).reshape(uuids.shape)


def _exclusions(t: GpuTable, rows: slice | np.ndarray, pod: PodRequest, present: np.ndarray,
                healthy: np.ndarray) -> np.ndarray:
    """Per GPU: why the pod may not use it (code id: unhealthy, uuid or type excluded), 0 if it
    may (``fit._excluded``)."""
    code = np.zeros(present.shape, dtype=np.int64)
    c = pod.constraints
    if not c.empty or pod.gpu_spec:
        model = t.model[rows]
        names = t.model_names
        if not c.empty:
            types = Constraints(c.use_types, c.nouse_types)
            type_ok = np.array([types.allows(GPUDevice("", 0, m, 0)) for m in names])[model]
            uuid_bad = np.zeros(present.shape, dtype=bool)
            if c.use_uuids or c.nouse_uuids:
                uuids = t.uuids[rows]
                if c.use_uuids:
                    uuid_bad |= ~_member(uuids, c.use_uuids)
                if c.nouse_uuids:
                    uuid_bad |= _member(uuids, c.nouse_uuids)
            no_types = not (c.use_types or c.nouse_types)
            why = np.where(uuid_bad & (no_types | type_ok), _UUID, _TYPE)
            code = np.where(type_ok & ~uuid_bad, 0, why)
        if pod.gpu_spec:
            spec_ok = np.array([m in pod.gpu_spec for m in names])[model]
            code = np.where((code == 0) & ~spec_ok, _TYPE, code)
    code = np.where(healthy, code, _UNHEALTHY)
    return np.where(present, code, 0)


def _at(v: int | np.ndarray, r: np.ndarray, col: np.ndarray) -> int | np.ndarray:
    """``v`` (a per-GPU array or one value for every GPU) at row ``r``, column ``col``."""
    return v[r, col] if isinstance(v, np.ndarray) else v


def evaluate(t: GpuTable, rows: np.ndarray, pod: PodRequest, scorer: type[Policy], order: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """Fit and score ``pod`` on the nodes at ``rows`` (node indexes, int64) of ``t``.

    scorer: the policy class whose node score to compute (Binpack, Spread, BestFit, DotProd);
    order: the GPU ordering (:func:`~kube_vgpu.placement.fit.order_kind`); see :func:`kinds`.
    Returns (score per node, float64, -inf where the pod does not fit; outcome per node, object:
    its FitFailure, or :data:`FEASIBLE`). Raises ValueError for a scorer or order it does not
    compute."""
    if scorer not in _SCORERS or order not in _ORDERS:
        raise ValueError(f"scorer, order: ({scorer.__name__}, {order!r}) is not vectorised; "
                         f"allowed: {', '.join(c.__name__ for c in _SCORERS)} with {', '.join(_ORDERS)}")
    m = len(rows)
    # every node, in order (a new shape): views, no copies; otherwise the rows asked about
    sel_rows: slice | np.ndarray = rows
    if m == t.n and (m == 0 or (int(rows[0]) == 0 and int(rows[-1]) == m - 1 and bool((np.diff(rows) == 1).all()))):
        sel_rows = slice(0, m)
    present = t.present[sel_rows]
    healthy = t.healthy[sel_rows]
    mem_t = t.mem_total[sel_rows]
    cores_t = t.cores_total[sel_rows]
    split = t.split[sel_rows]
    fm0 = t.free_mem[sel_rows]
    fc0 = t.free_cores[sel_rows]
    fs0 = t.free_slots[sel_rows]
    n_gpus = t.n_gpus[sel_rows]
    cpu_total = t.cpu_total[sel_rows]
    cpu_free = t.cpu_free[sel_rows]
    fail = _Failures(m)

    # host CPU and memory (fit_pod), where a node models them
    fail.set((cpu_total != 0) & (pod.cpu_milli > cpu_free), _HOST, _ID[Code.HOST_CPU], pod.cpu_milli, cpu_free)
    hmt, hmf = t.host_mem_total[sel_rows], t.host_mem_free[sel_rows]
    fail.set(~fail.done & (hmt != 0) & (pod.memory_mib > hmf), _HOST, _ID[Code.HOST_MEMORY], pod.memory_mib, hmf)

    excl = _exclusions(t, sel_rows, pod, present, healthy)
    usable = present & (excl == 0)
    n_excl = np.count_nonzero(excl, axis=1)
    w = present.shape[1]
    safe_c, safe_m = np.maximum(cores_t, 1), np.maximum(mem_t, 1)
    slot_used: np.ndarray | None = None  # fit._used_score's slot term, the same for every container
    if order in (ORDER_BINPACK, ORDER_SPREAD):
        with np.errstate(divide="ignore", invalid="ignore"):
            slot_used = (split - fs0) / split
    #: per GPU, what the pod would hold (MiB, cores): only BestFit and DotProd score it
    usage = scorer in (BestFit, DotProd)
    if usage:
        app_mem, app_cores = np.zeros((m, w), dtype=np.int64), np.zeros((m, w), dtype=np.int64)
        ini_mem, ini_cores = np.zeros((m, w), dtype=np.int64), np.zeros((m, w), dtype=np.int64)

    def container(k: int, req: ContainerRequest, mem: np.ndarray, cores: np.ndarray, slots: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, int | np.ndarray, int | np.ndarray]:
        """Fit one container (``fit._fit_container``) on every node not failed yet; records the
        failures; returns (rows that fit, chosen GPU columns per such row, MiB and cores per GPU)."""
        gm: int | np.ndarray = req.memory_mib if req.memory_mib else np.maximum(1, mem_t * req.memory_percent // 100)
        gc: int | np.ndarray = cores_t if req.cores >= 100 else req.cores
        alive = ~fail.done
        few = alive & (req.count > n_gpus)
        fail.set(few, k, _ID[Code.TOO_FEW_GPUS], req.count, n_gpus)
        alive &= ~few
        no_slot = usable & (slots <= 0)
        u = usable & ~no_slot
        busy = None
        if req.exclusive:
            busy = u & (slots < split)
            u &= ~busy
        exh = None  # a request with cores (or per-GPU cores: exclusive) never meets compute_full
        if not isinstance(gc, np.ndarray) and gc == 0:
            exh = u & (cores <= 0) & (cores_t > 0)
            u &= ~exh
        fit = u & (mem >= gm) & (cores >= gc)
        n_cand = np.count_nonzero(fit, axis=1)
        ok = alive & (n_cand >= req.count)
        bad = alive & ~ok
        if bad.any():
            _reasons(k, req, bad, u, busy, no_slot, exh, n_cand, mem, cores, gm, gc)
        ok_rows = np.flatnonzero(ok)
        if not len(ok_rows):
            return ok_rows, np.zeros((0, req.count), dtype=np.int64), gm, gc
        if order == ORDER_INDEX:
            key: np.ndarray = np.where(fit, 0, 1)
        elif order == ORDER_BESTFIT:
            share = np.minimum(cores * 1000 // safe_c, mem * 1000 // safe_m)
            key = np.where(fit, share, np.iinfo(np.int64).max)
        else:  # spread / binpack: fit._used_score with this node's free slots, before this pod
            assert slot_used is not None
            used = slot_used + (cores_t - cores) / safe_c + (mem_t - mem) / safe_m
            key = np.where(fit, -used if order == ORDER_BINPACK else used, np.inf)
        key = key[ok_rows]
        if req.count == 1:  # the first smallest key, as the stable sort's first
            chosen = np.argmin(key, axis=1)[:, None]
        else:
            chosen = np.argsort(key, axis=1, kind="stable")[:, : req.count]
        return ok_rows, chosen, gm, gc

    def _reasons(k: int, req: ContainerRequest, bad: np.ndarray, u: np.ndarray,
                 busy: np.ndarray | None, no_slot: np.ndarray, exh: np.ndarray | None, n_cand: np.ndarray,
                 mem: np.ndarray, cores: np.ndarray, gm: int | np.ndarray, gc: int | np.ndarray) -> None:
        """The most useful reason per failed node, in fit._fit_container's order (computed on the
        failed nodes only)."""
        cnt = req.count
        b = np.flatnonzero(bad)
        rl = np.arange(len(b))
        ng, nx = n_gpus[b], n_excl[b]
        rem = np.ones(len(b), dtype=bool)

        def put(sel: np.ndarray, code: int | np.ndarray, need: int | np.ndarray, have: int | np.ndarray,
                gpu: int | np.ndarray = -1) -> None:
            if sel.any():
                fail.set_rows(b[sel], k, *(v[sel] if isinstance(v, np.ndarray) else v
                                           for v in (code, need, have, gpu)))
                rem[sel] = False

        all_excl = nx == ng
        if all_excl.any():
            ex = excl[b]
            n_type = np.count_nonzero(ex == _TYPE, axis=1)
            n_uuid = np.count_nonzero(ex == _UUID, axis=1)
            n_unh = np.count_nonzero(ex == _UNHEALTHY, axis=1)
            code = np.where(n_type > 0, _TYPE, np.where(n_uuid > 0, _UUID, _UNHEALTHY))
            have = np.where(n_type > 0, n_type, np.where(n_uuid > 0, n_uuid, n_unh))
            put(all_excl, code, ng, have)
        if busy is not None:
            n_busy = np.count_nonzero(busy[b], axis=1)
            put(rem & (n_busy > 0), _ID[Code.EXCLUSIVE_BUSY], cnt, n_busy)
        n_slots = np.count_nonzero(no_slot[b], axis=1)
        put(rem & (n_slots > 0) & (n_slots + nx == ng), _ID[Code.NO_FREE_SLOT], cnt, n_slots)
        # the GPU with the most free memory (first on ties) among those that got that far
        ub = u[b]
        bm_all = np.where(ub, mem[b], -1)
        bmi = np.argmax(bm_all, axis=1)
        bm = bm_all[rl, bmi]
        bc_all = np.where(ub, cores[b], -1)
        bci = np.argmax(bc_all, axis=1)
        bc = np.maximum(bc_all[rl, bci], -1)  # fit starts from -1 and keeps the first strictly larger
        bci = np.where(bc > -1, bci, -1)
        nm = gm[b][rl, bmi] if isinstance(gm, np.ndarray) else gm
        put(rem & (bm >= 0) & (bm < nm), _ID[Code.INSUFFICIENT_MEMORY], nm, bm, bmi)
        nc = gc[b][rl, bmi] if isinstance(gc, np.ndarray) else gc  # on the most-free-memory GPU, as fit
        put(rem & (bm >= 0) & (bc < nc), _ID[Code.INSUFFICIENT_CORES], nc, bc, bci)
        if exh is not None:
            n_exh = np.count_nonzero(exh[b], axis=1)
            put(rem & (n_exh > 0), _ID[Code.COMPUTE_FULL], cnt, n_exh)
        put(rem, _ID[Code.TOO_FEW_QUALIFY], cnt, n_cand[b])

    for k, req in enumerate(pod.init):  # one at a time, on the node as it is
        ok_rows, chosen, gm, gc = container(k, req, fm0, fc0, fs0)
        if usage:
            rr = ok_rows[:, None]
            ini_mem[rr, chosen] = np.maximum(ini_mem[rr, chosen], _at(gm, rr, chosen))
            ini_cores[rr, chosen] = np.maximum(ini_cores[rr, chosen], _at(gc, rr, chosen))
    mem, cores, slots = fm0, fc0, fs0
    for j, req in enumerate(pod.app):  # together, on an accumulating copy
        ok_rows, chosen, gm, gc = container(len(pod.init) + j, req, mem, cores, slots)
        rr = ok_rows[:, None]
        gmc, gcc = _at(gm, rr, chosen), _at(gc, rr, chosen)
        if j + 1 < len(pod.app):  # the next container sees what this one took
            if mem is fm0:
                mem, cores, slots = fm0.copy(), fc0.copy(), fs0.copy()
            mem[rr, chosen] -= gmc
            cores[rr, chosen] -= gcc
            slots[rr, chosen] -= 1
        if usage:
            app_mem[rr, chosen] += gmc
            app_cores[rr, chosen] += gcc

    feasible = ~fail.done
    if not usage:  # Binpack / Spread: NodeState.used_fraction, before this pod
        uf = t.used_fraction[sel_rows]
        score = uf if scorer is Binpack else -uf
    else:
        # BestFit / DotProd: the node's free milli-GPU, and policies.pod_gpu_milli of the pod
        gfree = t.milli_free[sel_rows]
        u_mem = np.maximum(app_mem, ini_mem)
        u_cores = np.maximum(app_cores, ini_cores)
        pgm = np.maximum(u_cores * 1000 // safe_c, -(-u_mem * 1000 // safe_m)).sum(axis=1)
        modelled = cpu_total != 0
        if scorer is BestFit:
            cpu_left = np.where(modelled, (cpu_free - pod.cpu_milli) / MAX_CPU_MILLI, 0.0)
            gpu_left = (gfree - pgm) / MAX_GPU_MILLI
            score = -(0.5 * cpu_left + 0.5 * gpu_left)
        else:
            cpu = np.where(modelled, (cpu_free / MAX_CPU_MILLI) * (pod.cpu_milli / MAX_CPU_MILLI), 0.0)
            gpu = (gfree / MAX_GPU_MILLI) * (pgm / MAX_GPU_MILLI)
            score = 1.0 - (cpu + gpu) / 2.0
    scores = np.where(feasible, score, -np.inf).astype(np.float64)
    return scores, fail.objects(pod)
