"""A hostile tenant against the webhook's isolation rules, over real HTTPS.

Each test plays one escape a tenant with pod create/update rights could try on a pod that asks for
a vGPU, sends it to a webhook server on 127.0.0.1 (certificates from ``certs``, a client that
trusts only that CA, reviews in the API server's shape) and asserts the denial and that its message
names the container (kind and name) and the field. Positive controls show the rule does not deny
what it must allow (otherwise a test could pass by denying everything).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from certs import pki, store
from kube_vgpu.config import Config, WebhookConfig, replace
from tests.webhook.wh_helpers import Client, base_pod, decode_patch, limits, review_of
from webhook.admission import answer
from webhook.server import BackgroundServer, WebhookServer

SYSTEM_USER = "system:serviceaccount:kube-vgpu:kv-kube-vgpu-extender"
TENANT = "system:serviceaccount:team-a:default"
ADMIN_NS = "gpu-admin"
CFG = replace(Config(), webhook=replace(WebhookConfig(), system_users=(SYSTEM_USER,),
                                        allow_disable_control_namespaces=(ADMIN_NS,),
                                        protected_host_paths=("/srv/gpu-secrets",)))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    store.write_files(d, pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-vgpu"), ["127.0.0.1"]))
    return d


@pytest.fixture(scope="module")
def client(tls: Path) -> Iterator[Client]:
    srv = WebhookServer(CFG, str(tls / "tls.crt"), str(tls / "tls.key"), host="127.0.0.1", port=0)
    with BackgroundServer(srv) as bg:
        c = Client(bg.port, tls / "ca.crt")
        yield c
        c.close()


def gpu_pod(**spec: Any) -> dict[str, Any]:
    """A tenant's vGPU pod: one container 'train' asking for 4000 MiB."""
    pod = base_pod(limits(gpumem="4000"), **spec)
    pod["metadata"]["namespace"] = "team-a"
    pod["spec"]["containers"][0]["name"] = "train"
    return pod


def create(client: Client, pod: dict[str, Any], namespace: str = "team-a") -> dict[str, Any]:
    rev = review_of(pod)
    rev["request"]["namespace"] = namespace
    rev["request"]["userInfo"] = {"username": TENANT, "groups": ["system:serviceaccounts"]}
    return client.review(rev)["response"]


def update(client: Client, new: dict[str, Any], old: dict[str, Any], user: str = TENANT,
           subresource: str | None = None) -> dict[str, Any]:
    rev = review_of(new)
    req = rev["request"]
    req.update(operation="UPDATE", oldObject=old, namespace="team-a",
               userInfo={"username": user, "groups": ["system:authenticated"]},
               options={"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"})
    if subresource:
        req["subResource"] = subresource
        req["requestSubResource"] = subresource
    return client.review(rev)["response"]


def denied(resp: dict[str, Any], *needles: str) -> str:
    assert resp["allowed"] is False, resp
    assert resp["status"]["code"] == 403 and "patch" not in resp
    msg: str = resp["status"]["message"]
    for n in needles:
        assert n in msg, (n, msg)
    assert "allowed:" in msg
    return msg


def patch_of(resp: dict[str, Any]) -> list[dict[str, Any]]:
    return decode_patch({"response": resp})


def allowed(resp: dict[str, Any]) -> dict[str, Any]:
    assert resp["allowed"] is True, resp.get("status")
    return resp


def set_env(pod: dict[str, Any], *env: dict[str, Any], key: str = "containers", i: int = 0) -> dict[str, Any]:
    pod["spec"][key][i]["env"] = list(env)
    return pod


# --- env of the env contract, the shim's knobs and LD_PRELOAD ------------------------------------

