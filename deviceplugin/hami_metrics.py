"""HAMi's metric names and labels, computed from kube-vgpu's own state (config
``compat.hamiMetrics: true``), so dashboards and alerts written for HAMi keep working after a
migration.

HAMi splits its metrics between the scheduler (allocation, port 9395) and the vGPU monitor of each
node (usage, port 9394); here the device plugin of each node exports both halves for its own GPUs
and pods, from the same state as its ``kube_vgpu_*`` series (:mod:`deviceplugin.metrics`). Every
series carries HAMi's constant label ``zone="vGPU"``. Two generations of names are exported:

* HAMi v2.10's ``hami_*`` names (labels ``node``, ``device_uuid``, ``device_index``,
  ``device_type``, ...), and
* the older names still emitted by HAMi's ``--legacy-metrics`` (``GPUDeviceMemoryAllocated``,
  ``HostGPUMemoryUsage``, ``vGPU_device_memory_usage_in_bytes``, ... with ``nodeid``,
  ``deviceuuid``, ``deviceidx``, ``podnamespace``, ``podname``, ``ctrname``, ...), plus
  ``vGPUPodsDeviceAllocated`` from before v2.8.

Units follow HAMi: memory in bytes; the ``*_ratio`` core series are percent of the GPU (0-100,
allocated rounded up, as HAMi normalises them); the legacy core series are raw ``gpucores``.
``device_type`` is HAMi's ``NVIDIA-<NVML name>``.

Not exported, because kube-vgpu has no source for them (docs/observability.md lists them):
per-container SM utilisation (``hami_container_device_utilization_ratio``,
``Device_utilization_desc_of_container``), time since a container's last kernel, the context /
module / buffer split of a container's memory, MIG instances, the memory-controller utilisation
and HAMi's ResourceQuota gauges (quota is enforced by the extender: docs/quota.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from .metrics import MIB, ContainerState, GpuState

ZONE = "vGPU"

#: HAMi metric names exported here (the docs table and the tests read this)
EXPORTED = (
    "hami_gpu_memory_limit_bytes", "hami_gpu_core_limit_ratio", "hami_gpu_memory_allocated_bytes",
    "hami_gpu_shared_count", "hami_gpu_core_allocated_ratio", "hami_node_gpu_overview",
    "hami_node_gpu_memory_allocated_ratio", "hami_vgpu_memory_allocated_bytes", "hami_vgpu_core_allocated_ratio",
    "hami_host_gpu_memory_used_bytes", "hami_host_gpu_utilization_ratio", "hami_vgpu_memory_used_bytes",
    "hami_vgpu_memory_limit_bytes", "hami_container_device_memory_bytes",
    "GPUDeviceMemoryLimit", "GPUDeviceCoreLimit", "GPUDeviceMemoryAllocated", "GPUDeviceSharedNum",
    "GPUDeviceCoreAllocated", "nodeGPUOverview", "nodeGPUMemoryPercentage", "vGPUMemoryAllocated",
    "vGPUCoreAllocated", "vGPUMemoryPercentage", "vGPUCorePercentage", "vGPUPodsDeviceAllocated",
    "HostGPUMemoryUsage", "HostCoreUtilization", "vGPU_device_memory_usage_in_bytes",
    "vGPU_device_memory_limit_in_bytes",
)

#: HAMi metric names kube-vgpu cannot fill (no source); see the module docstring
NOT_EXPORTED = (
    "hami_container_device_utilization_ratio", "hami_container_last_kernel_elapsed_seconds",
    "hami_vgpu_memory_context_bytes", "hami_vgpu_memory_module_bytes", "hami_vgpu_memory_buffer_bytes",
    "hami_host_gpu_memory_controller_utilization_ratio", "hami_node_gpu_mig_instance_info", "hami_mig_device_info",
    "hami_resource_quota_used", "hami_resource_quota_limit", "Device_memory_desc_of_container",
    "Device_utilization_desc_of_container", "Device_last_kernel_of_container", "nodeGPUMigInstance", "QuotaUsed",
)


class _Families:
    """Gauge families by name, each with HAMi's constant ``zone`` label last."""

    def __init__(self) -> None:
        self.fams: dict[str, GaugeMetricFamily] = {}

    def add(self, name: str, labels: list[str], values: list[str], value: float,
            help_: str = "HAMi-compatible series (kube-vgpu)") -> None:
        fam = self.fams.get(name)
        if fam is None:
            fam = self.fams[name] = GaugeMetricFamily(name, help_, labels=[*labels, "zone"])
        fam.add_metric([*values, ZONE], value)


def _ratio(part: int, whole: int) -> float:
    """HAMi's normalised core ratio: ``part`` of ``whole`` in percent, rounded up (0 if no whole)."""
    return float(math.ceil(part / whole * 100)) if whole > 0 else 0.0


