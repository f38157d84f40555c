"""GPU-aware preemption (the extender's ``preemptVerb``, scheduler/preempt.py and
kube_vgpu/placement/preempt.py) over the real extender HTTP protocol, with the Go-field-name JSON
kube-scheduler sends (``ExtenderPreemptionArgs {Pod, NodeNameToVictims, NodeNameToMetaVictims}``
-> ``ExtenderPreemptionResult {NodeNameToMetaVictims}``).

Pods on the nodes are booked the way the extender books them: from signed allocation records of
bound pods, with ``spec.priority`` as the API server's Priority admission sets it. The attacks
played: a forged body naming higher-priority pods, pods of other nodes and unknown UIDs, claiming
a huge priority for the preemptor; none may become a victim or change the cache.
"""

from __future__ import annotations

import copy
from itertools import combinations
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vgpu_sched_util import Extender, node_obj, offline_service, pod_obj, run

from kube_vgpu.model import (
    ContainerAllocation,
    ContainerRequest,
    DeviceBooking,
    GPUDevice,
    PodAllocation,
    PodRequest,
)
from kube_vgpu.placement.fit import Plan, fit_pod
from kube_vgpu.placement.preempt import Holder, select_victims, what_if
from kube_vgpu.placement.render import summary
from kube_vgpu.placement.state import ClusterState, OvercommitError
from kube_vgpu.placement.status import NO_INVENTORY
from kube_vgpu.podspec import parse_pod
from scheduler.preempt import answer_text
from scheduler.service import SchedulerService


def running(svc: SchedulerService, name: str, node: str, gpus: list[int], mem: int, cores: int, priority: int,
            ns: str = "default") -> str:
    """A pod bound to ``node`` holding ``mem`` MiB / ``cores`` % on each of ``gpus`` (indexes), with a
    signed record and ``spec.priority``, fed to the cache as the watch would. Returns its uid."""
    uid = f"uid-{ns}-{name}"
    alloc = PodAllocation(node, (ContainerAllocation("c", False, tuple(
        DeviceBooking(f"GPU-{node}-{i:02d}", mem, cores) for i in gpus)),), 1.0)
    p = pod_obj(name, ns=ns, uid=uid, limits={"nvidia.com/gpu": len(gpus), "nvidia.com/gpumem": mem,
                                              "nvidia.com/gpucores": cores})
    p["spec"]["nodeName"] = node
    p["spec"]["priority"] = priority
    p["metadata"]["annotations"] = svc.bind_annotations(uid, node, alloc)
    svc.cache.on_pod("ADDED", p)
    assert f"{ns}/{name}" in svc.cache.state.bookings, f"{name} not booked"
    return uid


def preemptor(name: str = "big", priority: int = 1000, **limits: Any) -> dict[str, Any]:
    p = pod_obj(name, limits=limits or {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 100})
    p["spec"]["priority"] = priority
    return p


def meta_args(pod: dict[str, Any], victims: dict[str, list[str]], pdb: dict[str, int] | None = None) -> dict[str, Any]:
    """ExtenderPreemptionArgs as kube-scheduler sends them with nodeCacheCapable: true."""
    return {"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": {
        n: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": (pdb or {}).get(n, 0)}
        for n, uids in victims.items()}}


def preempt(svc: SchedulerService, body: Any) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with Extender(svc) as ext:
            return await ext.post("/preempt", body)
    return run(go)


def victims_of(res: dict[str, Any], node: str) -> list[str]:
    return [p["UID"] for p in res["NodeNameToMetaVictims"][node]["Pods"]]


def snapshot(svc: SchedulerService) -> tuple[object, ...]:
    st_ = svc.cache.state
    return (dict(st_.bookings), {n: (list(x.free_mem), list(x.free_cores), list(x.free_slots))
                                 for n, x in st_.nodes.items()}, dict(st_.assumed), copy.deepcopy(svc.cache.pods))


def full_node(svc: SchedulerService, node: str = "n0", priority: int = 100, gpus: int = 2) -> dict[int, list[str]]:
    """Four slices of 6144 MiB / 25 % on each GPU (the node's 4 slots per GPU all taken)."""
    return {g: [running(svc, f"{node}-s{g}{j}", node, [g], 6144, 25, priority) for j in range(4)]
            for g in range(gpus)}


