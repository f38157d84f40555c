"""Filter answers typed failures rendered so kube-scheduler can group them: one text per code and
request, no GPU names, the numbers behind it in the debug log; rejections counted by code."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vgpu_sched_util import filter_args, node_obj, offline_service, pod_obj, run

from kube_vgpu.codec import encode_allocation
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.placement import Code
from kube_vgpu.placement.render import aggregate
from scheduler.service import SchedulerService


def _book(svc: SchedulerService, node: str, mib: int, k: int) -> None:
    """Book ``mib`` on GPU 0 of ``node`` for a pod, as a bound pod's record would."""
    alloc = PodAllocation(node, (ContainerAllocation("c", False, (DeviceBooking(f"GPU-{node}-00", mib, 0),)),), 1.0)
    svc.cache.state.book(f"default/b{k}", alloc, check=True)
    assert encode_allocation(alloc)


def _codes(svc: SchedulerService) -> dict[str, float]:
    out = {}
    for key, failed in _drain(svc):
        svc._handle_rejection(key, failed)
    for m in svc.metrics.registry.collect():
        if m.name == "kube_vgpu_scheduler_filter_rejections":
            for s in m.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def _drain(svc: SchedulerService) -> list[Any]:
    items = []
    while not svc._events.empty():
        items.append(svc._events.get_nowait())
    return items


def test_identical_failures_on_different_nodes_render_identically() -> None:
    nodes = [node_obj(f"n{i:02d}", 2, mem=24576) for i in range(50)]
    svc = offline_service(nodes)
    for i in range(50):  # every node in a different state: largest free differs per node
        _book(svc, f"n{i:02d}", 1000 + 100 * i, i)
        svc.cache.state.book(f"default/c{i}", PodAllocation(f"n{i:02d}", (ContainerAllocation(
            "c", False, (DeviceBooking(f"GPU-n{i:02d}-01", 1000 + 100 * i, 0),)),), 1.0))

    async def go() -> None:
        res = await svc.filter(filter_args(pod_obj("big", limits={"nvidia.com/gpumem": 24000}), nodes))
        assert res["NodeNames"] == [] and res["FailedAndUnresolvableNodes"] == {}
        texts = set(res["FailedNodes"].values())
        assert len(res["FailedNodes"]) == 50 and len(texts) == 1  # kube-scheduler groups them
        (text,) = texts
        assert "GPU-" not in text and "24000" in text
        assert aggregate(res["FailedNodes"].values(), 50).startswith("0/50 nodes are available: 50 ")
        assert _codes(svc) == {"insufficient_memory": 50.0}
    run(go)


def test_resolvable_and_unresolvable_failures_are_split_by_code() -> None:
    nodes = [node_obj("small", 1), node_obj("busy", 2), node_obj("noalloc", 2, allocatable=0)]
    svc = offline_service(nodes)
    _book(svc, "busy", 24576, 0)
    svc.cache.state.book("default/x", PodAllocation("busy", (ContainerAllocation(
        "c", False, (DeviceBooking("GPU-busy-01", 24576, 0),)),), 1.0))

    async def go() -> None:
        res = await svc.filter(filter_args(pod_obj("p", limits={"nvidia.com/gpu": 2, "nvidia.com/gpumem": 1000}),
                                           nodes))
        assert set(res["FailedNodes"]) == {"busy"}  # preemption on busy could free its GPUs
        assert set(res["FailedAndUnresolvableNodes"]) == {"small", "noalloc"}
        assert _codes(svc) == {"insufficient_memory": 1.0, "too_few_gpus": 1.0, "no_allocatable": 1.0}
    run(go)


def test_invalid_request_is_unresolvable_on_every_node() -> None:
    nodes = [node_obj("n0"), node_obj("n1")]
    svc = offline_service(nodes)

    async def go() -> None:
        res = await svc.filter(filter_args(pod_obj("p", limits={"nvidia.com/gpumem-percentage": 0}), nodes))
        assert res["NodeNames"] == [] and res["FailedNodes"] == {}
        assert set(res["FailedAndUnresolvableNodes"]) == {"n0", "n1"}
        assert len(set(res["FailedAndUnresolvableNodes"].values())) == 1
        assert _codes(svc) == {Code.INVALID_REQUEST.value: 2.0}
    run(go)


def test_details_with_the_gpu_go_to_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    nodes = [node_obj("n0", 1)]
    svc = offline_service(nodes)
    _book(svc, "n0", 20000, 0)

    async def go() -> None:
        await svc.filter(filter_args(pod_obj("p", limits={"nvidia.com/gpumem": 10000}), nodes))
        with caplog.at_level(logging.DEBUG, logger="kube_vgpu.scheduler"):
            _codes(svc)
    run(go)
    (rec,) = [r for r in caplog.records if r.getMessage() == "node rejected"]
    assert rec.__dict__["node"] == "n0" and rec.__dict__["outcome"] == "insufficient_memory"
    assert "10000" in rec.__dict__["error"] and "4576" in rec.__dict__["error"]  # needed, largest free
    assert "GPU-n0-00" in rec.__dict__["error"]  # and the GPU it was measured on


def test_no_debug_detail_below_debug_level(caplog: pytest.LogCaptureFixture) -> None:
    nodes = [node_obj("n0", 1)]
    svc = offline_service(nodes)

    async def go() -> None:
        await svc.filter(filter_args(pod_obj("p", limits={"nvidia.com/gpu": 3}), nodes))
        with caplog.at_level(logging.INFO, logger="kube_vgpu.scheduler"):
            assert _codes(svc) == {"too_few_gpus": 1.0}
    run(go)
    assert not [r for r in caplog.records if r.getMessage() == "node rejected"]
