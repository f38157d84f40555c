"""Prometheus metrics of the extender (own registry per service instance).

Names (all prefixed ``kube_vgpu_scheduler_``; memory in bytes, compute in percent of one GPU,
the project's naming scheme in docs/observability.md):

* ``gpus``, ``memory_capacity_bytes`` / ``memory_allocated_bytes``, ``cores_capacity_percent`` /
  ``cores_allocated_percent``, ``slots_capacity`` / ``slots_allocated``: cluster totals per GPU
  ``model`` in the extender's own state (bookings and promises), summed at scrape time
  (:class:`GpuTotals`). Per-GPU allocation is exported by the device plugins only
  (``kube_vgpu_gpu_*``, one scrape target per node): the extender's scrape stays small at any
  cluster size.
* ``filter_seconds`` / ``prioritize_seconds`` / ``bind_seconds`` histograms (handler time).
* ``filter_rejections_total{reason}`` - rejected (pod, node) pairs by fit failure code
  (:class:`kube_vgpu.placement.status.Code` values, e.g. ``insufficient_memory``).
* ``assumed_pods`` gauge / ``assumptions_expired_total`` - pods holding a promise on their chosen
  node while kube-scheduler binds them, and promises that ended unbound (their time ran out).
* ``binds_total{outcome}`` - outcome in success | unschedulable | api_error | conflict | not_leader
  | invalid | not_found.
* ``allocation_records_rejected_total{reason}`` - pods whose allocation record was refused (once
  per pod): reason missing | malformed | unknown-key | mismatch | undecodable | other-node.
* ``config_reload_errors_total{key}``, ``config_last_reload_success`` (1/0), ``is_leader``,
  ``cache_synced``, ``nodes`` / ``unavailable_nodes`` / ``bookings`` gauges.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5)
MIB = 1024 * 1024

#: per GPU: (node, uuid, model, alloc MiB, alloc cores, alloc slots, cap MiB, cap cores, cap slots)
GpuRow = tuple[str, str, str, int, int, int, int, int, int]

#: the cluster totals per model: (name, help, index in a GpuRow or None for the GPU count, scale)
TOTAL_FAMILIES: tuple[tuple[str, str, int | None, int], ...] = (
    ("kube_vgpu_scheduler_gpus", "GPUs in the extender's state, by model", None, 1),
    ("kube_vgpu_scheduler_memory_allocated_bytes", "GPU memory booked (bookings and promises), bytes", 3, MIB),
    ("kube_vgpu_scheduler_cores_allocated_percent", "GPU compute booked, percent of one GPU summed", 4, 1),
    ("kube_vgpu_scheduler_slots_allocated", "vGPU slots (containers) booked", 5, 1),
    ("kube_vgpu_scheduler_memory_capacity_bytes", "Schedulable GPU memory, bytes", 6, MIB),
    ("kube_vgpu_scheduler_cores_capacity_percent", "Schedulable GPU compute, percent of one GPU summed", 7, 1),
    ("kube_vgpu_scheduler_slots_capacity", "vGPU slots", 8, 1),
)


def _sums(rows: tuple[GpuRow, ...]) -> dict[str, list[int]]:
    """Per model: [GPUs, alloc MiB, alloc cores, alloc slots, cap MiB, cap cores, cap slots]."""
    out: dict[str, list[int]] = {}
    for _node, _uuid, model, *vals in rows:
        cur = out.get(model)
        if cur is None:
            cur = out[model] = [0] * 7
        cur[0] += 1
        for i, v in enumerate(vals, 1):
            cur[i] += v
    return out


class GpuTotals:
    """The cluster totals per GPU model (:data:`TOTAL_FAMILIES`) from the per-node GPU rows the
    service snapshots on its event loop (:meth:`scheduler.service.SchedulerService.gpu_rows`).

    A node's sums are kept while its rows tuple is the same object (the service reuses it while
    the node is unchanged), so a scrape costs O(nodes) plus O(GPUs) of the changed nodes, and its
    text is a few lines whatever the cluster size. Thread-safe (one render at a time)."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[tuple[GpuRow, ...], dict[str, list[int]]]] = {}
        self._lock = threading.Lock()

    def totals(self, nodes: Iterable[tuple[str, tuple[GpuRow, ...]]]) -> dict[str, list[int]]:
        """Per model: [GPUs, alloc MiB, alloc cores, alloc slots, cap MiB, cap cores, cap slots]."""
        with self._lock:
            fresh: dict[str, tuple[tuple[GpuRow, ...], dict[str, list[int]]]] = {}
            total: dict[str, list[int]] = {}
            for name, rows in nodes:
                hit = self._nodes.get(name)
                if hit is None or (hit[0] is not rows and hit[0] != rows):
                    hit = (rows, _sums(rows))
                fresh[name] = hit
                for model, vals in hit[1].items():
                    cur = total.get(model)
                    if cur is None:
                        cur = total[model] = [0] * 7
                    for i, v in enumerate(vals):
                        cur[i] += v
            self._nodes = fresh  # nodes gone from the cluster are dropped
            return total

    def render(self, nodes: Iterable[tuple[str, tuple[GpuRow, ...]]], head: bytes = b"") -> bytes:
        """``nodes``: (node name, its GPUs' rows) -> ``head`` (the registry's text) followed by the
        totals families, in the Prometheus text format (UTF-8)."""
        total = self.totals(nodes)
        fams = []
        for k, (name, help_, _, scale) in enumerate(TOTAL_FAMILIES):
            fam = GaugeMetricFamily(name, help_, labels=["model"])
            for model in sorted(total):
                fam.add_metric([model], total[model][k] * scale)
            fams.append(fam)

        class _Once:
            def collect(self) -> Iterable[GaugeMetricFamily]:
                return fams

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Once())  # type: ignore[arg-type]
        return head + generate_latest(reg)


class Metrics:
    """All metrics of one service: /metrics renders ``registry`` followed by ``gpus`` (the
    cluster totals, :class:`GpuTotals`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.gpus = GpuTotals()
        p = "kube_vgpu_scheduler_"
        self.filter_seconds = Histogram(p + "filter_seconds", "Filter handler latency", registry=r,
                                        buckets=LATENCY_BUCKETS)
        self.prioritize_seconds = Histogram(p + "prioritize_seconds", "Prioritize handler latency", registry=r,
                                            buckets=LATENCY_BUCKETS)
        self.bind_seconds = Histogram(p + "bind_seconds", "Bind handler latency (includes API calls)",
                                      registry=r, buckets=LATENCY_BUCKETS)
        self.filter_rejections = Counter(p + "filter_rejections", "Rejected (pod, node) pairs by fit failure code",
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
        self.events_dropped = Counter(p + "events_dropped", "Filter rejections not counted (queue full)",
                                      registry=r)
        self.assumed = Gauge(p + "assumed_pods", "Pods holding a promise on their node until bound", registry=r)
        self.assumptions_expired = Counter(p + "assumptions_expired", "Promises that ended unbound (expired)",
                                           registry=r)
        self.records_rejected = Counter(p + "allocation_records_rejected",
                                        "Pods whose allocation record books nothing (not written by the vGPU "
                                        "system), once per pod, by reason", ["reason"], registry=r)
        self.config_ok.set(1)