def test_whole_card_evicts_exactly_the_slices_on_one_card() -> None:
    svc = offline_service([node_obj("n0", 2, split=4)])
    cards = full_node(svc)
    before = snapshot(svc)
    # kube-scheduler's own dry run proposes one slice (its filters cannot see GPUs): the answer is
    # that slice's card, every slice on it and nothing else
    status, res = preempt(svc, meta_args(preemptor(), {"n0": [cards[1][2]]}))
    assert status == 200, res
    assert set(res) == {"NodeNameToMetaVictims"} and set(res["NodeNameToMetaVictims"]) == {"n0"}
    assert sorted(victims_of(res, "n0")) == sorted(cards[1])
    assert res["NodeNameToMetaVictims"]["n0"]["NumPDBViolations"] == 0
    # a proposal of a pod without GPUs (kube-scheduler's own victim for CPU): passed through first,
    # then exactly the slices of one card
    status, res = preempt(svc, meta_args(preemptor(), {"n0": ["uid-cpu-hog"]}))
    got = victims_of(res, "n0")
    assert got[0] == "uid-cpu-hog" and sorted(got[1:]) in (sorted(cards[0]), sorted(cards[1])), got
    assert snapshot(svc) == before, "the preempt verb changed the cache"
    # the answer lets the pod fit exactly: evicting them for real frees one whole card
    for uid in got[1:]:
        key = next(k for k, i in svc.cache.pods.items() if i.uid == uid)
        svc.cache.on_pod("DELETED", {"metadata": {"name": key.split("/")[1], "namespace": "default", "uid": uid}})
    ok, failed, _ = svc.cache.evaluate(parse_pod(preemptor(), svc.config), ["n0"])
    assert ok == ["n0"], failed


def test_lowest_priority_first_then_fewest_pods() -> None:
    svc = offline_service([node_obj("n0", 2, split=4)])
    one = running(svc, "one", "n0", [0], 20000, 0, priority=50)
    two = [running(svc, f"two-{j}", "n0", [1], 10000, 0, priority=10) for j in range(2)]
    big = preemptor(**{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 16000})
    _, res = preempt(svc, meta_args(big, {"n0": ["uid-cpu-hog"]}))
    # two pods of priority 10 before one pod of priority 50
    assert sorted(victims_of(res, "n0")[1:]) == sorted(two) and one not in victims_of(res, "n0")

    svc = offline_service([node_obj("n0", 2, split=4)])
    one = running(svc, "one", "n0", [0], 20000, 0, priority=10)
    two = [running(svc, f"two-{j}", "n0", [1], 10000, 0, priority=10) for j in range(2)]
    _, res = preempt(svc, meta_args(big, {"n0": ["uid-cpu-hog"]}))
    assert victims_of(res, "n0") == ["uid-cpu-hog", one]  # same priority: the fewest pods


def test_least_disruption_among_equal_sets_and_order_highest_priority_first() -> None:
    svc = offline_service([node_obj("n0", 3, split=4)])
    running(svc, "large", "n0", [0], 20000, 50, priority=30)
    small = running(svc, "small", "n0", [1], 12000, 10, priority=10)
    running(svc, "other", "n0", [1], 12000, 10, priority=500)
    running(svc, "fill", "n0", [2], 20000, 10, priority=10)
    fill2 = running(svc, "fill2", "n0", [2], 4000, 10, priority=20)
    big = preemptor(**{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 12000})
    _, res = preempt(svc, meta_args(big, {"n0": ["uid-cpu-hog"]}))
    # one pod on each card would do; "small" frees the least (12000 MiB, 10 %)
    assert victims_of(res, "n0") == ["uid-cpu-hog", small]
    # 24000 MiB: card 2's two pods (priorities 10 and 20) before card 0's one pod of priority 30;
    # listed highest priority first (kube-scheduler reads Pods[0] as the highest)
    big2 = preemptor(**{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 24000})
    _, res = preempt(svc, meta_args(big2, {"n0": ["uid-cpu-hog"]}))
    got = victims_of(res, "n0")
    assert got[1] == fill2 and len(got) == 3, got


