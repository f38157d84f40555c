"""NVLink/topology-aware multi-GPU placement (kube_vgpu/topology.py, placement/fit.py
topology_plan): on an 8-GPU box with two NVLink islands of 4, a container asking for 4 GPUs gets
one island even when its GPU policy's order would straddle both; what a node can hold and how it
scores never depend on the topology; the inventory carries the ranks."""

from __future__ import annotations

import pytest

from kube_vgpu.codec import decode_inventory, encode_inventory
from kube_vgpu.errors import CodecError
from kube_vgpu.model import ContainerRequest, GPUDevice, NodeInventory, PodRequest
from kube_vgpu.placement import ClusterState, Engine
from kube_vgpu.placement.fit import Plan
from kube_vgpu.topology import HOST_BRIDGE, NVLINK, SYSTEM, UNKNOWN, best_connected, rank_of

ISLANDS = [[UNKNOWN if a == b else (NVLINK + 2 if a // 4 == b // 4 else SYSTEM) for b in range(8)] for a in range(8)]


def node_devices(links: bool = True) -> tuple[GPUDevice, ...]:
    return tuple(GPUDevice(f"GPU-{i}", i, "NVIDIA H200", 80000, links=tuple(ISLANDS[i]) if links else ())
                 for i in range(8))


def pod(name: str, count: int, mib: int = 10000, containers: int = 1) -> PodRequest:
    app = tuple(ContainerRequest(f"c{k}", False, count, mib, 0, 0) for k in range(containers))
    return PodRequest("default", name, (), app)


def engine(links: bool = True, gpu_policy: str = "spread") -> Engine:
    st = ClusterState()
    st.set_node("n1", node_devices(links), 0, 0, 0.0)
    return Engine(st, "binpack", gpu_policy)


def book_some(eng: Engine, gpus: list[int]) -> None:
    """Book 1000 MiB on each of ``gpus`` (pods of one GPU each), so a spread order starts elsewhere."""
    for k, g in enumerate(gpus):
        p = pod(f"small-{k}", 1, 1000)
        plan = Plan((((g, 1000, 0),),))
        eng.book(p, eng.allocation(p, "n1", plan, now=0.0))


def test_ranks_and_the_best_connected_set() -> None:
    assert rank_of(None) == UNKNOWN and rank_of(50) == SYSTEM and rank_of(30) == HOST_BRIDGE
    assert rank_of(10, nvlinks=2) == NVLINK + 2
    # the policy's order straddles the islands: the best set is one whole island
    assert sorted(best_connected([3, 4, 5, 6, 0, 1, 2, 7], 4, ISLANDS)) in ([0, 1, 2, 3], [4, 5, 6, 7])
    assert best_connected([4, 5, 6, 7, 0], 4, ISLANDS) == [4, 5, 6, 7]  # already an island: kept
    assert best_connected([0, 1, 2], 2, []) == [0, 1]  # no topology: the policy's order
    assert best_connected([2, 1, 0], 1, ISLANDS) == [2]


def test_four_gpu_container_lands_on_one_nvlink_island() -> None:
    eng = engine()
    book_some(eng, [0, 1, 2, 7])  # spread: the idle GPUs 3-6 come first, straddling both islands
    plan = eng.plan_for(pod("big", 4), "n1")
    assert isinstance(plan, Plan)
    chosen = sorted(i for i, _, _ in plan.containers[0])
    assert chosen in ([0, 1, 2, 3], [4, 5, 6, 7]), chosen
    # without published topology the same request follows the GPU policy's order alone
    plain = engine(links=False)
    book_some(plain, [0, 1, 2, 7])
    p2 = plain.plan_for(pod("big", 4), "n1")
    assert isinstance(p2, Plan) and sorted(i for i, _, _ in p2.containers[0]) == [3, 4, 5, 6]


def test_topology_never_changes_what_fits_or_how_nodes_score() -> None:
    with_links, without = engine(), engine(links=False)
    for e in (with_links, without):
        book_some(e, [0, 1, 2, 7])
    for p in (pod("a", 4), pod("b", 2, 70000), pod("c", 8), pod("d", 2, containers=2)):
        r1, r2 = with_links.evaluate(p, ["n1"]), without.evaluate(p, ["n1"])
        assert (r1[0], r1[2]) == (r2[0], r2[2]), p.name  # feasible nodes and scores
    # two GPU containers: the plan is the policy's (their choices interact), topology or not
    d1, d2 = with_links.plan_for(pod("d", 2, containers=2), "n1"), without.plan_for(pod("d", 2, containers=2), "n1")
    assert d1 == d2


def test_inventory_carries_the_ranks_and_refuses_bad_ones() -> None:
    inv = NodeInventory(node_devices(), 1.0)
    assert decode_inventory(encode_inventory(inv)) == inv
    assert decode_inventory(encode_inventory(NodeInventory(node_devices(False), 1.0))).devices[0].links == ()
    text = encode_inventory(inv)
    for bad in (text.replace('"links":[0,12,', '"links":[0,"x",', 1), text.replace('"links":[0,12,', '"links":[0,99,', 1),
                text.replace('"links":[0,12,12,12,1,1,1,1]', '"links":[0,12]', 1)):
        assert bad != text
        with pytest.raises(CodecError, match="links"):
            decode_inventory(bad)


# -- a pod that requires a link class (annotation kube-vgpu.io/gpu-link) --------------------------

def linked_pod(name: str, count: int, link: str, mib: int = 10000) -> PodRequest:
    from kube_vgpu.model import Constraints
    from kube_vgpu.topology import LINK_CLASSES
    return PodRequest("default", name, app=(ContainerRequest("c0", False, count, mib, 0, 0),),
                      constraints=Constraints(min_link=LINK_CLASSES[link]))


def fill(eng: Engine, gpus: list[int]) -> None:
    """Book each of ``gpus`` whole (all its memory), so nothing else fits there."""
    for k, g in enumerate(gpus):
        p = pod(f"full-{k}", 1, 80000)
        eng.book(p, eng.allocation(p, "n1", Plan((((g, 80000, 0),),)), now=0.0))


def test_a_required_nvlink_set_is_found_across_the_policys_order() -> None:
    eng = engine()
    fill(eng, [0])  # island 0 has 3 free GPUs; island 1 has 4
    plan = eng.plan_for(linked_pod("big", 4, "nvlink"), "n1")
    assert isinstance(plan, Plan) and sorted(i for i, _, _ in plan.containers[0]) == [4, 5, 6, 7]
    assert isinstance(eng.plan_for(linked_pod("pair", 2, "nvlink"), "n1"), Plan)


def test_a_required_link_that_is_busy_is_resolvable_and_one_the_node_lacks_is_not() -> None:
    from kube_vgpu.placement.render import detail
    from kube_vgpu.placement.status import Code, FitFailure
    eng = engine()
    fill(eng, [0, 4])  # each island has 3 free GPUs: 4 NVLinked GPUs exist, but not free
    r = eng.plan_for(linked_pod("big", 4, "nvlink"), "n1")
    assert isinstance(r, FitFailure) and r.code is Code.LINK_UNAVAILABLE and r.resolvable
    assert r.need == NVLINK + 1 and r.have == SYSTEM
    assert "linked by nvlink" in detail(r) and "reaches system" in detail(r)
    # without the requirement the same pod fits (straddling the islands)
    assert isinstance(eng.plan_for(pod("big", 4), "n1"), Plan)
    # 5 GPUs are never NVLinked together on a 2x4 box: not resolvable by eviction
    r5 = engine().plan_for(linked_pod("five", 5, "nvlink"), "n1")
    assert isinstance(r5, FitFailure) and r5.code is Code.LINK_ABSENT and not r5.resolvable
    # a node that publishes no topology cannot prove the link: absent, not assumed
    r0 = engine(links=False).plan_for(linked_pod("big", 2, "nvlink"), "n1")
    assert isinstance(r0, FitFailure) and r0.code is Code.LINK_ABSENT
    # a weaker class is met by the cross-island pairs (SYSTEM is below numa: still absent)
    assert isinstance(engine().plan_for(linked_pod("x", 8, "numa"), "n1"), FitFailure)


def test_one_gpu_containers_ignore_the_requirement_and_the_engine_agrees_with_the_reference() -> None:
    from kube_vgpu.placement.fit import fit_pod
    assert isinstance(engine().plan_for(linked_pod("one", 1, "nvlink"), "n1"), Plan)
    st = ClusterState()
    for k in range(30):  # enough changed nodes for the vectorised path, which must not answer it
        st.set_node(f"n{k}", node_devices(), 0, 0, 0.0)
    many = Engine(st, "binpack", "spread", vector_min=0)
    for k in range(0, 30, 2):  # even nodes: one GPU of each island full
        for g in (0, 4):
            p = pod(f"full-{k}-{g}", 1, 80000)
            many.book(p, many.allocation(p, f"n{k}", Plan((((g, 80000, 0),),)), now=0.0))
    p = linked_pod("big", 4, "nvlink")
    feasible, failed, _ = many.evaluate(p, [f"n{k}" for k in range(30)])
    assert feasible == [f"n{k}" for k in range(1, 30, 2)]
    assert {f.code.value for f in failed.values()} == {"link_unavailable"}
    for node in st.node_list:
        assert isinstance(fit_pod(node, p), Plan) == (node.name in feasible)


def test_the_link_annotation_is_parsed_and_a_bad_value_named() -> None:
    from kube_vgpu.errors import RequestError
    from kube_vgpu.podspec import parse_constraints
    from kube_vgpu.resources import ANN_GPU_LINK, TENANT_KEYS, system_owned
    from kube_vgpu.topology import LINK_CLASSES
    assert parse_constraints({ANN_GPU_LINK: "nvlink"}).min_link == LINK_CLASSES["nvlink"]
    assert parse_constraints({}).min_link == 0 and parse_constraints({ANN_GPU_LINK: ""}).min_link == 0
    with pytest.raises(RequestError) as e:
        parse_constraints({ANN_GPU_LINK: "infiniband"})
    assert ANN_GPU_LINK in str(e.value) and "infiniband" in str(e.value) and "nvlink" in str(e.value)
    assert ANN_GPU_LINK in TENANT_KEYS and not system_owned(ANN_GPU_LINK)  # a tenant's own choice


@pytest.mark.parametrize("policy", ["binpack", "bestfit", "spread", "dotprod"])
def test_uuid_selectors_are_not_answered_by_a_twin_node(policy: str) -> None:
    """Two idle nodes alike in every GPU but their uuids share one memo entry for ordinary pods; a
    pod that names uuids must be fitted per node (it was refused everywhere: the first node's
    answer was reused for its twin)."""
    from kube_vgpu.model import Constraints
    st = ClusterState()
    for n in ("node-a", "node-b"):
        st.set_node(n, tuple(GPUDevice(f"GPU-{n}-{i}", i, "NVIDIA T4", 15000) for i in range(2)), 0, 0, 0.0)
    eng = Engine(st, policy, "spread", vector_min=10**9)  # the memoised reference path
    plain = PodRequest("default", "p", app=(ContainerRequest("c", False, 1, 4000, 0, 10),))
    assert eng.choose(plain) is not None
    pinned = PodRequest("default", "q", app=plain.app, constraints=Constraints(use_uuids=("GPU-node-b-1",)))
    d = eng.choose(pinned)
    assert d is not None and d.node == "node-b" and d.plan.containers[0][0][0] == 1
    avoid = PodRequest("default", "r", app=plain.app,
                       constraints=Constraints(nouse_uuids=("GPU-node-a-0", "GPU-node-a-1")))
    d2 = eng.choose(avoid)
    assert d2 is not None and d2.node == "node-b"
    feasible, failed, _ = eng.evaluate(pinned, ["node-a", "node-b"])
    assert feasible == ["node-b"] and set(failed) == {"node-a"}
