"""``/livez``, ``/readyz`` and ``/metrics`` (Prometheus text format) of the device plugin.

Naming (docs/observability.md): memory in ``_bytes``, compute in ``_percent`` of one GPU, counts
bare; every series carries ``node``; a GPU is ``gpu_uuid``, ``gpu_index``, ``model``; a workload
``namespace``, ``pod``, ``container`` (and ``vgpu_index``, the device's index inside the container).

Per GPU (labels ``node``, ``gpu_uuid``, ``gpu_index``, ``model``); the device plugins are the one
exporter of per-GPU allocation (the extender exports cluster totals only):

* ``kube_vgpu_gpu_memory_capacity_bytes``, ``kube_vgpu_gpu_cores_capacity_percent``,
  ``kube_vgpu_gpu_slots_capacity``: schedulable (after memory/core scaling and split count);
* ``kube_vgpu_gpu_memory_allocated_bytes``, ``kube_vgpu_gpu_cores_allocated_percent``,
  ``kube_vgpu_gpu_slots_allocated``: booked by live pods on this node (verified allocation records);
* ``kube_vgpu_gpu_memory_used_bytes`` / ``kube_vgpu_gpu_utilization_percent``: from NVML;
* ``kube_vgpu_gpu_healthy``: 1 or 0.

Per container and GPU (labels ``node``, ``namespace``, ``pod``, ``container``, ``vgpu_index``,
``gpu_uuid``): ``kube_vgpu_container_memory_allocated_bytes`` / ``..._cores_allocated_percent``
(the verified allocation record: the limits the shim enforces) and
``kube_vgpu_container_memory_used_bytes`` (the shim's shared cache file, when present and
readable, :mod:`deviceplugin.shimcache`; the container can write that file, so this figure is
the tenant's own report). Per container (labels ``node``, ``namespace``, ``pod``, ``container``):
``kube_vgpu_container_oom_refusals_total``, the allocations the shim refused past the limit
(the same file: the tenant's own report too).

Plugin (label ``node``): ``kube_vgpu_device_plugin_allocations_total{result}``,
``kube_vgpu_device_plugin_prestarts_total{result}``, ``..._registrations_total`` (counters),
``..._registered`` (gauge).

With config ``compat.hamiMetrics: true`` the same state is also exported under HAMi's names
(:mod:`deviceplugin.hami_metrics`).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kube_vgpu.codec import allocation_or_none
from kube_vgpu.model import GPUDevice
from kube_vgpu.scrape import CONNECTION_TIMEOUT, MAX_CONNECTIONS, SharedRender
from kube_vgpu.views import PodView

from . import shimcache

if TYPE_CHECKING:
    from .server import DevicePlugin

log = logging.getLogger("kube_vgpu.deviceplugin.metrics")
MIB = 1024 * 1024

#: labels of a per-GPU series, in order
GPU_LABELS = ["node", "gpu_uuid", "gpu_index", "model"]
#: labels of a per-container, per-GPU series, in order
CONTAINER_LABELS = ["node", "namespace", "pod", "container", "vgpu_index", "gpu_uuid"]
#: labels of a per-container series that is not per GPU (the shim's refusal counter)
REFUSAL_LABELS = CONTAINER_LABELS[:4]


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU at scrape time: the device, what live pods book on it (MiB, cores, containers) and
    NVML's figures (bytes used, utilisation percent; None when NVML has none)."""

    device: GPUDevice
    alloc_mib: int
    alloc_cores: int
    alloc_slots: int
    used_bytes: int | None
    util_percent: float | None


@dataclass(frozen=True, slots=True)
class ContainerState:
    """One container's booking on one GPU at scrape time. ``vgpu_index`` is the device's index
    inside the container; ``used_bytes`` is the shim's report (None without a readable file)."""

    namespace: str
    pod: str
    container: str
    init: bool
    container_index: int
    vgpu_index: int
    gpu_uuid: str
    alloc_mib: int
    alloc_cores: int
    used_bytes: int | None
    oom_refusals: int | None = None  # the container's shim counter (same on each of its GPUs' rows)


def gpu_states(plugin: DevicePlugin) -> list[GpuState]:
    """The node's GPUs with their bookings and NVML usage, read now."""
    booked = plugin.allocated_by_gpu()
    out = []
    for d in plugin.devices():
        mem, c, n = booked.get(d.uuid, (0, 0, 0))
        u = plugin.nvml.usage(d.uuid)
        out.append(GpuState(d, mem, c, n, None if u is None else u.used_mib * MIB,
                            None if u is None else u.util_percent))
    return out


