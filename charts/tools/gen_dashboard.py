# ruff: noqa: E701, E702, E731, E741
"""Regenerate charts/kube-vgpu/dashboards/kube-vgpu.json (run from anywhere; commit the result).

The chart tests check the output: valid JSON, and every kube_vgpu_* series and label it queries is in a component's
exposition (tests/observability/test_exposition.py)."""
import json
import os

CHART = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'kube-vgpu')
DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []
pid = [0]
def row(title, y):
    pid[0] += 1
    panels.append({"id": pid[0], "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
def ts(title, targets, x, y, w=12, h=8, unit="short", desc="", stack=False, maxv=None):
    pid[0] += 1
    p = {"id": pid[0], "type": "timeseries", "title": title, "description": desc, "datasource": DS,
         "gridPos": {"h": h, "w": w, "x": x, "y": y},
         "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 10, "stacking": {"mode": "normal" if stack else "none"}}}, "overrides": []},
         "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                     "tooltip": {"mode": "multi", "sort": "desc"}},
         "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": e, "legendFormat": l} for i, (e, l) in enumerate(targets)]}
    if maxv is not None:
        p["fieldConfig"]["defaults"]["max"] = maxv
    panels.append(p)
def stat(title, expr, x, y, w=4, h=4, unit="short", desc=""):
    pid[0] += 1
    panels.append({"id": pid[0], "type": "stat", "title": title, "description": desc, "datasource": DS,
                   "gridPos": {"h": h, "w": w, "x": x, "y": y},
                   "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                   "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "area"},
                   "targets": [{"refId": "A", "datasource": DS, "expr": expr}]})

N = 'node=~"$node"'
GI = "{{node}} #{{gpu_index}}"
y = 0
row("Cluster", y); y += 1
stat("GPUs", f'count(kube_vgpu_gpu_memory_capacity_bytes{{{N}}})', 0, y, desc="GPUs advertised by the device plugins.")
stat("Memory allocated", f'sum(kube_vgpu_gpu_memory_allocated_bytes{{{N}}}) / sum(kube_vgpu_gpu_memory_capacity_bytes{{{N}}})', 4, y, unit="percentunit")
stat("Memory used (NVML)", f'sum(kube_vgpu_gpu_memory_used_bytes{{{N}}}) / sum(kube_vgpu_gpu_memory_capacity_bytes{{{N}}})', 8, y, unit="percentunit")
stat("Cores allocated", f'sum(kube_vgpu_gpu_cores_allocated_percent{{{N}}}) / sum(kube_vgpu_gpu_cores_capacity_percent{{{N}}})', 12, y, unit="percentunit")
stat("Pods holding GPUs", 'max(kube_vgpu_scheduler_bookings)', 16, y, desc="Bookings in the scheduler's state (leader).")
stat("Unhealthy GPUs", f'count(kube_vgpu_gpu_healthy{{{N}}} == 0) or vector(0)', 20, y)
y += 4
row("Per GPU: allocated vs used", y); y += 1
ts("GPU memory: allocated vs used", [
    (f'kube_vgpu_gpu_memory_allocated_bytes{{{N}}}', "allocated " + GI),
    (f'kube_vgpu_gpu_memory_used_bytes{{{N}}}', "used " + GI),
    (f'kube_vgpu_gpu_memory_capacity_bytes{{{N}}}', "capacity " + GI)], 0, y, unit="bytes",
   desc="Allocated: booked by pods (allocation records). Used: NVML. Capacity: schedulable memory.")
ts("GPU compute: allocated vs utilisation", [
    (f'kube_vgpu_gpu_cores_allocated_percent{{{N}}}', "allocated " + GI),
    (f'kube_vgpu_gpu_utilization_percent{{{N}}}', "utilisation " + GI)], 12, y, unit="percent",
   desc="Allocated: gpucores booked. Utilisation: NVML SM utilisation.")
y += 8
ts("vGPU slots in use", [
    (f'kube_vgpu_gpu_slots_allocated{{{N}}}', GI),
    (f'kube_vgpu_gpu_slots_capacity{{{N}}}', "capacity " + GI)], 0, y, unit="short")
ts("Scheduler vs device plugins: memory allocated", [
    ('sum by (model) (kube_vgpu_scheduler_memory_allocated_bytes)', "scheduler {{model}}"),
    ('sum by (model) (kube_vgpu_gpu_memory_allocated_bytes)', "device plugins {{model}}")], 12, y, unit="bytes",
   desc="The extender's bookings (promises included) and what the device plugins read from the pods' "
        "allocation records, per GPU model, cluster-wide. They should agree within a bind's time.")
y += 8
row("Per namespace", y); y += 1
ts("GPU memory used by namespace", [
    ('sum by (namespace) (kube_vgpu_container_memory_used_bytes)', "{{namespace}}")], 0, y, unit="bytes", stack=True,
   desc="From each container's shim accounting file (the container's own report).")
