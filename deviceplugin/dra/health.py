"""Metrics of the DRA plugin, served with /livez and /readyz by :class:`deviceplugin.metrics.HealthServer`.

All series carry the label ``node``:

* ``kube_vgpu_dra_prepares_total{result="ok|error"}``: claims NodePrepareResources answered;
* ``kube_vgpu_dra_unprepares_total{result="ok|error"}``: claims NodeUnprepareResources answered;
* ``kube_vgpu_dra_prepared_claims``: claims prepared now (the checkpoint's);
* ``kube_vgpu_dra_registered``: 1 once kubelet accepted the registration;
* ``kube_vgpu_dra_gpu_healthy{gpu_uuid, gpu_index}``: 1 or 0 per published GPU;
* ``kube_vgpu_dra_last_publish_timestamp_seconds``: last successful ResourceSlice publish (0 = never).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .plugin import DRAPlugin


class DRACollector(Collector):
    """Reads the plugin's status at every scrape."""

    def __init__(self, plugin: DRAPlugin) -> None:
        self.p = plugin

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        node = self.p.opts.node_name
        st = self.p.status
        for name, doc, counts in (("kube_vgpu_dra_prepares", "claims NodePrepareResources answered", st.prepared),
                                  ("kube_vgpu_dra_unprepares", "claims NodeUnprepareResources answered",
                                   st.unprepared)):
            c = CounterMetricFamily(name, doc, labels=["node", "result"])
            for result, n in sorted(counts.items()):
                c.add_metric([node, result], n)
            yield c
        g = GaugeMetricFamily("kube_vgpu_dra_prepared_claims", "claims prepared on this node", labels=["node"])
        g.add_metric([node], len(self.p.checkpoint.claims))
        yield g
        g = GaugeMetricFamily("kube_vgpu_dra_registered", "1 once kubelet accepted the plugin", labels=["node"])
        g.add_metric([node], 1 if st.registered else 0)
        yield g
        g = GaugeMetricFamily("kube_vgpu_dra_gpu_healthy", "1 when the GPU is healthy",
                              labels=["node", "gpu_uuid", "gpu_index"])
        for d in self.p.devices():
            g.add_metric([node, d.uuid, str(d.index)], 1 if d.healthy else 0)
        yield g
        g = GaugeMetricFamily("kube_vgpu_dra_last_publish_timestamp_seconds",
                              "unix time of the last successful ResourceSlice publish (0 = never)", labels=["node"])
        g.add_metric([node], st.last_publish)
        yield g


def registry(plugin: DRAPlugin) -> CollectorRegistry:
    """A registry exporting :class:`DRACollector` of ``plugin``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DRACollector(plugin))
    return reg
