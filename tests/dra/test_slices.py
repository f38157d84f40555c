"""kube_vgpu.dra.slices: the ResourceSlice builder (resource.k8s.io/v1 field names and limits)."""

from __future__ import annotations

import copy

import pytest

from kube_vgpu.dra import DRIVER_NAME, TAINT_UNHEALTHY, device_name
from kube_vgpu.dra.slices import (
    MAX_DEVICES_PER_SLICE,
    capacity_dropped,
    driver_version_attribute,
    resource_slice,
    resource_slices,
    same_content,
    slice_name,
    taints_dropped,
)
from kube_vgpu.model import GPUDevice


def gpu(i: int, mem: int = 24576, healthy: bool = True, cores: int = 100, numa: int = 0) -> GPUDevice:
    return GPUDevice(uuid=f"GPU-{i:04d}", index=i, model="NVIDIA H200", memory_mib=mem, healthy=healthy,
                     cores=cores, numa=numa)


def test_one_device_per_gpu_with_v1_fields() -> None:
    s = resource_slice("node-a", [gpu(1, numa=1), gpu(0)], pool_generation=3, driver_version="550.54.15")
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    assert s["metadata"]["name"] == f"node-a-{DRIVER_NAME}-0"
    spec = s["spec"]
    assert spec["driver"] == DRIVER_NAME and spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    d1 = spec["devices"][1]
    assert d1["attributes"] == {"uuid": {"string": "GPU-0001"}, "model": {"string": "NVIDIA H200"},
                                "index": {"int": 1}, "numa": {"int": 1}, "memoryMiB": {"int": 24576},
                                "driverVersion": {"version": "550.54.15"}}
    assert d1["allowMultipleAllocations"] is True
    assert d1["capacity"]["memory"] == {"value": "24576Mi", "requestPolicy": {
        "default": "24576Mi", "validRange": {"min": "1Mi", "max": "24576Mi", "step": "1Mi"}}}
    assert d1["capacity"]["cores"] == {"value": "100", "requestPolicy": {
        "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}}
    assert "taints" not in d1


def test_scaled_cores_cap_the_request_range() -> None:
    d = resource_slice("n", [gpu(0, cores=50)], pool_generation=0)["spec"]["devices"][0]["capacity"]["cores"]
    assert d["value"] == "50" and d["requestPolicy"]["default"] == "50"
    assert d["requestPolicy"]["validRange"]["max"] == "50"
    d = resource_slice("n", [gpu(0, cores=200)], pool_generation=0)["spec"]["devices"][0]["capacity"]["cores"]
    assert d["value"] == "200" and d["requestPolicy"]["validRange"]["max"] == "100"


def test_unhealthy_gpu_tainted_or_left_out() -> None:
    devs = [gpu(0), gpu(1, healthy=False)]
    tainted = resource_slice("n", devs, pool_generation=1)["spec"]["devices"]
    assert [d["name"] for d in tainted] == ["gpu-0", "gpu-1"]
    assert tainted[1]["taints"] == [{"key": TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
    removed = resource_slice("n", devs, pool_generation=1, taint_unhealthy=False)["spec"]["devices"]
    assert [d["name"] for d in removed] == ["gpu-0"]


def test_empty_node_has_one_empty_slice() -> None:
    s = resource_slices("n", [], pool_generation=0)
    assert len(s) == 1 and s[0]["spec"]["devices"] == [] and s[0]["spec"]["pool"]["resourceSliceCount"] == 1


def test_many_gpus_split_across_slices_of_one_pool() -> None:
    devs = [gpu(i) for i in range(MAX_DEVICES_PER_SLICE + 3)]
    s = resource_slices("n", devs, pool_generation=7)
    assert [len(x["spec"]["devices"]) for x in s] == [MAX_DEVICES_PER_SLICE, 3]
    assert {x["spec"]["pool"]["resourceSliceCount"] for x in s} == {2}
    assert [x["metadata"]["name"] for x in s] == [slice_name("n", 0), slice_name("n", 1)]
    with pytest.raises(ValueError, match="need 2 ResourceSlices"):
        resource_slice("n", devs, pool_generation=7)


def test_owner_reference_on_every_slice() -> None:
    owner = {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "u-1", "controller": True}
    s = resource_slice("n", [gpu(0)], pool_generation=0, owner=owner)
    assert s["metadata"]["ownerReferences"] == [owner]


@pytest.mark.parametrize(("text", "want"), [
    ("550.54.15", {"version": "550.54.15"}),
    ("535.104.05", {"version": "535.104.5"}),
    ("560.28", {"string": "560.28"}),
    ("unknown", {"string": "unknown"}),
])
def test_driver_version_attribute(text: str, want: dict[str, str]) -> None:
    assert driver_version_attribute(text) == want


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"node": "Node_A"}, "node name: 'Node_A' is not a DNS subdomain"),
    ({"node": ""}, "node name"),
    ({"pool_generation": -1}, "pool generation: -1 is negative"),
    ({"devices": [gpu(0), gpu(0)]}, "GPU index 0 appears twice"),
    ({"devices": [gpu(0), GPUDevice(uuid="GPU-0000", index=1, model="m", memory_mib=2)]}, "uuid GPU-0000 appears twice"),
    ({"devices": [gpu(0, mem=1)]}, r"GPU 0 \(GPU-0000\): memory_mib 1 must be at least 2 MiB"),
    ({"devices": [gpu(0, cores=1)]}, r"cores 1 must be at least 2 percent"),
    ({"devices": [GPUDevice(uuid="GPU-1", index=0, model="x" * 65, memory_mib=2)]}, "model 'x+' must be 1-64"),
    ({"driver_version": "9" * 65}, "driverVersion"),
])
def test_bad_input_names_the_field(kwargs: dict, match: str) -> None:
    args = {"node": "n", "devices": [gpu(0)], "pool_generation": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        resource_slices(args.pop("node"), args.pop("devices"), **args)


def test_device_name_refuses_negative_index() -> None:
    assert device_name(3) == "gpu-3"
    with pytest.raises(ValueError, match="GPU index: -1 is negative"):
        device_name(-1)


def test_long_node_name_gives_valid_unique_names() -> None:
    a, b = "a" * 250, "a" * 249 + "b"
    na, nb = slice_name(a), slice_name(b)
    assert len(na) <= 253 and len(nb) <= 253 and na != nb
    assert na.endswith(f"-{DRIVER_NAME}-0")


def test_same_content_ignores_generation_canonical_quantities_and_time_added() -> None:
    want = resource_slice("n", [gpu(0, mem=1024), gpu(1, healthy=False)], pool_generation=1)
    got = copy.deepcopy(want)
    got["spec"]["pool"]["generation"] = 9
    mem = got["spec"]["devices"][0]["capacity"]["memory"]
    mem["value"] = mem["requestPolicy"]["default"] = "1Gi"  # the server's canonical spelling
    got["spec"]["devices"][1]["taints"][0]["timeAdded"] = "2026-12-01T00:00:00Z"
    got["metadata"].update(uid="x", resourceVersion="5", generation=2)
    assert same_content(got, want)
    got["spec"]["devices"][0]["capacity"]["cores"]["value"] = "99"
    assert not same_content(got, want)


def test_same_content_sees_owner_change() -> None:
    a = resource_slice("n", [gpu(0)], pool_generation=1,
                       owner={"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "old"})
    b = resource_slice("n", [gpu(0)], pool_generation=1,
                       owner={"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "new"})
    assert not same_content(a, b)


def test_dropped_fields_detected() -> None:
    want = resource_slice("n", [gpu(0), gpu(1, healthy=False)], pool_generation=1)
    got = copy.deepcopy(want)
    assert not taints_dropped(got, want) and not capacity_dropped(got)
    for d in got["spec"]["devices"]:
        d.pop("taints", None)
        d.pop("allowMultipleAllocations")
    assert taints_dropped(got, want) and capacity_dropped(got)


def test_slices_validate_against_the_1_36_schema() -> None:
    """Field names and types as kube-apiserver 1.36 serves them (offline; the e2e suite creates them)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    owner = {"apiVersion": "v1", "kind": "Node", "name": "n", "uid": "u-1", "controller": True}
    for s in resource_slices("n", [gpu(i, healthy=i != 1) for i in range(70)], pool_generation=2,
                             driver_version="550.54.15", owner=owner):
        kubernetes_validate.validate(s, "1.36.0", strict=True)
    bad = resource_slice("n", [gpu(0)], pool_generation=1)
    bad["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRnage"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.36.0", strict=True)
