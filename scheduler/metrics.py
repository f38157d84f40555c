"""Prometheus metrics of the extender (own registry per service instance).

Names (all prefixed ``kube_vgpu_scheduler_``):

* ``gpu_allocated_memory_mib`` / ``gpu_allocated_cores_percent`` / ``gpu_allocated_slots`` and the
  matching ``gpu_capacity_*`` gauges, labels ``node``, ``uuid``, ``model`` - computed from the
  bookings at scrape time (nothing on the hot path).
* ``filter_seconds`` / ``prioritize_seconds`` / ``bind_seconds`` histograms (handler time).
* ``filter_rejections_total{reason}`` - rejected (pod, node) pairs by reason category
  (:data:`scheduler.reasons.CATEGORIES`).
* ``binds_total{outcome}`` - outcome in success | unschedulable | api_error | conflict | not_leader
  | invalid | not_found.
* ``config_reload_errors_total{key}``, ``config_last_reload_success`` (1/0), ``is_leader``,
  ``cache_synced``, ``nodes`` / ``unavailable_nodes`` / ``bookings`` gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5)

#: per GPU: (node, uuid, model, alloc MiB, alloc cores, alloc slots, cap MiB, cap cores, cap slots)
GpuRow = tuple[str, str, str, int, int, int, int, int, int]


class _GpuCollector(Collector):
    def __init__(self, snapshot: Callable[[], Iterable[GpuRow]]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        labels = ["node", "uuid", "model"]
        fams = [GaugeMetricFamily(f"kube_vgpu_scheduler_gpu_{n}", h, labels=labels) for n, h in (
            ("allocated_memory_mib", "Device memory booked on the GPU (MiB)"),
            ("allocated_cores_percent", "Compute booked on the GPU (percent of one GPU)"),
            ("allocated_slots", "vGPU slots (containers) booked on the GPU"),
            ("capacity_memory_mib", "Schedulable device memory of the GPU (MiB)"),
            ("capacity_cores_percent", "Schedulable compute of the GPU (percent)"),
            ("capacity_slots", "vGPU slots of the GPU"))]
        for row in self.snapshot():
            lv = [row[0], row[1], row[2]]
            for f, v in zip(fams, row[3:], strict=True):
                f.add_metric(lv, v)
        yield from fams


class Metrics:
    """All metrics of one service; ``registry`` is what /metrics renders."""

    def __init__(self, gpu_snapshot: Callable[[], Iterable[GpuRow]]):
        r = self.registry = CollectorRegistry()
        p = "kube_vgpu_scheduler_"
        self.filter_seconds = Histogram(p + "filter_seconds", "Filter handler latency", registry=r,
                                        buckets=LATENCY_BUCKETS)
        self.prioritize_seconds = Histogram(p + "prioritize_seconds", "Prioritize handler latency", registry=r,
                                            buckets=LATENCY_BUCKETS)
        self.bind_seconds = Histogram(p + "bind_seconds", "Bind handler latency (includes API calls)",
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.filter_rejections = Counter(p + "filter_rejections", "Rejected (pod, node) pairs by reason",
                                         ["reason"], registry=r)
        self.binds = Counter(p + "binds", "Bind requests by outcome", ["outcome"], registry=r)
        self.config_reload_errors = Counter(p + "config_reload_errors", "Invalid policy config files seen",
                                            ["key"], registry=r)
        self.config_ok = Gauge(p + "config_last_reload_success", "1 if the last config (re)load succeeded",
                               registry=r)
        self.is_leader = Gauge(p + "is_leader", "1 if this replica may bind", registry=r)
        self.synced = Gauge(p + "cache_synced", "1 once nodes and pods are listed", registry=r)
        self.nodes = Gauge(p + "nodes", "Nodes with a vGPU inventory", registry=r)
        self.unavailable = Gauge(p + "unavailable_nodes", "Nodes that are not candidates", registry=r)
        self.bookings = Gauge(p + "bookings", "Pods holding GPUs", registry=r)
        self.events_dropped = Counter(p + "events_dropped", "Pod events not sent (queue full)", registry=r)
        self.config_ok.set(1)
        r.register(_GpuCollector(gpu_snapshot))
