"""Per-node bind hand-over (scheduling.bindHandoverSeconds): a bind waits while a pod bound to the
node is still allocating a GPU container of the same GPU count, and goes on as soon as that pod is
allocated, deleted, failed or past the hand-over limit. Against the fake kube-apiserver."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_device_plugin import mark_allocated
from test_cluster import create_nodes, create_pod, extender
from vgpu_sched_util import Extender, bind_args, filter_args, pod_obj, run, wait_until

from kube_vgpu.config import load_config_text
from kube_vgpu.resources import ANN_ALLOCATION, ANN_BIND_PHASE
from tests.fakeapi import FakeKubeAPI


@pytest.fixture
def fake() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI(bookmark_interval=0.5)
    api.start()
    try:
        yield api
    finally:
        api.stop()


async def bind(ext: Extender, pod: dict[str, Any], node: str = "node-0") -> str:
    _, res = await ext.post("/bind", bind_args(pod, node))
    return str(res["Error"])


def gpu_pod(fake: FakeKubeAPI, name: str, count: int = 1, mem: int = 1000) -> dict[str, Any]:
    return create_pod(fake, pod_obj(name, limits={"nvidia.com/gpu": count, "nvidia.com/gpumem": mem}))


async def waiting(ext: Extender, pod: dict[str, Any], node: str = "node-0") -> asyncio.Task[str]:
    """Start ``pod``'s bind and return once it is waiting for the hand-over."""
    before = ext.svc.handover_waits
    task = asyncio.create_task(bind(ext, pod, node))
    await wait_until(lambda: ext.svc.handover_waits > before or task.done())
    assert not task.done(), task.result()
    return task


def no_trace(fake: FakeKubeAPI, ext: Extender, name: str) -> None:
    """The pod's bind left nothing: no booking, no annotation, not bound, nothing in flight."""
    svc = ext.svc
    assert f"default/{name}" not in svc.cache.state.bookings
    p = fake.get_object("pods", name, "default")
    assert p is not None and not p["spec"].get("nodeName")
    assert ANN_ALLOCATION not in (p["metadata"].get("annotations") or {})
    assert not svc.cache.inflight and not svc._active_binds


def test_waits_for_the_previous_pod_and_binds_as_soon_as_it_is_allocated(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1)
    a, b = gpu_pod(fake, "a"), gpu_pod(fake, "b")

    async def go() -> None:
        async with extender(fake) as ext:
            assert await bind(ext, a) == ""
            task = await waiting(ext, b)
            await asyncio.sleep(0.5)
            assert not task.done()  # a is still allocating
            t0 = time.monotonic()
            assert mark_allocated(fake, "a")
            assert await task == ""
            assert time.monotonic() - t0 < 1.0
            p = fake.get_object("pods", "b", "default")
            assert p is not None and p["spec"]["nodeName"] == "node-0"
            assert p["metadata"]["annotations"][ANN_BIND_PHASE] == "allocating"
    run(go)


def test_deleted_or_failed_pod_hands_over_at_once(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1)
    a, b, c = gpu_pod(fake, "a"), gpu_pod(fake, "b"), gpu_pod(fake, "c")

    async def go() -> None:
        async with extender(fake) as ext:
            assert await bind(ext, a) == ""
            task = await waiting(ext, b)
            t0 = time.monotonic()
            fake.delete_object("pods", "a", "default")
            assert await task == ""
            assert time.monotonic() - t0 < 1.0
            task = await waiting(ext, c)  # b is allocating now
            t0 = time.monotonic()
            fake.set_pod_phase("b", "Failed")
            assert await task == ""
            assert time.monotonic() - t0 < 1.0
    run(go)


def test_pod_stuck_past_the_hand_over_limit_no_longer_blocks(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1)
    a, b = gpu_pod(fake, "a"), gpu_pod(fake, "b")
    cfg = load_config_text("scheduling: {bindHandoverSeconds: 0.5}")

    async def go() -> None:
        async with extender(fake, config=cfg) as ext:
            assert await bind(ext, a) == ""
            t0 = time.monotonic()
            assert await bind(ext, b) == ""  # a never finishes: b goes on once a is 0.5 s old
            assert 0.2 < time.monotonic() - t0 < 1.5
            assert ext.svc.handover_waits == 1
    run(go)


