"""The webhook under DRA's extended-resource mapping of the GPU count resource (docs/dra.md).

With ``dra.enabled``, ``dra.nodes: all`` and ``dra.deviceClass.extendedResourceName: nvidia.com/gpu``
(the chart's ``config.resourceNames.gpu``) kube-scheduler serves a pod asking ``nvidia.com/gpu`` with a
whole GPU from the DeviceClass. If the webhook routed such a pod to ``kube-vgpu-scheduler`` (and
rewrote a bare ``nvidia.com/gpu: 1`` into gpumem-percentage/gpucores), its extender, which places only
on nodes that publish a device-plugin inventory, would refuse every DRA node and the pod would never
schedule. Each test renders the chart, loads the policy ConfigMap it renders exactly as the webhook
does (``load_config_text``) and reviews pods with it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from wh_helpers import base_pod, limits

from kube_vgpu.config import Config, load_config_text
from tests.chart.conftest import Renderer, _load_get_helm, find
from tests.chart.test_webhook_admission import pod as admission_pod
from tests.chart.test_webhook_admission import sent
from webhook import mutate

KUBE = "1.36.0"
GPU = "nvidia.com/gpu"
SCHED = "kube-vgpu-scheduler"
MAPPED_ALL: dict[str, Any] = {"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": GPU}}}


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Renderer]:
    try:
        helm = Path(_load_get_helm().get_helm())
    except Exception as e:  # no network and no cached helm: like tests/chart
        pytest.skip(f"helm unavailable: {e}")
    yield Renderer(helm, tmp_path_factory.mktemp("helm"))


def chart_config(renderer: Renderer, values: dict[str, Any]) -> Config:
    """The config the chart's webhook reads (ConfigMap <fullname>-config, key config.yaml)."""
    cm = find(renderer.render(values, KUBE), "ConfigMap", "config")
    return load_config_text(cm["data"]["config.yaml"])


def review(p: dict[str, Any], cfg: Config) -> tuple[mutate.Decision, dict[str, Any]]:
    d = mutate.review_pod(p, cfg)
    return d, (jsonpatch.apply_patch(p, d.patch) if d.patch else copy.deepcopy(p))


def routed(out: dict[str, Any]) -> bool:
    return bool(out["spec"].get("schedulerName") == SCHED)


@pytest.fixture(scope="module")
def cfg(renderer: Renderer) -> Config:
    return chart_config(renderer, MAPPED_ALL)


@pytest.mark.parametrize("res", [limits(gpu="1"), limits(gpu="2"), {"requests": {GPU: "1"}, "limits": {GPU: "1"}}],
                         ids=["gpu-1", "gpu-2", "requests-and-limits"])
def test_whole_gpu_pod_is_left_to_its_scheduler(cfg: Config, res: dict[str, Any]) -> None:
    """The reproduction: before the fix the chart's config routed this pod to kube-vgpu-scheduler and
    added gpumem-percentage: 100, gpucores: 100 to its limits."""
    p = base_pod(res)
    d, out = review(p, cfg)
    assert d.allowed and d.outcome == mutate.SKIPPED and d.patch == [], d
    assert not routed(out) and out["spec"]["containers"][0]["resources"] == res


def test_system_owned_keys_are_still_removed(cfg: Config) -> None:
    p = base_pod(limits(gpu="1"))
    p["metadata"]["annotations"] = {"kube-vgpu.io/allocation": "forged", "team": "a"}
    p["metadata"]["labels"] = {"kube-vgpu.io/bind-phase": "success"}
    d, out = review(p, cfg)
    assert d.allowed and d.outcome == mutate.STRIPPED and not routed(out)
    assert out["metadata"]["annotations"] == {"team": "a"} and out["metadata"]["labels"] == {}
    assert {op["op"] for op in d.patch} == {"remove"}