@pytest.mark.parametrize("name,value", [
    ("NVIDIA_VISIBLE_DEVICES", "all"),
    ("NVIDIA_VISIBLE_DEVICES", "GPU-1b2c3d4e"),
    ("CUDA_DEVICE_MEMORY_LIMIT_0", "24000m"),
    ("CUDA_DEVICE_MEMORY_LIMIT_3", "24000m"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "80g"),
    ("CUDA_DEVICE_SM_LIMIT", "100"),
    ("CUDA_DEVICE_SM_LIMIT_0", "0"),
    ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/fake.cache"),
    ("CUDA_TASK_PRIORITY", "0"),
    ("CUDA_DISABLE_CONTROL", "true"),
    ("CUDA_DISABLE_CONTROL", "false"),
    ("GPU_CORE_UTILIZATION_POLICY", "disable"),
    ("LIBVGPU_CUDA_LIBRARY", "/tmp/fake-libcuda.so"),
    ("LIBVGPU_NVML_LIBRARY", "/tmp/fake-nvml.so"),
    ("LIBVGPU_CONTEXT_COST", "0"),
    ("LIBVGPU_SM_PERIOD_MS", "100000"),
    ("LD_PRELOAD", "/tmp/unhook.so"),
    ("LD_AUDIT", "/tmp/rebind.so"),
    ("NVIDIA_IMEX_CHANNELS", "all"),
    ("NVIDIA_MIG_CONFIG_DEVICES", "all"),
    ("NVIDIA_GDRCOPY", "enabled"),
])
def test_env_override_denied(client: Client, name: str, value: str) -> None:
    resp = create(client, set_env(gpu_pod(), {"name": "A", "value": "1"}, {"name": name, "value": value}))
    denied(resp, "container 'train'", f"env {name}={value!r}")


@pytest.mark.parametrize("name", ["CUDA_DEVICE_MEMORY_LIMIT_0", "LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES",
                                  "CUDA_DISABLE_CONTROL"])
def test_env_value_from_denied(client: Client, name: str) -> None:
    entry = {"name": name, "valueFrom": {"configMapKeyRef": {"name": "tenant-cm", "key": "k"}}}
    denied(create(client, set_env(gpu_pod(), entry)), "container 'train'", f"env {name}=valueFrom")


def test_disable_control_only_in_admin_namespaces(client: Client) -> None:
    pod = set_env(gpu_pod(), {"name": "CUDA_DISABLE_CONTROL", "value": "true"})
    msg = denied(create(client, pod), "webhook.allowDisableControlNamespaces", "'gpu-admin'", "'team-a'")
    assert "env CUDA_DISABLE_CONTROL='true'" in msg
    pod["metadata"]["namespace"] = ADMIN_NS
    allowed(create(client, pod, namespace=ADMIN_NS))


def test_harmless_env_is_allowed(client: Client) -> None:
    """LIBVGPU_LOG_LEVEL only sets the shim's verbosity; CUDA_VISIBLE_DEVICES narrows what the container
    has; CUDA_DEVICE_ORDER / CUDA_DEVICE_MAX_CONNECTIONS are ordinary CUDA settings; 'none' hides GPUs."""
    pod = set_env(gpu_pod(), {"name": "LIBVGPU_LOG_LEVEL", "value": "4"}, {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                  {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
                  {"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1"},
                  {"name": "LD_LIBRARY_PATH", "value": "/opt/lib"})
    allowed(create(client, pod))


# --- envFrom -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [{"configMapRef": {"name": "tenant-env"}},
                                    {"secretRef": {"name": "tenant-secret"}},
                                    {"configMapRef": {"name": "tenant-env"}, "prefix": "CUDA_"},
                                    {"configMapRef": {"name": "tenant-env"}, "prefix": "LD_"},
                                    {"secretRef": {"name": "s"}, "prefix": "LIBVGPU"}])
def test_env_from_denied(client: Client, source: dict[str, Any]) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["envFrom"] = [source]
    denied(create(client, pod), "container 'train'", "envFrom[0]=", "webhook.allowEnvFrom")


def test_env_from_with_safe_prefix_or_admin_option_allowed(client: Client) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "tenant-env"}, "prefix": "APP_"}]
    allowed(create(client, pod))
    pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "tenant-env"}}]
    cfg = replace(CFG, webhook=replace(CFG.webhook, allow_env_from=True))
    assert answer(review_of(pod), cfg)[0]["response"]["allowed"] is True


# --- mounts over the shim, its preload file and the cache ---------------------------------------------

@pytest.mark.parametrize("path", ["/etc/ld.so.preload", "/usr/local/vgpu", "/usr/local/vgpu/libvgpu.so",
                                  "/usr/local/vgpu/cache", "/usr/local/vgpu/cache/vgpu.cache",
                                  "/usr/local/vgpu/limits", "/etc", "/etc/", "/usr/local", "/usr", "/",
                                  "//etc//ld.so.preload", "/usr/local/vgpu/../vgpu", "/tmp/../etc",
                                  "/usr/./local/vgpu/", "etc/ld.so.preload"])
def test_mount_over_shim_files_denied(client: Client, path: str) -> None:
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "evil", "configMap": {"name": "fake-preload"}})
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "evil", "mountPath": path})
    denied(create(client, pod), "container 'train'", f"volumeMounts[1].mountPath={path!r}")


