"""The chart's PrometheusRule (``prometheusRule.enabled``, off by default): it renders as a valid
monitoring.coreos.com/v1 PrometheusRule, ships the promised alerts, and every expression's metric
and label names exist in the components' expositions (``up`` is Prometheus' own; its ``job``
values are the chart's Service names, which the ServiceMonitors use as job)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.chart.conftest import Renderer, find_all

from .exposition import Exposition, collect, missing
from .promql import uses

ALERTS = {"KubeVgpuExtenderDown", "KubeVgpuExtenderNoLeader", "KubeVgpuBindFailures", "KubeVgpuPolicyConfigInvalid",
          "KubeVgpuWebhookDown", "KubeVgpuWebhookErrors", "KubeVgpuWebhookCertExpiresSoon", "KubeVgpuDevicePluginDown",
          "KubeVgpuDevicePluginNotRegistered", "KubeVgpuGPUUnhealthy", "KubeVgpuGPUMemoryOverAllocated",
          "KubeVgpuGPUCoresOverAllocated", "KubeVgpuContainerMemoryNearLimit", "KubeVgpuContainerOutOfMemory"}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
BUILTIN = {"up"}  # written by Prometheus for every target


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    from tests.chart.conftest import _load_get_helm

    gh = _load_get_helm()
    try:
        helm = gh.get_helm()
    except gh.FetchError as e:
        pytest.skip(f"helm unavailable: {e}")
    return Renderer(Path(helm), tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def docs(renderer: Renderer) -> list[dict[str, Any]]:
    return renderer.render({"serviceMonitor": {"enabled": True},
                            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}})


@pytest.fixture(scope="module")
def rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (pr,) = find_all(docs, "PrometheusRule")
    return [r for g in pr["spec"]["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Exposition:
    from tests.fakeapi.server import FakeKubeAPI

    api = FakeKubeAPI()
    api.start()
    try:
        return collect(api, tmp_path_factory.mktemp("obs"))
    finally:
        api.stop()


def test_off_by_default(renderer: Renderer) -> None:
    assert not find_all(renderer.render({}), "PrometheusRule")


def test_renders_a_valid_prometheusrule(docs: list[dict[str, Any]], rules: list[dict[str, Any]]) -> None:
    (pr,) = find_all(docs, "PrometheusRule")
    assert (pr["apiVersion"], pr["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert pr["metadata"]["namespace"] == "gpu-system" and pr["metadata"]["labels"]["release"] == "prometheus"
    assert set(pr) == {"apiVersion", "kind", "metadata", "spec"}
    assert [set(g) for g in pr["spec"]["groups"]] == [{"name", "rules"}]
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        assert isinstance(r["expr"], str) and r["expr"].strip()
        assert DURATION.match(r["for"]), r
        assert r["labels"]["severity"] in {"critical", "warning", "info"}
        assert all(isinstance(v, str) for v in r["annotations"].values())
        assert r["annotations"]["summary"] and r["annotations"]["runbook_url"].startswith("https://")
        assert r["expr"].count("(") == r["expr"].count(")") and r["expr"].count("{") == r["expr"].count("}")
    assert len({r["alert"] for r in rules}) == len(rules)


def test_ships_the_promised_alerts(rules: list[dict[str, Any]]) -> None:
    assert {r["alert"] for r in rules} == ALERTS


def test_alert_templates_reach_prometheus_unrendered(rules: list[dict[str, Any]]) -> None:
    """Prometheus' own {{ $labels.x }} must survive Helm, and name labels the series have."""
    gpu = next(r for r in rules if r["alert"] == "KubeVgpuGPUUnhealthy")
    assert "{{ $labels.node }}" in gpu["annotations"]["summary"]
    assert "{{ $labels.gpu_uuid }}" in gpu["annotations"]["summary"]


def test_every_expression_resolves_against_the_components(rules: list[dict[str, Any]],
                                                          exposition: Exposition) -> None:
    gaps = []
    for r in rules:
        legend = " ".join(r["annotations"].values())
        u = uses(r["expr"], legend)
        ours = u.metrics - BUILTIN
        assert ours or u.metrics == BUILTIN, r["expr"]
        gaps += missing(exposition, [(r["expr"], legend if ours == u.metrics else "")],
                        prefix=("kube_vgpu_",))
    assert not gaps


