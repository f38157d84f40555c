"""Promises through the extender: pods whose filter and prioritize all run before any bind (as
kube-scheduler pipelines them: binds are asynchronous) are placed without a bind losing a race
for capacity, and no promise outlives its pod's bind or its time."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from vgpu_sched_util import (
    Extender,
    api_extender,
    bind_args,
    filter_args,
    node_obj,
    offline_service,
    pod_obj,
    run,
)

from kube_vgpu.codec import decode_allocation
from kube_vgpu.resources import ANN_ALLOCATION
from scheduler.service import SchedulerService
from tests.fakeapi import FakeKubeAPI


def _create(fake: FakeKubeAPI, n: int, limits: dict[str, int]) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        p = pod_obj(f"p{i:03d}", limits=limits)
        p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
        out.append(fake.create_object("pods", p))
    return out


async def _decide(ext: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]], rnd: random.Random) -> str | None:
    """kube-scheduler's scheduling cycle: filter, prioritize (skipped for a single feasible node),
    the highest score wins, ties broken at random. Returns the node, None if unschedulable."""
    _, res = await ext.post("/filter", filter_args(pod, nodes))
    ok = res["NodeNames"] or []
    if len(ok) <= 1:
        return ok[0] if ok else None
    _, prio = await ext.post("/prioritize", filter_args(pod, [n for n in nodes if n["metadata"]["name"] in ok]))
    return str(max(prio, key=lambda p: (p["Score"], rnd.random()))["Host"])


def _gpu_use(fake: FakeKubeAPI) -> dict[str, list[int]]:
    used: dict[str, list[int]] = {}
    for p in fake.objects("pods"):
        text = (p["metadata"].get("annotations") or {}).get(ANN_ALLOCATION)
        if text and p["spec"].get("nodeName"):
            for uuid, (m, _c, s) in decode_allocation(text).usage().items():
                u = used.setdefault(uuid, [0, 0])
                u[0] += m
                u[1] += s
    return used


async def _pipeline(ext: Extender, pods: list[dict[str, Any]], nodes: list[dict[str, Any]]
                    ) -> tuple[dict[str, str | None], list[str]]:
    """Every pod's scheduling cycle first, then all binds at once. Returns (pod -> decided node,
    the bind errors)."""
    rnd = random.Random(3)
    decided = {p["metadata"]["name"]: await _decide(ext, p, nodes, rnd) for p in pods}
    by_name = {p["metadata"]["name"]: p for p in pods}
    results = await asyncio.gather(*(ext.post("/bind", bind_args(by_name[k], n))
                                     for k, n in decided.items() if n is not None))
    return decided, [b["Error"] for _, b in results if b["Error"]]


@pytest.mark.parametrize(("n_nodes", "gpus", "n_pods", "limits"), [
    (50, 8, 200, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}),  # the throughput benchmark's shape
    (4, 2, 20, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 12000}),  # 16 fit exactly: the cluster fills up
    (1, 2, 8, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 12000}),  # one node: promised at filter
])
@pytest.mark.parametrize("best_only", [False, True])
def test_pipelined_pods_bind_without_races_and_leave_no_promise(fake: FakeKubeAPI, n_nodes: int, gpus: int,
                                                                 n_pods: int, limits: dict[str, int],
                                                                 best_only: bool) -> None:
    nodes = [fake.create_object("nodes", node_obj(f"node-{i:02d}", gpus)) for i in range(n_nodes)]
    pods = _create(fake, n_pods, limits)
    fits = min(n_pods, n_nodes * gpus * (24576 // limits["nvidia.com/gpumem"]), n_nodes * gpus * 10)

    async def go() -> None:
        async with api_extender(fake, filter_best_node=best_only) as ext:
            svc = ext.svc
            decided, errors = await _pipeline(ext, pods, nodes)
            assert sum(1 for n in decided.values() if n) == fits  # promises told later pods what is left
            assert errors == []  # no bind lost a race for capacity
            assert svc.cache.state.assumed == {}  # every promise became a booking
            assert len(svc.cache.state.bookings) == fits
            for uuid, (mem, slots) in _gpu_use(fake).items():
                assert mem <= 24576 and slots <= 10, uuid
            assert svc.metrics.registry.get_sample_value("kube_vgpu_scheduler_binds_total",
                                                         {"outcome": "success"}) == fits
    run(go, timeout=120)


def test_without_promises_the_same_pipeline_loses_races(fake: FakeKubeAPI) -> None:
    """The control: with promises off the pipelined pods all see the same free capacity (one node
    with room for 4 of the 8): every pod passes filter and 4 binds fail."""
    nodes = [fake.create_object("nodes", node_obj("node-00", 2))]
    pods = _create(fake, 8, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 12000})

    async def go() -> None:
        async with api_extender(fake, assume_seconds=0.0) as ext:
            decided, errors = await _pipeline(ext, pods, nodes)
            assert all(decided.values()) and len(errors) == 4
            assert ext.svc.cache.state.assumed == {}
    run(go, timeout=60)


def _service(n_nodes: int = 2, now: list[float] | None = None) -> tuple[SchedulerService, list[dict[str, Any]]]:
    nodes = [node_obj(f"n{i}", 1) for i in range(n_nodes)]
    svc = offline_service(nodes, filter_best_node=False)  # these tests read every feasible node
    if now is not None:
        svc.clock = lambda: now[0]
    return svc, nodes


def test_promises_of_pods_that_never_bind_expire() -> None:
    now = [1000.0]
    svc, nodes = _service(2, now)
    empty = {n.name: n.signature() for n in svc.cache.state.node_list}

    async def go() -> None:
        for i in range(2):  # each takes a whole GPU: the second promise goes to the other node
            p = pod_obj(f"p{i}", limits={"nvidia.com/gpu": 1})
            await svc.prioritize(filter_args(p, nodes))
        assert len(svc.cache.state.assumed) == 2
        res = await svc.filter(filter_args(pod_obj("late", limits={"nvidia.com/gpu": 1}), nodes))
        assert res["NodeNames"] == []  # promised capacity is not offered again
        now[0] += svc.opts.assume_seconds
        svc._tick()  # the periodic sweep ends them, no filter needed
        assert svc.cache.state.assumed == {}
        assert {n.name: n.signature() for n in svc.cache.state.node_list} == empty
        assert svc.metrics.registry.get_sample_value("kube_vgpu_scheduler_assumptions_expired_total") == 2
        res = await svc.filter(filter_args(pod_obj("late", limits={"nvidia.com/gpu": 1}), nodes))
        assert sorted(res["NodeNames"]) == ["n0", "n1"]
    run(go)


def test_a_new_scheduling_cycle_replaces_the_pods_promise() -> None:
    svc, nodes = _service(1)

    async def go() -> None:
        p = pod_obj("p", limits={"nvidia.com/gpu": 1})
        res = await svc.filter(filter_args(p, nodes))  # one feasible node: promised at filter
        assert res["NodeNames"] == ["n0"] and list(svc.cache.state.assumed) == ["default/p"]
        res = await svc.filter(filter_args(p, nodes))  # retried: its own promise does not block it
        assert res["NodeNames"] == ["n0"] and len(svc.cache.state.assumed) == 1
    run(go)


def test_filter_best_node_answers_the_node_prioritize_would_promise() -> None:
    """With ``filter_best_node`` /filter answers one node, the one /prioritize ranks first (and
    promises it, as for any single feasible node), so kube-scheduler skips scoring; the other
    feasible nodes are left out, not reported as failed. Nodes of different sizes, so the policy's
    scores differ; a pod that fits nowhere still gets every node's reason."""
    nodes = [node_obj("n0", 1, mem=16384), node_obj("n1", 2, mem=24576), node_obj("n2", 4, mem=40960),
             node_obj("n3", 8, mem=81920)]

    async def go() -> None:
        for i, mib in enumerate((1000, 8000, 20000, 30000)):
            pod = pod_obj(f"p{i}", limits={"nvidia.com/gpumem": mib})
            ref = offline_service(nodes, filter_best_node=False)
            feasible = (await ref.filter(filter_args(pod, nodes)))["NodeNames"]
            assert len(feasible) > 1, (mib, feasible)
            ref = offline_service(nodes, filter_best_node=False)
            scores = {e["Host"]: e["Score"] for e in json.loads(await ref.prioritize(filter_args(pod, nodes)))}
            top = max(scores.values())
            (expected,) = [n for n, sc in scores.items() if sc == top]
            best = offline_service(nodes, filter_best_node=True)
            res = await best.filter(filter_args(pod, nodes))
            assert res["NodeNames"] == [expected], (mib, res)
            assert set(res["FailedNodes"]) == {n["metadata"]["name"] for n in nodes} - set(feasible)
            assert {a.node for a in best.cache.state.assumed.values()} == {expected}
        res = await offline_service(nodes, filter_best_node=True).filter(
            filter_args(pod_obj("huge", limits={"nvidia.com/gpumem": 90000}), nodes))
        assert res["NodeNames"] == [] and set(res["FailedNodes"]) | set(res.get("FailedAndUnresolvableNodes") or {}) \
            == {"n0", "n1", "n2", "n3"}
    run(go)


