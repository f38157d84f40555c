"""The environment contract between the device plugin (writer) and the libvgpu shim (reader).

Written once here; the C shim reads the same names (see docs/env-contract.md).

* ``NVIDIA_VISIBLE_DEVICES``: comma-separated GPU UUIDs, in visible-device order.
* ``CUDA_DEVICE_MEMORY_LIMIT_<i>``: memory limit of visible device i, ``<MiB>m``.
* ``CUDA_DEVICE_SM_LIMIT``: compute limit in percent when all devices share one value; otherwise
  ``CUDA_DEVICE_SM_LIMIT_<i>`` per device. 0 or 100 = no limit.
* ``CUDA_DEVICE_MEMORY_SHARED_CACHE``: path of the container's mmap'd shared accounting file.
* ``CUDA_DISABLE_CONTROL=true``: the pod opts the container out of enforcement.
* ``LIBVGPU_LOG_LEVEL``: 0 (silent) .. 4 (debug).
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import DeviceBooking

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
MEMORY_LIMIT_PREFIX = "CUDA_DEVICE_MEMORY_LIMIT_"
SM_LIMIT = "CUDA_DEVICE_SM_LIMIT"
SM_LIMIT_PREFIX = "CUDA_DEVICE_SM_LIMIT_"
SHARED_CACHE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
DISABLE_CONTROL = "CUDA_DISABLE_CONTROL"
LOG_LEVEL = "LIBVGPU_LOG_LEVEL"
TASK_PRIORITY = "CUDA_TASK_PRIORITY"

#: where the shim and its preload file are mounted inside the container
SHIM_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
PRELOAD_CONTAINER_PATH = "/etc/ld.so.preload"
CACHE_CONTAINER_DIR = "/usr/local/vgpu/cache"


def container_env(devices: Sequence[DeviceBooking], cache_path: str, priority: int | None = None) -> dict[str, str]:
    """The env a container gets for its booked devices (visible order = booking order).

    devices: the container's bookings (memory MiB, cores percent); cache_path: path of the shared
    cache file *inside the container*. Returns name -> value.
    """
    env = {VISIBLE_DEVICES: ",".join(d.uuid for d in devices), SHARED_CACHE: cache_path}
    for i, d in enumerate(devices):
        env[f"{MEMORY_LIMIT_PREFIX}{i}"] = f"{d.memory_mib}m"
    cores = {d.cores for d in devices}
    if len(cores) == 1:
        env[SM_LIMIT] = str(cores.pop())
    else:
        for i, d in enumerate(devices):
            env[f"{SM_LIMIT_PREFIX}{i}"] = str(d.cores)
    if priority is not None:
        env[TASK_PRIORITY] = str(priority)
    return env
