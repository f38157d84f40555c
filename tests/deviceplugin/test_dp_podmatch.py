"""Pure tests of the pod/container matching behind Allocate and GetPreferredAllocation."""

from __future__ import annotations

import pytest
from dp_helpers import NODE, bound_pod

from deviceplugin.podmatch import (
    ANN_ALLOCATED_CONTAINERS,
    MatchError,
    match,
    pending_containers,
    preferred_allocation,
    slot_id,
    slot_uuid,
)
from deviceplugin.response import container_spec
from kube_vgpu.resources import ANN_ALLOCATION, ANN_BIND_PHASE

A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
B = "GPU-bbbbbbbb-0000-4000-8000-000000000001"


def ids(uuid: str, *ks: int) -> list[str]:
    return [slot_id(uuid, k) for k in ks]


def test_slot_ids_round_trip() -> None:
    assert slot_id(A, 3) == f"{A}::3"
    assert slot_uuid(slot_id(A, 3)) == A
    assert slot_uuid(A) == A
    assert len(slot_id(A, 1023)) <= 63  # kubelet's limit on device IDs


def test_kf06_init_container_without_gpu_does_not_take_app_limits() -> None:
    pod = bound_pod("kf06", [("init", True, None, {}), ("app", False, [(A, 4000, 0)], {})])
    cands = pending_containers([pod], NODE)
    assert [c.container for c in cands] == ["app"]
    pc = match(ids(A, 0), cands)
    assert pc.container == "app" and not pc.init
    spec = container_spec(pc, shim_host_path="/usr/local/vgpu/libvgpu.so", cache_host_dir="/var/c")
    assert spec.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4000m"
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == A


def test_init_then_app_in_spec_order_and_progress() -> None:
    pod = bound_pod("p", [("app", False, [(B, 2000, 20)], {}), ("init", True, [(A, 1000, 10)], {})])
    cands = pending_containers([pod], NODE)
    assert cands[0].container == "init" and cands[0].remaining == ("init", "app")
    pod["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "init"
    cands = pending_containers([pod], NODE)
    assert cands[0].container == "app" and cands[0].in_progress and cands[0].remaining == ("app",)


def test_skips_deleted_finished_other_node_and_done_pods() -> None:
    live = bound_pod("live", [("c", False, [(A, 1000, 0)], {})], bind_time=5)
    deleting = bound_pod("deleting", [("c", False, [(A, 1000, 0)], {})], bind_time=1)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    failed = bound_pod("failed", [("c", False, [(A, 1000, 0)], {})], bind_time=1)
    failed["status"] = {"phase": "Failed"}
    other = bound_pod("other", [("c", False, [(A, 1000, 0)], {})], node="elsewhere", bind_time=1)
    done = bound_pod("done", [("c", False, [(A, 1000, 0)], {})], bind_time=1, phase="success")
    garbage = bound_pod("garbage", [("c", False, [(A, 1000, 0)], {})], bind_time=1)
    garbage["metadata"]["annotations"][ANN_ALLOCATION] = "{not json"
    cands = pending_containers([deleting, failed, other, done, garbage, live], NODE)
    assert [c.pod for c in cands] == ["live"]


def test_container_without_gpu_resource_in_spec_is_not_waited_for() -> None:
    pod = bound_pod("p", [("c", False, [(A, 1000, 0)], {})])
    del pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert pending_containers([pod], NODE) == []


def test_two_pods_on_different_gpus_match_by_uuid() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(B, 5000, 50)], {})], bind_time=2)
    cands = pending_containers([p2, p1], NODE)
    assert [c.pod for c in cands] == ["p1", "p2"]
    assert match(ids(B, 4), cands).pod == "p2"
    assert match(ids(A, 0), cands).pod == "p1"


def test_ambiguous_request_fails_rather_than_guessing() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(A, 5000, 50)], {})], bind_time=2)
    cands = pending_containers([p1, p2], NODE)
    with pytest.raises(MatchError, match="ambiguous") as e:
        match(ids(A, 0), cands)
    assert "default/p1/c" in str(e.value) and "default/p2/c" in str(e.value)
    # kubelet chose a GPU nobody booked: still ambiguous
    with pytest.raises(MatchError):
        match(ids(B, 0), cands)