def test_mount_with_sub_path_over_preload_denied(client: Client) -> None:
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "evil", "emptyDir": {}})
    pod["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "evil", "mountPath": "/etc/ld.so.preload", "subPath": "empty-preload"})
    denied(create(client, pod), "container 'train'", "volumeMounts[1].mountPath='/etc/ld.so.preload'")


def test_block_device_path_over_preload_denied(client: Client) -> None:
    """A raw block volume placed at the preload file would keep the shim from loading."""
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "blk", "persistentVolumeClaim": {"claimName": "raw"}})
    pod["spec"]["containers"][0]["volumeDevices"] = [{"name": "blk", "devicePath": "/etc/ld.so.preload"}]
    denied(create(client, pod), "container 'train'", "volumeDevices[0].devicePath='/etc/ld.so.preload'")


def test_nvidia_runtime_knobs_that_ask_for_nothing_new_are_allowed(client: Client) -> None:
    pod = set_env(gpu_pod(), {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
                  {"name": "NVIDIA_REQUIRE_CUDA", "value": "cuda>=12.0"},
                  {"name": "NVIDIA_DISABLE_REQUIRE", "value": "1"})
    allowed(create(client, pod))


def test_non_gpu_containers_of_a_vgpu_pod_get_no_gpu_by_default(client: Client) -> None:
    """A CUDA image carries NVIDIA_VISIBLE_DEVICES=all; under a default nvidia runtime a sidecar of a
    vGPU pod would see every GPU of the node. By default the webhook hides them (env wins over image)."""
    pod = gpu_pod()
    pod["spec"]["containers"].append({"name": "sidecar", "image": "nvidia/cuda"})
    pod["spec"]["initContainers"] = [{"name": "prep", "image": "nvidia/cuda"}]
    out = jsonpatch.apply_patch(pod, decode_patch({"response": allowed(create(client, pod))}))
    for c in (out["spec"]["containers"][1], out["spec"]["initContainers"][0]):
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"} in c["env"]
    assert not any(e.get("name") == "NVIDIA_VISIBLE_DEVICES" for e in out["spec"]["containers"][0].get("env") or [])


def test_ordinary_mounts_allowed(client: Client) -> None:
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "data", "emptyDir": {}})
    for p in ("/data", "/usr/local/vgpu-data", "/etc/ld.so.preload.d", "/usr/local/lib/python3"):
        pod["spec"]["containers"][0]["volumeMounts"].append({"name": "data", "mountPath": p, "subPath": p[1:]})
    allowed(create(client, pod))


# --- hostPath volumes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/dev/nvidia0", "/dev/nvidia7", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                  "/dev/nvidia-caps/nvidia-cap1", "/dev/dri", "/dev/dri/card0", "/dev/char",
                                  "/dev", "/dev/", "/", "/dev/../dev/nvidia0", "//dev//nvidia0",
                                  "/usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                                  "/usr/lib", "/run/nvidia/driver", "/run/nvidia-persistenced",
                                  "/var/run/nvidia-fabricmanager", "/usr/local/nvidia", "/var/lib/kubelet",
                                  "/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pods", "/var/lib",
                                  "/usr/local/vgpu", "/var/lib/kube-vgpu/containers", "/proc/driver/nvidia",
                                  "/srv/gpu-secrets/x",
                                  # merged-/usr aliases of the driver directories, container runtimes
                                  "/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/lib",
                                  "/lib64", "/run/containerd/containerd.sock", "/var/run/containerd",
                                  "/var/lib/containerd", "/var/run/docker.sock", "/run/crio/crio.sock"])
def test_host_path_denied(client: Client, path: str) -> None:
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": path}})
    denied(create(client, pod), "pod: spec.volumes[1] ('host').hostPath.path", repr(path))


def test_host_path_mounted_only_by_a_sidecar_denied(client: Client) -> None:
    """The volume is the pod's: a container without a GPU request could open every GPU through it."""
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "devs", "hostPath": {"path": "/dev/nvidia1"}})
    pod["spec"]["containers"].append({"name": "helper", "image": "x",
                                      "volumeMounts": [{"name": "devs", "mountPath": "/dev/nvidia1"}]})
    denied(create(client, pod), "hostPath.path='/dev/nvidia1'")