ts("GPU memory allocated by namespace", [
    ('sum by (namespace) (kube_vgpu_container_memory_allocated_bytes)', "{{namespace}}")],
   12, y, unit="bytes", stack=True,
   desc="Booked by live pods (allocation records, percentage requests resolved): the hard limits the shim enforces.")
y += 8
ts("GPU cores allocated by namespace", [
    ('sum by (namespace) (kube_vgpu_container_cores_allocated_percent)', "{{namespace}}")],
   0, y, unit="percent", stack=True, desc="Percent of one GPU, summed over GPUs.")
ts("Top containers by GPU memory used", [
    ('topk(10, sum by (namespace, pod, container) (kube_vgpu_container_memory_used_bytes))', "{{namespace}}/{{pod}}/{{container}}")],
   12, y, unit="bytes")
y += 8
row("Scheduling", y); y += 1
ts("Extender latency (p50 / p99)", [
    ('histogram_quantile(0.5, sum by (le) (rate(kube_vgpu_scheduler_filter_seconds_bucket[5m])))', "filter p50"),
    ('histogram_quantile(0.99, sum by (le) (rate(kube_vgpu_scheduler_filter_seconds_bucket[5m])))', "filter p99"),
    ('histogram_quantile(0.99, sum by (le) (rate(kube_vgpu_scheduler_prioritize_seconds_bucket[5m])))', "prioritize p99"),
    ('histogram_quantile(0.5, sum by (le) (rate(kube_vgpu_scheduler_bind_seconds_bucket[5m])))', "bind p50"),
    ('histogram_quantile(0.99, sum by (le) (rate(kube_vgpu_scheduler_bind_seconds_bucket[5m])))', "bind p99")],
   0, y, unit="s")
ts("Webhook latency (p50 / p99)", [
    ('histogram_quantile(0.5, sum by (le) (rate(kube_vgpu_webhook_request_duration_seconds_bucket[5m])))', "p50"),
    ('histogram_quantile(0.99, sum by (le) (rate(kube_vgpu_webhook_request_duration_seconds_bucket[5m])))', "p99")],
   12, y, unit="s")
y += 8
ts("Filter rejections by reason", [
    ('sum by (reason) (rate(kube_vgpu_scheduler_filter_rejections_total[5m]))', "{{reason}}")], 0, y, unit="ops", stack=True,
   desc="Rejected (pod, node) pairs per second, by reason category.")
ts("Binds by outcome", [
    ('sum by (outcome) (rate(kube_vgpu_scheduler_binds_total[5m]))', "{{outcome}}")], 12, y, unit="ops", stack=True)
y += 8
ts("Webhook requests by outcome", [
    ('sum by (outcome) (rate(kube_vgpu_webhook_requests_total[5m]))', "{{outcome}}")], 0, y, unit="ops", stack=True)
ts("Device plugin Allocate calls by result", [
    (f'sum by (result) (rate(kube_vgpu_device_plugin_allocations_total{{{N}}}[5m]))', "{{result}}")], 12, y, unit="ops", stack=True)
y += 8
row("Health", y); y += 1
stat("Scheduler leader", 'max(kube_vgpu_scheduler_is_leader)', 0, y, desc="1 when a replica may bind.")
stat("Scheduler cache synced", 'min(kube_vgpu_scheduler_cache_synced)', 4, y)
stat("Policy config OK", 'min(kube_vgpu_scheduler_config_last_reload_success)', 8, y,
     desc="0 when the last ConfigMap change was invalid (the previous config is kept).")
stat("Unavailable nodes", 'max(kube_vgpu_scheduler_unavailable_nodes)', 12, y)
stat("Device plugins registered", f'sum(kube_vgpu_device_plugin_registered{{{N}}})', 16, y)
stat("Webhook cert expires in", '(min(kube_vgpu_webhook_cert_expiry_timestamp_seconds) - time())', 20, y, unit="s")

dash = {
    "__inputs": [], "uid": "kube-vgpu-overview", "title": "kube-vgpu: GPU sharing",
    "description": "Allocated vs used GPU memory and compute per GPU and namespace, scheduling latency, rejections.",
    "tags": ["kube-vgpu", "gpu"], "timezone": "browser", "editable": True, "schemaVersion": 39, "version": 1,
    "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "node", "type": "query", "label": "Node", "datasource": DS,
         "query": {"query": "label_values(kube_vgpu_gpu_memory_capacity_bytes, node)", "refId": "node"},
         "definition": "label_values(kube_vgpu_gpu_memory_capacity_bytes, node)",
         "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "sort": 1, "hide": 0},
    ]},
    "annotations": {"list": []},
    "panels": panels,
}
open(CHART + "/dashboards/kube-vgpu.json", "w").write(json.dumps(dash, indent=2) + "\n")
