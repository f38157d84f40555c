"""The DRA kubelet plugin (deviceplugin/dra) against a fake kubelet over the real gRPC protocols
(plugin registration + k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin on unix sockets) and the fake API
server serving ResourceClaims allocated with consumed capacity, as the v1 API shapes them."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.dra.checkpoint import Checkpoint, CheckpointError
from deviceplugin.dra_publish import SlicePublisher
from kube_vgpu import envcontract
from kube_vgpu.dra import DRIVER_NAME
from tests.dra.dra_node_helpers import NODE, NS, Node, make_root, remove_root, result, running_node
from tests.fakeapi import FakeKubeAPI


@pytest.fixture
def node() -> Iterator[Node]:
    with running_node(check_api_errors=True) as n:
        yield n


def prep(n: Node, *claims: dict) -> dict:
    assert n.kubelet is not None
    resp = n.kubelet.prepare(DRIVER_NAME, [(NS, c["metadata"]["uid"], c["metadata"]["name"]) for c in claims])
    return {uid: r for uid, r in resp.claims.items()}


def test_registration_handshake(node: Node) -> None:
    assert node.kubelet is not None and node.server is not None and node.plugin is not None
    reg = node.kubelet.plugins[DRIVER_NAME]
    assert reg.service == "v1.DRAPlugin"
    assert reg.endpoint == os.path.join(node.opts.plugin_dir, "dra.sock") and os.path.exists(reg.endpoint)
    assert reg.socket == os.path.join(node.opts.registry_dir, f"{DRIVER_NAME}-reg.sock")
    assert node.server.registration.notified.wait(5)
    assert node.plugin.status.registered and node.plugin.status.registration_error == ""
    assert node.kubelet.refused == []


def test_kubelet_re_registers_a_vanished_registration_socket(node: Node) -> None:
    assert node.kubelet is not None and node.server is not None
    node.kubelet.restart()
    os.unlink(node.server.registration_socket)  # e.g. the registry directory cleaned on a node reboot
    node.kubelet.wait_registered(DRIVER_NAME)
    assert os.path.exists(node.server.registration_socket)


def test_prepare_writes_cdi_spec_and_limits_from_consumed_capacity(node: Node) -> None:
    c = node.claim("c1", [result("gpu-1", "3000Mi", "30")])
    uid = c["metadata"]["uid"]
    r = prep(node, c)[uid]
    assert r.error == ""
    [d] = r.devices
    assert (list(d.request_names), d.pool_name, d.device_name) == (["gpu"], NODE, "gpu-1")
    assert list(d.cdi_device_ids) == [f"kube-vgpu.io/vgpu={uid}-gpu-1"]
    assert d.share_id == c["status"]["allocation"]["devices"]["results"][0]["shareID"]
    gpu = node.gpu_uuid(1)
    limits = node.limits(uid)
    assert limits is not None
    assert (limits["devices"], limits["uuid_0"], limits["memory_mib_0"], limits["cores_0"]) == ("1", gpu, "3000", "30")
    assert limits["shared_cache"] == envcontract.CACHE_CONTAINER_PATH and limits["disable_control"] == "false"
    spec = node.cdi_spec(uid)
    assert spec is not None
    assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "kube-vgpu.io/vgpu")
    root = node.root
    assert spec["devices"] == [{"name": f"{uid}-gpu-1", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia1", "hostPath": f"{root}/dev/nvidia1"},
        {"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl"},
        {"path": "/dev/nvidia-uvm", "hostPath": f"{root}/dev/nvidia-uvm"}]}}]
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env == {"NVIDIA_VISIBLE_DEVICES": gpu, "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m", "CUDA_DEVICE_SM_LIMIT": "30",
                   "CUDA_DEVICE_MEMORY_SHARED_CACHE": envcontract.CACHE_CONTAINER_PATH}
    mounts = {m["containerPath"]: (m["hostPath"], m["options"][0]) for m in spec["containerEdits"]["mounts"]}
    assert mounts == {
        envcontract.SHIM_CONTAINER_PATH: (f"{root}/shim/libvgpu.so", "ro"),
        envcontract.PRELOAD_CONTAINER_PATH: (f"{root}/shim/ld.so.preload", "ro"),
        envcontract.CACHE_CONTAINER_DIR: (f"{root}/cache/dra-{uid}", "rw"),
        envcontract.LIMITS_CONTAINER_DIR: (f"{root}/cache/dra-{uid}.limits", "ro"),
    }
    assert Path(f"{root}/shim/ld.so.preload").read_text() == envcontract.SHIM_CONTAINER_PATH + "\n"
    assert oct(os.stat(f"{root}/cache/dra-{uid}").st_mode & 0o777) == "0o777"
    assert oct(os.stat(f"{root}/cache/dra-{uid}.limits").st_mode & 0o777) == "0o755"


def test_two_claims_share_one_gpu_each_with_its_own_limit(node: Node) -> None:
    a = node.claim("a", [result("gpu-0", "3000Mi", "30")])
    b = node.claim("b", [result("gpu-0", "8Gi", "50")])
    got = prep(node, a, b)
    assert all(r.error == "" for r in got.values())
    la, lb = node.limits(a["metadata"]["uid"]), node.limits(b["metadata"]["uid"])
    assert la is not None and lb is not None
    assert (la["memory_mib_0"], la["cores_0"]) == ("3000", "30")
    assert (lb["memory_mib_0"], lb["cores_0"]) == ("8192", "50")
    assert la["uuid_0"] == lb["uuid_0"] == node.gpu_uuid(0)


def test_whole_device_without_consumed_capacity_gets_the_whole_gpu(node: Node) -> None:
    c = node.claim("whole", [result("gpu-0", None, None, share=False)])
    r = prep(node, c)[c["metadata"]["uid"]]
    assert r.error == "" and not r.devices[0].HasField("share_id")
    lim = node.limits(c["metadata"]["uid"])
    assert lim is not None and (lim["memory_mib_0"], lim["cores_0"]) == ("24576", "100")


def test_a_claim_over_two_gpus_and_two_shares_of_one(node: Node) -> None:
    c = node.claim("multi", [result("gpu-0", "1Gi", "10", request="a"), result("gpu-1", "2Gi", "20", request="b"),
                             result("gpu-0", "1Gi", "15", request="c")])
    uid = c["metadata"]["uid"]
    r = prep(node, c)[uid]
    assert r.error == ""
    assert [(list(d.request_names), d.device_name) for d in r.devices] == [(["a"], "gpu-0"), (["b"], "gpu-1"),
                                                                          (["c"], "gpu-0")]
    lim = node.limits(uid)
    assert lim is not None
    assert (lim["devices"], lim["uuid_0"], lim["memory_mib_0"], lim["cores_0"]) == ("2", node.gpu_uuid(0), "2048", "25")
    assert (lim["uuid_1"], lim["memory_mib_1"], lim["cores_1"]) == (node.gpu_uuid(1), "2048", "20")
    spec = node.cdi_spec(uid)
    assert spec is not None and [d["name"] for d in spec["devices"]] == [f"{uid}-gpu-0", f"{uid}-gpu-1"]


def test_a_claim_named_twice_in_one_call_is_answered_once(node: Node) -> None:
    c = node.claim("c1", [result("gpu-0", "1Gi", "10")])
    uid = c["metadata"]["uid"]
    assert node.kubelet is not None
    resp = node.kubelet.prepare(DRIVER_NAME, [(NS, uid, "c1"), (NS, uid, "c1")])
    assert resp.claims[uid].error == "" and len(resp.claims[uid].devices) == 1


def test_slices_deleted_by_someone_else_are_put_back() -> None:
    api = FakeKubeAPI(auto_create_namespaces=True)
    api.start()
    root = make_root()
    n = Node(api=api, root=root, resync_seconds=0.2)
    try:
        api.create_object("nodes", {"metadata": {"name": NODE}})
        pub = _Observed(SlicePublisher(api.api_client(), NODE))
        n.start_plugin(publisher=pub)
        assert pub.published.wait(10)
        for s in api.objects("resourceslices"):
            api.delete_object("resourceslices", s["metadata"]["name"])
        for _ in range(3):  # a publish that listed before the deletion may finish first; the next one restores
            pub.published.clear()
            assert pub.published.wait(10)
            if api.objects("resourceslices"):
                break
        assert api.objects("resourceslices")
    finally:
        n.stop_plugin()
        api.stop()
        remove_root(root)


def test_subrequest_answers_the_base_request_name(node: Node) -> None:
    c = node.claim("sub", [result("gpu-0", "1Gi", "10", request="gpu/small")])
    r = prep(node, c)[c["metadata"]["uid"]]
    assert r.error == "" and list(r.devices[0].request_names) == ["gpu"]


def test_prepare_is_idempotent(node: Node) -> None:
    c = node.claim("c1", [result("gpu-0", "3000Mi", "30")])
    uid = c["metadata"]["uid"]
    first = prep(node, c)[uid]
    spec = node.cdi_spec(uid)
    os.unlink(os.path.join(node.opts.cdi_dir, f"kube-vgpu.io-vgpu_{uid}.json"))  # lost: rewritten
    second = prep(node, c)[uid]
    assert second == first and node.cdi_spec(uid) == spec
    assert list(node.checkpoint()["claims"]) == [uid]
    node.api.fail_next("get", "resourceclaims", status=503, count=1)  # API down: the checkpoint answers
    assert prep(node, c)[uid] == first


def test_claim_of_another_driver_is_ignored(node: Node) -> None:
    other = node.claim("other", [result("gpu-0", driver="gpu.nvidia.com", pool=NODE)])
    mixed = node.claim("mixed", [result("gpu-9", driver="gpu.nvidia.com"), result("gpu-1", "1Gi", "5")])
    got = prep(node, other, mixed)
    o, m = got[other["metadata"]["uid"]], got[mixed["metadata"]["uid"]]
    assert o.error == "" and list(o.devices) == [] and node.cdi_spec(other["metadata"]["uid"]) is None
    assert m.error == "" and [d.device_name for d in m.devices] == ["gpu-1"]


def test_restart_then_unprepare(node: Node) -> None:
    c = node.claim("c1", [result("gpu-0", "3000Mi", "30")])
    uid = c["metadata"]["uid"]
    first = prep(node, c)[uid]
    node.stop_plugin()
    assert node.kubelet is not None
    node.kubelet.restart()
    node.api.delete_object("resourceclaims", "c1", NS)  # the API cannot be asked again: the checkpoint answers
    node.start_plugin()
    node.kubelet.wait_registered(DRIVER_NAME)
    assert prep(node, c)[uid] == first
    resp = node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1")])
    assert resp.claims[uid].error == ""
    assert node.cdi_spec(uid) is None and node.limits(uid) is None
    assert not os.path.exists(os.path.join(node.opts.cache_host_dir, f"dra-{uid}"))
    assert node.checkpoint()["claims"] == {}
    # unprepare again, and of a claim never prepared: success
    again = node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1"), (NS, "0d6f6a9e-3c3b-4c1e-9a55-8f0e2b7d1a01", "x")])
    assert all(r.error == "" for r in again.claims.values())


def test_unprepare_cleans_up_after_a_lost_checkpoint(node: Node) -> None:
    c = node.claim("c1", [result("gpu-0", "3000Mi", "30")])
    uid = c["metadata"]["uid"]
    prep(node, c)
    node.stop_plugin()
    os.unlink(os.path.join(node.opts.plugin_dir, "checkpoint.json"))
    node.start_plugin()
    assert node.kubelet is not None
    node.kubelet.restart()
    node.kubelet.wait_registered(DRIVER_NAME)
    assert node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid].error == ""
    assert node.cdi_spec(uid) is None and node.limits(uid) is None


@pytest.mark.parametrize("case,results,reserved,want", [
    ("other-pool", [result(pool="node-2")], True, "not this node's pool"),
    ("unknown-device", [result("gpu-7")], True, "which this node does not publish"),
    ("not-reserved", [result()], False, "not reserved"),
    ("too-much-memory", [result("gpu-0", "30000Mi", "10")], True, "more than its 24576 MiB"),
    ("two-shares-over-memory", [result("gpu-0", "20000Mi", "10"), result("gpu-0", "5000Mi", "10")], True,
     "more than its 24576 MiB"),
    ("malformed", [result("gpu-0", "3000Mi", "0")], True, "consumedCapacity.cores"),
])
def test_claims_the_node_cannot_serve_get_a_per_claim_error(node: Node, case: str, results: list, reserved: bool,
                                                             want: str) -> None:
    bad = node.claim(case, results, reserved=reserved)
    good = node.claim("good", [result()])
    got = prep(node, bad, good)
    assert want in got[bad["metadata"]["uid"]].error and not got[bad["metadata"]["uid"]].devices
    assert got[good["metadata"]["uid"]].error == ""  # one claim's trouble does not fail the others
    assert node.cdi_spec(bad["metadata"]["uid"]) is None and node.limits(bad["metadata"]["uid"]) is None
    assert bad["metadata"]["uid"] not in node.checkpoint()["claims"]


def test_a_checkpoint_that_cannot_be_written_fails_the_claim_and_leaves_no_files(node: Node) -> None:
    assert node.plugin is not None
    cp = node.plugin.checkpoint

    def disk_full() -> None:
        raise OSError(28, "No space left on device")
    cp.save = disk_full  # type: ignore[method-assign]
    c = node.claim("c1", [result()])
    uid = c["metadata"]["uid"]
    r = prep(node, c)[uid]
    assert "No space left on device" in r.error and not r.devices
    assert node.cdi_spec(uid) is None and node.limits(uid) is None and uid not in cp.claims
    assert not os.path.exists(os.path.join(node.opts.cache_host_dir, f"dra-{uid}"))
    del cp.save  # the disk has room again: kubelet's retry prepares it
    assert prep(node, c)[uid].error == "" and uid in node.checkpoint()["claims"]


def test_missing_claim_and_api_errors_are_per_claim_errors(node: Node) -> None:
    assert node.kubelet is not None
    uid = "11111111-2222-4333-8444-555555555555"
    r = node.kubelet.prepare(DRIVER_NAME, [(NS, uid, "nope")]).claims[uid]
    assert "not found" in r.error
    c = node.claim("c1", [result()])
    node.api.fail_next("get", "resourceclaims", status=503, count=1)
    r = prep(node, c)[c["metadata"]["uid"]]
    assert "cannot be read from the API server" in r.error and "503" in r.error
    assert prep(node, c)[c["metadata"]["uid"]].error == ""  # kubelet's retry succeeds


def test_checkpoint_survives_and_refuses_garbage(tmp_path: Path) -> None:
    cp = Checkpoint(str(tmp_path), NODE)
    cp.load()
    assert cp.claims == {}
    (tmp_path / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        cp.load()
    (tmp_path / "checkpoint.json").write_text(json.dumps({"version": 1, "node": "other", "claims": {}}))
    with pytest.raises(CheckpointError, match="node="):
        cp.load()
    (tmp_path / "checkpoint.json").write_text(json.dumps({"version": 1, "node": NODE, "claims": {"../x": {}}}))
    with pytest.raises(CheckpointError, match="malformed"):
        cp.load()


class _Observed:
    """The real SlicePublisher, with an event set after each publish returns."""

    def __init__(self, inner: SlicePublisher) -> None:
        self.inner = inner
        self.published = threading.Event()

    @property
    def driver_version(self) -> str:
        return self.inner.driver_version

    @driver_version.setter
    def driver_version(self, v: str) -> None:
        self.inner.driver_version = v

    def publish(self, devices):  # type: ignore[no-untyped-def]
        gen = self.inner.publish(devices)
        self.published.set()
        return gen


def test_plugin_publishes_resource_slices_through_the_slice_publisher() -> None:
    api = FakeKubeAPI(auto_create_namespaces=True)
    api.start()
    root = make_root()
    n = Node(api=api, root=root)
    try:
        api.create_object("nodes", {"metadata": {"name": NODE}})
        pub = _Observed(SlicePublisher(api.api_client(), NODE))
        n.start_plugin(publisher=pub)
        assert pub.published.wait(10), "the plugin never published"
        slices = api.objects("resourceslices")
        assert slices and slices[0]["spec"]["driver"] == DRIVER_NAME and slices[0]["spec"]["pool"]["name"] == NODE
        names = sorted(d["name"] for s in slices for d in s["spec"]["devices"])
        assert names == ["gpu-0", "gpu-1"]
        assert n.plugin is not None and n.plugin.status.last_publish_error == ""
    finally:
        n.stop_plugin()
        api.stop()
        remove_root(root)
