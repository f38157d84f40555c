"""Dynamic MIG in the placement engine: a one-GPU memory request on a GPU in dynamic-MIG mode is
served by the smallest allowed profile that holds it, placed by kube_vgpu.mig.place over the GPU's
booked instances; the booking records the profile and start; typed failures when no profile holds
the request or no placement is free; the vectorised twin leaves such nodes to the reference rules."""

from __future__ import annotations

import pytest

from kube_vgpu.codec import decode_allocation, encode_allocation
from kube_vgpu.mig import TABLES, Instance, headroom
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, PodAllocation
from kube_vgpu.placement import ClusterState, Code, Engine, FitFailure, OvercommitError, Plan
from kube_vgpu.placement.render import detail, summary

from .helpers import gpu_used, pod, req

H200 = TABLES["H200-141GB"]


def mig_gpu(node: str, i: int, profiles: tuple[str, ...] = ()) -> GPUDevice:
    return GPUDevice(uuid=f"GPU-{node}-{i}", index=i, model="NVIDIA H200", memory_mib=H200.memory_mib,
                     split=7, mig="H200-141GB", mig_profiles=profiles)


def mig_engine(n_gpus: int = 1, profiles: tuple[str, ...] = (), vector_min: int = 24,
               extra: tuple[GPUDevice, ...] = ()) -> Engine:
    st = ClusterState()
    st.set_node("m", tuple(mig_gpu("m", i, profiles) for i in range(n_gpus)) + extra)
    return Engine(st, "binpack", "binpack", vector_min=vector_min)


def bind(e: Engine, name: str, mib: int) -> PodAllocation:
    r = req(pod(name, {"gpu": 1, "gpumem": mib}))
    d = e.choose(r)
    assert d is not None, e.plan_for(r, "m")
    alloc = e.allocation(r, d.node, d.plan, now=1.0)
    e.book(r, alloc)
    return alloc


def instances(e: Engine, gpu: int = 0) -> list[tuple[str, int]]:
    return sorted(e.state.nodes["m"].mig_used[gpu])