def test_equal_or_higher_priority_pods_are_never_victims() -> None:
    svc = offline_service([node_obj("n0", 2, split=4), node_obj("n1", 2, split=4)])
    equal = full_node(svc, "n0", priority=1000)
    low = full_node(svc, "n1", priority=999)
    _, res = preempt(svc, meta_args(preemptor(priority=1000), {"n0": [equal[0][0]], "n1": [low[0][0]]}))
    assert set(res["NodeNameToMetaVictims"]) == {"n1"}, res  # n0 holds only equal-priority pods: dropped
    assert sorted(victims_of(res, "n1")) == sorted(low[0])
    # mixed: a higher-priority pod on a card is never moved; the card with low pods is cleared
    svc = offline_service([node_obj("n0", 2, split=4)])
    high = running(svc, "high", "n0", [0], 1000, 0, priority=5000)
    lows = [running(svc, f"l{j}", "n0", [1], 6000, 0, priority=1) for j in range(2)]
    _, res = preempt(svc, meta_args(preemptor(priority=1000), {"n0": [high]}))
    assert sorted(victims_of(res, "n0")) == sorted(lows), res


def test_node_where_no_subset_helps_is_dropped() -> None:
    svc = offline_service([node_obj("n0", 1, split=4), node_obj("n1", 1, split=4), node_obj("small", 1, mem=8000),
                           node_obj("stale", 1, heartbeat=1.0)])
    hi = running(svc, "hi", "n0", [0], 20000, 0, priority=2000)
    lo = running(svc, "lo", "n0", [0], 4000, 0, priority=10)
    lo1 = running(svc, "lo1", "n1", [0], 20000, 0, priority=10)
    big = preemptor(**{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 16000})
    _, res = preempt(svc, meta_args(big, {"n0": [lo], "n1": [lo1], "small": ["x"], "stale": ["y"], "gone": ["z"]}))
    # n0: only 4000 MiB can be freed (the rest is a higher-priority pod's); small: the GPU is too small;
    # stale: not a candidate; gone: unknown to the extender
    assert res == {"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": lo1}], "NumPDBViolations": 0}}}, res
    assert hi not in str(res)
    # why each node is left out is data; its text is rendered at the log (fit failures by render.summary)
    answers = svc.preemption.answer(big, {n: ([], 0) for n in ("n0", "small", "stale", "gone")})
    assert answers["stale"].failure is svc.cache.unavailable["stale"] and not answers["stale"].uids
    assert answer_text(answers["stale"]) == f"not a candidate: {summary(svc.cache.unavailable['stale'])}"
    assert answer_text(answers["gone"]) == f"not a candidate: {summary(NO_INVENTORY)}"
    assert answer_text(answers["n0"]) == "no set of lower-priority pods makes room"


def test_forged_body_cannot_make_a_victim_or_change_the_cache() -> None:
    svc = offline_service([node_obj("n0", 2, split=4), node_obj("n1", 1, split=4)])
    cards = full_node(svc, "n0", priority=100)
    high = running(svc, "vip", "n1", [0], 1000, 0, priority=2_000_000_000)
    elsewhere = running(svc, "elsewhere", "n1", [0], 1000, 0, priority=1)
    before = snapshot(svc)
    forged = meta_args(preemptor(priority=10**9), {"n0": [high, elsewhere, cards[0][0], "uid-made-up"],
                                                   "n1": [high]})
    _, res = preempt(svc, forged)
    got = victims_of(res, "n0")
    # the higher-priority pod is not made a victim (n1 has nothing else that helps: dropped); the pod
    # of another node is not a victim on n0; the made-up UID is passed through as kube-scheduler's own
    assert high not in str(res) and elsewhere not in got and "n1" not in res["NodeNameToMetaVictims"]
    assert got[0] == "uid-made-up" and sorted(got[1:]) == sorted(cards[0])
    assert snapshot(svc) == before
    # the preemptor's priority comes from the pod as the watch shows it, not from the body
    pod = preemptor(priority=50)
    svc.cache.on_pod("ADDED", pod)  # pending, watched (priority 50 < the slices' 100)
    lie = copy.deepcopy(pod)
    lie["spec"]["priority"] = 10**9
    _, res = preempt(svc, meta_args(lie, {"n0": [cards[0][0]]}))
    assert res == {"NodeNameToMetaVictims": {}}, res
    assert snapshot(svc)[:3] == before[:3]


