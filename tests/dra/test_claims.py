"""kube_vgpu.dra.claims: reading an allocated resource.k8s.io/v1 ResourceClaim into grants."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu.dra import DRIVER_NAME
from kube_vgpu.dra.claims import ClaimError, Grant, read_claim

UID = "0d6f6a9e-3c3b-4c1e-9a55-8f0e2b7d1a01"
SHARE = "5b1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f"


def claim(results: list[dict[str, Any]] | None = None, **status: Any) -> dict[str, Any]:
    """An allocated claim as the v1 API serves it."""
    if results is None:
        results = [result()]
    st_: dict[str, Any] = {"allocation": {"devices": {"results": results}},
                           "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-uid-1"}]}
    st_.update(status)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "team-a", "name": "c1", "uid": UID},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME}}]}},
            "status": st_}


def result(**kw: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"request": "gpu", "driver": DRIVER_NAME, "pool": "node-1", "device": "gpu-0",
                         "shareID": SHARE, "consumedCapacity": {"memory": "3000Mi", "cores": "30"}}
    r.update(kw)
    return {k: v for k, v in r.items() if v is not None}


def test_reads_consumed_capacity() -> None:
    g = read_claim(claim())
    assert (g.namespace, g.name, g.uid) == ("team-a", "c1", UID)
    assert g.grants == (Grant("gpu", "node-1", "gpu-0", 3000, 30, SHARE),)
    assert [(c.resource, c.name, c.uid) for c in g.reserved_for] == [("pods", "p", "pod-uid-1")]
    assert not g.grants[0].whole


def test_memory_in_bytes_rounds_down_to_whole_mib() -> None:
    g = read_claim(claim([result(consumedCapacity={"memory": str(3000 * 2**20 + 2**20 - 1), "cores": 30})]))
    assert g.grants[0].memory_mib == 3000
    assert read_claim(claim([result(consumedCapacity={"memory": "2Gi", "cores": "100"})])).grants[0].memory_mib == 2048


def test_other_drivers_results_are_ignored() -> None:
    other = result(driver="gpu.nvidia.com", device="gpu-7", consumedCapacity=None, shareID=None)
    g = read_claim(claim([other, result(device="gpu-1")]))
    assert [x.device for x in g.grants] == ["gpu-1"]
    assert read_claim(claim([other])).grants == ()


def test_no_consumed_capacity_is_the_whole_device() -> None:
    g = read_claim(claim([result(consumedCapacity=None, shareID=None)])).grants[0]
    assert g.whole and g.memory_mib is None and g.cores == 100 and g.share_id is None


def test_cores_absent_takes_the_class_default() -> None:
    g = read_claim(claim([result(consumedCapacity={"memory": "1Gi"})]), default_cores=25).grants[0]
    assert (g.memory_mib, g.cores) == (1024, 25)
    with pytest.raises(ValueError, match="default_cores"):
        read_claim(claim(), default_cores=0)


def test_admin_access_is_refused() -> None:
    with pytest.raises(ClaimError) as e:
        read_claim(claim([result(adminAccess=True, consumedCapacity=None, shareID=None)]))
    assert e.value.field == "status.allocation.devices.results[0].adminAccess"
    assert "admin access" in str(e.value)
    # false is the ordinary case; another driver's admin access is not ours to judge
    assert read_claim(claim([result(adminAccess=False)])).grants
    assert read_claim(claim([result(driver="other.example.com", adminAccess=True)])).grants == ()


def test_not_allocated_is_refused() -> None:
    c = claim()
    del c["status"]["allocation"]
    with pytest.raises(ClaimError, match="status.allocation"):
        read_claim(c)
    with pytest.raises(ClaimError, match="status.allocation"):
        read_claim({"metadata": {"namespace": "a", "name": "b", "uid": UID}})


@pytest.mark.parametrize("field,value,where", [
    ("consumedCapacity", {"memory": "0"}, "consumedCapacity.memory"),
    ("consumedCapacity", {"memory": "-1Gi", "cores": "10"}, "consumedCapacity.memory"),
    ("consumedCapacity", {"memory": "1000", "cores": "10"}, "consumedCapacity.memory"),  # < 1 MiB
    ("consumedCapacity", {"memory": "lots", "cores": "10"}, "consumedCapacity.memory"),
    ("consumedCapacity", {"memory": True, "cores": "10"}, "consumedCapacity.memory"),
    ("consumedCapacity", {"cores": "10"}, "consumedCapacity.memory"),
    ("consumedCapacity", {"memory": "1Gi", "cores": "0"}, "consumedCapacity.cores"),
    ("consumedCapacity", {"memory": "1Gi", "cores": "101"}, "consumedCapacity.cores"),
    ("consumedCapacity", {"memory": "1Gi", "cores": "500m"}, "consumedCapacity.cores"),
    ("consumedCapacity", {"memory": "1Gi", "bandwidth": "1"}, "consumedCapacity"),
    ("consumedCapacity", ["memory"], "consumedCapacity"),
    ("device", "GPU_0", "device"),
    ("device", "", "device"),
    ("pool", "Node 1", "pool"),
    ("request", "", "request"),
    ("request", "a/b/c", "request"),
    ("shareID", "not-a-uid", "shareID"),
    ("shareID", 7, "shareID"),
    ("adminAccess", "yes", "adminAccess"),
    ("driver", 5, "driver"),
])
def test_malformed_result_names_field_value_and_allowed(field: str, value: Any, where: str) -> None:
    with pytest.raises(ClaimError) as e:
        read_claim(claim([result(**{field: value})]))
    assert e.value.field == f"status.allocation.devices.results[0].{where}"
    assert "allowed:" in str(e.value) and where.split(".")[-1] in str(e.value)


@pytest.mark.parametrize("path,value", [
    (("metadata",), None), (("metadata", "uid"), ""), (("metadata", "namespace"), 3),
    (("status",), "x"), (("status", "allocation"), []), (("status", "allocation", "devices", "results"), {}),
    (("status", "allocation", "devices", "results", 0), "gpu-0"), (("status", "reservedFor"), {}),
    (("status", "reservedFor", 0, "uid"), None),
])
def test_malformed_claim_shapes(path: tuple[Any, ...], value: Any) -> None:
    c = claim()
    o: Any = c
    for k in path[:-1]:
        o = o[k]
    o[path[-1]] = value
    with pytest.raises(ClaimError) as e:
        read_claim(c)
    assert "allowed:" in str(e.value)


json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                         max_size=3), max_leaves=8)
RESULT_KEYS = ["request", "driver", "pool", "device", "shareID", "adminAccess", "consumedCapacity"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(RESULT_KEYS), value=json_value)
def test_any_value_in_a_result_field_is_a_grant_or_a_claim_error(key: str, value: Any) -> None:
    """Whatever lands in a result field: either a valid grant within bounds, or ClaimError naming it."""
    c = claim([result(**{key: value})]) if value is not None else claim([result()])
    if value is None:
        c["status"]["allocation"]["devices"]["results"][0][key] = None
    try:
        g = read_claim(c)
    except ClaimError as e:
        assert e.field.startswith("status.allocation.devices.results[0]")
        assert "allowed:" in str(e)
        return
    for x in g.grants:
        assert x.memory_mib is None or x.memory_mib >= 1
        assert 1 <= x.cores <= 100


@settings(max_examples=200, deadline=None)
@given(mem=st.one_of(st.integers(-10**12, 10**15), st.text(max_size=10)), cores=st.one_of(
    st.integers(-5, 300), st.text(max_size=6)))
def test_capacity_values_bounded_or_refused(mem: Any, cores: Any) -> None:
    try:
        g = read_claim(claim([result(consumedCapacity={"memory": mem, "cores": cores})])).grants[0]
    except ClaimError as e:
        assert e.field.endswith((".memory", ".cores"))
        return
    assert g.memory_mib is not None and g.memory_mib >= 1 and 1 <= g.cores <= 100


@settings(max_examples=150, deadline=None)
@given(st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.sampled_from(["metadata", "status", "allocation", "devices", "results", "reservedFor", "uid", "name",
                     "namespace"]), c, max_size=4), max_leaves=12))
def test_arbitrary_json_never_raises_anything_but_claim_error(doc: Any) -> None:
    try:
        read_claim(doc)
    except ClaimError:
        pass


def test_reader_does_not_mutate_its_input() -> None:
    c = claim()
    before = copy.deepcopy(c)
    read_claim(c)
    assert c == before


def test_claims_kube_scheduler_allocated() -> None:
    """Claims a real kube-scheduler v1.36 allocated from our slices (tests/dra/data), read as served."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parent / "data" / "claims_kube_scheduler_1_36.json").read_text())
    got = {name: read_claim(c) for name, c in doc["claims"].items()}
    share = got["share"].grants[0]
    assert (share.pool, share.device, share.memory_mib, share.cores) == ("n1", "gpu-0", 3000, 30)
    assert share.share_id and not share.whole
    assert [(g.memory_mib, g.cores) for g in got["memonly"].grants] == [(1024, 100)]  # the slice's cores default
    assert [(g.memory_mib, g.cores) for g in got["whole"].grants] == [(24576, 100)]  # defaults: the whole GPU
    assert all(len(g.reserved_for) == 1 and g.reserved_for[0].resource == "pods" for g in got.values())
