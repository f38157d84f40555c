"""Binds to one node never wait for the device plugin: it identifies each container exactly at
PreStartContainer (kubelet's PodResources API), so same-size pods may all be pending device
allocation on one node at once. Against the fake kube-apiserver, with no device plugin at all."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from test_cluster import create_nodes, create_pod, extender
from vgpu_sched_util import Extender, bind_args, pod_obj, run

from kube_vgpu.cluster import ClusterCache
from kube_vgpu.config import load_config_text
from kube_vgpu.resources import ANN_BIND_PHASE, BIND_ALLOCATING
from scheduler.service import Options, SchedulerService
from tests.fakeapi import FakeKubeAPI


async def bind(ext: Extender, pod: dict[str, Any], node: str = "node-0") -> str:
    _, res = await ext.post("/bind", bind_args(pod, node))
    return str(res["Error"])


def test_no_wait_path_exists() -> None:
    """The extender has no hand-over wait and no per-node bind state to wait on."""
    assert "handover_wait" not in {f.name for f in dataclasses.fields(Options)}
    for name in ("_handover", "_handover_blocker", "_wake_handover"):
        assert not hasattr(SchedulerService, name), name
    for name in ("handover_blocker", "_set_allocating", "_track_allocating"):
        assert not hasattr(ClusterCache, name), name


@pytest.mark.parametrize("handover", [None, 30])
def test_same_size_binds_to_one_node_complete_concurrently_without_a_device_plugin(
        fake: FakeKubeAPI, handover: int | None) -> None:
    """Twelve 1-GPU pods bound concurrently to one node, nobody answering for the device plugin
    (every pod stays ``allocating``): every bind succeeds at once, none is refused or retried, also
    with the deprecated ``bindHandoverSeconds`` set."""
    create_nodes(fake, 1, gpus=4, split=10)
    pods = [create_pod(fake, pod_obj(f"p{i:02d}", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000 + i}))
            for i in range(12)]
    cfg = load_config_text(f"scheduling: {{bindHandoverSeconds: {handover}}}") if handover else None

    async def go() -> None:
        async with extender(fake, config=cfg) as ext:
            errors = await asyncio.gather(*(bind(ext, p) for p in pods))
            assert errors == [""] * len(pods)
            for p in pods:
                live = fake.get_object("pods", p["metadata"]["name"], "default")
                assert live["spec"]["nodeName"] == "node-0"
                assert live["metadata"]["annotations"][ANN_BIND_PHASE] == BIND_ALLOCATING
            assert ext.svc.metrics.binds.labels(outcome="success")._value.get() == len(pods)
    run(go, 60)
