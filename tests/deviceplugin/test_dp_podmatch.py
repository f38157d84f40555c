"""Pure tests of the pod/container rules behind PreStartContainer (the identified container's
booking and the GPU check) and GetPreferredAllocation (candidates, admission order, the guess)."""

from __future__ import annotations

import pytest
from dp_helpers import NODE, bound_pod

from deviceplugin.podmatch import (
    ANN_ALLOCATED_CONTAINERS,
    Arrival,
    MatchError,
    PendingContainer,
    check_assignment,
    disables_control,
    identified,
    pending_containers,
    preferred_allocation,
    slot_id,
    slot_uuid,
)
from deviceplugin.podwatch import ArrivalBook
from deviceplugin.response import container_spec
from kube_vgpu.resources import ANN_ALLOCATION, ANN_BIND_PHASE

A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"
B = "GPU-bbbbbbbb-0000-4000-8000-000000000001"


def ids(uuid: str, *ks: int) -> list[str]:
    return [slot_id(uuid, k) for k in ks]


def with_uid(pod: dict, uid: str | None = None) -> dict:
    pod["metadata"]["uid"] = uid or f"uid-{pod['metadata']['name']}"
    return pod


def started(pods: list[dict], name: str, container: str, device_ids: list[str]) -> PendingContainer:
    """What PreStartContainer decides when kubelet's PodResources names ``name``/``container`` as the
    holder of ``device_ids``: the identified container, after the GPU check (raises MatchError)."""
    pod = next(p for p in pods if p["metadata"]["name"] == name)
    pc = identified(pod, container, NODE)
    check_assignment(pc, device_ids)
    return pc


def scheduled_at(pod: dict, when: str) -> dict:
    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": when}]}
    return pod


def test_slot_ids_round_trip() -> None:
    assert slot_id(A, 3) == f"{A}::3"
    assert slot_uuid(slot_id(A, 3)) == A
    assert slot_uuid(A) == A
    assert len(slot_id(A, 1023)) <= 63  # kubelet's limit on device IDs


def test_kf06_init_container_without_gpu_does_not_take_app_limits() -> None:
    pod = bound_pod("kf06", [("init", True, None, {}), ("app", False, [(A, 4000, 0)], {})])
    cands = pending_containers([pod], NODE)
    assert [c.container for c in cands] == ["app"]
    pc = started([pod], "kf06", "app", ids(A, 0))
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


def test_prestart_takes_the_named_pods_booking_and_checks_its_gpus() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(B, 5000, 50)], {})], bind_time=2)
    assert started([p1, p2], "p2", "c", ids(B, 4)).devices[0].memory_mib == 5000
    assert started([p1, p2], "p1", "c", ids(A, 0)).devices[0].memory_mib == 3000
    with pytest.raises(MatchError) as e:  # kubelet put p1 on p2's GPU
        started([p1, p2], "p1", "c", ids(B, 0))
    msg = str(e.value)
    assert "pod default/p1 container c" in msg and f"assigned GPUs {B}" in msg and f"booked {A}" in msg
    assert "refusing to start it on GPUs booked for another pod" in msg


def test_same_gpu_pods_with_different_limits_need_no_guess() -> None:
    """What Allocate could not tell apart, PreStart can: the holder is named."""
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(A, 5000, 50)], {})], bind_time=2)
    assert started([p1, p2], "p2", "c", ids(A, 0)).devices[0].memory_mib == 5000
    assert started([p1, p2], "p1", "c", ids(A, 1)).devices[0].memory_mib == 3000


def test_identified_refuses_unknown_containers_and_containers_without_gpus() -> None:
    p = bound_pod("p", [("c", False, [(A, 3000, 30)], {}), ("side", False, None, {})])
    with pytest.raises(MatchError, match="pod default/p container nope: no such container"):
        identified(p, "nope", NODE)
    with pytest.raises(MatchError, match="does not request nvidia.com/gpu"):
        identified(p, "side", NODE)
    with pytest.raises(MatchError, match="allocation record is for node 'gpu-node-1', not 'other'"):
        identified(p, "c", "other")
    with pytest.raises(MatchError, match="refusing to start it with GPUs"):
        identified(p, "c", NODE, refused="allocation signature missing")