def test_unrelated_host_path_allowed(client: Client) -> None:
    pod = gpu_pod()
    pod["spec"]["volumes"].append({"name": "ds", "hostPath": {"path": "/mnt/datasets"}})
    allowed(create(client, pod))


# --- privileged, capabilities, host namespaces, runtime class ----------------------------------------------

@pytest.mark.parametrize("key,kind", [("containers", "container"), ("initContainers", "init container"),
                                      ("initContainers", "sidecar container")])
def test_privileged_denied_in_every_container_kind(client: Client, key: str, kind: str) -> None:
    pod = gpu_pod()
    c = {"name": "x", "image": "x", "resources": limits(gpumem="100"), "securityContext": {"privileged": True}}
    if kind == "sidecar container":
        c["restartPolicy"] = "Always"
    pod["spec"].setdefault(key, []).append(c)
    denied(create(client, pod), f"{kind} 'x': securityContext.privileged=true", "webhook.privileged=deny")


@pytest.mark.parametrize("cap", ["SYS_ADMIN", "CAP_SYS_ADMIN", "sys_admin", "cap_sys_admin", "ALL", "all"])
def test_sys_admin_capability_denied(client: Client, cap: str) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["NET_BIND_SERVICE", cap]}}
    denied(create(client, pod), "container 'train'", f"securityContext.capabilities.add[1]={cap!r}")


def test_other_capabilities_and_no_privilege_escalation_allowed(client: Client) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True,
                                                       "capabilities": {"add": ["NET_BIND_SERVICE"]}}
    allowed(create(client, pod))


@pytest.mark.parametrize("field", ["hostPID", "hostIPC"])
def test_host_namespaces_denied(client: Client, field: str) -> None:
    denied(create(client, gpu_pod(**{field: True})), f"pod: spec.{field}=true")


def test_host_network_is_not_denied(client: Client) -> None:
    """A documented decision (docs/webhook.md): hostNetwork gives no device access and no shim bypass."""
    allowed(create(client, gpu_pod(hostNetwork=True)))


@pytest.mark.parametrize("rc", ["runc", "kata", "nvidia-privileged", "gvisor"])
def test_runtime_class_outside_allowlist_denied(client: Client, rc: str) -> None:
    denied(create(client, gpu_pod(runtimeClassName=rc)), f"pod: spec.runtimeClassName={rc!r}",
           "webhook.allowedRuntimeClasses ('nvidia')")


def test_runtime_class_in_allowlist_allowed(client: Client) -> None:
    allowed(create(client, gpu_pod(runtimeClassName="nvidia")))


# --- the checks cannot be skipped ----------------------------------------------------------------------

def test_pod_label_does_not_opt_out(client: Client) -> None:
    pod = set_env(gpu_pod(), {"name": "LD_PRELOAD", "value": "/tmp/unhook.so"})
    pod["metadata"]["labels"] = {"kube-vgpu.io/webhook": "ignore", "hami.io/webhook": "ignore"}
    denied(create(client, pod), "container 'train'", "env LD_PRELOAD")


@pytest.mark.parametrize("sched", ["volcano", "nobody", "default-scheduler-2"])
def test_foreign_scheduler_still_checked(client: Client, sched: str) -> None:
    pod = set_env(gpu_pod(schedulerName=sched), {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "24000m"})
    denied(create(client, pod), "container 'train'", "env CUDA_DEVICE_MEMORY_LIMIT_0")
    # a clean pod of a foreign scheduler is left to it (not routed), forged keys removed
    clean = gpu_pod(schedulerName=sched)
    clean["metadata"]["annotations"] = {"kube-vgpu.io/allocation": "{}"}
    resp = allowed(create(client, clean))
    assert patch_of(resp) == [{"op": "remove", "path": "/metadata/annotations/kube-vgpu.io~1allocation"}]


def test_init_container_checked(client: Client) -> None:
    pod = gpu_pod(initContainers=[{"name": "prep", "image": "x", "resources": limits(gpu="1"),
                                   "volumeMounts": [{"name": "kube-api-access-9wjzm", "mountPath": "/usr/local/vgpu"}]}])
    denied(create(client, pod), "init container 'prep'", "volumeMounts[0].mountPath='/usr/local/vgpu'")


def test_sidecar_checked(client: Client) -> None:
    pod = gpu_pod(initContainers=[{"name": "proxy", "image": "x", "restartPolicy": "Always",
                                   "resources": limits(cores="10"),
                                   "env": [{"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"}]}])
    denied(create(client, pod), "sidecar container 'proxy'", "env CUDA_DEVICE_SM_LIMIT='100'")