def test_pdb_violations_as_kube_scheduler_counts_them() -> None:
    svc = offline_service([node_obj("n0", 2, split=4), node_obj("n1", 2, split=4)])
    a = full_node(svc, "n0")
    b = full_node(svc, "n1")
    _, res = preempt(svc, meta_args(preemptor(), {"n0": [a[0][0]], "n1": [b[1][0]]}, pdb={"n0": 2, "n1": 0}))
    assert res["NodeNameToMetaVictims"]["n0"]["NumPDBViolations"] == 2
    assert res["NodeNameToMetaVictims"]["n1"]["NumPDBViolations"] == 0


def test_full_victims_shape_and_pass_through_and_errors() -> None:
    svc = offline_service([node_obj("n0", 2, split=4)])
    cards = full_node(svc)
    # nodeCacheCapable: false sends whole pods; only their uid is read, the answer is MetaVictims
    body = {"Pod": preemptor(), "NodeNameToMetaVictims": None, "NodeNameToVictims": {
        "n0": {"Pods": [{"metadata": {"uid": cards[0][1], "name": "whatever"}}], "NumPDBViolations": 1}}}
    _, res = preempt(svc, body)
    assert sorted(victims_of(res, "n0")) == sorted(cards[0]) and res["NodeNameToMetaVictims"]["n0"]["NumPDBViolations"] == 1
    # a pod without vGPU resources: kube-scheduler's proposal comes back unchanged
    plain = pod_obj("plain", limits={"cpu": "1"})
    _, res = preempt(svc, meta_args(plain, {"n0": ["u1", "u2"]}, pdb={"n0": 3}))
    assert res == {"NodeNameToMetaVictims": {"n0": {"Pods": [{"UID": "u1"}, {"UID": "u2"}], "NumPDBViolations": 3}}}
    # malformed bodies: 400 naming the field
    for bad, field in [([], "ExtenderPreemptionArgs"), ({"Pod": preemptor(), "NodeNameToMetaVictims": []},
                                                         "NodeNameToMetaVictims"),
                       ({"Pod": preemptor(), "NodeNameToMetaVictims": {"n0": {"Pods": [{"UID": 5}]}}},
                        'NodeNameToMetaVictims["n0"].Pods[0].UID must be a string, got a number'),
                       ({"Pod": preemptor(), "NodeNameToMetaVictims": {"n0": {"NumPDBViolations": -1}}},
                        'NodeNameToMetaVictims["n0"].NumPDBViolations must be a whole number >= 0'),
                       ({"Pod": preemptor(), "NodeNameToVictims": {"n0": {"Pods": [{"spec": []}]}}},
                        'NodeNameToVictims["n0"].Pods[0].spec must be an object, got a list'),
                       ({"NodeNameToMetaVictims": {}}, "Pod must be an object (core/v1 Pod), got null")]:
        status, res = preempt(svc, bad)
        assert status == 400 and field in res["Error"], (bad, res)
    # an invalid vGPU request keeps no node
    _, res = preempt(svc, meta_args(preemptor(**{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "-5"}), {"n0": ["u"]}))
    assert res == {"NodeNameToMetaVictims": {}}


def test_metrics_count_preempt_calls() -> None:
    svc = offline_service([node_obj("n0", 2, split=4), node_obj("n1", 1, mem=8000)])
    cards = full_node(svc)

    async def go() -> str:
        async with Extender(svc) as ext:
            await ext.post("/preempt", meta_args(preemptor(), {"n0": [cards[0][0]], "gone": ["x"]}))
            return (await ext.get("/metrics"))[1]
    text = run(go)
    assert 'kube_vgpu_scheduler_preempt_nodes_total{outcome="kept"} 1.0' in text
    assert 'kube_vgpu_scheduler_preempt_nodes_total{outcome="dropped"} 1.0' in text
    assert "kube_vgpu_scheduler_preempt_victims_total 3.0" in text  # 3 added to kube-scheduler's 1
    assert "kube_vgpu_scheduler_preempt_seconds_count 1.0" in text


