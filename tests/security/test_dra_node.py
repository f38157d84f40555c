"""Attacks on the DRA kubelet plugin (deviceplugin/dra), played through the fake kubelet over the real
gRPC protocol and the fake API server. The tenant controls its claims' specs, its pods and whatever
it writes inside its own (read-write) cache directory; claim status is written by the control plane."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_vgpu.dra import DRIVER_NAME
from tests.dra.dra_node_helpers import NS, Node, result, running_node


@pytest.fixture
def node() -> Iterator[Node]:
    with running_node() as n:
        yield n


def prepare(n: Node, uid: str, name: str) -> tuple[str, list]:
    assert n.kubelet is not None
    r = n.kubelet.prepare(DRIVER_NAME, [(NS, uid, name)]).claims[uid]
    return r.error, list(r.devices)


def test_claim_recreated_under_the_same_name_is_not_prepared(node: Node) -> None:
    """kubelet asks for the claim it admitted (uid A); the tenant deleted it and created a new claim of
    the same name (uid B, another allocation): B's allocation must not be served as A."""
    old = node.claim("c1", [result("gpu-0", "1Gi", "10")])
    node.api.delete_object("resourceclaims", "c1", NS)
    new = node.claim("c1", [result("gpu-0", "20000Mi", "100")])
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    err, devices = prepare(node, old["metadata"]["uid"], "c1")
    assert "has uid" in err and "not the uid kubelet named" in err and devices == []
    assert node.limits(old["metadata"]["uid"]) is None and node.limits(new["metadata"]["uid"]) is None
    assert node.cdi_spec(old["metadata"]["uid"]) is None


def test_admin_access_result_gets_no_unlimited_gpu(node: Node) -> None:
    """An admin-access result consumes no capacity; serving it would give a container the GPU with no
    booked limit. Refused, nothing written."""
    c = node.claim("admin", [result("gpu-0", None, None, share=False, adminAccess=True)])
    uid = c["metadata"]["uid"]
    err, devices = prepare(node, uid, "admin")
    assert "adminAccess" in err and "admin access" in err and devices == []
    assert node.limits(uid) is None and node.cdi_spec(uid) is None


def test_tenant_edit_of_the_claim_spec_does_not_change_the_limit(node: Node) -> None:
    """The claim's spec is the tenant's; only the status the allocator wrote counts."""
    c = node.claim("c1", [result("gpu-0", "3000Mi", "30")], spec_memory="3000Mi")
    node.api.patch_object("resourceclaims", "c1", {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER_NAME, "capacity": {"requests": {"memory": "24Gi", "cores": "100"}}}}]}}},
        namespace=NS, patch_type="merge")
    assert node.api.get_object("resourceclaims", "c1", NS)["spec"]["devices"]["requests"][0]["exactly"][
        "capacity"]["requests"]["memory"] == "24Gi"
    err, _ = prepare(node, c["metadata"]["uid"], "c1")
    lim = node.limits(c["metadata"]["uid"])
    assert err == "" and lim is not None and (lim["memory_mib_0"], lim["cores_0"]) == ("3000", "30")


def test_claim_uid_cannot_steer_files_out_of_their_directories(node: Node) -> None:
    """The uid names the CDI file and the allocation directories: a path in it is refused before any write."""
    for uid in ("../../etc", "a/b", "..", "UPPER", "x" * 80, ""):
        err, devices = prepare(node, uid, "c1")
        assert "claim uid=" in err and devices == []
        assert node.kubelet is not None
        assert "claim uid=" in node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid].error
    assert sorted(os.listdir(node.opts.cache_host_dir)) == []
    assert not os.path.exists(node.opts.cdi_dir) or os.listdir(node.opts.cdi_dir) == []


def test_allocation_in_another_nodes_pool_is_refused(node: Node) -> None:
    """A result naming another node's pool (status from elsewhere, or a pod moved by hand) is not
    turned into a limit on this node's GPU of the same name."""
    c = node.claim("c1", [result("gpu-0", "1Gi", "10", pool="node-2")])
    err, devices = prepare(node, c["metadata"]["uid"], "c1")
    assert "not this node's pool" in err and devices == []


def test_consumed_capacity_beyond_the_gpu_is_refused(node: Node) -> None:
    """Status claiming more memory or compute than the GPU has (several shares summed) is refused,
    not clipped into a limit nobody booked."""
    c = node.claim("big", [result("gpu-0", "16Gi", "60", request="a"), result("gpu-0", "16Gi", "60", request="b")])
    err, _ = prepare(node, c["metadata"]["uid"], "big")
    assert "more than its 24576 MiB" in err
    c = node.claim("hot", [result("gpu-1", "1Gi", "60", request="a"), result("gpu-1", "1Gi", "60", request="b")])
    err, _ = prepare(node, c["metadata"]["uid"], "hot")
    assert "120 cores on gpu-1, more than its 100" in err


def test_unprepare_never_follows_a_tenant_symlink(node: Node, tmp_path: Path) -> None:
    """The cache directory is the tenant's (mounted read-write): a symlink planted there to a host
    directory must not make unprepare delete the host's files."""
    victim = tmp_path / "host-dir"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    c = node.claim("c1", [result()])
    uid = c["metadata"]["uid"]
    assert prepare(node, uid, "c1")[0] == ""
    cache = Path(node.opts.cache_host_dir) / f"dra-{uid}"
    (cache / "escape").symlink_to(victim, target_is_directory=True)
    assert node.kubelet is not None
    assert node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid].error == ""
    assert (victim / "precious").read_text() == "keep" and not cache.exists()


def test_unprepare_of_one_claim_leaves_the_others(node: Node) -> None:
    a, b = node.claim("a", [result()]), node.claim("b", [result()])
    for c in (a, b):
        assert prepare(node, c["metadata"]["uid"], c["metadata"]["name"])[0] == ""
    assert node.kubelet is not None
    node.kubelet.unprepare(DRIVER_NAME, [(NS, a["metadata"]["uid"], "a")])
    assert node.limits(a["metadata"]["uid"]) is None
    assert node.limits(b["metadata"]["uid"]) is not None and node.cdi_spec(b["metadata"]["uid"]) is not None


def test_a_prepared_uid_is_not_served_under_another_claim_name(node: Node) -> None:
    """A repeat prepare answers from the checkpoint only for the same namespace/name as recorded."""
    c = node.claim("c1", [result()])
    uid = c["metadata"]["uid"]
    assert prepare(node, uid, "c1")[0] == ""
    err, devices = prepare(node, uid, "other-name")
    assert "was prepared as" in err and devices == []


def test_a_claim_allocated_anew_is_not_served_its_old_grant(node: Node) -> None:
    """Same claim (same uid) deallocated and allocated again, smaller, while a stale checkpoint entry
    remained (an unprepare that never came): the new allocation is what the container gets."""
    c = node.claim("c1", [result("gpu-0", "20000Mi", "80")])
    uid = c["metadata"]["uid"]
    assert prepare(node, uid, "c1")[0] == ""
    node.api.patch_object("resourceclaims", "c1", {"status": {"allocation": {"devices": {"results": [
        result("gpu-1", "1000Mi", "10")]}}}}, namespace=NS, patch_type="merge", subresource="status")
    err, devices = prepare(node, uid, "c1")
    lim = node.limits(uid)
    assert err == "" and [d.device_name for d in devices] == ["gpu-1"]
    assert lim is not None and (lim["uuid_0"], lim["memory_mib_0"], lim["cores_0"]) == (node.gpu_uuid(1), "1000", "10")
