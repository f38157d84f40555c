"""Dynamic MIG through the extender's HTTP protocol (Go-field-name ExtenderArgs) and the fake
kube-apiserver: a ``gpumem`` request on a node whose GPU is in dynamic-MIG mode is booked as the
smallest allowed MIG profile that holds it, placed by kube_vgpu.mig.place over the instances already
booked on the GPU; the signed record carries the profile and start; a request no allowed profile
holds is refused with the reason; a record a tenant edited to a bigger profile is not booked."""

from __future__ import annotations

import json
import time
from typing import Any

from vgpu_sched_util import (
    Extender,
    api_extender,
    bind_args,
    filter_args,
    node_obj,
    pod_obj,
    quota_obj,
    run,
    wait_until,
)

from kube_vgpu.codec import decode_allocation, encode_allocation, encode_inventory
from kube_vgpu.mig import TABLES, Instance, place
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation
from kube_vgpu.resources import ANN_ALLOCATION, ANN_ALLOCATION_SIGNATURE, ANN_NODE_INVENTORY
from tests.fakeapi import FakeKubeAPI

H200 = TABLES["H200-141GB"]
GPU = "GPU-m0-mig"


def mig_node(fake: FakeKubeAPI, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    n = node_obj("m0", 1, split=18)
    dev = GPUDevice(uuid=GPU, index=0, model="NVIDIA H200", memory_mib=143771, split=7, mig="H200-141GB",
                    mig_profiles=profiles)
    n["metadata"]["annotations"][ANN_NODE_INVENTORY] = encode_inventory(NodeInventory((dev,), time.time()))
    return dict(fake.create_object("nodes", n))


def create_pod(fake: FakeKubeAPI, name: str, **limits: int) -> dict[str, Any]:
    p = pod_obj(name, limits={f"nvidia.com/{k}": v for k, v in limits.items()})
    p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
    return dict(fake.create_object("pods", p))


async def place_pod(ext: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str | None, str]:
    _, res = await ext.post("/filter", filter_args(pod, nodes))
    if not res["NodeNames"]:
        return None, " | ".join({**(res["FailedNodes"] or {}), **(res["FailedAndUnresolvableNodes"] or {})}.values())
    _, b = await ext.post("/bind", bind_args(pod, res["NodeNames"][0]))
    assert b["Error"] == "", b
    return res["NodeNames"][0], ""


def instance_of(fake: FakeKubeAPI, name: str) -> tuple[str, int, int, int]:
    p = fake.get_object("pods", name, "default")
    assert p is not None
    ann = p["metadata"]["annotations"]
    assert ann.get(ANN_ALLOCATION_SIGNATURE)  # signed like every record
    (c,) = decode_allocation(ann[ANN_ALLOCATION]).containers
    (d,) = c.devices
    assert d.uuid == GPU
    return d.profile, d.start, d.memory_mib, d.cores


def test_profile_choice_packing_and_the_too_big_reason(fake: FakeKubeAPI) -> None:
    nodes = [mig_node(fake)]

    async def go() -> None:
        async with api_extender(fake) as ext:
            await wait_until(lambda: "m0" in ext.svc.cache.state.nodes)
            assert (await place_pod(ext, create_pod(fake, "small", gpu=1, gpumem=10000), nodes))[0] == "m0"
            assert instance_of(fake, "small") == ("1g.18gb", 6, 18432, 14)
            # the second pod packs next to the first by mig.place's fragmentation rule
            assert (await place_pod(ext, create_pod(fake, "next", gpu=1, gpumem=10000), nodes))[0] == "m0"
            want = place(10000, H200, [Instance("1g.18gb", 6)])
            assert instance_of(fake, "next") == ("1g.18gb", want.start, 18432, 14) and want.start == 4
            # percent of the card's memory: 40% of 143771 MiB needs a 3g.71gb (placed at 0: 4-7 are taken in part)
            assert (await place_pod(ext, create_pod(fake, "third", gpu=1, **{"gpumem-percentage": 40}), nodes))[0]
            assert instance_of(fake, "third") == ("3g.71gb", 0, 72704, 42)
            node, why = await place_pod(ext, create_pod(fake, "huge", gpu=1, gpumem=150000), nodes)
            assert node is None
            assert why == ("no allowed MIG profile holds the request: container c needs 150000 MiB; the largest "
                           "allowed MIG profile of H200-141GB has 144384 MiB")
            node, why = await place_pod(ext, create_pod(fake, "nofit", gpu=1, gpumem=30000), nodes)
            assert node is None and why.startswith("no free MIG placement: container c needs 30000 MiB (MIG profile "
                                                   "1g.35gb or a larger allowed one)"), why
            booked = sorted(ext.svc.cache.state.nodes["m0"].mig_used[0])
            assert booked == [("1g.18gb", 4), ("1g.18gb", 6), ("3g.71gb", 0)]
    run(go)


def test_allowlist_from_the_inventory_bounds_the_profiles(fake: FakeKubeAPI) -> None:
    nodes = [mig_node(fake, ("1g.18gb", "3g.71gb"))]

    async def go() -> None:
        async with api_extender(fake) as ext:
            await wait_until(lambda: "m0" in ext.svc.cache.state.nodes)
            # 30000 MiB: 1g.35gb / 2g.35gb are not allowed, the next allowed profile holding it is 3g.71gb
            assert (await place_pod(ext, create_pod(fake, "mid", gpu=1, gpumem=30000), nodes))[0] == "m0"
            assert instance_of(fake, "mid")[:2] == ("3g.71gb", 4)
            node, why = await place_pod(ext, create_pod(fake, "big", gpu=1, gpumem=80000), nodes)
            assert node is None and why.endswith("the largest allowed MIG profile of H200-141GB has 72704 MiB"), why
    run(go)


def test_a_record_edited_to_a_bigger_profile_is_not_booked(fake: FakeKubeAPI) -> None:
    """A tenant rewrites its bound pod's record to claim the whole GPU: the signature no longer
    matches, so the extender books what it signed, not the claim (the device plugin refuses the
    container too: tests/deviceplugin/test_dp_mig_dynamic.py)."""
    nodes = [mig_node(fake)]

    async def go() -> None:
        async with api_extender(fake) as ext:
            await wait_until(lambda: "m0" in ext.svc.cache.state.nodes)
            assert (await place_pod(ext, create_pod(fake, "small", gpu=1, gpumem=10000), nodes))[0] == "m0"
            await wait_until(lambda: sorted(ext.svc.cache.state.nodes["m0"].mig_used[0]) == [("1g.18gb", 6)])
            p = fake.get_object("pods", "small", "default")
            assert p is not None
            rec = json.loads(p["metadata"]["annotations"][ANN_ALLOCATION])
            rec["containers"][0]["devices"][0].update({"mig": "7g.141gb", "start": 0, "mem": 144384, "cores": 100})
            assert decode_allocation(json.dumps(rec))  # well-formed, just not what was signed
            fake.patch_object("pods", "small", {"metadata": {"annotations": {
                ANN_ALLOCATION: encode_allocation(decode_allocation(json.dumps(rec)))}}}, "default")
            # the edit is seen and refused: the GPU never holds the claimed 7g.141gb
            rejected = ext.svc.metrics.records_rejected.labels(reason="mismatch")
            await wait_until(lambda: rejected._value.get() >= 1)
            assert sorted(ext.svc.cache.state.nodes["m0"].mig_used[0]) == [("1g.18gb", 6)]
            kept = ext.svc.cache.state.bookings["default/small"].allocation.containers[0].devices[0]
            assert (kept.profile, kept.start, kept.memory_mib) == ("1g.18gb", 6, 18432)
            # another pod still gets an instance: the claim blocks nothing
            assert (await place_pod(ext, create_pod(fake, "other", gpu=1, gpumem=10000), nodes))[0] == "m0"
    run(go)


def test_a_memory_quota_counts_the_instance_not_the_request(fake: FakeKubeAPI) -> None:
    """A 10000 MiB request is served by an 18432 MiB instance: the namespace's quota is charged what
    the container gets, so a second one goes over a 30000 MiB quota (two requests would fit)."""
    nodes = [mig_node(fake)]
    fake.create_object("resourcequotas", quota_obj({"limits.nvidia.com/gpumem": "30000"}, "gpu", "default"),
                       namespace="default")

    async def go() -> None:
        async with api_extender(fake) as ext:
            await wait_until(lambda: "m0" in ext.svc.cache.state.nodes and ext.svc.cache.quotas.limits("default"))
            assert (await place_pod(ext, create_pod(fake, "one", gpu=1, gpumem=10000), nodes))[0] == "m0"
            assert ext.svc.cache.namespace_usage("default").mib == 18432
            node, why = await place_pod(ext, create_pod(fake, "two", gpu=1, gpumem=10000), nodes)
            assert node is None
            assert why == ("GPU quota exceeded: namespace default, ResourceQuota gpu: limits.nvidia.com/gpumem "
                           "used 18432 + asked 18432 > hard 30000"), why
    run(go)


def test_a_tenant_cannot_pick_its_profile(fake: FakeKubeAPI) -> None:
    """What a tenant can write does not choose the instance: a forged record written before bind
    (claiming the whole GPU) is replaced by the extender's signed one, and asking for all the
    compute does not buy a bigger profile (memory alone chooses it)."""
    nodes = [mig_node(fake)]
    forged = PodAllocation("m0", (ContainerAllocation("c", False, (
        DeviceBooking(GPU, 144384, 100, "7g.141gb", 0),)),), 1.0)
    p = pod_obj("forger", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10000, "nvidia.com/gpucores": 100},
                annotations={ANN_ALLOCATION: encode_allocation(forged)})
    p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
    pod = dict(fake.create_object("pods", p))

    async def go() -> None:
        async with api_extender(fake) as ext:
            await wait_until(lambda: "m0" in ext.svc.cache.state.nodes)
            assert ext.svc.cache.state.nodes["m0"].mig_used[0] == []  # the forged claim books nothing
            assert (await place_pod(ext, pod, nodes))[0] == "m0"
            assert instance_of(fake, "forger") == ("1g.18gb", 6, 18432, 14)
            assert ext.svc.cache.state.nodes["m0"].mig_used[0] == [("1g.18gb", 6)]
    run(go)
