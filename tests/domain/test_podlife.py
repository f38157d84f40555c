"""kube_vgpu.podlife (the one "does this pod still hold GPUs" rule) and the codec's record readers."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.codec import allocation_or_none, allocation_text, encode_allocation, read_allocation
from kube_vgpu.errors import CodecError
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.podlife import active, finished, holds_gpus, terminating
from kube_vgpu.resources import ANN_ALLOCATION


def pod(phase: str | None = None, deleting: bool = False, ann: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if ann is not None:
        meta["annotations"] = ann
    return {"metadata": meta, "status": {"phase": phase} if phase else {}}


@pytest.mark.parametrize(("p", "fin", "term", "holds", "act"), [
    (pod("Running"), False, False, True, True),
    (pod("Pending"), False, False, True, True),
    (pod(), False, False, True, True),
    (pod("Running", deleting=True), False, True, True, False),   # containers may still run
    (pod("Succeeded"), True, False, False, False),
    (pod("Failed", deleting=True), True, True, False, False),
    ({"metadata": "junk", "status": ["junk"]}, False, False, True, True),  # never raises
])
def test_pod_life(p: dict[str, Any], fin: bool, term: bool, holds: bool, act: bool) -> None:
    assert (finished(p), terminating(p), holds_gpus(p), active(p)) == (fin, term, holds, act)


ALLOC = PodAllocation("n1", (ContainerAllocation("c", False, (DeviceBooking("GPU-1", 1000, 10),)),), 5.0)


def test_record_readers() -> None:
    text = encode_allocation(ALLOC)
    p = pod(ann={ANN_ALLOCATION: text})
    assert allocation_text(p) == text and read_allocation(p) == ALLOC == allocation_or_none(p)
    for none in (pod(), pod(ann={}), pod(ann={ANN_ALLOCATION: ""}), {"metadata": None}, {"metadata": {"annotations": 3}}):
        assert allocation_text(none) is None and read_allocation(none) is None and allocation_or_none(none) is None
    bad = pod(ann={ANN_ALLOCATION: "{not json"})
    with pytest.raises(CodecError, match="not JSON"):
        read_allocation(bad)
    assert allocation_or_none(bad) is None
    with pytest.raises(CodecError, match="must be a string"):
        read_allocation(pod(ann={ANN_ALLOCATION: 7}))
