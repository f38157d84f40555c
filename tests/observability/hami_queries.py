"""The PromQL of HAMi's published Grafana dashboard (``dashboards/hami-vgpu-dashboard.json`` of
HAMi v2.10: its panels' targets and its two template variables), and queries over the older
names HAMi still emits with ``--legacy-metrics`` (written here with those names' label sets, as
dashboards and alerts built before v2.10 use them). Each entry: (expr, legendFormat)."""

from __future__ import annotations

N = 'node=~"$node"'
NS = 'namespace=~"$namespace"'
DEV = "{{device_type}} idx{{device_index}} ({{device_uuid}})"
CTR = "{{namespace}}/{{pod}}/{{container}} v{{vdevice_index}}"

#: HAMi v2.10 dashboard: cluster overview, physical GPUs, scheduler / allocation, vGPU / containers
DASHBOARD_V2_10: list[tuple[str, str]] = [
    (f"count(hami_gpu_memory_limit_bytes{{{N}}})", "GPUs"),
    (f"sum(hami_gpu_memory_limit_bytes{{{N}}})", "Total"),
    (f"sum(hami_gpu_memory_allocated_bytes{{{N}}})", "Allocated"),
    (f"100 * sum(hami_gpu_memory_allocated_bytes{{{N}}}) / sum(hami_gpu_memory_limit_bytes{{{N}}})", "Allocated %"),
    (f"sum(hami_gpu_shared_count{{{N}}})", "Shared"),
    (f"hami_host_gpu_memory_used_bytes and on (device_uuid) hami_gpu_memory_limit_bytes{{{N}}}", DEV),
    (f"hami_host_gpu_utilization_ratio and on (device_uuid) hami_gpu_memory_limit_bytes{{{N}}}", DEV),
    (f"sum by (node) (hami_gpu_memory_allocated_bytes{{{N}}})", "allocated {{node}}"),
    (f"sum by (node) (hami_gpu_memory_limit_bytes{{{N}}})", "limit {{node}}"),
    (f"hami_node_gpu_memory_allocated_ratio{{{N}}}", "{{node}} idx{{device_index}}"),
    (f"hami_gpu_core_allocated_ratio{{{N}}}", "{{node}} idx{{device_index}} ({{device_uuid}})"),
    (f"hami_gpu_shared_count{{{N}}}", "{{node}} idx{{device_index}} ({{device_uuid}})"),
    (f"hami_vgpu_memory_used_bytes{{{NS}}}", "used " + CTR),
    (f"hami_vgpu_memory_limit_bytes{{{NS}}}", "limit " + CTR),
    (f"hami_container_device_utilization_ratio{{{NS}}}", CTR),
    (f"100 * hami_vgpu_memory_used_bytes{{{NS}}} / hami_vgpu_memory_limit_bytes{{{NS}}}", CTR),
    # a table panel: its columns are the series' labels
    (f"topk(10, hami_vgpu_memory_used_bytes{{{NS}}})",
     "{{namespace}} {{pod}} {{container}} {{vdevice_index}} {{device_uuid}}"),
    ("label_values(hami_gpu_memory_limit_bytes, node)", ""),
    ("label_values(hami_vgpu_memory_used_bytes, namespace)", ""),
]

#: the dashboard's one panel kube-vgpu cannot fill: per-container SM utilisation has no source
#: here (docs/observability.md, "HAMi compatibility")
UNRESOLVED_V2_10 = {"hami_container_device_utilization_ratio"}

#: the legacy names (before v2.10, and with --legacy-metrics since), with their label sets
LEGACY: list[tuple[str, str]] = [
    ('sum by (nodeid) (GPUDeviceMemoryAllocated{nodeid=~"$node"}) / sum by (nodeid) (GPUDeviceMemoryLimit)',
     "{{nodeid}}"),
    ("GPUDeviceCoreAllocated / GPUDeviceCoreLimit", "{{nodeid}} {{deviceidx}} {{deviceuuid}} {{devicetype}}"),
    ('GPUDeviceSharedNum{deviceuuid=~"$gpu"}', "{{nodeid}} {{deviceidx}}"),
    ("GPUDeviceMemoryAllocated", "{{devicecores}} {{devicetype}}"),
    ("nodeGPUOverview", "{{nodeid}} {{deviceuuid}} {{deviceidx}} {{devicecores}} {{devicememorylimit}} {{devicetype}}"),
    ("nodeGPUMemoryPercentage > 0.9", "{{nodeid}} {{deviceuuid}} {{deviceidx}}"),
    ("HostGPUMemoryUsage", "{{nodeid}} gpu {{deviceidx}} {{deviceuuid}} {{devicetype}}"),
    ("HostCoreUtilization", "{{nodeid}} gpu {{deviceidx}}"),
    ('sum by (podnamespace, podname) (vGPUPodsDeviceAllocated{podnamespace=~"$ns"})', "{{podnamespace}}/{{podname}}"),
    ("vGPUPodsDeviceAllocated", "{{nodename}} {{containeridx}} {{deviceuuid}} {{deviceusedcore}}"),
    ("vGPUMemoryAllocated", "{{podnamespace}}/{{podname}} {{containeridx}} {{nodename}} {{deviceuuid}}"),
    ("vGPUCoreAllocated", "{{podnamespace}}/{{podname}} {{containeridx}}"),
    ("vGPUMemoryPercentage", "{{podname}}"),
    ("vGPUCorePercentage", "{{podname}}"),
    ('vGPU_device_memory_usage_in_bytes{podnamespace=~"$ns"}', "{{podname}}/{{ctrname}} {{vdeviceid}} {{deviceuuid}}"),
    ("vGPU_device_memory_usage_in_bytes / vGPU_device_memory_limit_in_bytes > 0.9",
     "{{podnamespace}}/{{podname}}/{{ctrname}}"),
    ('label_values(vGPU_device_memory_limit_in_bytes, podnamespace)', ""),
    ('sum(hami_gpu_memory_allocated_bytes{zone="vGPU"}) by (device_cores)', "{{device_cores}}"),
    ('hami_node_gpu_overview{zone="vGPU"}', "{{device_memory_limit}} {{device_cores}}"),
    ("hami_vgpu_memory_allocated_bytes", "{{namespace}}/{{pod}} {{container_index}} {{node}} {{device_uuid}}"),
    ("hami_vgpu_core_allocated_ratio", "{{container_index}}"),
    ("hami_gpu_core_limit_ratio", "{{device_type}}"),
    ("hami_container_device_memory_bytes", CTR),
]