def test_smallest_profile_that_holds_the_request_is_booked_with_its_memory_and_start() -> None:
    e = mig_engine()
    a = bind(e, "small", 10000)
    (b,) = a.containers[0].devices
    # 1g.18gb holds 10000 MiB; on an empty GPU the start keeping the most large profiles is slice 6
    assert (b.profile, b.start, b.memory_mib, b.cores) == ("1g.18gb", 6, 18432, 14)
    assert instances(e) == [("1g.18gb", 6)]
    # the record carries the instance (and reads back identically)
    assert decode_allocation(encode_allocation(a)) == a
    # the GPU's accounting: one memory slice of eight, 1 of 7 compute slices, one slot
    assert gpu_used(e, "m") == [(H200.memory_mib // 8, 14, 1)]


def test_a_second_pod_packs_next_to_the_first_by_the_fragmentation_rule() -> None:
    e = mig_engine()
    big = bind(e, "big", 60000).containers[0].devices[0]
    assert (big.profile, big.start) == ("3g.71gb", 4)  # at 4, slices 0-3 still take a 4g.71gb
    e = mig_engine()
    e.state.book("ns/big", PodAllocation("m", (ContainerAllocation("c0", False, (
        DeviceBooking("GPU-m-0", 72704, 42, "3g.71gb", 0),)),)))
    small = bind(e, "small", 10000).containers[0].devices[0]
    # slice 6, not 4: slices 4-5 still take a 2g.35gb (docs/mig.md's example)
    assert (small.profile, small.start) == ("1g.18gb", 6)
    assert headroom(H200, [Instance("3g.71gb", 0), Instance("1g.18gb", 6)]) > \
        headroom(H200, [Instance("3g.71gb", 0), Instance("1g.18gb", 4)])
    two = bind(e, "two", 30000).containers[0].devices[0]
    assert (two.profile, two.start) == ("1g.35gb", 4)  # the smallest allowed profile holding 30000 MiB


def test_no_free_placement_and_no_free_slot() -> None:
    e = mig_engine()
    assert bind(e, "whole", 100000).containers[0].devices[0].profile == "7g.141gb"
    r = req(pod("late", {"gpu": 1, "gpumem": 5000}))
    f = e.plan_for(r, "m")
    assert isinstance(f, FitFailure) and f.code is Code.MIG_NO_PLACEMENT and f.resolvable
    assert (f.need, f.have, f.detail) == (5000, 1, "1g.18gb")
    assert summary(f) == ("no free MIG placement: container c0 needs 5000 MiB (MIG profile 1g.18gb or a larger "
                          "allowed one) and the MIG GPUs' free memory slices cannot hold it")
    e2 = mig_engine()
    for k in range(7):  # seven 1g.18gb: every compute slice, and every slot, taken
        assert bind(e2, f"p{k}", 5000).containers[0].devices[0].profile == "1g.18gb"
    assert sorted(s for _, s in instances(e2)) == list(range(7))
    f2 = e2.plan_for(r, "m")
    assert isinstance(f2, FitFailure) and f2.code is Code.NO_FREE_SLOT


def test_a_request_bigger_than_the_largest_allowed_profile_fails_with_the_reason() -> None:
    e = mig_engine(profiles=("1g.18gb", "3g.71gb"))
    f = e.plan_for(req(pod("huge", {"gpu": 1, "gpumem": 80000})), "m")
    assert isinstance(f, FitFailure) and f.code is Code.MIG_NO_PROFILE and not f.resolvable
    assert summary(f) == ("no allowed MIG profile holds the request: container c0 needs 80000 MiB; the largest "
                          "allowed MIG profile of H200-141GB has 72704 MiB")
    assert "80000 MiB" in detail(f)
    # without an allowlist, 7g.141gb holds it
    a = bind(mig_engine(), "huge", 80000).containers[0].devices[0]
    assert (a.profile, a.start, a.memory_mib, a.cores) == ("7g.141gb", 0, 144384, 100)


def test_multi_gpu_containers_and_plain_gpus_beside_mig_ones() -> None:
    plain = GPUDevice(uuid="GPU-m-9", index=9, model="NVIDIA H200", memory_mib=140000, split=10)
    e = mig_engine(extra=(plain,))
    r = req(pod("two", {"gpu": 2, "gpumem": 1000}))
    f = e.plan_for(r, "m")  # a dynamic-MIG GPU serves one-GPU containers only
    assert isinstance(f, FitFailure) and f.code is Code.TOO_FEW_QUALIFY
    p = e.plan_for(req(pod("one", {"gpu": 1, "gpumem": 150000})), "m")  # no profile: the plain GPU fits
    assert isinstance(p, FitFailure) and p.code is Code.INSUFFICIENT_MEMORY  # plain GPU: memory reason
    p2 = e.plan_for(req(pod("one", {"gpu": 1, "gpumem": 100000})), "m")
    assert isinstance(p2, Plan) and len(p2.containers[0]) == 1


def test_app_containers_of_one_pod_get_distinct_instances_and_release_frees_them() -> None:
    e = mig_engine()
    r = req(pod("duo", {"gpu": 1, "gpumem": 10000}, {"gpu": 1, "gpumem": 10000}))
    d = e.choose(r)
    assert d is not None
    alloc = e.allocation(r, d.node, d.plan, now=1.0)
    got = sorted((c.devices[0].profile, c.devices[0].start) for c in alloc.containers)
    assert got == [("1g.18gb", 4), ("1g.18gb", 6)]  # mig.place: 6 first, then 4 (keeps 1g.35gb@0,2)
    e.book(r, alloc)
    assert instances(e) == got
    e.release(r.key)
    assert instances(e) == [] and gpu_used(e, "m") == [(0, 0, 0)]


def test_promises_hold_the_instance_for_the_next_pod() -> None:
    e = mig_engine()
    r1 = req(pod("first", {"gpu": 1, "gpumem": 10000}))
    assert e.assume_on(r1, "u1", "m", expires=100.0) is not None
    assert instances(e) == [("1g.18gb", 6)]
    a2 = bind(e, "second", 10000).containers[0].devices[0]
    assert (a2.profile, a2.start) != ("1g.18gb", 6)
    e.state.forget_assumed(r1.key)
    assert instances(e) == [(a2.profile, a2.start)]


def test_booking_refuses_overlapping_or_invalid_instances() -> None:
    e = mig_engine()
    bind(e, "big", 60000)  # 3g.71gb at 4

    def rec(profile: str, start: int, mem: int = 18432) -> PodAllocation:
        return PodAllocation("m", (ContainerAllocation("c0", False, (
            DeviceBooking("GPU-m-0", mem, 14, profile, start),)),))
    with pytest.raises(OvercommitError, match="overlaps"):
        e.state.book("ns/x", rec("1g.18gb", 5))
    with pytest.raises(OvercommitError, match="cannot start"):
        e.state.book("ns/y", rec("3g.71gb", 2, 72704))
    with pytest.raises(OvercommitError, match="does not exist"):
        e.state.book("ns/z", rec("9g.999gb", 0))
    assert instances(e) == [("3g.71gb", 4)]
    e.state.book("ns/ok", rec("1g.18gb", 0))
    assert instances(e) == [("1g.18gb", 0), ("3g.71gb", 4)]


@pytest.mark.parametrize("vector_min", [0, 10**9])
def test_vectorised_path_leaves_mig_nodes_to_the_reference_rules(vector_min: int) -> None:
    st = ClusterState()
    st.set_node("m", (mig_gpu("m", 0),))
    st.set_node("p", (GPUDevice(uuid="GPU-p-0", index=0, model="NVIDIA A10", memory_mib=20000),))
    e = Engine(st, "binpack", "binpack", vector_min=vector_min)
    r = req(pod("x", {"gpu": 1, "gpumem": 30000}))
    ok, failed, _ = e.evaluate(r)
    assert ok == ["m"] and failed["p"].code is Code.INSUFFICIENT_MEMORY
    assert int(st.table.mig[st.nodes["m"].idx]) == 1 and int(st.table.mig[st.nodes["p"].idx]) == 0
    d = e.choose(r)
    assert d is not None and d.node == "m" and d.plan.mig == ((0, 0, "1g.35gb", 6),)
