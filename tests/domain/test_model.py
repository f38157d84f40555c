"""kube_vgpu.model: constraints, per-device booking rules and pod usage."""

from __future__ import annotations

import pytest

from kube_vgpu.model import (
    Constraints,
    ContainerAllocation,
    ContainerRequest,
    DeviceBooking,
    GPUDevice,
    PodAllocation,
    PodRequest,
)

H200 = GPUDevice(uuid="GPU-h200", index=0, model="NVIDIA H200", memory_mib=143771)
A100 = GPUDevice(uuid="GPU-a100", index=1, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, cores=200)
T4 = GPUDevice(uuid="GPU-t4", index=2, model="Tesla T4", memory_mib=15360)


def test_gpu_device_defaults() -> None:
    d = GPUDevice(uuid="GPU-x", index=3, model="m", memory_mib=100)
    assert (d.cores, d.split, d.healthy, d.numa) == (100, 10, True, 0)


@pytest.mark.parametrize(
    ("c", "allowed"),
    [
        (Constraints(), {"GPU-h200", "GPU-a100", "GPU-t4"}),
        (Constraints(use_types=("h200",)), {"GPU-h200"}),  # case-insensitive substring
        (Constraints(use_types=("A100", "T4")), {"GPU-a100", "GPU-t4"}),
        (Constraints(nouse_types=("tesla",)), {"GPU-h200", "GPU-a100"}),
        (Constraints(use_types=("NVIDIA",), nouse_types=("a100",)), {"GPU-h200"}),
        (Constraints(use_uuids=("GPU-t4", "GPU-nope")), {"GPU-t4"}),
        (Constraints(nouse_uuids=("GPU-t4",)), {"GPU-h200", "GPU-a100"}),
        (Constraints(use_uuids=("GPU-h200", "GPU-t4"), nouse_uuids=("GPU-h200",)), {"GPU-t4"}),
        (Constraints(use_uuids=("gpu-t4",)), set()),  # uuids are exact, case-sensitive
    ],
)
def test_constraints_allows_and_why_not_agree(c: Constraints, allowed: set[str]) -> None:
    for dev in (H200, A100, T4):
        assert c.allows(dev) is (dev.uuid in allowed), dev.uuid
        reason = c.why_not(dev)
        if dev.uuid in allowed:
            assert reason is None
        else:
            assert isinstance(reason, str) and reason


def test_why_not_messages() -> None:
    assert Constraints(use_types=("A100", "T4")).why_not(H200) == "model NVIDIA H200 not in use-gputype A100,T4"
    assert Constraints(nouse_types=("h200",)).why_not(H200) == "model NVIDIA H200 excluded by nouse-gputype"
    assert Constraints(use_uuids=("x",)).why_not(H200) == "uuid not in use-gpuuuid"
    assert Constraints(nouse_uuids=("GPU-h200",)).why_not(H200) == "uuid excluded by nouse-gpuuuid"


def test_constraints_empty() -> None:
    assert Constraints().empty
    assert not Constraints(nouse_uuids=("x",)).empty


def test_memory_on() -> None:
    assert ContainerRequest("c", False, 1, memory_mib=3000).memory_on(H200) == 3000
    assert ContainerRequest("c", False, 1, memory_percent=50).memory_on(H200) == 143771 * 50 // 100 == 71885
    assert ContainerRequest("c", False, 1, memory_percent=100).memory_on(T4) == 15360
    tiny = GPUDevice(uuid="g", index=0, model="m", memory_mib=50)
    assert ContainerRequest("c", False, 1, memory_percent=1).memory_on(tiny) == 1  # floor 0 -> at least 1
    # MiB wins when both are set
    assert ContainerRequest("c", False, 1, memory_mib=10, memory_percent=100).memory_on(H200) == 10


def test_cores_on() -> None:
    assert ContainerRequest("c", False, 1, cores=30).cores_on(A100) == 30
    assert ContainerRequest("c", False, 1, cores=100).cores_on(A100) == 200  # whole card of a scaled device
    assert ContainerRequest("c", False, 1, cores=100).cores_on(H200) == 100
    assert ContainerRequest("c", False, 1, cores=0).cores_on(H200) == 0


def test_exclusive() -> None:
    assert ContainerRequest("c", False, 1, cores=100).exclusive
    assert ContainerRequest("c", False, 1, memory_percent=100).exclusive
    assert not ContainerRequest("c", False, 1, memory_percent=99, cores=99).exclusive
    assert not ContainerRequest("c", False, 1, memory_mib=143771).exclusive


def test_pod_request_props() -> None:
    i = ContainerRequest("i", True, 1, memory_mib=1)
    a = ContainerRequest("a", False, 1, memory_mib=1)
    p = PodRequest(namespace="ns", name="n", init=(i,), app=(a,))
    assert p.key == "ns/n"
    assert p.containers == (i, a)
    assert p.has_gpu
    assert not PodRequest(namespace="ns", name="n").has_gpu


def _alloc(*conts: ContainerAllocation) -> PodAllocation:
    return PodAllocation(node="n1", containers=conts, time=1.0)


def test_usage_kf05_init_containers_collapse() -> None:
    inits = [ContainerAllocation(f"init-{k}", True, (DeviceBooking("GPU-0", 10240, c),)) for k, c in
             enumerate((20, 50, 10))]
    app = ContainerAllocation("main", False, (DeviceBooking("GPU-0", 4096, 30),))
    assert _alloc(*inits, app).usage() == {"GPU-0": (10240, 50, 1)}


def test_usage_app_containers_sum() -> None:
    a = ContainerAllocation("a", False, (DeviceBooking("GPU-0", 3000, 30),))
    b = ContainerAllocation("b", False, (DeviceBooking("GPU-0", 5000, 20),))
    assert _alloc(a, b).usage() == {"GPU-0": (8000, 50, 2)}


def test_usage_app_sum_exceeds_init_peak() -> None:
    i = ContainerAllocation("i", True, (DeviceBooking("GPU-0", 6000, 60),))
    a = ContainerAllocation("a", False, (DeviceBooking("GPU-0", 3000, 30),))
    b = ContainerAllocation("b", False, (DeviceBooking("GPU-0", 5000, 20),))
    assert _alloc(i, a, b).usage() == {"GPU-0": (8000, 60, 2)}


def test_usage_init_and_app_on_different_gpus() -> None:
    i = ContainerAllocation("i", True, (DeviceBooking("GPU-0", 10240, 40),))
    a = ContainerAllocation("a", False, (DeviceBooking("GPU-1", 4096, 30),))
    assert _alloc(i, a).usage() == {"GPU-0": (10240, 40, 1), "GPU-1": (4096, 30, 1)}


def test_usage_multi_gpu_container_and_empty() -> None:
    a = ContainerAllocation("a", False, (DeviceBooking("GPU-0", 100, 10), DeviceBooking("GPU-1", 200, 20)))
    b = ContainerAllocation("b", False, (DeviceBooking("GPU-1", 300, 30),))
    assert _alloc(a, b).usage() == {"GPU-0": (100, 10, 1), "GPU-1": (500, 50, 2)}
    assert _alloc().usage() == {}
    assert _alloc(ContainerAllocation("x", False, ())).usage() == {}


def test_pod_allocation_container_lookup_by_name_and_kind() -> None:
    i = ContainerAllocation("same", True, (DeviceBooking("GPU-0", 1, 0),))
    a = ContainerAllocation("same", False, (DeviceBooking("GPU-1", 2, 0),))
    p = _alloc(i, a)
    assert p.container("same") is a
    assert p.container("same", init=True) is i
    assert p.container("other") is None