def test_the_promised_node_alone_gets_the_top_score() -> None:
    svc, nodes = _service(3)

    async def go() -> None:
        body = await svc.prioritize(filter_args(pod_obj("p", limits={"nvidia.com/gpumem": 1000}), nodes))
        scores = {e["Host"]: e["Score"] for e in json.loads(body)}
        (promised,) = {a.node for a in svc.cache.state.assumed.values()}
        assert scores[promised] == 10 and all(s == 9 for n, s in scores.items() if n != promised)
    run(go)


def test_forged_prioritize_bodies_hold_nothing_beyond_bounds_and_time() -> None:
    """Attack: /prioritize bodies are not authenticated (the listener is loopback by default). A
    flood of forged pods holds at most ``max_assumed`` promises, never more than fits, never for a
    pod that is booked, and all of it lapses after ``assume_seconds``."""
    now = [1000.0]
    svc, nodes = _service(2, now)
    svc.cache.state.max_assumed = 8
    booked = pod_obj("real", limits={"nvidia.com/gpumem": 1000})
    from kube_vgpu.podspec import parse_pod
    r = svc.cache.reserve(parse_pod(booked), booked["metadata"]["uid"], "n0")
    assert not isinstance(r, str)
    empty_but_real = {n.name: n.signature() for n in svc.cache.state.node_list}

    async def go() -> None:
        for i in range(50):
            forged = pod_obj(f"forged-{i}", limits={"nvidia.com/gpumem": 4000})
            forged["metadata"]["uid"] = f"forged-uid-{i}"
            await svc.prioritize(filter_args(forged, nodes))
        assert len(svc.cache.state.assumed) == 8  # bounded: the oldest ended
        for n in svc.cache.state.node_list:
            assert all(x >= 0 for x in n.free_mem + n.free_cores + n.free_slots)
        # a forged body naming a booked pod gets no promise and leaves its booking as it is
        await svc.prioritize(filter_args(booked, nodes))
        assert "default/real" not in svc.cache.state.assumed
        assert svc.cache.state.bookings["default/real"] is r[0]
        now[0] += svc.opts.assume_seconds
        svc._tick()
        assert svc.cache.state.assumed == {}
        assert {n.name: n.signature() for n in svc.cache.state.node_list} == empty_but_real
    run(go)
