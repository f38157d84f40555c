"""helm lint / helm template for every documented option set (charts/kube-vgpu/ci/*-values.yaml),
with every rendered manifest validated offline against the Kubernetes schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .conftest import CHART, Renderer

OPTION_SETS = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
#: kinds from CRDs, not in kubernetes-validate's bundled schemas; checked structurally below
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("cert-manager.io/v1", "Certificate"),
             ("cert-manager.io/v1", "Issuer")}
#: minimum supported version (kubescheduler.config.k8s.io/v1) and a recent one
KUBE_VERSIONS = ["1.25.0", "1.31.0", "1.34.0"]


def option_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def test_option_sets_exist() -> None:
    assert {"default", "cert-manager", "ha", "monitoring", "custom-resource-names", "foreign-deny"} <= set(OPTION_SETS)


@pytest.mark.parametrize("name", OPTION_SETS)
def test_helm_lint(renderer: Renderer, name: str) -> None:
    r = renderer.run(["lint", str(CHART), "--strict", "--namespace", "gpu-system"], option_values(name))
    assert r.returncode == 0, r.stdout + r.stderr


#: every option set on the reference version; the default and HA sets on every supported version
MATRIX = [(n, "1.31.0") for n in OPTION_SETS] + [(n, v) for n in ("default", "ha", "cert-manager")
                                                for v in KUBE_VERSIONS if v != "1.31.0"]


@pytest.mark.parametrize(("name", "kube_version"), MATRIX)
def test_rendered_manifests_validate(renderer: Renderer, name: str, kube_version: str) -> None:
    docs = renderer.render(option_values(name), kube_version)
    assert docs, "nothing rendered"
    checked = 0
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRD_KINDS:
            assert d["metadata"]["name"] and isinstance(d["spec"], dict)
            continue
        try:
            kubernetes_validate.validate(d, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for {kube_version}: {e.message}")
        checked += 1
    assert checked >= 20


def test_chart_requires_scheduler_config_v1(renderer: Renderer) -> None:
    r = renderer.template(kube_version="1.24.9")
    assert r.returncode != 0
    assert "kubeVersion" in r.stderr or "incompatible" in r.stderr


def test_every_object_is_namespaced_to_the_release_or_cluster_scoped(renderer: Renderer) -> None:
    cluster_kinds = {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for d in renderer.render():
        ns = d["metadata"].get("namespace")
        if d["kind"] in cluster_kinds:
            assert ns is None
        elif d["kind"] == "RoleBinding" and d["metadata"]["name"].endswith("auth-reader"):
            assert ns == "kube-system"
        else:
            assert ns == "gpu-system", d["metadata"]["name"]


def test_dashboard_json_is_valid(renderer: Renderer) -> None:
    docs = renderer.render(option_values("monitoring"))
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU"}
    import json
    (name, text), = cm["data"].items()
    dash = json.loads(text)
    assert dash["title"] and dash["panels"]
    assert Path(CHART / "dashboards" / name).is_file()


def _metric_sources() -> str:
    root = CHART.parents[1]
    text = ""
    for d in ("scheduler", "deviceplugin", "webhook"):
        for f in sorted((root / d).glob("*.py")):
            text += f.read_text()
    return text


def test_dashboard_metrics_exist_in_code() -> None:
    """Every kube_vgpu_* series the dashboard queries is exported by a component."""
    import json
    import re
    src = _metric_sources()
    if "kube_vgpu_" not in src:
        pytest.skip("component metrics not present in this tree")
    dash = json.loads((CHART / "dashboards" / "kube-vgpu.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [dash["templating"]["list"][1]["definition"]]
    names = {m for e in exprs for m in re.findall(r"kube_vgpu_\w+", e)}
    missing = []
    for name in sorted(names):
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        candidates = {base}
        for prefix in ("kube_vgpu_scheduler_gpu_", "kube_vgpu_scheduler_"):
            if base.startswith(prefix):
                candidates.add(f'"{base.removeprefix(prefix)}"')
        if not any(c in src for c in candidates):
            missing.append(name)
    assert not missing, f"dashboard queries metrics no component exports: {missing}"


def test_device_plugin_servicemonitor_honors_labels(renderer: Renderer) -> None:
    docs = renderer.render(option_values("monitoring"))
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("device-plugin"))
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