def test_identical_candidates_are_interchangeable() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=2)
    p2 = bound_pod("p2", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    assert match(ids(A, 0), pending_containers([p1, p2], NODE)).pod == "p2"


def test_preferred_record_disambiguates_same_gpu() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(A, 5000, 50)], {})], bind_time=2)
    cands = pending_containers([p1, p2], NODE)
    avail = ids(A, 0, 1, 2) + ids(B, 0, 1)
    chosen, target = preferred_allocation(avail, [], 1, cands)
    assert target is not None and target.pod == "p1" and chosen == ids(A, 0)
    assert match(chosen, cands, target).pod == "p1"


def test_count_mismatch_and_no_candidates() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30), (B, 3000, 30)], {})])
    with pytest.raises(MatchError, match="2 GPU"):
        match(ids(A, 0), pending_containers([p1], NODE))
    with pytest.raises(MatchError, match="none"):
        match(ids(A, 0), [])


def test_multi_gpu_preference_one_slot_per_booked_gpu() -> None:
    p1 = bound_pod("p1", [("c", False, [(B, 1000, 0), (A, 1000, 0)], {})])
    cands = pending_containers([p1], NODE)
    avail = ids(A, 0, 1) + ids(B, 0, 1)
    chosen, target = preferred_allocation(avail, [], 2, cands)
    assert sorted(chosen) == sorted([slot_id(A, 0), slot_id(B, 0)])
    assert match(chosen, cands).pod == "p1"
    # with no candidate: distinct GPUs first
    chosen, target = preferred_allocation(avail, [], 2, [])
    assert target is None and {slot_uuid(i) for i in chosen} == {A, B}
    # must-include ids are kept
    chosen, _ = preferred_allocation(avail, [slot_id(A, 1)], 2, cands)
    assert chosen[0] == slot_id(A, 1) and slot_id(B, 0) in chosen


def test_in_progress_pod_wins_over_newcomers() -> None:
    p1 = bound_pod("p1", [("i", True, [(A, 1000, 0)], {}), ("c", False, [(B, 2000, 0)], {})], bind_time=5)
    p1["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "i"
    p2 = bound_pod("p2", [("c", False, [(A, 7000, 0)], {})], bind_time=1)
    cands = pending_containers([p2, p1], NODE)
    assert cands[0].pod == "p1"
    # kubelet reuses the init container's slot for the app container: still p1
    assert match(ids(A, 0), cands).pod == "p1"


def test_disable_control_and_priority() -> None:
    env = {"env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]}
    p = bound_pod("p", [("c", False, [(A, 1000, 10)], env)])
    pc = pending_containers([p], NODE)[0]
    assert pc.disable_control
    spec = container_spec(pc, shim_host_path="/s/libvgpu.so", cache_host_dir="/c")
    assert spec.mounts == ()
    assert not any(k.startswith("CUDA_DEVICE_MEMORY_LIMIT") for k in spec.envs)
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == A
    q = bound_pod("q", [("c", False, [(A, 1000, 10)], {"resources": {"limits": {"nvidia.com/priority": "0"}}})])
    qc = pending_containers([q], NODE)[0]
    spec = container_spec(qc, shim_host_path="/s/libvgpu.so", cache_host_dir="/c")
    assert spec.envs["CUDA_TASK_PRIORITY"] == "0"
    paths = {m.container_path: (m.host_path, m.read_only) for m in spec.mounts}
    assert paths["/etc/ld.so.preload"] == ("/s/ld.so.preload", True)
    assert paths["/usr/local/vgpu/libvgpu.so"] == ("/s/libvgpu.so", True)
    assert paths["/usr/local/vgpu/cache"][1] is False
    assert spec.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/usr/local/vgpu/cache/vgpu.cache"


def test_bind_phase_must_be_allocating() -> None:
    p = bound_pod("p", [("c", False, [(A, 1000, 10)], {})])
    p["metadata"]["annotations"][ANN_BIND_PHASE] = "failed"
    assert pending_containers([p], NODE) == []
