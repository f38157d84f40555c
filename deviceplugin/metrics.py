"""``/livez``, ``/readyz`` and ``/metrics`` (Prometheus text format) of the device plugin.

Metrics (gauges unless noted; labels ``node``, ``device_uuid``, ``device_index``, ``device_type``):

* ``kube_vgpu_gpu_memory_limit_bytes``: schedulable memory (NVML total x memory scaling);
* ``kube_vgpu_gpu_memory_allocated_bytes`` / ``kube_vgpu_gpu_core_allocated_percent`` /
  ``kube_vgpu_gpu_shared_count``: booked by live pods on this node (allocation annotations);
* ``kube_vgpu_gpu_memory_used_bytes`` / ``kube_vgpu_gpu_utilization_percent``: from NVML;
* ``kube_vgpu_gpu_healthy``: 1 or 0;
* ``kube_vgpu_container_memory_used_bytes`` (labels ``namespace``, ``pod``, ``container``,
  ``vdevice_index``, ``device_uuid``): from the shim's shared cache file of each container, when
  present and readable (:mod:`deviceplugin.shimcache`);
* ``kube_vgpu_device_plugin_allocations_total{result}``, ``kube_vgpu_device_plugin_prestarts_total{result}``
  (counters), ``..._registrations_total`` (counter), ``..._registered`` (gauge).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kube_vgpu.codec import allocation_or_none

from . import shimcache

if TYPE_CHECKING:
    from .server import DevicePlugin

log = logging.getLogger("kube_vgpu.deviceplugin.metrics")
MIB = 1024 * 1024


class PluginCollector(Collector):
    """Collects on every scrape from the plugin's current state (no background work)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    def collect(self) -> Iterator[Any]:
        node = self.p.opts.node_name
        labels = ["node", "device_uuid", "device_index", "device_type"]
        limit = GaugeMetricFamily("kube_vgpu_gpu_memory_limit_bytes", "Schedulable GPU memory", labels=labels)
        alloc = GaugeMetricFamily("kube_vgpu_gpu_memory_allocated_bytes", "GPU memory booked by pods", labels=labels)
        cores = GaugeMetricFamily("kube_vgpu_gpu_core_allocated_percent", "GPU compute booked by pods (percent)",
                                  labels=labels)
        shared = GaugeMetricFamily("kube_vgpu_gpu_shared_count", "Containers booked on the GPU", labels=labels)
        used = GaugeMetricFamily("kube_vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=labels)
        util = GaugeMetricFamily("kube_vgpu_gpu_utilization_percent", "GPU utilisation (NVML, percent)",
                                 labels=labels)
        healthy = GaugeMetricFamily("kube_vgpu_gpu_healthy", "1 when the GPU is healthy", labels=labels)
        booked = self.p.allocated_by_gpu()
        for d in self.p.devices():
            lv = [node, d.uuid, str(d.index), d.model]
            limit.add_metric(lv, d.memory_mib * MIB)
            mem, c, n = booked.get(d.uuid, (0, 0, 0))
            alloc.add_metric(lv, mem * MIB)
            cores.add_metric(lv, c)
            shared.add_metric(lv, n)
            healthy.add_metric(lv, 1 if d.healthy else 0)
            u = self.p.nvml.usage(d.uuid)
            if u is not None:
                used.add_metric(lv, u.used_mib * MIB)
                util.add_metric(lv, u.util_percent)
        yield from (limit, alloc, cores, shared, used, util, healthy)
        yield self._containers()
        st = self.p.status
        allocs = CounterMetricFamily("kube_vgpu_device_plugin_allocations", "Allocate calls answered",
                                     labels=["result"])
        for k, v in st.allocations.items():
            allocs.add_metric([k], v)
        yield allocs
        pre = CounterMetricFamily("kube_vgpu_device_plugin_prestarts", "PreStartContainer calls answered "
                                  "(ok: limits written; error: the container was not started)", labels=["result"])
        for k, v in st.prestarts.items():
            pre.add_metric([k], v)
        yield pre
        yield CounterMetricFamily("kube_vgpu_device_plugin_registrations", "Registrations with kubelet",
                                  value=st.registrations)
        yield GaugeMetricFamily("kube_vgpu_device_plugin_registered", "1 while registered with kubelet",
                                value=1 if st.registered else 0)

    def _containers(self) -> GaugeMetricFamily:
        fam = GaugeMetricFamily("kube_vgpu_container_memory_used_bytes",
                                "GPU memory used by a container (shim shared cache)",
                                labels=["namespace", "pod", "container", "vdevice_index", "device_uuid"])
        for pod in self.p.trusted_pods():  # a tenant's edited record never labels the metrics
            meta = pod.get("metadata") or {}
            rec = allocation_or_none(pod)
            if rec is None:
                continue
            for c in rec.containers:
                uid = str(meta.get("uid", ""))
                usage = shimcache.read_container(self.p.opts.cache_host_dir, uid, c.name,
                                                 self.p.cache_dir_for(uid, c.name))
                if usage is None:
                    continue
                for i, d in enumerate(c.devices):
                    if i in usage:
                        fam.add_metric([meta.get("namespace", ""), meta.get("name", ""), c.name, str(i), d.uuid],
                                       usage[i])
        return fam


def make_registry(plugin: DevicePlugin) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PluginCollector(plugin))
    return reg


class HealthServer:
    """A small threaded HTTP server for /livez, /readyz, /metrics. ``port`` 0 picks a free port."""

    def __init__(self, plugin: DevicePlugin, bind: str, port: int) -> None:
        registry = make_registry(plugin)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/livez":
                    ok = plugin.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not alive\n", "text/plain")
                elif path == "/readyz":
                    ok, why = plugin.ready()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                elif path == "/metrics":
                    self._send(200, generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8")
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

        self.httpd = ThreadingHTTPServer((bind, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="deviceplugin-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
