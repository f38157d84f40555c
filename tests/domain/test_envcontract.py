"""kube_vgpu.envcontract: env written by the device plugin for the libvgpu shim."""

from __future__ import annotations

from kube_vgpu.envcontract import container_env
from kube_vgpu.model import DeviceBooking


def test_two_devices_equal_cores() -> None:
    env = container_env([DeviceBooking("GPU-b", 3000, 30), DeviceBooking("GPU-a", 5000, 30)], "/c/cache")
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/c/cache",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "3000m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "5000m",
        "CUDA_DEVICE_SM_LIMIT": "30",
    }


def test_differing_cores_per_device() -> None:
    env = container_env([DeviceBooking("GPU-a", 100, 20), DeviceBooking("GPU-b", 200, 50)], "/x")
    assert env["CUDA_DEVICE_SM_LIMIT_0"] == "20"
    assert env["CUDA_DEVICE_SM_LIMIT_1"] == "50"
    assert "CUDA_DEVICE_SM_LIMIT" not in env
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_MEMORY_LIMIT_1"]) == ("100m", "200m")


def test_priority() -> None:
    devs = [DeviceBooking("GPU-a", 100, 0)]
    assert container_env(devs, "/x", priority=1)["CUDA_TASK_PRIORITY"] == "1"
    assert container_env(devs, "/x", priority=0)["CUDA_TASK_PRIORITY"] == "0"  # 0 is a value, not "unset"
    assert "CUDA_TASK_PRIORITY" not in container_env(devs, "/x")


def test_single_device() -> None:
    env = container_env([DeviceBooking("GPU-a", 143771, 100)], "/x")
    assert env["CUDA_DEVICE_SM_LIMIT"] == "100"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "143771m"
    assert "CUDA_DEVICE_MEMORY_LIMIT_1" not in env
