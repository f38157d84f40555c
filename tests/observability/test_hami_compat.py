"""``compat.hamiMetrics: true``: the device plugin exports HAMi's metric names and labels from
kube-vgpu's own state, so HAMi's published dashboard (and dashboards / alerts on the legacy names)
resolve against it; the values are the same figures as kube-vgpu's own series."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.hami_metrics import EXPORTED, NOT_EXPORTED
from kube_vgpu.config import config_from_dict

from .exposition import Exposition, device_plugin_text, missing
from .hami_queries import DASHBOARD_V2_10, LEGACY, UNRESOLVED_V2_10
from .promql import uses

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    from tests.fakeapi.server import FakeKubeAPI

    out = {}
    for hami in (False, True):
        api = FakeKubeAPI()
        api.start()
        try:
            out[hami] = device_plugin_text(api, tmp_path_factory.mktemp("hami"), hami=hami)
        finally:
            api.stop()
    return out


@pytest.fixture(scope="module")
def hami(texts: dict[bool, str]) -> Exposition:
    exp = Exposition()
    exp.add_text("device-plugin", texts[True])
    return exp


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_hami_dashboard_queries_resolve(hami: Exposition) -> None:
    """Every metric name and label HAMi v2.10's dashboard uses is exported, except the one panel
    with no source here (per-container SM utilisation), which the docs name."""
    gaps = missing(hami, DASHBOARD_V2_10)
    assert {g.split()[0] for g in gaps} == UNRESOLVED_V2_10, gaps
    assert UNRESOLVED_V2_10 <= set(NOT_EXPORTED)


def test_legacy_hami_queries_resolve(hami: Exposition) -> None:
    assert not missing(hami, LEGACY)


def test_every_exported_hami_name_is_used_by_a_query_and_present(hami: Exposition) -> None:
    """The fixtures cover the whole exported list, and the list is what the exposition holds."""
    used = set().union(*(uses(e, leg).metrics for e, leg in DASHBOARD_V2_10 + LEGACY))
    assert set(EXPORTED) <= used
    assert set(EXPORTED) <= set(hami.names)
    assert not set(NOT_EXPORTED) & set(hami.names)


def test_the_resolver_fails_an_unknown_name_or_label(hami: Exposition) -> None:
    for q in [("GPUDeviceMemoryUsage", ""), ('HostGPUMemoryUsage{node_name="x"}', ""),
              ("vGPU_device_memory_usage_in_bytes", "{{container}}")]:
        assert missing(hami, [q]), q


def test_off_by_default(texts: dict[bool, str]) -> None:
    assert config_from_dict({}).compat.hami_metrics is False
    names = {n for n, _ in _samples(texts[False])}
    assert not {n for n in names if not n.startswith("kube_vgpu_")}


def test_hami_values_are_kube_vgpu_figures(texts: dict[bool, str]) -> None:
    """Same bookings, same bytes: per GPU and per container, HAMi's series equal kube-vgpu's own
    (allocation, capacity, slots, shim usage), core ratios as HAMi normalises them, zone="vGPU"."""
    s = _samples(texts[True])
    own = {}
    for (name, labels), v in s.items():
        if name.startswith("kube_vgpu_gpu_"):
            d = dict(labels)
            own[(name, d["gpu_uuid"])] = (v, d)
    assert own
    for (name, uuid), (v, d) in own.items():
        hl = {"node": d["node"], "device_uuid": uuid, "device_index": d["gpu_index"],
              "device_type": f"NVIDIA-{d['model']}", "zone": "vGPU"}
        ll = {"nodeid": d["node"], "deviceuuid": uuid, "deviceidx": d["gpu_index"],
              "devicetype": f"NVIDIA-{d['model']}", "zone": "vGPU"}
        key = lambda n, lab: (n, tuple(sorted(lab.items())))  # noqa: E731
        cores = own[("kube_vgpu_gpu_cores_capacity_percent", uuid)][0]
        if name == "kube_vgpu_gpu_memory_capacity_bytes":
            assert s[key("hami_gpu_memory_limit_bytes", hl)] == v == s[key("GPUDeviceMemoryLimit", ll)]
        if name == "kube_vgpu_gpu_memory_allocated_bytes":
            extra = {"device_cores": f"{cores:.0f}"}
            assert s[key("hami_gpu_memory_allocated_bytes", {**hl, **extra})] == v
            assert s[key("GPUDeviceMemoryAllocated", {**ll, "devicecores": f"{cores:.0f}"})] == v
        if name == "kube_vgpu_gpu_slots_allocated":
            assert s[key("hami_gpu_shared_count", hl)] == v == s[key("GPUDeviceSharedNum", ll)]
        if name == "kube_vgpu_gpu_cores_allocated_percent":
            assert s[key("GPUDeviceCoreAllocated", ll)] == v
            assert s[key("hami_gpu_core_allocated_ratio", hl)] == math.ceil(v / cores * 100)
        if name == "kube_vgpu_gpu_memory_used_bytes":
            host = {k: hl[k] for k in ("node", "device_uuid", "device_index", "device_type", "zone")}
            assert s[key("hami_host_gpu_memory_used_bytes", host)] == v
    ctr = {"podnamespace": "team-a", "podname": "train", "ctrname": "c", "vdeviceid": "0", "zone": "vGPU"}
    used = [v for (n, lab), v in s.items() if n == "vGPU_device_memory_usage_in_bytes"
            and {k: x for k, x in lab if k != "deviceuuid"} == ctr]
    assert used == [700 * MIB]
    limit = [v for (n, lab), v in s.items() if n == "hami_vgpu_memory_limit_bytes" and dict(lab)["pod"] == "train"
             and dict(lab)["vdevice_index"] == "0"]
    assert limit == [3000 * MIB]
    pods = {(dict(lab)["podname"], dict(lab)["containeridx"], dict(lab)["deviceusedcore"]): v
            for (n, lab), v in s.items() if n == "vGPUPodsDeviceAllocated"}
    assert pods[("infer", "0", "10")] == 1000 * MIB and pods[("infer", "1", "20")] == 4000 * MIB
    assert all(dict(lab).get("zone") == "vGPU" for (n, lab) in s if not n.startswith("kube_vgpu_"))


def test_config_key_is_validated() -> None:
    from kube_vgpu.errors import ConfigError

    assert config_from_dict({"compat": {"hamiMetrics": True}}).compat.hami_metrics is True
    with pytest.raises(ConfigError, match="compat.hamiMetrics"):
        config_from_dict({"compat": {"hamiMetrics": "yes"}})
