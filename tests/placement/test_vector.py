"""The vectorised fit (kube_vgpu/placement/vector.py) gives exactly the reference engine's answers.

Two engines over two identical clusters: one evaluates every node with the reference rules
(``vector_min`` huge), the other evaluates every changed node with numpy (``vector_min=0``).
Random clusters (mixed models, sizes, cores, vGPU slots, unhealthy GPUs, host CPU and memory on
some nodes, bookings that overcommit) and random pods (init and app containers, MiB or percent,
exclusive, constraints by type and uuid, exact model lists, host requests), under every vectorised
policy and GPU ordering: feasible nodes, scores (bit for bit), typed failures, the chosen node and
its plan, every node's plan, and again after binding the choice (the arrays follow the bookings).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.model import (
    Constraints,
    ContainerAllocation,
    ContainerRequest,
    DeviceBooking,
    GPUDevice,
    PodAllocation,
    PodRequest,
)
from kube_vgpu.placement import (
    BestFit,
    Binpack,
    ClusterState,
    DotProd,
    Engine,
    Spread,
    TaskShape,
    make_policy,
)
from kube_vgpu.placement.policies import FGD
from kube_vgpu.placement.vector import FEASIBLE, evaluate, kinds
from kube_vgpu.policyregistry import GPU_POLICIES, NODE_POLICIES

MODELS = ("NVIDIA A100-SXM4-40GB", "Tesla T4", "NVIDIA H100 80GB HBM3")
#: the node policies the vectorised fit computes (FGD stays on the reference path)
VECTOR_POLICIES = [n for n in NODE_POLICIES if kinds(make_policy(n, GPU_POLICIES[0],
                                                                 [TaskShape(0, 500, 1, frozenset(), 1.0)]))]
#: GPU orderings: the configurable ones plus those only a pod annotation or the replay names
ORDERS = [*GPU_POLICIES, "index", "bestfit"]


def _cluster(rnd: np.random.Generator, n_nodes: int, host: bool) -> list[tuple[str, tuple[GPUDevice, ...], int, int, list[PodAllocation]]]:
    out = []
    for k in range(n_nodes):
        name = f"n{k}"
        n_gpus = int(rnd.integers(0, 6))
        model = MODELS[int(rnd.integers(0, len(MODELS)))]
        devs = []
        for g in range(n_gpus):
            m = model if rnd.random() < 0.8 else MODELS[int(rnd.integers(0, len(MODELS)))]
            devs.append(GPUDevice(f"GPU-{k:03d}-{g}", g, m, int(rnd.choice([1000, 16384, 40960, 81559])),
                                  int(rnd.choice([100, 100, 50, 200])), int(rnd.choice([1, 2, 4, 10])),
                                  healthy=bool(rnd.random() < 0.9)))
        allocs = []
        for _ in range(int(rnd.integers(0, 5)) if n_gpus else 0):
            picks = rnd.choice(n_gpus, size=int(rnd.integers(1, n_gpus + 1)), replace=False)
            allocs.append(PodAllocation(name, (ContainerAllocation("c", False, tuple(
                DeviceBooking(devs[int(g)].uuid, int(rnd.integers(0, 50)) * 1000, int(rnd.choice([0, 10, 30, 60, 100])))
                for g in picks)),)))
        cpu = int(rnd.choice([0, 4000, 64000])) if host else 0
        memory = int(rnd.choice([0, 8192, 262144])) if host else 0
        out.append((name, tuple(devs), cpu, memory, allocs))
    return out


def _container(rnd: np.random.Generator, name: str, init: bool) -> ContainerRequest:
    pct = rnd.random() < 0.3
    return ContainerRequest(
        name=name, init=init, count=int(rnd.choice([1, 1, 1, 2, 3, 5])),
        memory_mib=0 if pct else int(rnd.choice([0, 1, 500, 4000, 8000, 20000, 41000, 90000])),
        memory_percent=int(rnd.choice([1, 25, 50, 100])) if pct else 0,
        cores=int(rnd.choice([0, 0, 10, 30, 50, 100, 150])))


def _pod(rnd: np.random.Generator, k: int, uuids: list[str]) -> PodRequest:
    init = tuple(_container(rnd, f"init{i}", True) for i in range(int(rnd.choice([0, 0, 0, 1, 2]))))
    app = tuple(_container(rnd, f"c{i}", False) for i in range(int(rnd.choice([0, 1, 1, 1, 2, 3]))))
    if not init and not app:
        app = (_container(rnd, "c0", False),)
    c = Constraints()
    roll = rnd.random()
    if roll < 0.1:
        c = Constraints(use_types=("a100", "h100"))
    elif roll < 0.2:
        c = Constraints(nouse_types=("T4",))
    elif roll < 0.3 and uuids:
        c = Constraints(use_uuids=tuple(rnd.choice(uuids, size=min(len(uuids), 3), replace=False).tolist()))
    elif roll < 0.4 and uuids:
        c = Constraints(use_types=("T4",), nouse_uuids=tuple(rnd.choice(uuids, size=min(len(uuids), 5), replace=False).tolist()))
    spec = (MODELS[int(rnd.integers(0, len(MODELS)))],) if rnd.random() < 0.1 else ()
    return PodRequest("ns", f"p{k}", f"uid-{k}", init, app, c, cpu_milli=int(rnd.choice([0, 1000, 8000])),
                      memory_mib=int(rnd.choice([0, 1024, 16384])), gpu_spec=spec)


def _engines(seed: int, n_nodes: int, host: bool, policy: str, order: str) -> tuple[Engine, Engine, np.random.Generator]:
    rnd = np.random.default_rng(seed)
    ref = Engine(ClusterState(), policy, order, vector_min=10**9)
    vec = Engine(ClusterState(), policy, order, vector_min=0)
    for name, devs, cpu, memory, allocs in _cluster(rnd, n_nodes, host):
        pod_cpu = [int(rnd.integers(0, 3)) * 1000 if host else 0 for _ in allocs]
        for e in (ref, vec):
            e.state.set_node(name, devs, cpu, memory)
            for i, a in enumerate(allocs):
                e.state.book(f"{name}/b{i}", a, cpu_milli=pod_cpu[i], check=False)
    return ref, vec, rnd


def _assert_same(ref: Engine, vec: Engine, pod: PodRequest) -> None:
    names = [n.name for n in ref.state.node_list]
    want = ref.evaluate(pod, names[::-1] + ["unknown"])
    got = vec.evaluate(pod, names[::-1] + ["unknown"])
    assert got == want
    # bit for bit (== would let -0.0 and 0.0 pass)
    assert [np.float64(v).tobytes() for v in got[2].values()] == [np.float64(v).tobytes() for v in want[2].values()]
    assert vec.choose(pod) == ref.choose(pod)
    for n in names:
        assert vec.plan_for(pod, n) == ref.plan_for(pod, n)


def _assert_table_matches(state: ClusterState) -> None:
    t = state.table
    assert t.n == len(state.node_list)
    for node in state.node_list:
        k = len(node.devices)
        r = node.idx
        assert t.free_mem[r, :k].tolist() == node.free_mem and t.free_cores[r, :k].tolist() == node.free_cores
        assert t.free_slots[r, :k].tolist() == node.free_slots and int(t.n_gpus[r]) == k
        assert t.uuids[r, :k].tolist() == [d.uuid for d in node.devices] and not t.present[r, k:].any()
        assert (int(t.cpu_free[r]), int(t.host_mem_free[r])) == (node.cpu_free, node.memory_free)


@given(st.integers(0, 2**32 - 1), st.integers(1, 14), st.booleans(), st.sampled_from(VECTOR_POLICIES),
       st.sampled_from(ORDERS))
@settings(max_examples=250, deadline=None)
def test_vectorised_fit_equals_the_reference_engine(seed: int, n_nodes: int, host: bool, policy: str,
                                                    order: str) -> None:
    ref, vec, rnd = _engines(seed, n_nodes, host, policy, order)
    uuids = [d.uuid for n in ref.state.node_list for d in n.devices]
    for k in range(4):
        pod = _pod(rnd, k, uuids)
        _assert_same(ref, vec, pod)
        d = ref.choose(pod)
        if d is not None:  # bind it in both: the next pod sees the arrays after a booking
            for e in (ref, vec):
                e.book(pod, e.allocation(pod, d.node, d.plan, now=1.0))
        _assert_table_matches(vec.state)


@given(st.integers(0, 2**32 - 1), st.integers(1, 8), st.sampled_from(VECTOR_POLICIES), st.sampled_from(ORDERS))
@settings(max_examples=200, deadline=None)
def test_app_containers_share_gpus_in_the_reference_order(seed: int, n_nodes: int, policy: str, order: str) -> None:
    """Pods of several small app containers on nodes of a few shared GPUs: each container's GPUs
    follow from the ones taken before it (the accumulating copy and the GPU order's ties)."""
    ref, vec, rnd = _engines(seed, n_nodes, False, policy, order)
    for k in range(4):
        app = tuple(ContainerRequest(f"c{i}", False, int(rnd.choice([1, 1, 2])),
                                     memory_mib=int(rnd.choice([0, 100, 1000, 3000])), cores=int(rnd.choice([0, 5, 20])))
                    for i in range(int(rnd.integers(2, 5))))
        pod = PodRequest("ns", f"m{k}", app=app)
        _assert_same(ref, vec, pod)
        d = ref.choose(pod)
        if d is not None:
            for e in (ref, vec):
                e.book(pod, e.allocation(pod, d.node, d.plan, now=1.0))


@given(st.integers(0, 2**32 - 1), st.integers(2, 10))
@settings(max_examples=60, deadline=None)
def test_arrays_follow_nodes_added_replaced_removed_and_promises(seed: int, n_nodes: int) -> None:
    ref, vec, rnd = _engines(seed, n_nodes, True, VECTOR_POLICIES[0], ORDERS[0])
    uuids = [d.uuid for n in ref.state.node_list for d in n.devices]
    pod = _pod(rnd, 0, uuids)
    for step in range(6):
        names = [n.name for n in ref.state.node_list]
        what = step % 3
        d = ref.choose(pod)
        for e in (ref, vec):
            if what == 0 and names:
                e.state.remove_node(names[len(names) // 2])
            elif what == 1:  # a wider node (more GPUs than any before) replaces or joins
                e.state.set_node(f"n{step % 4}", tuple(GPUDevice(f"GPU-w{step}-{g}", g, MODELS[0], 40960) for g in range(7)),
                                 8000, 0)
            elif d is not None:
                e.assume(pod, "u", d.node, d.plan, expires=5.0)
        _assert_table_matches(vec.state)
        _assert_same(ref, vec, pod)


def test_kinds_cover_the_vectorised_policies_and_leave_fgd_on_the_reference_path() -> None:
    shapes = [TaskShape(0, 500, 1, frozenset(), 1.0)]
    assert {kinds(make_policy(n, o, shapes)) is not None for n in NODE_POLICIES for o in ORDERS}
    assert kinds(FGD(shapes)) is None
    assert {type(make_policy(n, GPU_POLICIES[0], shapes)) for n in VECTOR_POLICIES} == {Binpack, Spread, BestFit, DotProd}


def test_a_new_shape_is_vectorised_and_the_plan_is_made_for_the_chosen_node_only() -> None:
    st_ = ClusterState()
    for k in range(30):
        st_.set_node(f"n{k}", tuple(GPUDevice(f"GPU-{k}-{g}", g, MODELS[0], 40960) for g in range(2)))
    e = Engine(st_, VECTOR_POLICIES[0], vector_min=24)
    pod = PodRequest("ns", "p", app=(ContainerRequest("c", False, 1, memory_mib=1000),))
    res = e.evaluate_nodes(pod, np.arange(30, dtype=np.int64))
    assert all(o is FEASIBLE for o in res.outcomes) and res.feasible.all()
    d = e.choose(pod)
    assert d is not None and d.plan.containers == (((0, 1000, 0),),)


def test_evaluate_refuses_a_policy_it_does_not_compute() -> None:
    import pytest

    st_ = ClusterState()
    with pytest.raises(ValueError, match="scorer, order: \\(FGD, .*allowed: Binpack"):
        evaluate(st_.table, np.zeros(0, dtype=np.int64), PodRequest("ns", "p"), FGD, ORDERS[0])
