"""The extender's cache reuses the verdict on a pod's allocation record across watch events that
change nothing it reads (status updates, the device plugin's progress), so each pod's record is
verified once, not once per event. The attacks: edit the record, its signature, its bind time, the
pod's uid or node after the verdict was memoised, or rotate the keys away: each is verified again
and refused, never served from the memo."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from bind_support import node_obj

from kube_vgpu.cluster import ClusterCache, Record, Rejected
from kube_vgpu.codec import encode_allocation
from kube_vgpu.config import Config
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.resources import ANN_ALLOCATION, ANN_ALLOCATION_SIGNATURE, ANN_BIND_TIME
from kube_vgpu.signing import KeyRing, sign_allocation

K1 = KeyRing("k1", {"k1": b"1" * 32})
K2 = KeyRing("k2", {"k2": b"2" * 32})


def signed_pod(keys: KeyRing = K1, mib: int = 1000) -> dict[str, Any]:
    alloc = PodAllocation("n1", (ContainerAllocation("c", False, (DeviceBooking("GPU-n1-00", mib, 0),)),), 100)
    text = encode_allocation(alloc)
    return {"metadata": {"name": "p", "namespace": "default", "uid": "uid-p", "resourceVersion": "5",
                         "annotations": {ANN_ALLOCATION: text, ANN_BIND_TIME: "100",
                                         ANN_ALLOCATION_SIGNATURE: sign_allocation(keys, "uid-p", "n1", "100", text)}},
            "spec": {"nodeName": "n1", "schedulerName": "kube-vgpu-scheduler",
                     "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpumem": str(mib)}}}]},
            "status": {"phase": "Pending"}}


class Ring:
    """A key source whose ring can be swapped (a key rotation)."""

    def __init__(self, ring: KeyRing):
        self.ring = ring

    def current(self) -> KeyRing:
        return self.ring


def cache(ring: Ring) -> ClusterCache:
    c = ClusterCache(Config(), keys=ring)
    c.on_node("ADDED", node_obj("n1", 1))
    return c


def test_unchanged_record_is_verified_once() -> None:
    c = cache(Ring(K1))
    pod = signed_pod()
    first = c.read_record(pod)
    assert isinstance(first, Record)
    later = copy.deepcopy(pod)
    later["status"]["phase"] = "Running"
    later["metadata"]["resourceVersion"] = "9"
    assert c.read_record(later) is first


@pytest.mark.parametrize("edit", ["record", "signature", "bind-time", "uid", "node"])
def test_an_edit_after_the_verdict_is_verified_again(edit: str) -> None:
    c = cache(Ring(K1))
    pod = signed_pod()
    assert isinstance(c.read_record(pod), Record)
    forged = copy.deepcopy(pod)
    ann = forged["metadata"]["annotations"]
    if edit == "record":
        ann[ANN_ALLOCATION] = encode_allocation(PodAllocation(
            "n1", (ContainerAllocation("c", False, (DeviceBooking("GPU-n1-00", 24000, 0),)),), 100))
    elif edit == "signature":
        ann[ANN_ALLOCATION_SIGNATURE] = signed_pod(mib=2000)["metadata"]["annotations"][ANN_ALLOCATION_SIGNATURE]
    elif edit == "bind-time":
        ann[ANN_BIND_TIME] = "101"
    elif edit == "uid":
        forged["metadata"]["uid"] = "uid-other"
    else:
        forged["spec"]["nodeName"] = "n2"
    assert isinstance(c.read_record(forged), Rejected)


def test_key_rotation_verifies_again() -> None:
    ring = Ring(K1)
    c = cache(ring)
    pod = signed_pod()
    assert isinstance(c.read_record(pod), Record)
    ring.ring = K2  # k1 retired: its records no longer verify
    assert isinstance(c.read_record(pod), Rejected)


def test_memo_entry_goes_with_the_pod() -> None:
    c = cache(Ring(K1))
    pod = signed_pod()
    c.on_pod("ADDED", pod)
    assert "default/p" in c._record_memo
    c.on_pod("DELETED", pod)
    assert "default/p" not in c._record_memo
    c.on_pod("ADDED", pod)
    c.replace_pods([], "100")
    assert c._record_memo == {}


def test_a_record_this_process_wrote_is_trusted_only_as_written() -> None:
    """The extender seeds the memo with the record it signed at bind: the watch event bringing
    exactly that record back needs no HMAC; the same pod with any other signature or text is
    verified (and refused) as usual."""
    c = cache(Ring(K1))
    pod = signed_pod()
    ann = pod["metadata"]["annotations"]
    from kube_vgpu.codec import decode_allocation
    written = decode_allocation(ann[ANN_ALLOCATION])
    c.remember_written("default/p", "uid-p", "n1", dict(ann), written)
    rec = c.read_record(pod)
    assert isinstance(rec, Record) and rec.allocation is written and rec.kid == "k1"
    forged = copy.deepcopy(pod)
    forged["metadata"]["annotations"][ANN_ALLOCATION_SIGNATURE] = "v1:k1:" + "A" * 43
    assert isinstance(c.read_record(forged), Rejected)