def test_identical_candidates_are_interchangeable() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=2)
    p2 = bound_pod("p2", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    _, target = preferred_allocation(ids(A, 0, 1), [], 1, pending_containers([p1, p2], NODE))
    assert target is not None and target.pod == "p2"


def test_preferred_record_disambiguates_same_gpu() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30)], {})], bind_time=1)
    p2 = bound_pod("p2", [("c", False, [(A, 5000, 50)], {})], bind_time=2)
    cands = pending_containers([p1, p2], NODE)
    avail = ids(A, 0, 1, 2) + ids(B, 0, 1)
    chosen, target = preferred_allocation(avail, [], 1, cands)
    assert target is not None and target.pod == "p1" and chosen == ids(A, 0)
    assert started([p1, p2], "p1", "c", chosen).devices[0].memory_mib == 3000


def test_count_mismatch_is_refused() -> None:
    p1 = bound_pod("p1", [("c", False, [(A, 3000, 30), (B, 3000, 30)], {})])
    with pytest.raises(MatchError, match=f"assigned GPUs {A} .* booked {A}, {B}"):
        started([p1], "p1", "c", ids(A, 0))


def test_multi_gpu_preference_one_slot_per_booked_gpu() -> None:
    p1 = bound_pod("p1", [("c", False, [(B, 1000, 0), (A, 1000, 0)], {})])
    cands = pending_containers([p1], NODE)
    avail = ids(A, 0, 1) + ids(B, 0, 1)
    chosen, target = preferred_allocation(avail, [], 2, cands)
    assert sorted(chosen) == sorted([slot_id(A, 0), slot_id(B, 0)])
    assert [d.uuid for d in started([p1], "p1", "c", chosen).devices] == [B, A]  # booking order
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
    assert cands[0].pod == "p1" and cands[0].container == "c"
    _, target = preferred_allocation(ids(A, 0, 1) + ids(B, 0), [], 1, cands)
    assert target is not None and target.pod == "p1" and target.container == "c"


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


# --------------------------------------------------------------------------- admission order
# The old logic ordered pending pods by the bind-time annotation only and trusted the preference
# blindly; each test below fails on it (wrong pod preferred / matched).


