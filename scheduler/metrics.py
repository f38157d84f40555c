"""Prometheus metrics of the extender (own registry per service instance).

Names (all prefixed ``kube_vgpu_scheduler_``):

* ``gpu_allocated_memory_mib`` / ``gpu_allocated_cores_percent`` / ``gpu_allocated_slots`` and the
  matching ``gpu_capacity_*`` gauges, labels ``node``, ``uuid``, ``model`` - computed from the
  bookings at scrape time (nothing on the hot path), rendered by :class:`GpuMetricsText`.
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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5)

#: per GPU: (node, uuid, model, alloc MiB, alloc cores, alloc slots, cap MiB, cap cores, cap slots)
GpuRow = tuple[str, str, str, int, int, int, int, int, int]

#: the per-GPU gauges: (name suffix, help), in the order of a GpuRow's values
GPU_FAMILIES = (
    ("allocated_memory_mib", "Device memory booked on the GPU (MiB)"),
    ("allocated_cores_percent", "Compute booked on the GPU (percent of one GPU)"),
    ("allocated_slots", "vGPU slots (containers) booked on the GPU"),
    ("capacity_memory_mib", "Schedulable device memory of the GPU (MiB)"),
    ("capacity_cores_percent", "Schedulable compute of the GPU (percent)"),
    ("capacity_slots", "vGPU slots of the GPU"),
)
GPU_PREFIX = "kube_vgpu_scheduler_gpu_"


def _label_value(v: str) -> str:
    """A label value escaped for the text exposition format (backslash, quote, newline)."""
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class GpuMetricsText:
    """The per-GPU gauges (:data:`GPU_FAMILIES`, labels ``model``, ``node``, ``uuid``) in the
    Prometheus text exposition format, rendered per node and reused while the node's rows are
    unchanged.

    A 5,000-node x 8-GPU cluster has 240,000 such samples: prometheus_client renders them in
    about 2 s of CPU per scrape, holding the GIL the extender needs. This renders each node's
    lines once (the same text prometheus_client writes: sorted labels, values as floats) and
    afterwards only the nodes whose bookings changed. Thread-safe (one render at a time)."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[tuple[GpuRow, ...], tuple[bytes, ...]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _chunks(rows: tuple[GpuRow, ...]) -> tuple[bytes, ...]:
        out: list[list[str]] = [[] for _ in GPU_FAMILIES]
        for row in rows:
            labels = f'{{model="{_label_value(row[2])}",node="{_label_value(row[0])}",uuid="{_label_value(row[1])}"}} '
            for lines, v in zip(out, row[3:], strict=True):
                lines.append(f"{labels}{floatToGoString(v)}\n")
        return tuple("".join(GPU_PREFIX + suffix + line for line in lines).encode()
                     for (suffix, _), lines in zip(GPU_FAMILIES, out, strict=True))

    def render(self, nodes: Iterable[tuple[str, tuple[GpuRow, ...]]], head: bytes = b"") -> bytes:
        """``nodes``: (node name, its GPUs' rows) -> ``head`` (other families' text) followed by
        the six families, as UTF-8 text (one copy of the whole body)."""
        with self._lock:
            fams: list[list[bytes]] = [[] for _ in GPU_FAMILIES]
            cache = self._nodes
            fresh: dict[str, tuple[tuple[GpuRow, ...], tuple[bytes, ...]]] = {}
            for name, rows in nodes:
                hit = cache.get(name)
                if hit is None or hit[0] != rows:
                    hit = (rows, self._chunks(rows))
                fresh[name] = hit
                for parts, chunk in zip(fams, hit[1], strict=True):
                    parts.append(chunk)
            self._nodes = fresh  # nodes gone from the cluster are dropped
            out = [head]
            for (suffix, help_), parts in zip(GPU_FAMILIES, fams, strict=True):
                name = GPU_PREFIX + suffix
                out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n".encode())
                out.extend(parts)
            return b"".join(out)


class Metrics:
    """All metrics of one service: /metrics renders ``registry`` followed by ``gpus``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.gpus = GpuMetricsText()
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

