"""Every fit rule on small hand-made nodes, with the exact outcome asserted."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.model import GPUDevice
from kube_vgpu.placement import ClusterState, Code, Engine, FitFailure, OvercommitError

from .helpers import engine, gpu_used, gpus, place, pod, req


def test_memory_cores_and_slots_are_each_checked_per_gpu() -> None:
    e = engine({"n1": gpus("n1", [10000], split=2)})
    assert place(e, pod("a", {"gpumem": 4000, "gpucores": 60})) is not None
    # cores: 40 left
    ok, failed, _ = e.evaluate(req(pod("b", {"gpumem": 1000, "gpucores": 50})))
    assert ok == [] and failed["n1"] == FitFailure(Code.INSUFFICIENT_CORES, "c0", False, 1, 1000, 0, 50,
                                                   need=50, have=40, gpu=0)
    assert failed["n1"].resolvable
    assert place(e, pod("c", {"gpumem": 1000, "gpucores": 40})) is not None
    # slots: split 2 used up although memory is left
    ok, failed, _ = e.evaluate(req(pod("d", {"gpumem": 100})))
    assert ok == [] and (failed["n1"].code, failed["n1"].have) == (Code.NO_FREE_SLOT, 1)
    assert gpu_used(e, "n1") == [(5000, 100, 2)]


def test_percentage_is_of_each_gpu_memory() -> None:
    e = engine({"n1": gpus("n1", [8000, 16000])}, gpu_policy="binpack")
    alloc = place(e, pod("a", {"gpu": 2, "gpumem-percentage": 25}))
    assert alloc is not None
    assert sorted(d.memory_mib for d in alloc.containers[0].devices) == [2000, 4000]


def test_unhealthy_gpus_are_skipped_with_reason() -> None:
    devs = gpus("n1", [16000, 16000])
    devs = (replace(devs[0], healthy=False), devs[1])
    e = engine({"n1": devs})
    alloc = place(e, pod("a", {"gpumem": 1000}))
    assert alloc is not None and alloc.containers[0].devices[0].uuid == "GPU-n1-1"
    e2 = engine({"n1": (replace(devs[1], healthy=False), devs[0])[:1]})
    ok, failed, _ = e2.evaluate(req(pod("a", {"gpumem": 1000})))
    assert ok == [] and failed["n1"].code is Code.GPU_UNHEALTHY and not failed["n1"].resolvable


def test_type_and_uuid_constraints_use_hami_annotations() -> None:
    nodes = {"a100": gpus("a100", [40000], model="NVIDIA A100-SXM4-40GB"),
             "t4": gpus("t4", [15000], model="Tesla T4")}
    e = engine(nodes)
    p = pod("p", {"gpumem": 1000}, annotations={"nvidia.com/use-gputype": "a100, h100"})
    ok, failed, _ = e.evaluate(req(p))
    assert ok == ["a100"] and failed["t4"].code is Code.TYPE_EXCLUDED and not failed["t4"].resolvable
    p = pod("p", {"gpumem": 1000}, annotations={"nvidia.com/nouse-gputype": "A100"})
    ok, failed, _ = e.evaluate(req(p))
    assert ok == ["t4"] and failed["a100"].code is Code.TYPE_EXCLUDED
    p = pod("p", {"gpumem": 1000}, annotations={"nvidia.com/use-gpuuuid": "GPU-t4-0"})
    assert e.evaluate(req(p))[0] == ["t4"]
    p = pod("p", {"gpumem": 1000}, annotations={"nvidia.com/nouse-gpuuuid": "GPU-t4-0,GPU-a100-0"})
    ok, failed, _ = e.evaluate(req(p))
    assert ok == [] and failed["t4"].code is Code.UUID_EXCLUDED and failed["a100"].code is Code.UUID_EXCLUDED


def test_multi_gpu_container_takes_distinct_gpus() -> None:
    e = engine({"n1": gpus("n1", [10000] * 4)})
    alloc = place(e, pod("p", {"gpu": 3, "gpumem": 9000}))
    assert alloc is not None
    uuids = [d.uuid for d in alloc.containers[0].devices]
    assert len(set(uuids)) == 3
    ok, failed, _ = e.evaluate(req(pod("q", {"gpu": 2, "gpumem": 2000})))
    f = failed["n1"]
    assert ok == [] and (f.code, f.count, f.need, f.have) == (Code.TOO_FEW_QUALIFY, 2, 2, 1) and f.resolvable


def test_unknown_node_names_fail_with_reason() -> None:
    e = engine({"n1": gpus("n1", [10000])})
    ok, failed, _ = e.evaluate(req(pod("p", {"gpumem": 1})), ["n1", "cpu-only"])
    assert ok == ["n1"] and failed["cpu-only"].code is Code.NO_INVENTORY and not failed["cpu-only"].resolvable


def test_book_is_atomic_and_refuses_overcommit() -> None:
    e = engine({"n1": gpus("n1", [10000])})
    r1 = req(pod("a", {"gpumem": 6000}))
    plan = e.plan_for(r1, "n1")
    assert not isinstance(plan, FitFailure)
    alloc = e.allocation(r1, "n1", plan)
    r2 = req(pod("b", {"gpumem": 6000}))
    alloc2 = e.allocation(r2, "n1", plan)  # a stale plan computed before a was booked
    e.book(r1, alloc)
    try:
        e.book(r2, alloc2)
        raise AssertionError("overcommit accepted")
    except OvercommitError as err:
        assert "GPU-n1-0" in str(err)
    assert gpu_used(e, "n1") == [(6000, 0, 1)]
    try:
        e.book(r1, alloc)
        raise AssertionError("double booking accepted")
    except OvercommitError:
        pass


def test_inventory_update_keeps_bookings_by_uuid() -> None:
    st = ClusterState()
    devs = gpus("n1", [10000, 10000])
    st.set_node("n1", devs)
    e = Engine(st)
    assert place(e, pod("a", {"gpumem": 3000})) is not None
    used_before = gpu_used(e, "n1")
    st.set_node("n1", tuple(replace(d, split=4) for d in devs))
    assert gpu_used(e, "n1") == used_before
    assert st.nodes["n1"].devices[0].split == 4
    st.remove_node("n1")
    assert st.bookings == {}


sizes = st.lists(st.sampled_from([4096, 8192, 16384, 24576]), min_size=1, max_size=4)
pod_spec = st.fixed_dictionaries({
    "gpu": st.integers(1, 3),
    "gpumem": st.integers(1, 20000),
    "gpucores": st.integers(0, 100),
})


@settings(max_examples=60, deadline=None)
@given(node_sizes=st.lists(sizes, min_size=1, max_size=3), pods=st.lists(pod_spec, max_size=25),
       releases=st.lists(st.integers(0, 24), max_size=8), policy=st.sampled_from(["binpack", "spread", "bestfit"]))
def test_random_workloads_never_overcommit_and_release_to_zero(node_sizes: list[list[int]], pods: list[dict[str, int]],
                                                                releases: list[int], policy: str) -> None:
    e = engine({f"n{i}": gpus(f"n{i}", s, split=4) for i, s in enumerate(node_sizes)}, policy=policy)
    placed = []
    for k, spec in enumerate(pods):
        if place(e, pod(f"p{k}", spec)) is not None:
            placed.append(f"ns/p{k}")
        if k in releases and placed:
            e.release(placed.pop(0))
        for name, n in e.state.nodes.items():
            for i, d in enumerate(n.devices):
                assert 0 <= n.free_mem[i] <= d.memory_mib, name
                assert 0 <= n.free_cores[i] <= d.cores
                assert 0 <= n.free_slots[i] <= d.split
    for p in placed:
        e.release(p)
    for name in e.state.nodes:
        assert all(u == (0, 0, 0) for u in gpu_used(e, name))


def test_gpu_device_defaults() -> None:
    d = GPUDevice("GPU-x", 0, "m", 1000)
    assert (d.cores, d.split, d.healthy, d.numa) == (100, 10, True, 0)