def test_bare_gpu_checked_even_when_not_mutated(client: Client) -> None:
    pod = set_env(base_pod(limits(gpu="1")), {"name": "LD_PRELOAD", "value": "x.so"})
    cfg = replace(CFG, webhook=replace(CFG.webhook, mutate_bare_gpu=False))
    resp, d = answer(review_of(pod), cfg)
    assert resp["response"]["allowed"] is False and "container 'c': env LD_PRELOAD" in d.message
    denied(create(client, pod), "container 'c': env LD_PRELOAD")


def test_priority_only_pod_checked(client: Client) -> None:
    pod = base_pod({"limits": {"nvidia.com/priority": "0"}}, hostPID=True)
    denied(create(client, pod), "pod: spec.hostPID=true")


def test_pod_without_our_resources_is_not_checked(client: Client) -> None:
    pod = base_pod({"limits": {"cpu": "1"}}, hostPID=True)
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    resp = allowed(create(client, pod))
    assert "patch" not in resp


# --- ephemeral containers (pods/ephemeralcontainers) ------------------------------------------------------

def _debug(old: dict[str, Any], **container: Any) -> dict[str, Any]:
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", "targetContainerName": "train",
                                           **container}]
    return new


@pytest.mark.parametrize("extra,needle", [
    ({"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}, "env LD_PRELOAD='/tmp/x.so'"),
    ({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}, "env NVIDIA_VISIBLE_DEVICES='all'"),
    ({"securityContext": {"privileged": True}}, "securityContext.privileged=true"),
    ({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, "securityContext.capabilities.add[0]='SYS_ADMIN'"),
    ({"volumeMounts": [{"name": "kube-api-access-9wjzm", "mountPath": "/etc/ld.so.preload"}]},
     "volumeMounts[0].mountPath='/etc/ld.so.preload'"),
    ({"envFrom": [{"secretRef": {"name": "s"}}]}, "envFrom[0]"),
])
def test_ephemeral_container_checked_as_gpu_container(client: Client, extra: dict[str, Any], needle: str) -> None:
    old = gpu_pod(schedulerName="kube-vgpu-scheduler", nodeName="node-1")
    denied(update(client, _debug(old, **extra), old, subresource="ephemeralcontainers"),
           "ephemeral container 'debugger'", needle)


def test_plain_ephemeral_container_allowed_and_hidden_from_gpus(client: Client) -> None:
    """``kubectl debug --image=nvidia/cuda`` on a vGPU pod: admitted, and given
    NVIDIA_VISIBLE_DEVICES=none so the image's ``all`` cannot reach every GPU of the node."""
    old = gpu_pod(schedulerName="kube-vgpu-scheduler", nodeName="node-1")
    new = _debug(old, env=[{"name": "LIBVGPU_LOG_LEVEL", "value": "4"}])
    resp = allowed(update(client, new, old, subresource="ephemeralcontainers"))
    out = jsonpatch.apply_patch(new, decode_patch({"response": resp}))
    assert out["spec"]["ephemeralContainers"][0]["env"][-1] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}
    # one that already hides GPUs, and an existing one on a later update, are left as they are
    hidden = _debug(old, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
    assert "patch" not in allowed(update(client, hidden, old, subresource="ephemeralcontainers"))
    again = copy.deepcopy(hidden)
    again["spec"]["ephemeralContainers"].append({"name": "second", "image": "busybox",
                                                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]})
    assert "patch" not in allowed(update(client, again, hidden, subresource="ephemeralcontainers"))


def test_ephemeral_container_in_pod_without_gpu_not_our_business(client: Client) -> None:
    old = base_pod({"limits": {"cpu": "1"}})
    allowed(update(client, _debug(old, securityContext={"privileged": True}), old, subresource="ephemeralcontainers"))


# --- system-owned annotations and labels ---------------------------------------------------------------------

FORGED_ANN = {"kube-vgpu.io/allocation": '{"v":1,"node":"gpu-1","devices":[]}', "kube-vgpu.io/bind-phase": "success",
              "kube-vgpu.io/bind-time": "1700000000", "kube-vgpu.io/allocation-signature": "v1:k1:AAAA",
              "kube-vgpu.io/progress-signature": "v1:k1:BBBB", "kube-vgpu.io/allocated-containers": "train"}
FORGED_LABELS = {"kube-vgpu.io/node": "gpu-1"}


def test_create_with_forged_keys_stripped(client: Client) -> None:
    pod = gpu_pod()
    pod["metadata"]["annotations"] = {**FORGED_ANN, "kube-vgpu.io/node-scheduler-policy": "spread", "team": "a"}
    pod["metadata"]["labels"] = {**FORGED_LABELS, "app": "train"}
    resp = allowed(create(client, pod))
    out = jsonpatch.apply_patch(pod, patch_of(resp))
    # tenant keys (the per-pod placement policy) and foreign keys stay; every system-owned key is gone
    assert out["metadata"]["annotations"] == {"kube-vgpu.io/node-scheduler-policy": "spread", "team": "a"}
    assert out["metadata"]["labels"] == {"app": "train"}
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"  # and the pod is still prepared
    warnings = resp["warnings"]
    assert any("'kube-vgpu.io/allocation'" in w for w in warnings)
    assert any("label 'kube-vgpu.io/node'" in w for w in warnings)
    # the wording troubleshooting.md quotes, as the chart's admission policy writes it
    assert all("written only by the kube-vgpu system" in w for w in warnings)
    assert all(len(w) < 256 for w in warnings)
    # the stripped pod is a fixed point
    again = allowed(create(client, out))
    assert "patch" not in again


def test_create_without_gpu_request_also_stripped(client: Client) -> None:
    """A pending pod of any kind carrying a forged allocation is what the extender must never book."""
    pod = base_pod({}, schedulerName="nobody")
    pod["metadata"]["annotations"] = dict(FORGED_ANN)
    pod["metadata"]["labels"] = dict(FORGED_LABELS)
    out = jsonpatch.apply_patch(pod, patch_of(allowed(create(client, pod))))
    assert out["metadata"]["annotations"] == {} and out["metadata"]["labels"] == {}


def _bound(**ann: str) -> dict[str, Any]:
    pod = gpu_pod(schedulerName="kube-vgpu-scheduler", nodeName="gpu-1")
    pod["metadata"]["annotations"] = {**FORGED_ANN, **ann}
    pod["metadata"]["labels"] = {**FORGED_LABELS, "app": "train"}
    return pod


@pytest.mark.parametrize("change", ["edit", "add", "remove", "label"])
def test_update_of_system_keys_by_tenant_denied(client: Client, change: str) -> None:
    old = _bound()
    new = copy.deepcopy(old)
    if change == "edit":
        new["metadata"]["annotations"]["kube-vgpu.io/allocation"] = '{"v":1,"node":"gpu-1","devices":[{"mem":24000}]}'
        needle = "metadata.annotations['kube-vgpu.io/allocation'] (changed)"
    elif change == "add":
        del old["metadata"]["annotations"]["kube-vgpu.io/bind-phase"]
        needle = "metadata.annotations['kube-vgpu.io/bind-phase'] (added)"
    elif change == "remove":
        del new["metadata"]["annotations"]["kube-vgpu.io/allocation-signature"]
        needle = "metadata.annotations['kube-vgpu.io/allocation-signature'] (removed)"
    else:
        new["metadata"]["labels"]["kube-vgpu.io/node"] = "gpu-2"
        needle = "metadata.labels['kube-vgpu.io/node'] (changed)"
    msg = denied(update(client, new, old), f"user {TENANT!r}", needle, "webhook.systemUsers",
                 "written only by the kube-vgpu system")
    assert SYSTEM_USER in msg


def test_update_of_system_keys_by_system_user_allowed(client: Client) -> None:
    old = _bound()
    new = copy.deepcopy(old)
    new["metadata"]["annotations"]["kube-vgpu.io/bind-phase"] = "failed"
    new["metadata"]["labels"]["kube-vgpu.io/node"] = "gpu-2"
    assert "patch" not in allowed(update(client, new, old, user=SYSTEM_USER))


def test_tenant_update_that_leaves_system_keys_alone_allowed(client: Client) -> None:
    old = _bound()
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["app"] = "train-v2"
    new["metadata"]["annotations"]["kube-vgpu.io/gpu-scheduler-policy"] = "binpack"  # a tenant key
    new["metadata"]["finalizers"] = []
    allowed(update(client, new, old))


def test_update_of_legacy_pod_with_old_violation_allowed(client: Client) -> None:
    """A pod admitted before the rules (or in an exempt namespace) must still be labelled and finalised."""
    old = set_env(_bound(), {"name": "LD_PRELOAD", "value": "x.so"})
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["app"] = "x"
    allowed(update(client, new, old))
