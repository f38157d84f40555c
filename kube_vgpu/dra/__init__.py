"""Names shared by every part of the kube-vgpu DRA driver (``resource.k8s.io/v1``).

The driver publishes one device per physical GPU in a ResourceSlice whose pool is the node's
name. A device may be allocated to many claims at once (``allowMultipleAllocations: true``);
each claim consumes part of two capacities:

* :data:`CAPACITY_MEMORY` (``memory``): bytes of GPU memory (a Kubernetes quantity such as
  ``3000Mi``), requested in whole MiB.
* :data:`CAPACITY_CORES` (``cores``): percent of the GPU's compute, a plain integer 1..100.

Attribute and capacity names are unqualified: Kubernetes qualifies them with the driver name,
so CEL reads them as ``device.attributes["vgpu.kube-vgpu.io"].model`` and
``device.capacity["vgpu.kube-vgpu.io"].memory``.
"""

from __future__ import annotations

#: The DRA driver name (a DNS subdomain): ResourceSlice ``spec.driver``, the kubelet plugin's
#: registration name, the DeviceClass selector and the CDI vendor all use it.
DRIVER_NAME = "vgpu.kube-vgpu.io"

#: Capacity: GPU memory in bytes (quantities in MiB steps).
CAPACITY_MEMORY = "memory"
#: Capacity: compute in percent of one GPU (0-100 on the device, 1..100 per request).
CAPACITY_CORES = "cores"

#: Attribute: NVML UUID (string, ``GPU-...``).
ATTR_UUID = "uuid"
#: Attribute: NVML product name (string, e.g. ``NVIDIA H200``).
ATTR_MODEL = "model"
#: Attribute: NVML index on the node (int).
ATTR_INDEX = "index"
#: Attribute: NUMA node (int; 0 when unknown).
ATTR_NUMA = "numa"
#: Attribute: NVIDIA driver version (semantic version when it parses, else string).
ATTR_DRIVER_VERSION = "driverVersion"
#: Attribute: schedulable GPU memory in MiB (int), for CEL selectors that compare sizes.
ATTR_MEMORY_MIB = "memoryMiB"

#: Prefix of a device's name in the slice: ``gpu-<NVML index>``.
DEVICE_NAME_PREFIX = "gpu-"

#: Taint key the node component puts on an unhealthy GPU (effect NoSchedule).
TAINT_UNHEALTHY = f"{DRIVER_NAME}/unhealthy"

#: The DeviceClass the chart installs (same as the driver name).
DEVICE_CLASS = DRIVER_NAME


def device_name(index: int) -> str:
    """The device's name in the ResourceSlice for NVML index ``index`` (``gpu-<index>``).

    Raises ValueError for a negative index.
    """
    if index < 0:
        raise ValueError(f"GPU index: {index} is negative; allowed: 0 or more")
    return f"{DEVICE_NAME_PREFIX}{index}"


__all__ = [
    "ATTR_DRIVER_VERSION", "ATTR_INDEX", "ATTR_MEMORY_MIB", "ATTR_MODEL", "ATTR_NUMA", "ATTR_UUID",
    "CAPACITY_CORES", "CAPACITY_MEMORY", "DEVICE_CLASS", "DEVICE_NAME_PREFIX", "DRIVER_NAME",
    "TAINT_UNHEALTHY", "device_name",
]