def test_up_jobs_are_the_scraped_services(docs: list[dict[str, Any]], rules: list[dict[str, Any]]) -> None:
    """The ServiceMonitors' job label is the Service's name: every up{job=...} names a Service a
    ServiceMonitor of the chart selects."""
    services = {d["metadata"]["name"]: d for d in find_all(docs, "Service")}
    monitors = find_all(docs, "ServiceMonitor")
    scraped = {name for name, svc in services.items() for m in monitors
               if m["spec"]["selector"]["matchLabels"].items() <= (svc["metadata"].get("labels") or {}).items()}
    jobs = {j for r in rules for j in re.findall(r'up\{job="([^"]+)"\}', r["expr"])}
    assert len(jobs) == 3 and jobs <= scraped, (jobs, scraped)


def test_memory_near_limit_threshold_is_a_value(renderer: Renderer) -> None:
    docs = renderer.render({"prometheusRule": {"enabled": True, "memoryNearLimitRatio": 0.8}})
    (pr,) = find_all(docs, "PrometheusRule")
    r = next(r for g in pr["spec"]["groups"] for r in g["rules"] if r["alert"] == "KubeVgpuContainerMemoryNearLimit")
    assert "> 0.8" in r["expr"] and "80%" in r["annotations"]["summary"]
    bad = renderer.template({"prometheusRule": {"enabled": True, "memoryNearLimitRatio": 2}})
    assert bad.returncode != 0 and "memoryNearLimitRatio" in bad.stderr


def _anchors(doc: Path) -> set[str]:
    out = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_runbook_links_name_existing_docs_and_sections(rules: list[dict[str, Any]]) -> None:
    docs_dir = Path(__file__).resolve().parents[2] / "docs"
    for r in rules:
        url = r["annotations"]["runbook_url"]
        path, _, anchor = url.split("/docs/", 1)[1].partition("#")
        assert (docs_dir / path).is_file(), url
        assert not anchor or anchor in _anchors(docs_dir / path), url


#: the per-series rules, evaluated on real expositions: (alert, fires on the plain state, fires when overbooked)
SEMANTIC = {"KubeVgpuDevicePluginNotRegistered": (1, 1), "KubeVgpuGPUUnhealthy": (0, 0),
            "KubeVgpuGPUMemoryOverAllocated": (0, 1), "KubeVgpuGPUCoresOverAllocated": (0, 1),
            "KubeVgpuContainerMemoryNearLimit": (0, 1)}


def test_per_series_rules_fire_exactly_on_the_state_they_describe(rules: list[dict[str, Any]],
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each per-series rule's expression, evaluated on a device plugin's exposition: nothing fires on
    a sane node (the plugin is not registered in this in-process setup: that one fires), and GPU 1
    booked beyond its memory and compute, and a container at 97 % of its limit, fire their alerts
    with the labels the annotations name."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.fakeapi.server import FakeKubeAPI

    from .exposition import device_plugin_text
    from .promql import evaluate

    by_name = {r["alert"]: r for r in rules}
    for col, overbook in enumerate((False, True)):
        api = FakeKubeAPI()
        api.start()
        try:
            text = device_plugin_text(api, tmp_path_factory.mktemp("eval"), overbook=overbook)
        finally:
            api.stop()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        for alert, want in SEMANTIC.items():
            got = evaluate(by_name[alert]["expr"], samples)
            assert isinstance(got, dict)
            assert len(got) == want[col], (alert, overbook, got)
            for labels in got:
                names = dict(labels)
                for lab in re.findall(r"\$labels\.(\w+)", " ".join(by_name[alert]["annotations"].values())):
                    assert lab in names, (alert, lab, names)
        if overbook:
            (near,) = evaluate(by_name["KubeVgpuContainerMemoryNearLimit"]["expr"], samples)  # type: ignore[misc]
            assert dict(near)["pod"] == "hog" and dict(near)["container"] == "c"
