"""The environment contract between the device plugin (writer) and the libvgpu shim (reader).

Written once here; the C shim reads the same names (see docs/env-contract.md).

* ``NVIDIA_VISIBLE_DEVICES``: comma-separated GPU UUIDs (``MIG-...`` for MIG devices, docs/mig.md), in
  visible-device order.
* ``CUDA_DEVICE_MEMORY_LIMIT_<i>``: memory limit of visible device i, ``<MiB>m``.
* ``CUDA_DEVICE_SM_LIMIT``: compute limit in percent when all devices share one value; otherwise
  ``CUDA_DEVICE_SM_LIMIT_<i>`` per device. 0 or 100 = no limit.
* ``CUDA_DEVICE_MEMORY_SHARED_CACHE``: path of the container's mmap'd shared accounting file.
* ``CUDA_DISABLE_CONTROL=true``: the pod opts the container out of enforcement.
* ``LIBVGPU_LOG_LEVEL``: 0 (silent) .. 4 (debug).

The same bookings are also written to the container's read-only *limits file*
(:func:`limits_file`, mounted at ``LIMITS_CONTAINER_PATH``). The shim reads it in every process and it
wins over the environment, so a process started without the env (``env -i``, ``su``, sshd) or with
different values still runs under the container's limits.
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
#: the shared accounting file inside the container (in CACHE_CONTAINER_DIR)
CACHE_CONTAINER_PATH = f"{CACHE_CONTAINER_DIR}/vgpu.cache"
#: read-only directory holding the limits file; the shim's compiled-in path is LIMITS_CONTAINER_PATH
LIMITS_CONTAINER_DIR = "/usr/local/vgpu/limits"
LIMITS_FILE_NAME = "vgpu.limits"
LIMITS_CONTAINER_PATH = f"{LIMITS_CONTAINER_DIR}/{LIMITS_FILE_NAME}"
#: the device plugin's default host directories (``--shim-host-path``, ``--cache-host-dir``; the
#: chart's ``devicePlugin.shimHostDir`` and ``cacheHostDir``): where the shim is installed on a node,
#: and where the per-container accounting directories live. The webhook keeps vGPU pods' hostPath
#: volumes away from them.
SHIM_HOST_DIR = "/usr/local/vgpu"
SHIM_HOST_PATH = f"{SHIM_HOST_DIR}/libvgpu.so"
CACHE_HOST_ROOT = "/var/lib/kube-vgpu"
CACHE_HOST_DIR = f"{CACHE_HOST_ROOT}/containers"
#: format version of the limits file (the shim refuses any other version and fails closed)
LIMITS_FILE_VERSION = 1
#: SM-limit policies: ``default`` enforces the booked cores, ``disable`` turns the SM limit off
CORE_POLICIES = ("default", "disable")
#: how an SM limit shares the GPU: ``strict`` holds a container to its cores even on an idle GPU,
#: ``work_conserving`` lets it use what other containers leave idle (never less than its cores)
CORE_SHARING = ("strict", "work_conserving")
#: what a CUDA graph's launch is checked against: ``sum`` (the sizes of its memory-allocation nodes added up,
#: sound whatever the driver reserves) or ``peak`` (the most they can hold at once over the graph's order;
#: relies on the driver reusing memory between allocations never live together, which it may not do: a tenant
#: could then hold up to the difference past its limit until the reserve is read back after the launch)
GRAPH_MEMORY_BOUNDS = ("sum", "peak")


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


def _check_value(field: str, value: str) -> None:
    if not value or any(c.isspace() for c in value) or "=" in value or "#" in value:
        raise ValueError(f"limits file: {field}={value!r}: must be non-empty, without spaces, '=' or '#'")


def limits_file(devices: Sequence[DeviceBooking], cache_path: str = CACHE_CONTAINER_PATH, *,
                priority: int | None = None, core_policy: str = "default", disable_control: bool = False,
                core_sharing: str = "strict", graph_memory: str = "sum") -> str:
    """Contents of the container's limits file (format version ``LIMITS_FILE_VERSION``, docs/env-contract.md).

    devices: the container's bookings in visible-device order, the same list :func:`container_env`
    gets (memory MiB > 0, cores percent 0..100, 0 or 100 = no SM limit); cache_path: the shared
    accounting file inside the container; priority: ``nvidia.com/priority`` (0 high, 1 low) or None;
    core_policy: one of ``CORE_POLICIES``, the admin's choice; disable_control: no enforcement at all;
    core_sharing: one of ``CORE_SHARING``, the admin's choice; graph_memory: one of ``GRAPH_MEMORY_BOUNDS``, the
    admin's choice. Returns the text (``key=value`` lines).

    Raises:
        ValueError: no devices or more than 16, a booking of 0 MiB or less, cores outside 0..100, a
            UUID or path with spaces, ``=`` or ``#``, a relative cache path, an unknown core policy,
            core sharing or graph memory bound, or a priority other than 0/1. The message names the
            field and the value.
    """
    if not 1 <= len(devices) <= 16:
        raise ValueError(f"limits file: devices={len(devices)}: between 1 and 16 devices are allowed")
    if core_policy not in CORE_POLICIES:
        raise ValueError(f"limits file: core_policy={core_policy!r}: allowed values are {', '.join(CORE_POLICIES)}")
    if core_sharing not in CORE_SHARING:
        raise ValueError(f"limits file: core_sharing={core_sharing!r}: allowed values are {', '.join(CORE_SHARING)}")
    if graph_memory not in GRAPH_MEMORY_BOUNDS:
        raise ValueError(f"limits file: graph_memory={graph_memory!r}: allowed values are "
                         f"{', '.join(GRAPH_MEMORY_BOUNDS)}")
    if priority is not None and priority not in (0, 1):
        raise ValueError(f"limits file: priority={priority!r}: allowed values are 0 (high) and 1 (low)")
    _check_value("shared_cache", cache_path)
    if not cache_path.startswith("/"):
        raise ValueError(f"limits file: shared_cache={cache_path!r}: must be an absolute path")
    lines = ["# kube-vgpu container limits, written by the device plugin (read-only in the container)",
             f"version={LIMITS_FILE_VERSION}", f"devices={len(devices)}"]
    for i, d in enumerate(devices):
        _check_value(f"uuid_{i}", d.uuid)
        if isinstance(d.memory_mib, bool) or not isinstance(d.memory_mib, int) or d.memory_mib <= 0:
            raise ValueError(f"limits file: memory_mib_{i}={d.memory_mib!r}: must be a positive integer (MiB)")
        if isinstance(d.cores, bool) or not isinstance(d.cores, int) or not 0 <= d.cores <= 100:
            raise ValueError(f"limits file: cores_{i}={d.cores!r}: must be an integer percent 0..100")
        lines += [f"uuid_{i}={d.uuid}", f"memory_mib_{i}={d.memory_mib}", f"cores_{i}={d.cores}"]
    lines += [f"shared_cache={cache_path}", f"core_policy={core_policy}", f"core_sharing={core_sharing}",
              f"graph_memory={graph_memory}", f"disable_control={'true' if disable_control else 'false'}"]
    if priority is not None:
        lines.append(f"priority={priority}")
    return "\n".join(lines) + "\n"


#: value of the limits file's ``state`` key in the placeholder the device plugin writes at Allocate
LIMITS_STATE_PENDING = "pending"


def pending_limits_file() -> str:
    """Contents of the placeholder limits file the device plugin writes at ``Allocate``, before it
    knows which pod the container belongs to (docs/device-plugin.md): ``state=pending`` and no
    devices. Every shim that reads limits files fails closed on it (no usable limits: every GPU
    allocation is refused), so a container started without its real limits gets no GPU memory.
    ``PreStartContainer`` replaces it with :func:`limits_file` once the pod is identified."""
    return ("# kube-vgpu container limits: not written yet (the device plugin writes them when kubelet calls\n"
            "# PreStartContainer and the pod is identified); until then every GPU allocation is refused\n"
            f"version={LIMITS_FILE_VERSION}\nstate={LIMITS_STATE_PENDING}\ndevices=0\n")
