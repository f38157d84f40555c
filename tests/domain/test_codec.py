"""kube_vgpu.codec: v1 annotation format, exact round trips and strict decoding."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.codec import decode_allocation, decode_inventory, encode_allocation, encode_inventory
from kube_vgpu.errors import CodecError
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation

SETTINGS = settings(max_examples=200, deadline=None)

MIB = st.integers(min_value=1, max_value=1 << 24)
CORES = st.integers(min_value=1, max_value=10_000)
TIMES = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
TEXT = st.text()
UUID = st.text(min_size=1)

DEVICES = st.builds(GPUDevice, uuid=UUID, index=st.integers(0, 4096), model=TEXT, memory_mib=MIB, cores=CORES,
                    split=st.integers(1, 1024), healthy=st.booleans(), numa=st.integers(-1, 4096))
INVENTORIES = st.builds(NodeInventory, devices=st.lists(DEVICES, max_size=6, unique_by=lambda d: d.uuid).map(tuple),
                        heartbeat=TIMES)
BOOKINGS = st.builds(DeviceBooking, uuid=UUID, memory_mib=st.integers(0, 1 << 24), cores=st.integers(0, 10_000))
CONTAINERS = st.builds(ContainerAllocation, name=st.text(min_size=1), init=st.booleans(),
                       devices=st.lists(BOOKINGS, max_size=4, unique_by=lambda b: b.uuid).map(tuple))
ALLOCATIONS = st.builds(PodAllocation, node=TEXT,
                        containers=st.lists(CONTAINERS, max_size=5, unique_by=lambda c: (c.name, c.init)).map(tuple),
                        time=TIMES)


INV = NodeInventory(devices=(GPUDevice("GPU-1", 0, "NVIDIA H200", 143771, 100, 10, True, 0),
                             GPUDevice("GPU-2", 1, "NVIDIA H200", 143771, 200, 4, False, 1)), heartbeat=1700000000.5)
ALLOC = PodAllocation(node="gpu-1", containers=(
    ContainerAllocation("init", True, (DeviceBooking("GPU-1", 10240, 0),)),
    ContainerAllocation("main", False, (DeviceBooking("GPU-2", 3000, 30), DeviceBooking("GPU-1", 1, 0))),
), time=1700000001.0)


def test_inventory_wire_format() -> None:
    text = encode_inventory(NodeInventory(devices=(GPUDevice("GPU-1", 0, "NVIDIA H200", 143771),), heartbeat=5.0))
    assert text == ('{"devices":[{"cores":100,"healthy":true,"idx":0,"mem":143771,"model":"NVIDIA H200",'
                    '"numa":0,"split":10,"uuid":"GPU-1"}],"hb":5.0,"v":1}')


def test_allocation_wire_format() -> None:
    a = PodAllocation("gpu-1", (ContainerAllocation("main", False, (DeviceBooking("GPU-1", 3000, 30),)),), 7.0)
    assert encode_allocation(a) == ('{"containers":[{"devices":[{"cores":30,"mem":3000,"uuid":"GPU-1"}],'
                                    '"init":false,"name":"main"}],"node":"gpu-1","t":7.0,"v":1}')


def test_examples_round_trip() -> None:
    assert decode_inventory(encode_inventory(INV)) == INV
    assert decode_allocation(encode_allocation(ALLOC)) == ALLOC


def test_int_times_decode_as_float() -> None:
    inv = decode_inventory('{"v":1,"hb":5,"devices":[]}')
    assert inv.heartbeat == 5.0 and type(inv.heartbeat) is float
    al = decode_allocation('{"v":1,"t":9,"node":"n","containers":[]}')
    assert al.time == 9.0 and type(al.time) is float


def test_unknown_extra_fields_ignored() -> None:
    obj = json.loads(encode_allocation(ALLOC))
    obj["future"] = {"x": 1}
    obj["containers"][0]["extra"] = 1
    assert decode_allocation(json.dumps(obj)) == ALLOC


@SETTINGS
@given(inv=INVENTORIES)
def test_property_inventory_round_trip(inv: NodeInventory) -> None:
    text = encode_inventory(inv)
    assert decode_inventory(text) == inv
    assert encode_inventory(decode_inventory(text)) == text


@SETTINGS
@given(alloc=ALLOCATIONS)
def test_property_allocation_round_trip(alloc: PodAllocation) -> None:
    text = encode_allocation(alloc)
    assert decode_allocation(text) == alloc
    assert encode_allocation(decode_allocation(text)) == text


# --------------------------------------------------------------------------------------- strictness

def _inv_obj() -> dict:
    return json.loads(encode_inventory(INV))


def _alloc_obj() -> dict:
    return json.loads(encode_allocation(ALLOC))


@pytest.mark.parametrize("decode", [decode_inventory, decode_allocation])
@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not JSON"),
        ("", "not JSON"),
        ("{", "not JSON"),
        ("[1,2]", "must be a JSON object"),
        ('"x"', "must be a JSON object"),
        ("null", "must be a JSON object"),
        ('{"v":2}', "unsupported version 2"),
        ('{"v":"1"}', "unsupported version '1'"),
        ("{}", "unsupported version None"),
        ('{"v":0}', "unsupported version 0"),
    ],
)
def test_decode_rejects_envelope(decode, text: str, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CodecError, match=match):
        decode(text)


@pytest.mark.parametrize("decode", [decode_inventory, decode_allocation])
@pytest.mark.parametrize("value", [None, 1, b"{}", {"v": 1}])
def test_decode_rejects_non_string(decode, value: object) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CodecError, match="must be a string"):
        decode(value)


def _mutated(obj: dict, path: tuple, value: object) -> str:
    target = obj
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(obj)


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("hb",), _DELETE, "node inventory: missing field 'hb'"),
        (("devices",), _DELETE, "missing field 'devices'"),
        (("hb",), "1", "field 'hb' has type str"),
        (("hb",), True, "field 'hb' has type bool"),
        (("devices",), {}, "field 'devices' has type dict"),
        (("devices", 0), "GPU-1", r"device\[0\]: must be an object"),
        (("devices", 1, "uuid"), _DELETE, r"device\[1\]: missing field 'uuid'"),
        (("devices", 0, "idx"), True, r"device\[0\]: field 'idx' has type bool"),
        (("devices", 0, "mem"), False, "field 'mem' has type bool"),
        (("devices", 0, "mem"), 1.5, "field 'mem' has type float"),
        (("devices", 0, "mem"), "143771", "field 'mem' has type str"),
        (("devices", 0, "cores"), None, "field 'cores' has type NoneType"),
        (("devices", 0, "split"), 10.0, "field 'split' has type float"),
        (("devices", 0, "healthy"), 1, "field 'healthy' has type int"),
        (("devices", 0, "healthy"), "true", "field 'healthy' has type str"),
        (("devices", 0, "numa"), True, "field 'numa' has type bool"),
        (("devices", 0, "model"), 5, "field 'model' has type int"),
        (("devices", 0, "uuid"), None, "field 'uuid' has type NoneType"),
    ],
)
def test_decode_inventory_strict(path: tuple, value: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_inventory(_mutated(_inv_obj(), path, value))


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("t",), _DELETE, "pod allocation: missing field 't'"),
        (("node",), _DELETE, "missing field 'node'"),
        (("containers",), _DELETE, "missing field 'containers'"),
        (("t",), True, "field 't' has type bool"),
        (("t",), None, "field 't' has type NoneType"),
        (("node",), 1, "field 'node' has type int"),
        (("containers",), "x", "field 'containers' has type str"),
        (("containers", 0), [], r"container\[0\]: must be an object"),
        (("containers", 1, "name"), _DELETE, r"container\[1\]: missing field 'name'"),
        (("containers", 0, "init"), 0, "field 'init' has type int"),
        (("containers", 0, "devices"), None, "field 'devices' has type NoneType"),
        (("containers", 1, "devices", 1), 3, r"container\[1\] device\[1\]: must be an object"),
        (("containers", 1, "devices", 0, "mem"), True, r"container\[1\] device\[0\]: field 'mem' has type bool"),
        (("containers", 1, "devices", 0, "cores"), 30.0, "field 'cores' has type float"),
        (("containers", 1, "devices", 0, "uuid"), _DELETE, "missing field 'uuid'"),
    ],
)
def test_decode_allocation_strict(path: tuple, value: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_allocation(_mutated(_alloc_obj(), path, value))


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=10,
)


@SETTINGS
@given(text=st.one_of(st.text(), st.text(alphabet='{}[]",:0123456789.-eEtrufalsn v'),
                      JSONISH.map(json.dumps)))
def test_property_decode_only_codec_error(text: str) -> None:
    for decode in (decode_inventory, decode_allocation):
        try:
            decode(text)
        except CodecError:
            pass


@SETTINGS
@given(key=st.sampled_from(["v", "hb", "devices"]), value=JSONISH)
def test_property_inventory_field_junk(key: str, value: object) -> None:
    obj = _inv_obj()
    obj[key] = value
    try:
        decode_inventory(json.dumps(obj))
    except CodecError:
        pass


@SETTINGS
@given(key=st.sampled_from(["uuid", "idx", "model", "mem", "cores", "split", "healthy", "numa"]), value=JSONISH)
def test_property_device_field_junk(key: str, value: object) -> None:
    obj = _inv_obj()
    obj["devices"][0][key] = value
    try:
        inv = decode_inventory(json.dumps(obj))
    except CodecError:
        return
    # accepted only when the type is right
    got = {"uuid": inv.devices[0].uuid, "idx": inv.devices[0].index, "model": inv.devices[0].model,
           "mem": inv.devices[0].memory_mib, "cores": inv.devices[0].cores, "split": inv.devices[0].split,
           "healthy": inv.devices[0].healthy, "numa": inv.devices[0].numa}[key]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("decode", [decode_inventory, decode_allocation])
def test_version_true_rejected(decode) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CodecError):
        decode('{"v":true,"hb":1,"devices":[],"t":1,"node":"n","containers":[]}')


@pytest.mark.parametrize("decode", [decode_inventory, decode_allocation])
def test_huge_number_is_codec_error(decode) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CodecError):
        decode('{"v":1,"hb":' + "1" * 5000 + ',"t":1,"devices":[]}')


@pytest.mark.parametrize("decode", [decode_inventory, decode_allocation])
def test_deep_nesting_is_codec_error(decode) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CodecError):
        decode("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("patch", [
    ("devices", 0, "mem", -100), ("devices", 0, "mem", 0), ("devices", 0, "split", 0), ("devices", 0, "cores", -5),
    ("devices", 0, "mem", 10**30), ("devices", 0, "idx", -1),
])
def test_inventory_out_of_range_values_are_refused(patch: tuple[str, int, str, int]) -> None:
    obj = json.loads(encode_inventory(INV))
    obj[patch[0]][patch[1]][patch[2]] = patch[3]
    with pytest.raises(CodecError, match=f"'{patch[2]}' = .* out of range"):
        decode_inventory(json.dumps(obj))


def test_inventory_duplicate_uuid_and_bad_heartbeat_refused() -> None:
    obj = json.loads(encode_inventory(INV))
    obj["devices"][1]["uuid"] = obj["devices"][0]["uuid"]
    with pytest.raises(CodecError, match="listed twice"):
        decode_inventory(json.dumps(obj))
    for hb in ("Infinity", "-1"):
        with pytest.raises(CodecError, match="not a time"):
            decode_inventory('{"v":1,"hb":' + hb + ',"devices":[]}')


@pytest.mark.parametrize(("field", "value"), [("mem", -50000), ("mem", 10**30), ("cores", -1), ("cores", 10**6)])
def test_tampered_allocation_values_are_refused(field: str, value: int) -> None:
    obj = json.loads(encode_allocation(ALLOC))
    obj["containers"][1]["devices"][0][field] = value
    with pytest.raises(CodecError, match="out of range"):
        decode_allocation(json.dumps(obj))


def test_allocation_duplicates_refused() -> None:
    obj = json.loads(encode_allocation(ALLOC))
    obj["containers"][1]["devices"][1]["uuid"] = obj["containers"][1]["devices"][0]["uuid"]
    with pytest.raises(CodecError, match="booked twice"):
        decode_allocation(json.dumps(obj))
    obj = json.loads(encode_allocation(ALLOC))
    obj["containers"].append(dict(obj["containers"][1]))
    with pytest.raises(CodecError, match="listed twice"):
        decode_allocation(json.dumps(obj))
