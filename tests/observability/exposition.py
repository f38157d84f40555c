"""Each component's /metrics exposition, collected in-process from its own registry, with some
state in it (GPUs, a booked pod, a shim usage file) so that per-GPU and per-container series
have samples and so label names can be checked.

:class:`Exposition` is the union: sample names (``_total``, ``_bucket``, ... included) and family
names, each with the label names seen on it (from samples, and from the declared label names of
a labelled metric that has no child yet).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

NODE = "gpu-node-1"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": (), "untyped": (), "info": ("_info",)}


@dataclass
class Exposition:
    """Metric name -> label names seen, per component and in all (``names``)."""

    names: dict[str, set[str]] = field(default_factory=dict)
    by_component: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def add_text(self, component: str, text: str, declared: dict[str, set[str]] | None = None) -> None:
        comp = self.by_component.setdefault(component, {})
        self.texts[component] = text
        for fam in text_string_to_metric_families(text):
            labels = set((declared or {}).get(fam.name, set()))
            for s in fam.samples:
                labels |= set(s.labels) - {"le", "quantile"}
            for n in (fam.name, *(fam.name + x for x in SUFFIXES.get(fam.type, ()))):
                comp.setdefault(n, set()).update(labels)
            for s in fam.samples:
                comp.setdefault(s.name, set()).update(s.labels)  # le, quantile on _bucket / summary samples
        for n, labels in comp.items():
            self.names.setdefault(n, set()).update(labels)


def declared_labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Label names of the registry's labelled metrics (prometheus_client objects), by family name."""
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):  # noqa: SLF001 - read-only look
        names = getattr(collector, "_labelnames", None)
        if names:
            out[collector._name] = set(names)  # type: ignore[attr-defined]  # noqa: SLF001
    return out


def scheduler_text() -> tuple[str, dict[str, set[str]]]:
    """The extender's /metrics body (registry and cluster totals) with two nodes, one booking."""
    from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
    from tests.scheduler.vgpu_sched_util import node_obj, offline_service

    svc = offline_service([node_obj("n1", 2), node_obj("n2", 1, model="NVIDIA H200")])
    svc.cache.state.book("default/x", PodAllocation("n1", (ContainerAllocation("c", False, (
        DeviceBooking("GPU-n1-01", 3000, 30),)),)))
    return svc.render_metrics(svc.gpu_rows()).decode(), declared_labels(svc.metrics.registry)


def webhook_text() -> tuple[str, dict[str, set[str]]]:
    from webhook.server import Metrics

    m = Metrics()
    return generate_latest(m.registry).decode(), declared_labels(m.registry)


def device_plugin_text(api: Any, tmp: Path, *, hami: bool = False, overbook: bool = False) -> str:
    """A device plugin on simulated GPUs (2 x 24 GiB) with two signed pods bound to it: ``train``
    (container ``c``: GPU 0 3000 MiB 30 %, GPU 1 2000 MiB 0 %) and ``infer`` (init ``i`` then ``c``,
    GPU 0), the shim's usage file of ``train/c`` (700 MiB on its device 0). With ``overbook``, also
    ``hog`` on GPU 1 (``c``: 23000 MiB 90 %, using 22400 MiB; ``d``: 100 MiB 20 %): GPU 1 is then
    booked beyond its memory and compute, and ``hog/c`` is near its limit. No gRPC, no threads:
    only what /metrics reads."""
    from deviceplugin.kube import ApiKubeClient
    from deviceplugin.metrics import make_registry
    from deviceplugin.server import DevicePlugin, Options
    from deviceplugin.shimcache import cache_path
    from deviceplugin.simgpu import SimulatedGPUs
    from kube_vgpu.config import config_from_dict
    from tests.deviceplugin.dp_helpers import KEYS, bound_pod, create_signed, write_region

    sim = SimulatedGPUs("2x24576:NVIDIA A10", NODE)
    u = [g.uuid for g in sim.gpus]
    opts = Options(node_name=NODE, device_plugin_dir=str(tmp / "dp"), shim_host_path=str(tmp / "libvgpu.so"),
                   cache_host_dir=str(tmp / "containers"))
    kube = ApiKubeClient(api_client=api.api_client())
    p = DevicePlugin(config_from_dict({"compat": {"hamiMetrics": hami}}), opts, kube, nvml=sim, keys=KEYS)
    p.nvml.init()
    p._discover()  # noqa: SLF001 - the inventory without starting the gRPC server
    for ns in ("team-a", "team-b"):
        api.create_object("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    train = create_signed(api, bound_pod("train", [("c", False, [(u[0], 3000, 30), (u[1], 2000, 0)], {})],
                                         namespace="team-a"))
    create_signed(api, bound_pod("infer", [("i", True, [(u[0], 1000, 10)], {}), ("c", False, [(u[0], 4000, 20)], {})],
                                 namespace="team-b"))
    write_region(Path(cache_path(opts.cache_host_dir, train["metadata"]["uid"], "c")), {0: 700 * 1024 * 1024})
    if overbook:
        hog = create_signed(api, bound_pod("hog", [("c", False, [(u[1], 23000, 90)], {}),
                                                   ("d", False, [(u[1], 100, 20)], {})], namespace="team-a"))
        write_region(Path(cache_path(opts.cache_host_dir, hog["metadata"]["uid"], "c")), {0: 22400 * 1024 * 1024})
    p._pods = kube.list_node_pods(NODE)  # noqa: SLF001 - what the pod watch would have listed
    return generate_latest(make_registry(p)).decode()


def collect(api: Any, tmp: Path, *, hami: bool = False) -> Exposition:
    """The union of the three components' expositions."""
    out = Exposition()
    text, declared = scheduler_text()
    out.add_text("scheduler", text, declared)
    text, declared = webhook_text()
    out.add_text("webhook", text, declared)
    out.add_text("device-plugin", device_plugin_text(api, tmp, hami=hami))
    return out


def missing(exp: Exposition, queries: Iterable[tuple[str, str]], *, prefix: tuple[str, ...] = ()) -> list[str]:
    """What the queries (expr, legend) use that the exposition lacks: ``metric`` (a name) or
    ``metric{label}`` (a label matched on that metric) or ``{label}`` (a label no metric of the
    query has). Only metrics starting with one of ``prefix`` are checked when it is given."""
    from .promql import uses

    out: list[str] = []
    for expr, legend in queries:
        u = uses(expr, legend)
        mine = {m for m in u.metrics if not prefix or m.startswith(prefix)}
        if not mine:
            continue
        for m in sorted(mine):
            if m not in exp.names:
                out.append(f"{m}  (in {expr!r})")
        for m, labels in u.selectors.items():
            if m in mine and m in exp.names:
                out += [f"{m}{{{lab}}}  (in {expr!r})" for lab in sorted(labels - exp.names[m])]
        have = set().union(*(exp.names.get(m, set()) for m in mine))
        if u.metrics == mine and not mine - set(exp.names):  # only our metrics: every label must be on one
            out += [f"{{{lab}}}  (in {expr!r} / {legend!r})" for lab in sorted(u.labels - have)]
    return out