def test_concurrent_binds_follow_the_order_pods_became_bound_not_bind_time() -> None:
    """(a) A got bind-time t1 < t2 of B, but B's Binding committed first: kubelet admits B first."""
    a = with_uid(bound_pod("a", [("c", False, [(A, 3000, 30)], {})], bind_time=1))
    b = with_uid(bound_pod("b", [("c", False, [(A, 5000, 50)], {})], bind_time=2))
    arrivals = {"uid-b": Arrival(1, 0.0), "uid-a": Arrival(2, 0.0)}
    cands = pending_containers([a, b], NODE, arrivals=arrivals)
    assert [c.pod for c in cands] == ["b", "a"]
    chosen, target = preferred_allocation(ids(A, 0, 1, 2), [], 1, cands)
    assert target is not None and target.pod == "b"
    assert started([a, b], "b", "c", chosen).devices[0].memory_mib == 5000
    # B recorded: A is next, and is not demoted (it arrived after B)
    b["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "c"
    b["metadata"]["annotations"][ANN_BIND_PHASE] = "success"
    cands = pending_containers([a, b], NODE, arrivals=arrivals)
    assert [(c.pod, c.demoted) for c in cands] == [("a", False)]


def test_initial_list_ordered_by_pod_scheduled_time_then_bind_time_and_before_watched_pods() -> None:
    a = scheduled_at(with_uid(bound_pod("a", [("c", False, [(A, 1000, 0)], {})], bind_time=1)),
                     "2026-01-01T00:00:02Z")
    b = scheduled_at(with_uid(bound_pod("b", [("c", False, [(A, 2000, 0)], {})], bind_time=2)),
                     "2026-01-01T00:00:01Z")
    c = scheduled_at(with_uid(bound_pod("c", [("c", False, [(A, 3000, 0)], {})], bind_time=3)),
                     "2026-01-01T00:00:01Z")
    w = with_uid(bound_pod("w", [("c", False, [(A, 4000, 0)], {})], bind_time=0))
    arrivals = {"uid-a": Arrival(None, 0.0), "uid-b": Arrival(None, 0.0), "uid-c": Arrival(None, 0.0),
                "uid-w": Arrival(1, 0.0)}
    assert [p.pod for p in pending_containers([w, c, a, b], NODE, arrivals=arrivals)] == ["b", "c", "a", "w"]
    # without arrivals (no watch) the same fallback applies to all
    assert [p.pod for p in pending_containers([w, c, a, b], NODE)] == ["w", "b", "c", "a"]


def test_held_containers_are_not_guessed_again() -> None:
    """Containers kubelet's PodResources lists as holding devices are done for the preference."""
    from deviceplugin.podmatch import with_held

    p = with_uid(bound_pod("p", [("i", True, [(A, 1000, 10)], {}), ("c", False, [(A, 3000, 30)], {})], bind_time=1))
    q = with_uid(bound_pod("q", [("c", False, [(B, 5000, 50)], {})], bind_time=2))
    cands = pending_containers(with_held([p, q], {("default", "p"): ["i"]}), NODE)
    assert [(c.pod, c.container, c.in_progress) for c in cands] == [("p", "c", True), ("q", "c", False)]
    cands = pending_containers(with_held([p, q], {("default", "p"): ["i", "c"]}), NODE)
    assert [c.pod for c in cands] == ["q"]
    assert ANN_ALLOCATED_CONTAINERS not in p["metadata"]["annotations"]  # the input is not changed


def test_pod_skipped_by_kubelet_is_demoted_once_a_newer_pod_was_admitted() -> None:
    """(b) s never gets admitted; n2 (bound after it) was admitted, so kubelet skipped s."""
    s = with_uid(bound_pod("s", [("c", False, [(A, 3000, 30)], {})], bind_time=1))
    n2 = with_uid(bound_pod("n2", [("c", False, [(A, 1000, 0), (B, 1000, 0)], {})], bind_time=2))
    n1 = with_uid(bound_pod("n1", [("c", False, [(A, 5000, 50)], {})], bind_time=3))
    arrivals = {"uid-s": Arrival(1, 0.0), "uid-n2": Arrival(2, 0.0), "uid-n1": Arrival(3, 0.0)}
    cands = pending_containers([s, n1, n2], NODE, arrivals=arrivals)
    assert [(c.pod, c.demoted) for c in cands] == [("s", False), ("n2", False), ("n1", False)]
    n2["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "c"
    n2["metadata"]["annotations"][ANN_BIND_PHASE] = "success"
    cands = pending_containers([s, n1, n2], NODE, arrivals=arrivals)
    assert [(c.pod, c.demoted) for c in cands] == [("n1", False), ("s", True)]
    chosen, target = preferred_allocation(ids(A, 0, 1, 2), [], 1, cands)
    assert target is not None and target.pod == "n1"
    assert started([s, n1, n2], "n1", "c", chosen).devices[0].memory_mib == 5000
    # a demoted pod is still a candidate: if kubelet does come for it, on its own GPU, it matches
    s2 = with_uid(bound_pod("s2", [("c", False, [(B, 3000, 30)], {})], bind_time=1))
    arrivals["uid-s2"] = Arrival(1, 0.0)
    cands = pending_containers([s2, n1, n2], NODE, arrivals=arrivals)
    assert cands[-1].pod == "s2" and cands[-1].demoted
    assert started([s2, n1, n2], "s2", "c", ids(B, 3)).devices[0].memory_mib == 3000


def test_pod_pending_past_the_staleness_period_is_demoted() -> None:
    s = with_uid(bound_pod("s", [("c", False, [(A, 3000, 30)], {})], bind_time=1))
    n = with_uid(bound_pod("n", [("c", False, [(A, 5000, 50)], {})], bind_time=2))
    arrivals = {"uid-s": Arrival(1, 0.0), "uid-n": Arrival(2, 90.0)}
    fresh = pending_containers([s, n], NODE, arrivals=arrivals, now=50.0, stale_after=60.0)
    assert [(c.pod, c.demoted) for c in fresh] == [("s", False), ("n", False)]
    later = pending_containers([s, n], NODE, arrivals=arrivals, now=100.0, stale_after=60.0)
    assert [(c.pod, c.demoted) for c in later] == [("n", False), ("s", True)]
    _, target = preferred_allocation(ids(A, 0, 1), [], 1, later)
    assert target is not None and target.pod == "n"
    # no staleness period: never demoted for age
    assert not any(c.demoted for c in pending_containers([s, n], NODE, arrivals=arrivals, now=1e9))
    # everything stale (kubelet down a while): order among them is kept
    both = pending_containers([s, n], NODE, arrivals=arrivals, now=1000.0, stale_after=60.0)
    assert [(c.pod, c.demoted) for c in both] == [("s", True), ("n", True)]


def test_in_progress_pod_is_never_demoted() -> None:
    p = with_uid(bound_pod("p", [("i", True, [(A, 1000, 0)], {}), ("c", False, [(B, 2000, 0)], {})]))
    p["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "i"
    newer = with_uid(bound_pod("n", [("c", False, [(A, 500, 0)], {})]))
    newer["metadata"]["annotations"][ANN_ALLOCATED_CONTAINERS] = "c"
    arrivals = {"uid-p": Arrival(1, 0.0), "uid-n": Arrival(2, 0.0)}
    cands = pending_containers([p, newer], NODE, arrivals=arrivals, now=1e6, stale_after=1.0)
    assert [(c.pod, c.in_progress, c.demoted) for c in cands] == [("p", True, False)]


def test_arrival_book_numbers_pods_in_the_order_they_are_seen_bound() -> None:
    t = [0.0]
    book = ArrivalBook(NODE, clock=lambda: t[0])
    old = with_uid(bound_pod("old", [("c", False, [(A, 1, 0)], {})]))
    unbound = with_uid(bound_pod("u", [("c", False, [(A, 1, 0)], {})]))
    del unbound["spec"]["nodeName"]
    book.saw([old, unbound], complete=True)  # the initial list
    assert book.snapshot() == {"uid-old": Arrival(None, 0.0)}
    t[0] = 5.0
    late = with_uid(bound_pod("late", [("c", False, [(A, 1, 0)], {})], bind_time=1))
    early = with_uid(bound_pod("early", [("c", False, [(A, 1, 0)], {})], bind_time=9))
    book.saw([early])
    book.saw([late, early])  # already known pods keep their number
    snap = book.snapshot()
    assert snap["uid-early"] == Arrival(1, 5.0) and snap["uid-late"] == Arrival(2, 5.0)
    # several new pods in one listing: numbered in the fallback order (bind time here)
    x = with_uid(bound_pod("x", [("c", False, [(A, 1, 0)], {})], bind_time=7))
    y = with_uid(bound_pod("y", [("c", False, [(A, 1, 0)], {})], bind_time=6))
    book.saw([x, y])
    snap = book.snapshot()
    assert (snap["uid-y"].seq, snap["uid-x"].seq) == (3, 4)
    book.forget("uid-x")
    book.saw([old, early, y], complete=True)  # a relist forgets pods that are gone
    assert set(book.snapshot()) == {"uid-old", "uid-early", "uid-y"}


@pytest.mark.parametrize("value,opt_out", [("true", True), ("TRUE", True), ("True", True), ("1", True),
                                           ("false", False), ("0", False), ("yes", False), ("", False),
                                           (" 1", False)])
def test_disable_control_accepts_what_the_shim_accepts(value: str, opt_out: bool) -> None:
    env = {"env": [{"name": "CUDA_DISABLE_CONTROL", "value": value}]}
    pc = pending_containers([bound_pod("p", [("c", False, [(A, 1000, 10)], env)])], NODE)[0]
    assert pc.disable_control is opt_out
    spec = container_spec(pc, shim_host_path="/s/libvgpu.so", cache_host_dir="/c")
    assert ("CUDA_DEVICE_MEMORY_LIMIT_0" in spec.envs) is not opt_out
    assert disables_control(value) is opt_out


def test_zero_mib_booking_is_refused_never_unlimited() -> None:
    p = bound_pod("zero", [("c", False, [(A, 0, 10)], {})])
    with pytest.raises(MatchError) as e:
        started([p], "zero", "c", ids(A, 0))
    msg = str(e.value)
    assert "default/zero" in msg and "container c" in msg and A in msg
    assert "0 MiB booked; refusing to hand out an unlimited limit" in msg
    # one of two GPUs at 0 MiB is refused too, naming that GPU only
    q = bound_pod("two", [("c", False, [(A, 1000, 10), (B, 0, 10)], {})])
    with pytest.raises(MatchError, match=f"GPU {B}: 0 MiB booked"):
        started([q], "two", "c", ids(A, 0) + ids(B, 0))


def test_gpu_container_without_booking_is_refused_not_given_the_next_containers_limits() -> None:
    gpu1 = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    # "first" requests a GPU but the record books none; kubelet allocates it before "second"
    p = bound_pod("p", [("first", False, None, gpu1), ("second", False, [(A, 3000, 30)], {})])
    cands = pending_containers([p], NODE)
    assert [(c.container, c.unbooked) for c in cands] == [("first", True)]
    with pytest.raises(MatchError) as e:
        started([p], "p", "first", ids(A, 0))
    assert "default/p container first" in str(e.value) and "refusing to hand out an unlimited limit" in str(e.value)
    assert started([p], "p", "second", ids(A, 1)).devices[0].memory_mib == 3000


@pytest.mark.parametrize(("gpu", "waited_for"), [("1", True), ("1.0", True), ("1e0", True), ("0", False),
                                                  ("0.0", False), ("500m", True), ("lots", True)])
def test_gpu_count_is_read_by_podspecs_exact_rule(gpu: str, waited_for: bool) -> None:
    # podspec's whole-number rule (kube_vgpu.quantity): "1.0" and "1e0" are one GPU, "0.0" none; a
    # value that is no whole quantity ("500m", junk) still names the resource, so kubelet's Allocate
    # for it is waited for (and then refused by the record check), never silently ignored
    pod = bound_pod("p", [("c", False, [(A, 1000, 0)], {})])
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = gpu
    assert bool(pending_containers([pod], NODE)) is waited_for


@pytest.mark.parametrize(("prio", "want"), [("1", 1), ("1.0", 1), ("0", 0), ("1e0", 1), ("0.5", None),
                                            ("high", None)])
def test_priority_is_read_by_podspecs_exact_rule(prio: str, want: int | None) -> None:
    q = bound_pod("q", [("c", False, [(A, 1000, 10)], {"resources": {"limits": {"nvidia.com/priority": prio}}})])
    assert pending_containers([q], NODE)[0].priority == want


def test_identified_container_without_a_record_is_refused() -> None:
    pod = with_uid(bound_pod("p", [("c", False, [(A, 1000, 0)], {})]))
    del pod["metadata"]["annotations"][ANN_ALLOCATION]
    with pytest.raises(MatchError, match="no allocation record"):
        identified(pod, "c", NODE)
