"""The dynamic-MIG fields of the wire format: a device's profile table and allowed profiles in the
node inventory, a booking's profile and first memory slice in the allocation record. Written only
when set (records without them read as before), strictly checked when present."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.codec import decode_allocation, decode_inventory, encode_allocation, encode_inventory
from kube_vgpu.errors import CodecError
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation

DEV = GPUDevice("GPU-a", 0, "NVIDIA H200", 144384, split=7, mig="H200-141GB", mig_profiles=("1g.18gb", "3g.71gb"))
ALLOC = PodAllocation("n", (ContainerAllocation("c", False, (DeviceBooking("GPU-a", 18432, 14, "1g.18gb", 6),)),), 1.0)


def test_inventory_wire_format_and_round_trip() -> None:
    text = encode_inventory(NodeInventory((DEV,), 5.0))
    dev = json.loads(text)["devices"][0]
    assert (dev["mig"], dev["migprofiles"]) == ("H200-141GB", ["1g.18gb", "3g.71gb"])
    assert decode_inventory(text).devices == (DEV,)
    plain = encode_inventory(NodeInventory((GPUDevice("GPU-b", 0, "NVIDIA A10", 24000),), 5.0))
    assert "mig" not in json.loads(plain)["devices"][0]  # written only for dynamic-MIG GPUs


def test_allocation_wire_format_and_round_trip() -> None:
    text = encode_allocation(ALLOC)
    assert json.loads(text)["containers"][0]["devices"][0] == {
        "uuid": "GPU-a", "mem": 18432, "cores": 14, "mig": "1g.18gb", "start": 6}
    assert decode_allocation(text) == ALLOC
    plain = PodAllocation("n", (ContainerAllocation("c", False, (DeviceBooking("GPU-a", 100, 10),)),), 1.0)
    assert "mig" not in json.loads(encode_allocation(plain))["containers"][0]["devices"][0]


@pytest.mark.parametrize(("field", "value", "match"), [
    ("mig", "B999-1GB", "not a known MIG profile table"),
    ("mig", 7, "has type int"),
    ("migprofiles", ["9g.1tb"], "distinct profiles of H200-141GB"),
    ("migprofiles", ["1g.18gb", "1g.18gb"], "distinct profiles"),
    ("migprofiles", "1g.18gb", "has type str"),
])
def test_inventory_mig_fields_are_checked(field: str, value: object, match: str) -> None:
    obj = json.loads(encode_inventory(NodeInventory((DEV,), 5.0)))
    obj["devices"][0][field] = value
    with pytest.raises(CodecError, match=match):
        decode_inventory(json.dumps(obj))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("mig", "", "must be a MIG profile name"),
    ("mig", "x" * 33, "must be a MIG profile name"),
    ("mig", 1, "has type int"),
    ("start", 8, "out of range"),
    ("start", -1, "out of range"),
    ("start", "6", "has type str"),
])
def test_allocation_mig_fields_are_checked(field: str, value: object, match: str) -> None:
    obj = json.loads(encode_allocation(ALLOC))
    obj["containers"][0]["devices"][0][field] = value
    with pytest.raises(CodecError, match=match):
        decode_allocation(json.dumps(obj))


def test_a_profile_without_its_start_is_refused() -> None:
    obj = json.loads(encode_allocation(ALLOC))
    del obj["containers"][0]["devices"][0]["start"]
    with pytest.raises(CodecError, match="missing field 'start'"):
        decode_allocation(json.dumps(obj))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["mig", "migprofiles", "start"]),
       st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.text(max_size=12),
                 st.lists(st.text(max_size=8), max_size=3)))
def test_property_junk_in_mig_fields_is_only_ever_a_codec_error(field: str, value: object) -> None:
    for text, path in ((encode_inventory(NodeInventory((DEV,), 5.0)), ("devices",)),
                       (encode_allocation(ALLOC), ("containers", "devices"))):
        obj = json.loads(text)
        target = obj[path[0]][0] if len(path) == 1 else obj[path[0]][0][path[1]][0]
        target[field] = value
        try:
            (decode_inventory if len(path) == 1 else decode_allocation)(json.dumps(obj))
        except CodecError:
            pass