def container_states(plugin: DevicePlugin) -> list[ContainerState]:
    """Every GPU booking of every live pod on the node with a verified allocation record (a
    tenant's edited record never labels the metrics), with the shim's usage where readable.
    ``container_index`` counts the record's containers in order (init first), as HAMi does."""
    out = []
    node = plugin.opts.node_name
    for pod in plugin.trusted_pods():
        view = PodView(pod)
        if not view.active:
            continue
        rec = allocation_or_none(view)
        if rec is None or rec.node != node:
            continue
        uid, ns, name = view.uid, view.namespace, view.name
        for ci, c in enumerate(rec.containers):
            usage = shimcache.read_container(plugin.opts.cache_host_dir, uid, c.name,
                                             plugin.cache_dir_for(uid, c.name))
            for i, d in enumerate(c.devices):
                out.append(ContainerState(ns, name, c.name, c.init, ci, i, d.uuid, d.memory_mib, d.cores,
                                          None if usage is None else usage.used.get(i),
                                          None if usage is None else usage.oom_refusals))
    return out


class PluginCollector(Collector):
    """Collects on every scrape from the plugin's current state (no background work)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    def collect(self) -> Iterator[Any]:
        node = self.p.opts.node_name
        gpus = gpu_states(self.p)
        ctrs = container_states(self.p)
        yield from gpu_families(node, gpus)
        yield from container_families(node, ctrs)
        yield from self._plugin(node)
        if self.p.cfg.compat.hami_metrics:
            from .hami_metrics import hami_families

            yield from hami_families(node, gpus, ctrs)

    def _plugin(self, node: str) -> Iterator[Any]:
        st = self.p.status
        allocs = CounterMetricFamily("kube_vgpu_device_plugin_allocations", "Allocate calls answered",
                                     labels=["node", "result"])
        for k, v in st.allocations.items():
            allocs.add_metric([node, k], v)
        yield allocs
        pre = CounterMetricFamily("kube_vgpu_device_plugin_prestarts", "PreStartContainer calls answered "
                                  "(ok: limits written; error: the container was not started)",
                                  labels=["node", "result"])
        for k, v in st.prestarts.items():
            pre.add_metric([node, k], v)
        yield pre
        reg = CounterMetricFamily("kube_vgpu_device_plugin_registrations", "Registrations with kubelet",
                                  labels=["node"])
        reg.add_metric([node], st.registrations)
        yield reg
        up = GaugeMetricFamily("kube_vgpu_device_plugin_registered", "1 while registered with kubelet",
                               labels=["node"])
        up.add_metric([node], 1 if st.registered else 0)
        yield up


def gpu_families(node: str, gpus: list[GpuState]) -> list[GaugeMetricFamily]:
    """The per-GPU families (names in the module docstring)."""
    def fam(name: str, help_: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help_, labels=GPU_LABELS)
    cap_mem = fam("kube_vgpu_gpu_memory_capacity_bytes", "Schedulable GPU memory (NVML total x memory scaling)")
    cap_cores = fam("kube_vgpu_gpu_cores_capacity_percent", "Schedulable GPU compute (100 x core scaling)")
    cap_slots = fam("kube_vgpu_gpu_slots_capacity", "vGPU slots of the GPU (split count)")
    mem = fam("kube_vgpu_gpu_memory_allocated_bytes", "GPU memory booked by live pods")
    cores = fam("kube_vgpu_gpu_cores_allocated_percent", "GPU compute booked by live pods (percent of one GPU)")
    slots = fam("kube_vgpu_gpu_slots_allocated", "Containers booked on the GPU")
    used = fam("kube_vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML)")
    util = fam("kube_vgpu_gpu_utilization_percent", "GPU utilisation (NVML, percent)")
    healthy = fam("kube_vgpu_gpu_healthy", "1 when the GPU is healthy")
    for g in gpus:
        d = g.device
        lv = [node, d.uuid, str(d.index), d.model]
        cap_mem.add_metric(lv, d.memory_mib * MIB)
        cap_cores.add_metric(lv, d.cores)
        cap_slots.add_metric(lv, d.split)
        mem.add_metric(lv, g.alloc_mib * MIB)
        cores.add_metric(lv, g.alloc_cores)
        slots.add_metric(lv, g.alloc_slots)
        healthy.add_metric(lv, 1 if d.healthy else 0)
        if g.used_bytes is not None:
            used.add_metric(lv, g.used_bytes)
        if g.util_percent is not None:
            util.add_metric(lv, g.util_percent)
    return [cap_mem, cap_cores, cap_slots, mem, cores, slots, used, util, healthy]


def container_families(node: str, ctrs: list[ContainerState]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """The per-container families (names in the module docstring)."""
    mem = GaugeMetricFamily("kube_vgpu_container_memory_allocated_bytes",
                            "GPU memory booked by a container on a GPU (its hard limit)", labels=CONTAINER_LABELS)
    cores = GaugeMetricFamily("kube_vgpu_container_cores_allocated_percent",
                              "GPU compute booked by a container on a GPU (percent of one GPU)",
                              labels=CONTAINER_LABELS)
    used = GaugeMetricFamily("kube_vgpu_container_memory_used_bytes",
                             "GPU memory used by a container (the shim's shared cache file)", labels=CONTAINER_LABELS)
    refusals = CounterMetricFamily("kube_vgpu_container_oom_refusals",
                                   "GPU allocations the shim refused a container past its memory limit "
                                   "(the container's own accounting file; resets when the file is recreated)",
                                   labels=REFUSAL_LABELS)
    counted = set()
    for c in ctrs:
        lv = [node, c.namespace, c.pod, c.container, str(c.vgpu_index), c.gpu_uuid]
        mem.add_metric(lv, c.alloc_mib * MIB)
        cores.add_metric(lv, c.alloc_cores)
        if c.used_bytes is not None:
            used.add_metric(lv, c.used_bytes)
        key = (c.namespace, c.pod, c.container)
        if c.oom_refusals is not None and key not in counted:
            counted.add(key)
            refusals.add_metric([node, *key], c.oom_refusals)
    return [mem, cores, used, refusals]


def make_registry(plugin: DevicePlugin) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PluginCollector(plugin))
    return reg


class Probed(Protocol):
    """What :class:`HealthServer` asks of a component: ``alive()`` for /livez, ``ready()`` (ready,
    reason) for /readyz."""

    def alive(self) -> bool: ...
    def ready(self) -> tuple[bool, str]: ...


class BoundedHTTPServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` under :mod:`kube_vgpu.scrape`'s connection rules: the plain
    server gave every connection a thread for as long as its client kept it open without sending a
    request (about 26 KiB each: 10,000 idle connections from a tenant outgrew the plugin's memory
    limit, and a pid limit stopped its gRPC threads). At most ``max_connections`` are open (a new
    one beyond closes the one that has waited longest for its request, or itself when all are
    being answered); each reads and writes under the handler's ``timeout`` (its socket timeout)."""

    daemon_threads = True
    #: the listen backlog (socketserver's default, 5, dropped the SYN of a probe behind a few
    #: connections the accept loop had not taken yet: kubelet's probe waited 1 s for the retry)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int) -> None:
        self.max_connections = max_connections
        self._lock = threading.Lock()
        #: open connections, oldest first: socket -> True while still waiting for its request
        self._open: dict[socket.socket, bool] = {}
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._open) >= self.max_connections:
                idle = next((s for s, waiting in self._open.items() if waiting), None)
                if idle is None:
                    self.shutdown_request(request)
                    return
                del self._open[idle]
                _wake(idle)  # its thread's read ends; the thread closes it
            self._open[request] = True
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def answering(self, request: Any) -> bool:
        """The connection's request has been read: it is being answered, never evicted. False if
        it was evicted meanwhile (its read ended by the eviction: nothing is to be answered)."""
        with self._lock:
            if request not in self._open:
                return False
            self._open[request] = False
            return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (reset, timed out): one debug line, not a traceback on stderr."""
        log.debug("http connection error", extra={"error": repr(sys.exc_info()[1])[:200]})

    def open_connections(self) -> tuple[int, int]:
        """(open connections, those of them still waiting for their request)."""
        with self._lock:
            return len(self._open), sum(self._open.values())


def _wake(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class HealthServer:
    """A small threaded HTTP server for /livez, /readyz, /metrics (:class:`BoundedHTTPServer`: at
    most ``max_connections`` open, each read and written under ``timeout`` seconds). ``port`` 0
    picks a free port. registry: what /metrics exports (default: the device plugin's,
    :func:`make_registry`; the DRA plugin passes its own)."""

    def __init__(self, plugin: Probed, bind: str, port: int, registry: CollectorRegistry | None = None,
                 max_connections: int = MAX_CONNECTIONS, timeout: float = CONNECTION_TIMEOUT) -> None:
        reg = registry if registry is not None else make_registry(cast("DevicePlugin", plugin))
        metrics = SharedRender(lambda: generate_latest(reg))  # one render at a time (kube_vgpu.scrape)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if not cast(BoundedHTTPServer, self.server).answering(self.request):
                    self.close_connection = True
                    return
                path = self.path.split("?", 1)[0]
                if path == "/livez":
                    ok = plugin.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not alive\n", "text/plain")
                elif path == "/readyz":
                    ok, why = plugin.ready()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                elif path == "/metrics":
                    self._send(200, metrics.get(), "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("http request", extra={"line": format % args})

        Handler.timeout = timeout
        self.httpd = BoundedHTTPServer((bind, port), Handler, max_connections)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="deviceplugin-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