# -- property: the chosen victims make the pod fit, and no strict subset of them does ----------

def _node(n_gpus: int, split: int) -> ClusterState:
    cs = ClusterState()
    cs.set_node("n", tuple(GPUDevice(uuid=f"G{i}", index=i, model="M", memory_mib=16000, split=split)
                           for i in range(n_gpus)))
    return cs


holder_st = st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True),
                      st.sampled_from([1000, 2000, 4000, 8000, 12000]), st.sampled_from([0, 10, 30, 50]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_gpus=st.integers(1, 4), split=st.integers(2, 5), pods=st.lists(holder_st, min_size=1, max_size=9),
       count=st.integers(1, 2), mem=st.sampled_from([2000, 6000, 10000, 16000]), pct=st.booleans(),
       cores=st.sampled_from([0, 20, 60, 100]), prio=st.integers(0, 4), budget=st.sampled_from([0, 6000]))
def test_victims_make_the_pod_fit_and_are_minimal(n_gpus: int, split: int, pods: list[tuple[int, list[int], int, int]],
                                                  count: int, mem: int, pct: bool, cores: int, prio: int,
                                                  budget: int) -> None:
    cs = _node(n_gpus, split)
    holders = []
    for k, (p, gpus, m, c) in enumerate(pods):
        gpus = [g for g in gpus if g < n_gpus]
        if not gpus:
            continue
        alloc = PodAllocation("n", (ContainerAllocation("c", False, tuple(DeviceBooking(f"G{g}", m, c) for g in gpus)),))
        try:
            b = cs.book(f"ns/p{k}", alloc)
        except OvercommitError:
            continue
        holders.append(Holder(f"ns/p{k}", f"u{k}", p, b.usage))
    node = cs.nodes["n"]
    c = ContainerRequest("c", False, count, memory_mib=0 if pct else mem, memory_percent=mem * 100 // 16000 if pct else 0,
                         cores=cores)
    pod = PodRequest("ns", "big", app=(c,))
    sig = node.signature()

    def fits(freed: list[Holder]) -> bool:
        return isinstance(fit_pod(what_if(node, freed), pod), Plan)

    r = select_victims(node, pod, prio, holders, budget=budget)
    assert node.signature() == sig, "select_victims changed the live node"
    eligible = [h for h in holders if h.priority < prio]
    if r is None:
        assert not fits(eligible)
        return
    vs = list(r.victims)
    assert all(h.priority < prio for h in vs)
    assert fits(vs) and isinstance(r.plan, Plan)
    for size in range(len(vs)):  # minimal: no strict subset makes room
        for sub in combinations(vs, size):
            assert not fits(list(sub)), (vs, sub)
    if r.exact and vs:
        # the fewest pods among those of the lowest priority level that is enough
        level = min(lv for lv in sorted({h.priority for h in eligible})
                    if fits([h for h in eligible if h.priority <= lv]))
        pool = [h for h in eligible if h.priority <= level]
        smallest = next(k for k in range(len(pool) + 1) if any(fits(list(s)) for s in combinations(pool, k)))
        assert len(vs) == smallest and max(h.priority for h in vs) <= level


def test_request_budget_spent_falls_back_to_a_minimal_greedy_set() -> None:
    svc = offline_service([node_obj("n0", 2, split=4)])
    cards = full_node(svc)
    svc.preemption.request_budget = 0  # no exact search left: the greedy reprieve
    _, res = preempt(svc, meta_args(preemptor(), {"n0": ["uid-cpu-hog"]}))
    got = victims_of(res, "n0")
    assert got[0] == "uid-cpu-hog" and sorted(got[1:]) in (sorted(cards[0]), sorted(cards[1])), got