def test_bind_gives_up_naming_the_pod_it_waits_for_and_leaks_nothing(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1)
    a, b = gpu_pod(fake, "a"), gpu_pod(fake, "b")

    async def go() -> None:
        async with extender(fake, handover_wait=0.5) as ext:
            svc = ext.svc
            assert await bind(ext, a) == ""
            t0 = time.monotonic()
            err = await bind(ext, b)
            assert 0.4 < time.monotonic() - t0 < 1.5
            assert err == ("node node-0: waiting for pod default/a to finish device allocation (hand-over); "
                           "kube-scheduler will retry")
            assert svc.metrics.binds.labels(outcome="handover")._value.get() == 1
            await asyncio.sleep(0.2)
            no_trace(fake, ext, "b")
            assert set(svc.cache.state.bookings) == {"default/a"}
            assert mark_allocated(fake, "a")  # kube-scheduler's retry after a is allocated binds
            await wait_until(lambda: not svc.cache.allocating)
            assert await bind(ext, b) == ""
    run(go)


def test_pods_of_different_gpu_counts_never_wait_for_each_other(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1, gpus=4)
    a, b, c = gpu_pod(fake, "a", 2), gpu_pod(fake, "b", 1), gpu_pod(fake, "c", 3, mem=500)

    async def go() -> None:
        async with extender(fake) as ext:
            t0 = time.monotonic()
            for p in (a, b, c):  # none is ever allocated by a device plugin here
                assert await bind(ext, p) == ""
            assert time.monotonic() - t0 < 1.0
            assert ext.svc.handover_waits == 0
    run(go)


def test_a_waiting_bind_delays_no_other_node(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 2)
    a, b, c = gpu_pod(fake, "a"), gpu_pod(fake, "b"), gpu_pod(fake, "c")

    async def go() -> None:
        async with extender(fake) as ext:
            assert await bind(ext, a) == ""
            task = await waiting(ext, b, "node-0")
            t0 = time.monotonic()
            st, res = await ext.post("/filter", filter_args(c, nodes))
            assert st == 200 and res["NodeNames"] == ["node-0", "node-1"]
            st, _ = await ext.post("/prioritize", filter_args(c, nodes))
            assert st == 200
            assert await bind(ext, c, "node-1") == ""  # same GPU count, other node: no wait
            assert time.monotonic() - t0 < 0.5
            assert not task.done()
            assert mark_allocated(fake, "a")
            assert await task == ""
    run(go)


def test_cache_keeps_hand_over_state_right_when_watch_and_bind_interleave() -> None:
    """The watch may deliver the pre-Binding annotation patch after our bind recorded the pod, or
    the device plugin's 'success' before it: neither may open the hand-over early or keep it shut."""
    from vgpu_sched_util import node_obj

    from kube_vgpu.cluster import ClusterCache
    from kube_vgpu.codec import encode_allocation
    from kube_vgpu.config import Config
    from kube_vgpu.podspec import parse_pod
    from kube_vgpu.resources import ANN_ALLOCATED_CONTAINERS, ANN_BIND_TIME

    c = ClusterCache(Config())
    c.on_node("ADDED", node_obj("n1"))
    woken: list[int] = []
    c.on_handover_change = lambda: woken.append(1)
    for late in ("unbound-patch", "success-first"):
        pod = pod_obj(f"p-{late}", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})
        key, uid = f"default/p-{late}", pod["metadata"]["uid"]
        req = parse_pod(pod, c.config)
        r = c.reserve(req, uid, "n1")
        assert not isinstance(r, str)
        booking, alloc = r
        ann = {ANN_ALLOCATION: encode_allocation(alloc), ANN_BIND_PHASE: "allocating", ANN_BIND_TIME: str(int(time.time()))}
        c.inflight.add(key)
        if late == "success-first":
            done = dict(pod, metadata=dict(pod["metadata"], annotations={**ann, ANN_BIND_PHASE: "success",
                                                                         ANN_ALLOCATED_CONTAINERS: "c"}),
                        spec=dict(pod["spec"], nodeName="n1"))
            c.on_pod("MODIFIED", done)
        c.inflight.discard(key)
        c.record_bound(key, uid, booking, req)
        if late == "unbound-patch":
            assert c.handover_blocker("n1", "default/other", frozenset({1}), 30.0) == (key, pytest.approx(30, abs=1))
            assert c.handover_blocker("n1", "default/other", frozenset({2}), 30.0) is None
            c.on_pod("MODIFIED", dict(pod, metadata=dict(pod["metadata"], annotations=ann)))  # no nodeName
            assert c.handover_blocker("n1", "default/other", frozenset({1}), 30.0) is not None
            c.on_pod("DELETED", pod)
        assert c.handover_blocker("n1", "default/other", frozenset({1}), 30.0) is None
        assert not c.allocating
    assert woken
