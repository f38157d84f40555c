"""deviceplugin.dra_publish.SlicePublisher against the fake API server (real HTTP, official client)."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest

from deviceplugin.dra_publish import PublishError, SlicePublisher
from kube_vgpu.dra import DRIVER_NAME, TAINT_UNHEALTHY
from kube_vgpu.model import GPUDevice

RS = "resourceslices.resource.k8s.io"


def gpu(i: int, mem: int = 24576, healthy: bool = True) -> GPUDevice:
    return GPUDevice(uuid=f"GPU-{i:04d}", index=i, model="NVIDIA H200", memory_mib=mem, healthy=healthy)


def node(fake: Any, name: str = "n1") -> str:
    fake.create_object("nodes", {"metadata": {"name": name}})
    return str(fake.get_object("nodes", name)["metadata"]["uid"])


def slices(fake: Any) -> list[dict[str, Any]]:
    return sorted(fake.objects(RS), key=lambda s: s["metadata"]["name"])


def writes(fake: Any) -> list[tuple[str, str]]:
    return [(m, p) for m, p in fake.requests if "resourceslices" in p and m in ("POST", "PUT", "PATCH", "DELETE")]


def wait_until(pred: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_publish_creates_owned_slice_then_is_idempotent(fake_kube_api: Any, fake_kube_client: Any) -> None:
    uid = node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1", driver_version="550.54.15")
    assert pub.publish([gpu(0), gpu(1)]) == 1
    [s] = slices(fake_kube_api)
    assert s["spec"]["driver"] == DRIVER_NAME and s["spec"]["nodeName"] == "n1"
    assert s["spec"]["pool"] == {"name": "n1", "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert s["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": uid, "controller": True}]
    fake_kube_api.clear_requests()
    # same devices, new publisher (a restart): nothing written, generation kept
    assert SlicePublisher(fake_kube_client, "n1", driver_version="550.54.15").publish([gpu(1), gpu(0)]) == 1
    assert writes(fake_kube_api) == []
    assert fake_kube_api.errors == []


def test_change_bumps_generation_and_replaces(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(0), gpu(1)])
    rv = slices(fake_kube_api)[0]["metadata"]["resourceVersion"]
    assert pub.publish([gpu(0), gpu(1, mem=12288)]) == 2
    [s] = slices(fake_kube_api)
    assert s["metadata"]["resourceVersion"] != rv and s["spec"]["pool"]["generation"] == 2
    assert s["spec"]["devices"][1]["capacity"]["memory"]["value"] == "12288Mi"


def test_unhealthy_gpu_is_tainted(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(0), gpu(1, healthy=False)])
    devs = slices(fake_kube_api)[0]["spec"]["devices"]
    assert devs[1]["taints"] == [{"key": TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
    assert pub.device_taints is True and pub.consumable_capacity is True
    assert pub.publish([gpu(0), gpu(1)]) == 2  # healthy again: taint gone
    assert "taints" not in slices(fake_kube_api)[0]["spec"]["devices"][1]


class _DropTaints:
    """The custom-objects API of a server whose DRADeviceTaints gate is off: it stores (and
    answers) slices without device taints, without an error, as kube-apiserver drops disabled fields."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @staticmethod
    def _strip(body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        for d in body.get("spec", {}).get("devices") or ():
            d.pop("taints", None)
        return body

    def create_cluster_custom_object(self, g: str, v: str, p: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.inner.create_cluster_custom_object(g, v, p, self._strip(body), **kw)

    def replace_cluster_custom_object(self, g: str, v: str, p: str, n: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.inner.replace_cluster_custom_object(g, v, p, n, self._strip(body), **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_taints_dropped_by_server_fall_back_to_removal(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub._custom = _DropTaints(pub._custom)
    gen = pub.publish([gpu(0), gpu(1, healthy=False)])
    assert pub.device_taints is False
    [s] = slices(fake_kube_api)
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0"]  # the sick GPU is not offered at all
    assert s["spec"]["pool"]["generation"] == gen == 2


def test_forced_removal_mode(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    SlicePublisher(fake_kube_client, "n1", device_taints=False).publish([gpu(0, healthy=False), gpu(1)])
    assert [d["name"] for d in slices(fake_kube_api)[0]["spec"]["devices"]] == ["gpu-1"]


def test_no_node_is_an_error_naming_it(fake_kube_api: Any, fake_kube_client: Any) -> None:
    with pytest.raises(PublishError, match="node 'ghost' not found"):
        SlicePublisher(fake_kube_client, "ghost").publish([gpu(0)])
    assert slices(fake_kube_api) == []


def test_pool_shrinks_extra_slices_deleted_after_write(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(i) for i in range(70)])
    assert [len(s["spec"]["devices"]) for s in slices(fake_kube_api)] == [64, 6]
    fake_kube_api.clear_requests()
    assert pub.publish([gpu(0), gpu(1)]) == 2
    [s] = slices(fake_kube_api)
    assert s["spec"]["pool"] == {"name": "n1", "generation": 2, "resourceSliceCount": 1}
    assert [m for m, _ in writes(fake_kube_api)] == ["PUT", "DELETE"]  # new generation first, then the leftover


def test_conflict_rereads_and_retries(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(0)])
    fake_kube_api.fail_next("update", "resourceslices", status=409, count=1)
    assert pub.publish([gpu(0, mem=1000)]) == 2
    assert slices(fake_kube_api)[0]["spec"]["devices"][0]["capacity"]["memory"]["value"] == "1000Mi"


def test_endless_conflicts_give_up_with_error(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(0)])
    fake_kube_api.fail_next("update", "resourceslices", status=409, count=None)
    with pytest.raises(PublishError, match="kept changing"):
        pub.publish([gpu(0, mem=1000)])


def test_unknown_outcome_then_republish_writes_nothing_twice(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    fake_kube_api.fail_after_commit("create", "resourceslices", 504)
    with pytest.raises(Exception):  # noqa: B017 - the client's error for a 504
        pub.publish([gpu(0)])
    assert len(slices(fake_kube_api)) == 1  # committed although unanswered
    fake_kube_api.clear_requests()
    assert pub.publish([gpu(0)]) == 1
    assert writes(fake_kube_api) == []


def test_other_nodes_and_drivers_untouched(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api, "n1")
    node(fake_kube_api, "n2")
    other = {"metadata": {"name": "n1-other"}, "spec": {"driver": "gpu.example.com", "nodeName": "n1",
                                                         "pool": {"name": "n1", "generation": 1,
                                                                  "resourceSliceCount": 1}, "devices": []}}
    fake_kube_api.create_object(RS, other)
    SlicePublisher(fake_kube_client, "n2").publish([gpu(0)])
    p1 = SlicePublisher(fake_kube_client, "n1")
    p1.publish([gpu(0)])
    assert p1.remove() == 1
    assert p1.remove() == 0
    names = [s["metadata"]["name"] for s in slices(fake_kube_api)]
    assert names == ["n1-other", f"n2-{DRIVER_NAME}-0"]


def test_recreated_node_gets_new_owner(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    pub.publish([gpu(0)])
    fake_kube_api.delete_object("nodes", "n1")  # no garbage collector in the fake: the slice stays
    uid2 = node(fake_kube_api)
    assert pub.publish([gpu(0)]) == 2
    assert slices(fake_kube_api)[0]["metadata"]["ownerReferences"][0]["uid"] == uid2


def test_run_publishes_on_wake_and_stops(fake_kube_api: Any, fake_kube_client: Any) -> None:
    node(fake_kube_api)
    pub = SlicePublisher(fake_kube_client, "n1")
    devs = [gpu(0)]
    stop, wake = threading.Event(), threading.Event()
    t = threading.Thread(target=pub.run, args=(lambda: list(devs), stop, wake), kwargs={"period": 3600}, daemon=True)
    t.start()
    try:
        wait_until(lambda: len(slices(fake_kube_api)) == 1, "the first publish")
        devs.append(gpu(1, healthy=False))
        wake.set()
        wait_until(lambda: len(slices(fake_kube_api)[0]["spec"]["devices"]) == 2, "the republish after wake")
    finally:
        stop.set()
        wake.set()
        t.join(10)
    assert not t.is_alive()
    assert fake_kube_api.errors == []
