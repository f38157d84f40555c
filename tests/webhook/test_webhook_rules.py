"""The admission rules (webhook.mutate / webhook.admission), without the network. KF-10, KF-11,
KF-17 and KF-18 from shared/reference/known-failures.md are asserted with their values here."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from wh_helpers import base_pod, decode_patch, limits, review_of

from kube_vgpu.config import Config, Defaults, WebhookConfig, replace
from kube_vgpu.podspec import parse_pod
from webhook import mutate
from webhook.admission import answer

CFG = Config()


def run(pod: dict[str, Any], cfg: Config = CFG) -> tuple[mutate.Decision, dict[str, Any]]:
    """Review, apply the patch; assert the result is a fixed point. Returns (decision, mutated pod)."""
    d = mutate.review_pod(pod, cfg)
    out = jsonpatch.apply_patch(pod, d.patch) if d.patch else copy.deepcopy(pod)
    if d.allowed:
        again = mutate.review_pod(out, cfg)
        assert again.allowed and again.patch == [], again
    return d, out


def lim(pod: dict[str, Any], i: int = 0, key: str = "containers") -> dict[str, Any]:
    return pod["spec"][key][i]["resources"]["limits"]


def cfg_with(**wh: Any) -> Config:
    return replace(CFG, webhook=replace(WebhookConfig(), **wh))


# --- KF-10: routing -------------------------------------------------------------------------

@pytest.mark.parametrize("sched", ["default-scheduler", "", None])
def test_kf10_default_or_empty_scheduler_is_routed(sched: str | None) -> None:
    pod = base_pod(limits(gpu="1"))
    if sched is None:
        del pod["spec"]["schedulerName"]
    else:
        pod["spec"]["schedulerName"] = sched
    d, out = run(pod)
    assert d.allowed and d.outcome == mutate.PATCHED
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    # bare nvidia.com/gpu: 1 -> the whole card, written out so scheduler and device plugin agree
    assert lim(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "100", "nvidia.com/gpucores": "100"}
    req = parse_pod(out, CFG).app[0]
    assert (req.count, req.memory_percent, req.cores) == (1, 100, 100)


def test_kf10_foreign_scheduler_left_alone() -> None:
    pod = base_pod(limits(gpu="1"), schedulerName="volcano")
    d, out = run(pod)
    assert d.allowed and d.outcome == mutate.FOREIGN and d.patch == []
    assert out == pod
    # not otherwise validated either: even an invalid value is the other scheduler's business
    d, _ = run(base_pod(limits(gpu="1", pct="99.1"), schedulerName="volcano"))
    assert d.allowed and d.patch == []


def test_kf10_foreign_scheduler_deny_policy() -> None:
    d, _ = run(base_pod(limits(gpu="1"), schedulerName="volcano"), cfg_with(foreign_schedulers="deny"))
    assert not d.allowed and d.code == 403
    assert "spec.schedulerName='volcano'" in d.message and "kube-vgpu-scheduler" in d.message


def test_kf10_default_scheduler_kept_when_not_forced() -> None:
    cfg = cfg_with(force_overwrite_default_scheduler=False)
    d, _ = run(base_pod(limits(gpu="1")), cfg)
    assert d.outcome == mutate.FOREIGN and d.patch == []
    d, out = run(base_pod(limits(gpu="1"), schedulerName=""), cfg)
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"


def test_own_scheduler_name_kept() -> None:
    d, out = run(base_pod(limits(gpu="1", gpumem="1000", cores="30"), schedulerName="kube-vgpu-scheduler"))
    assert not any(op["path"] == "/spec/schedulerName" for op in d.patch)
    assert lim(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "30"}


def test_custom_scheduler_name_from_config() -> None:
    cfg = replace(CFG, scheduler_name="my-vgpu")
    _, out = run(base_pod(limits(gpumem="1000")), cfg)
    assert out["spec"]["schedulerName"] == "my-vgpu"


# --- KF-11: privileged ------------------------------------------------------------------------

def _privileged_pod() -> dict[str, Any]:
    pod = base_pod(limits(gpu="2", gpumem="10240"))
    pod["spec"]["containers"][0]["name"] = "trainer"
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    return pod


def test_kf11_privileged_gpu_container_denied_by_default() -> None:
    d, _ = run(_privileged_pod())
    assert not d.allowed and d.outcome == mutate.DENIED and d.code == 403
    assert "container 'trainer'" in d.message and "securityContext.privileged=true" in d.message
    assert "webhook.privileged=deny" in d.message


def test_kf11_privileged_allowed_by_policy_still_routed() -> None:
    d, out = run(_privileged_pod(), cfg_with(privileged="allow"))
    assert d.allowed and out["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    assert lim(out) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "10240", "nvidia.com/gpucores": "0"}


def test_privileged_sidecar_without_gpu_is_not_our_business() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["spec"]["containers"].append({"name": "side", "image": "x", "securityContext": {"privileged": True}})
    d, _ = run(pod)
    assert d.allowed


# --- KF-17 / KF-18 and other invalid quantities -------------------------------------------------

def test_kf17_zero_percentage_rejected() -> None:
    d, _ = run(base_pod(limits(gpu="1", pct="0")))
    assert not d.allowed and d.code == 400
    assert d.message == ("container 'c': nvidia.com/gpumem-percentage='0' is invalid; "
                         "allowed: a whole number of percent, 1..100")


@pytest.mark.parametrize("value", ["99.1", "50m"])
def test_kf18_fractional_percentage_rejected(value: str) -> None:
    d, _ = run(base_pod(limits(gpu="1", pct=value)))
    assert not d.allowed and d.code == 400
    assert f"nvidia.com/gpumem-percentage={value!r}" in d.message
    assert "whole number" in d.message and "container 'c'" in d.message


@pytest.mark.parametrize("kv,resource,allowed", [
    ({"gpumem": "-1"}, "nvidia.com/gpumem", "whole number of MiB"),
    ({"gpumem": "0"}, "nvidia.com/gpumem", "whole number of MiB"),
    ({"gpumem": "1.5"}, "nvidia.com/gpumem", "whole number of MiB"),
    ({"pct": "101"}, "nvidia.com/gpumem-percentage", "1..100"),
    ({"cores": "150"}, "nvidia.com/gpucores", "0..100"),
    ({"cores": "-5"}, "nvidia.com/gpucores", "0..100"),
    ({"gpu": "0.5"}, "nvidia.com/gpu", "whole number"),
    ({"gpu": "0", "gpumem": "1000"}, "nvidia.com/gpu", ">= 1"),
    ({"gpumem": "lots"}, "nvidia.com/gpumem", "MiB"),
])
def test_invalid_quantities_named(kv: dict[str, str], resource: str, allowed: str) -> None:
    d, _ = run(base_pod(limits(**kv)))
    assert not d.allowed and d.code == 400 and d.reason == "BadRequest"
    assert resource in d.message and allowed in d.message and "container 'c'" in d.message


def test_invalid_init_container_is_named_as_such() -> None:
    pod = base_pod(limits(gpumem="1000"), initContainers=[{"name": "prep", "image": "x", "resources": limits(pct="200")}])
    d, _ = run(pod)
    assert not d.allowed and d.message.startswith("init container 'prep'")


# --- other denials -----------------------------------------------------------------------------

def test_preset_node_name_denied() -> None:
    d, _ = run(base_pod(limits(gpumem="1000"), nodeName="node-7"))
    assert not d.allowed and "spec.nodeName='node-7'" in d.message


def test_visible_devices_in_gpu_container_denied() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    d, _ = run(pod)
    assert not d.allowed and "container 'c'" in d.message and "NVIDIA_VISIBLE_DEVICES='all'" in d.message
    d, _ = run(pod, cfg_with(allow_user_visible_devices=True))
    assert d.allowed


def test_visible_devices_in_sidecar() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["spec"]["containers"].append({"name": "side", "image": "x",
                                      "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-123"}]})
    d, _ = run(pod)
    assert not d.allowed and "container 'side'" in d.message
    pod["spec"]["containers"][1]["env"][0]["value"] = "none"
    d, _ = run(pod)
    assert d.allowed


# --- mutations ---------------------------------------------------------------------------------

def test_memory_only_gets_default_gpu_count_and_shm() -> None:
    d, out = run(base_pod(limits(gpumem="4000")))
    assert d.outcome == mutate.PATCHED
    assert lim(out) == {"nvidia.com/gpumem": "4000", "nvidia.com/gpu": "1", "nvidia.com/gpucores": "0"}
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["kube-vgpu-shm"] == {"name": "kube-vgpu-shm", "emptyDir": {"medium": "Memory"}}
    assert {"name": "kube-vgpu-shm", "mountPath": "/dev/shm"} in out["spec"]["containers"][0]["volumeMounts"]


def test_default_gpu_count_from_config() -> None:
    cfg = replace(CFG, defaults=replace(Defaults(), gpu_count=2, cores=20))
    _, out = run(base_pod(limits(pct="50")), cfg)
    assert lim(out) == {"nvidia.com/gpumem-percentage": "50", "nvidia.com/gpu": "2", "nvidia.com/gpucores": "20"}


def test_bare_gpu_not_exclusive_uses_defaults() -> None:
    cfg = replace(CFG, defaults=replace(Defaults(), bare_gpu_exclusive=False, memory_mib=2048, cores=10))
    _, out = run(base_pod(limits(gpu="1")), cfg)
    assert lim(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2048", "nvidia.com/gpucores": "10"}


def test_full_percentage_without_cores_is_exclusive() -> None:
    _, out = run(base_pod(limits(gpu="1", pct="100")))
    assert lim(out)["nvidia.com/gpucores"] == "100"


def test_requests_only_values_move_to_limits() -> None:
    pod = base_pod({"requests": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000", "cpu": "1"}})
    _, out = run(pod)
    assert lim(out) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "0"}
    assert out["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"


def test_gpumem_wins_over_percentage_with_warning() -> None:
    d, out = run(base_pod(limits(gpumem="3000", pct="50")))
    assert lim(out)["nvidia.com/gpumem"] == "3000" and lim(out)["nvidia.com/gpumem-percentage"] == "50"
    assert d.warnings and "ignored" in d.warnings[0]


def test_shm_size_limit_and_existing_shm_mount() -> None:
    _, out = run(base_pod(limits(gpumem="1000")), cfg_with(shm_size_limit="2Gi"))
    assert out["spec"]["volumes"][-1]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    pod = base_pod(limits(gpumem="1000"))
    pod["spec"]["volumes"].append({"name": "mine", "emptyDir": {}})
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "mine", "mountPath": "/dev/shm/"})
    _, out = run(pod)
    assert [v["name"] for v in out["spec"]["volumes"]] == ["kube-api-access-9wjzm", "mine"]


def test_runtime_class_written_only_where_a_vgpu_pod_names_none() -> None:
    """webhook.runtimeClassName (HAMi's runtimeClassName): written into vGPU pods that name no runtime
    class, never over one the pod names (the isolation rules judge that one), never into other pods."""
    cfg = cfg_with(runtime_class_name="nvidia", allowed_runtime_classes=("nvidia", "nvidia-cdi"))
    _, out = run(base_pod(limits(gpumem="1000")), cfg)
    assert out["spec"]["runtimeClassName"] == "nvidia"
    _, out = run(base_pod(limits(gpumem="1000"), runtimeClassName="nvidia-cdi"), cfg)
    assert out["spec"]["runtimeClassName"] == "nvidia-cdi"
    d, out = run(base_pod(limits(gpumem="1000"), runtimeClassName="runc"), cfg)
    assert not d.allowed and "spec.runtimeClassName" in d.message
    _, out = run(base_pod({"limits": {"cpu": "1"}}), cfg)  # not a vGPU pod
    assert "runtimeClassName" not in out["spec"]
    _, out = run(base_pod(limits(gpumem="1000")))  # the default: none written
    assert "runtimeClassName" not in out["spec"]


def test_shm_volume_name_collision() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["spec"]["volumes"].append({"name": "kube-vgpu-shm", "configMap": {"name": "x"}})
    _, out = run(pod)
    assert out["spec"]["volumes"][-1]["name"] == "kube-vgpu-shm-1"
    assert out["spec"]["containers"][0]["volumeMounts"][-1] == {"name": "kube-vgpu-shm-1", "mountPath": "/dev/shm"}


def test_init_and_app_gpu_containers_all_prepared() -> None:
    pod = base_pod(limits(gpumem="1000"),
                   initContainers=[{"name": "prep", "image": "x", "resources": limits(gpu="1", gpumem="2000")},
                                   {"name": "plain", "image": "x"}])
    _, out = run(pod)
    prep, plain = out["spec"]["initContainers"]
    assert prep["resources"]["limits"]["nvidia.com/gpucores"] == "0"
    assert prep["volumeMounts"] == [{"name": "kube-vgpu-shm", "mountPath": "/dev/shm"}]
    assert "volumeMounts" not in plain
    assert plain["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]  # nonGpuVisibleDevicesNone default


def test_non_gpu_containers_get_visible_devices_none() -> None:
    pod = base_pod(limits(gpumem="1000"), initContainers=[{"name": "plain", "image": "x"}])
    pod["spec"]["containers"].append({"name": "side", "image": "x", "env": [{"name": "A", "value": "1"}]})
    _, out = run(pod, cfg_with(non_gpu_visible_devices_none=True))
    none = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}
    assert out["spec"]["initContainers"][0]["env"] == [none]
    assert out["spec"]["containers"][1]["env"] == [{"name": "A", "value": "1"}, none]
    assert "env" not in out["spec"]["containers"][0]


def test_priority_is_carried() -> None:
    _, out = run(base_pod({"requests": {"nvidia.com/priority": "1", "nvidia.com/gpumem": "100"}}))
    assert lim(out)["nvidia.com/priority"] == "1"


# --- no-ops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("resources", [{}, {"limits": {"cpu": "1"}}, limits(gpu="0"),
                                       {"limits": {"example.com/gpu-mem": "4"}}])
def test_pods_without_vgpu_are_not_patched(resources: dict[str, Any]) -> None:
    d, _ = run(base_pod(resources))
    assert d.allowed and d.outcome == mutate.SKIPPED and d.patch == []


def test_bare_gpu_skipped_when_not_mutated() -> None:
    d, _ = run(base_pod(limits(gpu="1")), cfg_with(mutate_bare_gpu=False))
    assert d.outcome == mutate.SKIPPED and d.patch == []


def test_pod_label_does_not_opt_out() -> None:
    """The old opt-out label is a system-owned key now: removed on CREATE, and the rules still apply."""
    pod = base_pod(limits(gpu="1", pct="0"))
    pod["metadata"]["labels"] = {"kube-vgpu.io/webhook": "ignore", "app": "x"}
    d, _ = run(pod)
    assert not d.allowed and "gpumem-percentage='0'" in d.message
    pod = base_pod(limits(gpu="1"))
    pod["metadata"]["labels"] = {"kube-vgpu.io/webhook": "ignore", "app": "x"}
    d, out = run(pod)
    assert d.allowed and d.outcome == mutate.PATCHED
    assert {"op": "remove", "path": "/metadata/labels/kube-vgpu.io~1webhook"} in d.patch
    assert out["metadata"]["labels"] == {"app": "x"} and out["spec"]["schedulerName"] == "kube-vgpu-scheduler"


# --- envelope ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["admission.k8s.io/v1", "admission.k8s.io/v1beta1"])
def test_answer_envelope(version: str) -> None:
    rev = review_of(base_pod(limits(gpumem="1000")), version)
    resp, d = answer(rev, CFG)
    assert resp["apiVersion"] == version and resp["kind"] == "AdmissionReview"
    assert resp["response"]["uid"] == rev["request"]["uid"] and resp["response"]["allowed"] is True
    assert decode_patch(resp) == d.patch and d.patch


def test_answer_denial_status() -> None:
    resp, _ = answer(review_of(base_pod(limits(pct="0"))), CFG)
    r = resp["response"]
    assert r["allowed"] is False and "patch" not in r
    assert r["status"]["code"] == 400 and "gpumem-percentage='0'" in r["status"]["message"]


def test_answer_skipped_has_no_patch() -> None:
    resp, _ = answer(review_of(base_pod({})), CFG)
    assert resp["response"] == {"uid": resp["response"]["uid"], "allowed": True}


@pytest.mark.parametrize("mangle", [
    lambda p: p["spec"].__setitem__("containers", "nope"),
    lambda p: p.__setitem__("spec", "x"),
    lambda p: p["spec"]["containers"][0].__setitem__("resources", "x"),
    lambda p: p["metadata"].__setitem__("labels", "x"),
])
def test_structurally_broken_pod_denied_400(mangle: Any) -> None:
    pod = base_pod(limits(gpumem="1000"))
    mangle(pod)
    resp, d = answer(review_of(pod), CFG)
    assert resp["response"]["allowed"] is False and resp["response"]["status"]["code"] == 400


def test_non_pod_or_unchanged_update_is_passed() -> None:
    rev = review_of(base_pod(limits(gpumem="1000")))
    rev["request"]["operation"] = "UPDATE"
    rev["request"]["oldObject"] = copy.deepcopy(rev["request"]["object"])
    resp, d = answer(rev, CFG)
    assert resp["response"]["allowed"] is True and "patch" not in resp["response"] and d.outcome == mutate.ALLOWED
    rev["request"]["operation"] = "DELETE"
    resp, d = answer(rev, CFG)
    assert resp["response"]["allowed"] is True and d.outcome == "not-pod"
    rev = review_of({"kind": "ConfigMap"})
    rev["request"]["kind"] = {"group": "", "version": "v1", "kind": "ConfigMap"}
    rev["request"]["resource"] = {"group": "", "version": "v1", "resource": "configmaps"}
    resp, _ = answer(rev, CFG)
    assert resp["response"]["allowed"] is True


def test_update_without_old_object_is_400() -> None:
    rev = review_of(base_pod(limits(gpumem="1000")))
    rev["request"]["operation"] = "UPDATE"
    resp, _ = answer(rev, CFG)
    assert resp["response"]["allowed"] is False and resp["response"]["status"]["code"] == 400
    assert "request.oldObject" in resp["response"]["status"]["message"]


def test_review_without_kind_and_resource_uses_object_kind() -> None:
    rev = review_of(base_pod(limits(gpumem="1000")))
    del rev["request"]["kind"], rev["request"]["resource"]
    resp, d = answer(rev, CFG)
    assert d.outcome == mutate.PATCHED and decode_patch(resp)


def test_missing_object_is_400_denial() -> None:
    rev = review_of(base_pod())
    rev["request"]["object"] = None
    resp, _ = answer(rev, CFG)
    assert resp["response"]["allowed"] is False and resp["response"]["status"]["code"] == 400


def test_invalid_policy_annotation_denied() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["metadata"]["annotations"] = {"hami.io/node-scheduler-policy": "random"}
    d, _ = run(pod)
    assert not d.allowed and "metadata.annotations[hami.io/node-scheduler-policy]='random'" in d.message and "binpack" in d.message


def test_hami_gpu_policy_values_we_serve_are_admitted_and_mutex_is_refused() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["metadata"]["annotations"] = {"hami.io/gpu-scheduler-policy": "topology-aware"}
    d, _ = run(pod)
    assert d.allowed
    pod["metadata"]["annotations"] = {"hami.io/gpu-scheduler-policy": "mutex"}
    d, _ = run(pod)
    assert not d.allowed and "mutex" in d.message and "nvidia.com/gpucores: 100" in d.message


def test_invalid_link_annotation_denied_and_a_valid_one_kept() -> None:
    pod = base_pod(limits(gpu="4", gpumem="1000"))
    pod["metadata"]["annotations"] = {"kube-vgpu.io/gpu-link": "infiniband"}
    d, _ = run(pod)
    assert not d.allowed and "kube-vgpu.io/gpu-link" in d.message and "infiniband" in d.message
    assert "nvlink" in d.message
    pod["metadata"]["annotations"] = {"kube-vgpu.io/gpu-link": "nvlink"}
    d, out = run(pod)
    assert d.allowed and out["metadata"]["annotations"]["kube-vgpu.io/gpu-link"] == "nvlink"  # a tenant key: kept


def test_privileged_init_container_denied() -> None:
    pod = base_pod({}, initContainers=[{"name": "prep", "image": "x", "resources": limits(gpu="1"),
                                        "securityContext": {"privileged": True}}])
    d, _ = run(pod)
    assert not d.allowed and d.message.startswith("init container 'prep': securityContext.privileged=true")
