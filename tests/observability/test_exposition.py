"""One naming scheme across components, checked on their real expositions (collected in-process
from each component's registry, with GPUs, pods and a shim usage file in the state): the
dashboard's queries all resolve, memory is in bytes, the shared labels are spelled the same,
per-GPU allocation has one exporter, and every device plugin series names its node."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .exposition import Exposition, collect, missing

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "kube-vgpu" / "dashboards" / "kube-vgpu.json"
#: labels every component spells the same way (docs/observability.md)
SHARED_LABELS = {"node", "gpu_uuid", "gpu_index", "namespace", "pod", "container", "model"}
#: label spellings that must not come back (other components' or HAMi's names for the same thing)
FORBIDDEN_LABELS = {"uuid", "device_uuid", "device_index", "device_type", "vdevice_index", "nodeid", "node_name",
                    "gpu", "index", "pod_name", "pod_namespace", "container_name"}


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Exposition:
    from tests.fakeapi.server import FakeKubeAPI

    api = FakeKubeAPI()
    api.start()
    try:
        return collect(api, tmp_path_factory.mktemp("obs"))
    finally:
        api.stop()


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p.get("targets", [])]
    out += [(v["definition"], "") for v in dash["templating"]["list"] if v.get("definition")]
    return out


def test_every_dashboard_query_resolves_against_the_components(exposition: Exposition) -> None:
    queries = dashboard_queries()
    assert len(queries) > 30
    assert not missing(exposition, queries, prefix=("kube_vgpu_",))


def test_the_check_catches_a_wrong_name_and_a_wrong_label(exposition: Exposition) -> None:
    """The resolver is not vacuous: an old name, a label a metric lacks and a legend label fail."""
    bad = [("sum(kube_vgpu_gpu_memory_limit_bytes)", ""),
           ('kube_vgpu_gpu_memory_allocated_bytes{device_uuid="x"}', ""),
           ("kube_vgpu_device_plugin_registered", "{{gpu_uuid}}")]
    for q in bad:
        assert missing(exposition, [q], prefix=("kube_vgpu_",)), q


def test_device_plugins_registered_panel_has_its_node_label(exposition: Exposition) -> None:
    assert "node" in exposition.by_component["device-plugin"]["kube_vgpu_device_plugin_registered"]
    assert 'kube_vgpu_device_plugin_registered{node="gpu-node-1"} 0.0' in exposition.texts["device-plugin"]


def test_every_device_plugin_series_names_its_node(exposition: Exposition) -> None:
    text = exposition.texts["device-plugin"]
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(samples) > 30
    assert all('node="gpu-node-1"' in ln for ln in samples), [ln for ln in samples if "node=" not in ln]


def test_one_naming_scheme(exposition: Exposition) -> None:
    """Memory in bytes everywhere (no _mib / _kib / _gib), compute in percent, durations in
    seconds; the shared labels spelled one way; every name prefixed kube_vgpu_."""
    for comp, names in exposition.by_component.items():
        for name, labels in names.items():
            assert name.startswith("kube_vgpu_"), (comp, name)
            assert not re.search(r"_(mib|kib|gib|mb|gb|megabytes|ms|millis|milliseconds)(_|$)", name), (comp, name)
            if "memory" in name and not name.endswith(("_total", "_created")):
                assert name.endswith("_bytes"), (comp, name)
            if "cores" in name or "utilization" in name:
                assert name.endswith("_percent"), (comp, name)
            assert not labels & FORBIDDEN_LABELS, (comp, name, labels & FORBIDDEN_LABELS)


def test_shared_labels_are_spelled_the_same_in_every_component(exposition: Exposition) -> None:
    """Every label naming a node, GPU, model or workload is one of the shared spellings, in every
    component; a GPU is always (gpu_uuid, gpu_index) together with its node; a container is always
    (node, namespace, pod, container), and a container's GPU (vgpu_index) comes with its gpu_uuid."""
    for comp, names in exposition.by_component.items():
        for name, labels in names.items():
            if labels & {"gpu_uuid", "gpu_index"} and "vgpu_index" not in labels:
                assert {"node", "gpu_uuid", "gpu_index", "model"} <= labels, (comp, name, labels)
            if labels & {"pod", "container"}:
                assert {"node", "namespace", "pod", "container"} <= labels, (comp, name, labels)
            if "vgpu_index" in labels:
                assert "gpu_uuid" in labels, (comp, name, labels)
    used = set().union(*(lab for names in exposition.by_component.values() for lab in names.values()))
    assert SHARED_LABELS <= used


def test_per_gpu_allocation_has_one_exporter(exposition: Exposition) -> None:
    """Per-GPU series (a gpu_uuid label) come from the device plugins only; the extender exports
    a few cluster totals per model, whatever the cluster size."""
    per_gpu = {comp for comp, names in exposition.by_component.items() for labels in names.values()
               if "gpu_uuid" in labels}
    assert per_gpu == {"device-plugin"}
    sched = exposition.by_component["scheduler"]
    assert {"kube_vgpu_scheduler_memory_allocated_bytes", "kube_vgpu_scheduler_memory_capacity_bytes"} <= set(sched)
    assert sched["kube_vgpu_scheduler_memory_allocated_bytes"] == {"model"}


def test_scheduler_and_device_plugin_memory_are_in_bytes(exposition: Exposition) -> None:
    """The scheduler's total (3000 MiB booked on n1) and the device plugin's per-GPU figure are
    bytes, computed from the bookings (init containers counted at their peak, as booked)."""
    text = exposition.texts["scheduler"]
    assert 'kube_vgpu_scheduler_memory_allocated_bytes{model="NVIDIA A10"} 3.145728e+09' in text
    dp = exposition.texts["device-plugin"]
    want = (3000 + max(1000, 4000)) * 1024 * 1024  # GPU 0: train + infer (its init container runs before c)
    assert any(ln.startswith("kube_vgpu_gpu_memory_allocated_bytes{") and float(ln.rsplit(" ", 1)[1]) == want
               for ln in dp.splitlines()), dp