def hami_families(node: str, gpus: list[GpuState], ctrs: list[ContainerState]) -> Iterator[GaugeMetricFamily]:
    """HAMi's families for this node's ``gpus`` and container bookings ``ctrs`` (the states
    :mod:`deviceplugin.metrics` exports under kube-vgpu's own names)."""
    f = _Families()
    by_uuid = {g.device.uuid: g.device for g in gpus}
    gl = ["node", "device_uuid", "device_index", "device_type"]
    ll = ["nodeid", "deviceuuid", "deviceidx", "devicetype"]
    for g in gpus:
        d = g.device
        dtype = f"NVIDIA-{d.model}"
        ids = [node, d.uuid, str(d.index)]
        cap, alloc = d.memory_mib * MIB, g.alloc_mib * MIB
        for names, labels in ((("hami_gpu_memory_limit_bytes", "hami_gpu_core_limit_ratio",
                                "hami_gpu_shared_count", "hami_gpu_core_allocated_ratio"), gl),
                              (("GPUDeviceMemoryLimit", "GPUDeviceCoreLimit", "GPUDeviceSharedNum",
                                "GPUDeviceCoreAllocated"), ll)):
            legacy = labels is ll
            f.add(names[0], labels, [*ids, dtype], cap)
            f.add(names[1], labels, [*ids, dtype], d.cores if legacy else (100.0 if d.cores > 0 else 0.0))
            f.add(names[2], labels, [*ids, dtype], g.alloc_slots)
            f.add(names[3], labels, [*ids, dtype], g.alloc_cores if legacy else _ratio(g.alloc_cores, d.cores))
        f.add("hami_gpu_memory_allocated_bytes", ["node", "device_uuid", "device_index", "device_cores", "device_type"],
              [*ids, str(d.cores), dtype], alloc)
        f.add("GPUDeviceMemoryAllocated", ["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicetype"],
              [*ids, str(d.cores), dtype], alloc)
        f.add("hami_node_gpu_overview",
              ["node", "device_uuid", "device_index", "device_cores", "device_memory_limit", "device_type"],
              [*ids, str(d.cores), str(d.memory_mib), dtype], alloc)
        f.add("nodeGPUOverview", ["nodeid", "deviceuuid", "deviceidx", "devicecores", "devicememorylimit", "devicetype"],
              [*ids, str(d.cores), str(d.memory_mib), dtype], alloc)
        if d.memory_mib > 0:
            f.add("hami_node_gpu_memory_allocated_ratio", ["node", "device_uuid", "device_index"], ids,
                  g.alloc_mib / d.memory_mib)
            f.add("nodeGPUMemoryPercentage", ["nodeid", "deviceuuid", "deviceidx"], ids, g.alloc_mib / d.memory_mib)
        host = [node, str(d.index), d.uuid, dtype]
        if g.used_bytes is not None:
            f.add("hami_host_gpu_memory_used_bytes", ["node", "device_index", "device_uuid", "device_type"], host,
                  g.used_bytes)
            f.add("HostGPUMemoryUsage", ["nodeid", "deviceidx", "deviceuuid", "devicetype"], host, g.used_bytes)
        if g.util_percent is not None:
            f.add("hami_host_gpu_utilization_ratio", ["node", "device_index", "device_uuid", "device_type"], host,
                  g.util_percent)
            f.add("HostCoreUtilization", ["nodeid", "deviceidx", "deviceuuid", "devicetype"], host, g.util_percent)
    al = ["namespace", "node", "pod", "container_index", "device_uuid"]
    lal = ["podnamespace", "nodename", "podname", "containeridx", "deviceuuid"]
    ml = ["namespace", "pod", "container", "vdevice_index", "device_uuid"]
    lml = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"]
    for c in ctrs:
        dev = by_uuid.get(c.gpu_uuid)
        total_mib, total_cores = (dev.memory_mib, dev.cores) if dev is not None else (0, 0)
        a = [c.namespace, node, c.pod, str(c.container_index), c.gpu_uuid]
        mem = c.alloc_mib * MIB
        f.add("hami_vgpu_memory_allocated_bytes", al, a, mem)
        f.add("hami_vgpu_core_allocated_ratio", al, a, _ratio(c.alloc_cores, total_cores))
        f.add("vGPUMemoryAllocated", lal, a, mem)
        f.add("vGPUCoreAllocated", lal, a, c.alloc_cores)
        f.add("vGPUPodsDeviceAllocated", [*lal, "deviceusedcore"], [*a, str(c.alloc_cores)], mem)
        if total_mib > 0:
            f.add("vGPUMemoryPercentage", lal, a, c.alloc_mib / total_mib)
        if total_cores > 0:
            f.add("vGPUCorePercentage", lal, a, c.alloc_cores / total_cores)
        m = [c.namespace, c.pod, c.container, str(c.vgpu_index), c.gpu_uuid]
        f.add("hami_vgpu_memory_limit_bytes", ml, m, mem)
        f.add("vGPU_device_memory_limit_in_bytes", lml, m, mem)
        if c.used_bytes is not None:
            f.add("hami_vgpu_memory_used_bytes", ml, m, c.used_bytes)
            f.add("hami_container_device_memory_bytes", ml, m, c.used_bytes)
            f.add("vGPU_device_memory_usage_in_bytes", lml, m, c.used_bytes)
    # every exported family appears (HELP/TYPE) even when this node has no sample for it
    for name in EXPORTED:
        if name not in f.fams:
            f.fams[name] = GaugeMetricFamily(name, "HAMi-compatible series (kube-vgpu)", labels=["zone"])
    yield from f.fams.values()