@pytest.mark.parametrize(("spec", "container", "needle"), [
    ({}, {"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}, "env LD_PRELOAD"),
    ({}, {"env": [{"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "1000g"}]}, "env CUDA_DEVICE_MEMORY_LIMIT"),
    ({}, {"volumeMounts": [{"name": "kube-api-access-9wjzm", "mountPath": "/usr/local/vgpu/limits/vgpu.limits"}]},
     "mountPath='/usr/local/vgpu/limits/vgpu.limits'"),
    ({}, {"securityContext": {"privileged": True}}, "privileged"),
    ({"hostPID": True}, {}, "spec.hostPID=true"),
], ids=["ld-preload", "limit-env", "limits-mount", "privileged", "host-pid"])
def test_isolation_still_applies_to_whole_gpu_pods(renderer: Renderer, cfg: Config, spec: dict[str, Any],
                                                    container: dict[str, Any], needle: str) -> None:
    """A tenant cannot use the unrouted path to bring the attacks the webhook refuses for vGPU pods;
    and the chart's matchConditions still send such a pod to the webhook."""
    p = base_pod(limits(gpu="1"), **spec)
    p["spec"]["containers"][0].update(container)
    d, _ = review(p, cfg)
    assert not d.allowed and d.code == 403 and needle in d.message, d
    (wh,) = find(renderer.render(MAPPED_ALL, KUBE), "MutatingWebhookConfiguration")["webhooks"]
    assert sent(wh, "CREATE", admission_pod(limits={GPU: "1"}))


@pytest.mark.parametrize("res", [
    limits(gpu="1", gpumem="3000"), limits(gpu="1", pct="50"), limits(gpu="1", cores="30"), limits(gpumem="3000"),
], ids=["gpumem", "gpumem-percentage", "gpucores", "gpumem-only"])
def test_vgpu_pods_are_still_routed(cfg: Config, res: dict[str, Any]) -> None:
    d, out = review(base_pod(res), cfg)
    assert d.allowed and d.outcome == mutate.PATCHED and routed(out)


def test_a_vgpu_container_routes_the_whole_pod(cfg: Config) -> None:
    """A bare-gpu init container next to a gpucores app container: the pod is a vGPU pod, and every GPU
    container's request is spelled out, as without the mapping."""
    p = base_pod(limits(cores="30"))
    p["spec"]["initContainers"] = [{"name": "prep", "image": "x", "resources": limits(gpu="1")}]
    d, out = review(p, cfg)
    assert d.allowed and routed(out)
    assert out["spec"]["initContainers"][0]["resources"]["limits"]["nvidia.com/gpucores"] == "100"


@pytest.mark.parametrize("values", [
    {},
    {"dra": {"enabled": True, "nodes": "all"}},
    {"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": "example.com/dra-gpu"}}},
    {"dra": {"enabled": True, "deviceClass": {"extendedResourceName": "example.com/dra-gpu"}}},
    {"dra": {"enabled": False, "nodes": "all", "deviceClass": {"extendedResourceName": GPU}}},
    {"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": GPU}},
     "config": {"resourceNames": {"gpu": "example.com/vgpu"}}},
], ids=["no-dra", "no-mapping", "own-name", "own-name-labelled", "dra-off", "other-gpu-name"])
def test_bare_gpu_is_routed_unless_dra_maps_the_gpu_resource(renderer: Renderer, values: dict[str, Any]) -> None:
    cfg = chart_config(renderer, values)
    assert cfg.webhook.mutate_bare_gpu
    gpu = cfg.resource_names.gpu
    d, out = review(base_pod({"limits": {gpu: "1"}}), cfg)
    assert d.allowed and routed(out)


@pytest.mark.parametrize("values", [
    {"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": "example.com/vgpu"}},
     "config": {"resourceNames": {"gpu": "example.com/vgpu"}}},
    {"dra": {"enabled": True, "nodes": "all",
             "modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200", "extendedResourceName": GPU}]}},
    {**MAPPED_ALL, "config": {"webhook": {"mutateBareGpu": True}}},
], ids=["own-gpu-name", "model-class", "explicit-mutateBareGpu"])
def test_every_mapping_of_the_gpu_resource_leaves_whole_gpu_pods(renderer: Renderer, values: dict[str, Any]) -> None:
    cfg = chart_config(renderer, values)
    assert not cfg.webhook.mutate_bare_gpu
    d, out = review(base_pod({"limits": {cfg.resource_names.gpu: "1"}}), cfg)
    assert d.allowed and d.outcome == mutate.SKIPPED and not routed(out)
