"""kube_vgpu.dra.capacity: per-GPU free memory / cores per node from ResourceSlices and claims."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kube_vgpu.dra import DEVICE_CLASS, DRIVER_NAME
from kube_vgpu.dra.capacity import (
    ClaimSpecError,
    DraRequest,
    Use,
    allocated,
    claim_requests,
    node_capacity,
    pools,
)
from kube_vgpu.dra.slices import resource_slices
from kube_vgpu.model import GPUDevice

from .dra_objects import claim, node_slice, result

REAL = json.loads((Path(__file__).parent / "data" / "claims_kube_scheduler_1_36.json").read_text())["claims"]
CLASSES = {DEVICE_CLASS: ""}


def test_slices_give_each_node_its_gpus_in_published_order() -> None:
    caps = node_capacity([node_slice("n1", 3), node_slice("n2", 1, mem=81920, model="NVIDIA H100")], [])
    assert set(caps) == {"n1", "n2"}
    n1 = caps["n1"]
    assert [d.name for d in n1.devices] == ["gpu-0", "gpu-1", "gpu-2"]
    assert [(d.memory_mib, d.cores, d.shared, d.healthy, d.uuid) for d in n1.devices][0] == \
        (24576, 100, True, True, "GPU-n1-0")
    assert n1.used == (Use(), Use(), Use())
    assert caps["n2"].devices[0].model == "NVIDIA H100" and caps["n2"].free(0) == (81920, 100)


def test_real_kube_scheduler_allocations_are_counted() -> None:
    """The claims kube-scheduler v1.36.2 really wrote on n1 (3 GPUs of 24576 MiB)."""
    caps = node_capacity([node_slice("n1", 3)], REAL.values())
    n1 = caps["n1"]
    assert n1.free(0) == (24576 - 3000, 70)  # share: 3000Mi + 30 cores
    assert n1.free(1) == (24576 - 1024, 0)  # memonly: 1Gi, the cores default (100)
    assert n1.free(2) == (0, 0)  # whole: 24Gi + 100
    assert [u.shares for u in n1.used] == [1, 1, 1]


def test_claim_allocated_but_not_reserved_counts_as_used() -> None:
    c = claim("inflight", results=[result("n1", "gpu-1", "10000Mi", "50")])
    assert "reservedFor" not in c["status"]
    assert node_capacity([node_slice("n1", 2)], [c])["n1"].free(1) == (24576 - 10000, 50)


def test_shares_add_up_and_never_go_below_zero() -> None:
    cs = [claim(f"c{i}", results=[result("n1", "gpu-0", "20000Mi", "60")]) for i in range(2)]
    cap = node_capacity([node_slice("n1", 1)], cs)["n1"]
    assert cap.used[0] == Use(40000, 120, 2)
    assert cap.free(0) == (0, 0)


def test_doubtful_results_never_free_capacity() -> None:
    """Unknown state takes the whole device; memory is rounded up to whole MiB."""
    no_cc = claim("whole", results=[result("n1", "gpu-0", memory=None)])
    garbage = claim("bad", results=[{**result("n1", "gpu-1"), "consumedCapacity": {"memory": "lots", "cores": "x"}}])
    odd = claim("odd", results=[result("n2", "gpu-0", "1000001", "1")])  # bytes: 0.95 MiB -> 1 MiB
    caps = node_capacity([node_slice("n1", 2), node_slice("n2", 1)], [no_cc, garbage, odd])
    assert caps["n1"].free(0) == (0, 0) and caps["n1"].free(1) == (0, 0)
    assert caps["n2"].used[0] == Use(1, 1, 1)


def test_hostile_objects_change_nothing() -> None:
    """A claim of another driver, a claim of our class never allocated, forged annotations and a
    slice of another driver claiming our pool: no capacity moves."""
    base = node_capacity([node_slice("n1", 2)], [])
    other_driver = claim("other", results=[result("n1", "gpu-0", "24Gi", "100", driver="gpu.example.com")])
    never = claim("never", memory="24Gi", cores="100")
    forged = claim("forged", annotations={"kube-vgpu.io/allocation": "n1:gpu-0:24576:100",
                                          "resource.kubernetes.io/pod-claim-name": "x"})
    foreign = node_slice("n1", 2)
    foreign["metadata"]["name"] = "evil"
    foreign["spec"]["driver"] = "gpu.example.com"
    foreign["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Ti"
    assert not allocated(never) and not allocated(forged)
    assert node_capacity([node_slice("n1", 2), foreign], [other_driver, never, forged]) == base


def test_only_the_newest_generation_of_a_pool_counts_and_incomplete_pools_none() -> None:
    old = node_slice("n1", 4, generation=1)
    old["metadata"]["name"] = "n1-old"
    new = node_slice("n1", 2, generation=2)
    assert len(node_capacity([old, new], [])["n1"].devices) == 2
    big = [GPUDevice(uuid=f"G{i}", index=i, model="M", memory_mib=1024) for i in range(70)]
    two = resource_slices("n3", big, pool_generation=1)
    assert len(two) == 2
    assert len(node_capacity(two, [])["n3"].devices) == 70
    assert "n3" not in node_capacity(two[:1], [])  # one of two slices: incomplete


def test_tainted_and_unshareable_devices() -> None:
    s = node_slice("n1", 2, healthy=(True, False))
    s["spec"]["devices"][0]["allowMultipleAllocations"] = False
    d0, d1 = pools([s])["n1"][1]
    assert not d0.shared and d0.healthy
    assert d1.shared and not d1.healthy


def test_results_for_devices_not_published_are_ignored() -> None:
    c = claim("gone", results=[result("n1", "gpu-9"), result("n9", "gpu-0")])
    assert node_capacity([node_slice("n1", 2)], [c]) == node_capacity([node_slice("n1", 2)], [])


def test_malformed_objects_are_skipped() -> None:
    bad_slice = node_slice("n2", 1)
    bad_slice["spec"]["devices"][0]["capacity"] = {"memory": {"value": "much"}}
    caps = node_capacity([node_slice("n1", 1), {"spec": "x"}, bad_slice, {"metadata": 3}],
                         [{"status": []}, {"status": {"allocation": {"devices": {"results": "x"}}}}, "claim"])  # type: ignore[list-item]
    assert caps["n1"].free(0) == (24576, 100)
    assert caps["n2"].devices == ()


# -- claim requests ---------------------------------------------------------------------------------

def test_claim_requests_read_capacity_count_and_class() -> None:
    c = claim("c", memory="3000Mi", cores="30", count=2)
    assert claim_requests(c, CLASSES) == (DraRequest("c/gpu", 2, 3000, 30, ""),)
    assert claim_requests(claim("d", memory=None, cores=None), CLASSES) == (DraRequest("d/gpu", 1, None, None, ""),)
    assert claim_requests(claim("e", memory="1000001", cores=None), CLASSES)[0].memory_mib == 1  # rounded up
    h = claim("h", device_class="h200.vgpu.kube-vgpu.io")
    assert claim_requests(h, {**CLASSES, "h200.vgpu.kube-vgpu.io": "NVIDIA H200"})[0].model == "NVIDIA H200"
    assert claim_requests(claim("x", device_class="gpu.example.com"), CLASSES) == ()


def test_real_claim_specs() -> None:
    assert claim_requests(REAL["share"], CLASSES) == (DraRequest("share/gpu", 1, 3000, 30),)
    assert claim_requests(REAL["memonly"], CLASSES) == (DraRequest("memonly/gpu", 1, 1024, None),)
    assert claim_requests(REAL["whole"], CLASSES) == (DraRequest("whole/gpu", 1, None, None),)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda ex: ex.update(count=0), "spec.devices.requests[0].exactly.count"),
    (lambda ex: ex.update(allocationMode="All"), "spec.devices.requests[0].exactly.allocationMode"),
    (lambda ex: ex["capacity"]["requests"].update(cores="101"), "spec.devices.requests[0].exactly.capacity.requests.cores"),
    (lambda ex: ex["capacity"]["requests"].update(memory="0"), "spec.devices.requests[0].exactly.capacity.requests.memory"),
    (lambda ex: ex["capacity"]["requests"].update(bogus="1"), "spec.devices.requests[0].exactly.capacity.requests"),
])
def test_claim_requests_errors_name_the_field(mutate, field) -> None:
    c = claim("c")
    mutate(c["spec"]["devices"]["requests"][0]["exactly"])
    with pytest.raises(ClaimSpecError) as e:
        claim_requests(c, CLASSES)
    assert e.value.field == field and field in str(e.value)


def test_first_available_of_our_class_is_not_predicted() -> None:
    c = claim("c")
    r = c["spec"]["devices"]["requests"][0]
    r["firstAvailable"] = [{"name": "a", **r.pop("exactly")}]
    with pytest.raises(ClaimSpecError, match="firstAvailable"):
        claim_requests(c, CLASSES)


def test_derivation_is_pure() -> None:
    s, c = node_slice("n1", 2), claim("c", results=[result("n1", "gpu-0")])
    before = copy.deepcopy((s, c))
    node_capacity([s], [c])
    claim_requests(c, CLASSES)
    assert (s, c) == before and DRIVER_NAME == s["spec"]["driver"]
