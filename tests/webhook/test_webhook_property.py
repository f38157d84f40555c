"""Properties over random pod specs, answered by the server over real TLS:

* a patch applies cleanly with ``jsonpatch`` and the result is a valid Pod (``kubernetes-validate``
  schema, when installed; plus the podspec parser);
* the mutation keeps what the pod books (parse before == parse after);
* a second review of the mutated pod is allowed with an empty patch (idempotent);
* pods that ask for no vGPU are never patched, except that system-owned ``kube-vgpu.io/`` labels
  and annotations are removed from every pod (the opt-out label among them: it opts out of nothing).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from wh_helpers import Client, base_pod, decode_patch, review_of

from kube_vgpu.config import Config, Defaults, WebhookConfig, replace
from kube_vgpu.podspec import parse_container, parse_pod
from kube_vgpu.resources import system_owned
from webhook.isolation import pod_is_ours
from webhook.mutate import asks_vgpu

try:
    import kubernetes_validate
except ImportError:  # optional dev dependency
    kubernetes_validate = None

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIO = "nvidia.com/priority"

good = {GPU: ["1", "2", "4", 1], MEM: ["1", "1000", "10240", "3k"], PCT: ["1", "50", "100"],
        CORES: ["0", "30", "100"], PRIO: ["0", "1"]}
bad = {GPU: ["0.5", "-1"], MEM: ["0", "-5", "1.5", "x"], PCT: ["0", "99.1", "50m", "101"],
       CORES: ["101", "2.5"], PRIO: ["2"]}


@st.composite
def resources(draw: st.DrawFn, allow_bad: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for where in ("limits", "requests"):
        if draw(st.integers(0, 2)) == 0:
            continue
        d: dict[str, Any] = {}
        for name in (GPU, MEM, PCT, CORES, PRIO):
            if draw(st.integers(0, 2)) == 0:
                pool = good[name] + (bad[name] if allow_bad and draw(st.integers(0, 19)) == 0 else [])
                d[name] = draw(st.sampled_from(pool))
        if draw(st.booleans()):
            d["cpu"] = draw(st.sampled_from(["100m", "1"]))
        if d:
            res[where] = d
    # an extended resource given in both lists must agree (API validation); keep limits' value
    if "limits" in res and "requests" in res:
        for k in list(res["requests"]):
            if k.startswith("nvidia.com/") and k in res["limits"]:
                res["requests"][k] = res["limits"][k]
    return res


@st.composite
def containers(draw: st.DrawFn, prefix: str, n_min: int, n_max: int, allow_bad: bool) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(n_min, n_max))):
        c: dict[str, Any] = {"name": f"{prefix}{i}", "image": "busybox"}
        if draw(st.integers(0, 3)) > 0:
            c["resources"] = draw(resources(allow_bad))
        if draw(st.integers(0, 7)) == 0:
            c["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": draw(st.sampled_from(["none", "all"]))}]
        elif draw(st.booleans()):
            c["env"] = [{"name": "A", "value": "b"}]
        if draw(st.integers(0, 9)) == 0:
            c["securityContext"] = {"privileged": True}
        if draw(st.integers(0, 5)) == 0:
            c["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        out.append(c)
    return out


@st.composite
def pods(draw: st.DrawFn, allow_bad: bool = True) -> dict[str, Any]:
    pod = base_pod()
    spec = pod["spec"]
    spec["containers"] = draw(containers("c", 1, 3, allow_bad))
    inits = draw(containers("i", 0, 2, allow_bad))
    if inits:
        spec["initContainers"] = inits
    sched = draw(st.sampled_from(["default-scheduler", "", None, "kube-vgpu-scheduler", "volcano"]))
    if sched is None:
        del spec["schedulerName"]
    else:
        spec["schedulerName"] = sched
    if any(m["name"] == "shm" for c in spec["containers"] + inits for m in c.get("volumeMounts", [])):
        spec["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    if draw(st.integers(0, 4)) == 0:
        spec["volumes"].append({"name": "kube-vgpu-shm", "emptyDir": {}})
    if draw(st.integers(0, 19)) == 0:
        spec["nodeName"] = "node-1"
    if draw(st.integers(0, 9)) == 0:
        pod["metadata"]["labels"] = {"kube-vgpu.io/webhook": "ignore"}
    return pod


@st.composite
def configs(draw: st.DrawFn) -> Config:
    wh = WebhookConfig(
        mutate_bare_gpu=draw(st.booleans()),
        non_gpu_visible_devices_none=draw(st.booleans()),
        shm_size_limit=draw(st.sampled_from(["", "1Gi"])),
        privileged=draw(st.sampled_from(["deny", "allow"])),
        allow_user_visible_devices=draw(st.booleans()),
    )
    d = Defaults(memory_mib=draw(st.sampled_from([0, 2048])), cores=draw(st.sampled_from([0, 20])),
                 bare_gpu_exclusive=draw(st.booleans()))
    return Config(webhook=wh, defaults=d)


def _valid_pod(pod: dict[str, Any], cfg: Config) -> None:
    if kubernetes_validate is not None:
        kubernetes_validate.validate(pod, "1.30", strict=True)
    names = [c["name"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
    assert len(names) == len(set(names))
    vols = [v["name"] for v in pod["spec"]["volumes"]]
    assert len(vols) == len(set(vols))
    for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(mounts) == len(set(mounts))
        assert all(m["name"] in vols for m in c.get("volumeMounts", []))
        if parse_container(c, False, cfg) is None:
            continue  # not ours: left exactly as the user wrote it
        res = c.get("resources") or {}
        for k, v in (res.get("requests") or {}).items():  # extended resources need a limit
            if k.startswith("nvidia.com/"):
                assert k in (res.get("limits") or {}), (c["name"], k, v)


def _requests(pod: dict[str, Any], cfg: Config) -> Any:
    r = parse_pod(pod, cfg)
    return (r.init, r.app)


@pytest.fixture(scope="module")
def clients(tls_dir: Any) -> Any:
    """One server per config is too slow; run the server with its config swapped per example."""
    from webhook.server import BackgroundServer, WebhookServer
    srv = WebhookServer(Config(), str(tls_dir / "tls.crt"), str(tls_dir / "tls.key"), host="127.0.0.1", port=0)
    with BackgroundServer(srv) as bg:
        c = Client(bg.port, tls_dir / "ca.crt")
        yield srv, c
        c.close()


def _set_config(srv: Any, cfg: Config) -> None:
    # the app closes over the config object; swap its fields in place (frozen dataclass -> object.__setattr__)
    app_cfg = srv.config
    for f in ("webhook", "defaults"):
        object.__setattr__(app_cfg, f, getattr(cfg, f))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(pod=pods(), cfg=configs(), v1beta1=st.booleans())
def test_random_pods_over_tls(clients: Any, pod: dict[str, Any], cfg: Config, v1beta1: bool) -> None:
    srv, client = clients
    _set_config(srv, cfg)
    version = "admission.k8s.io/v1beta1" if v1beta1 else "admission.k8s.io/v1"
    original = copy.deepcopy(pod)
    resp = client.review(review_of(pod, version))
    assert resp["apiVersion"] == version
    r = resp["response"]
    patch = decode_patch(resp)
    spec = pod["spec"]
    all_containers = spec.get("initContainers", []) + spec["containers"]
    removals = [op for op in patch if op["path"].startswith("/metadata/")]
    assert all(op["op"] == "remove" for op in removals)
    if r["allowed"]:
        assert sorted(op["path"] for op in removals) == sorted(
            f"/metadata/labels/{k.replace('/', '~1')}" for k in pod["metadata"].get("labels", {}) if system_owned(k))
    if not pod_is_ours(pod, cfg):
        assert r["allowed"] is True and patch == removals, "pods without vGPU requests are never patched"
        event("not ours")
        return
    if not r["allowed"]:
        assert patch == [] and r["status"]["message"]
        event("denied")
        return
    if not any(asks_vgpu(c, cfg) for c in all_containers) or spec.get("schedulerName") == "volcano":
        assert patch == removals
    mutated = jsonpatch.apply_patch(pod, patch)
    assert pod == original  # apply_patch did not touch the input
    labels = {k: v for k, v in pod["metadata"].get("labels", {}).items() if not system_owned(k)}
    assert mutated["metadata"] == {**pod["metadata"], **({"labels": labels} if "labels" in pod["metadata"] else {})}
    event("patched" if patch != removals else "removals only" if patch else "allowed unchanged")
    if patch == removals:
        assert mutated["spec"] == pod["spec"]
    else:
        _valid_pod(mutated, cfg)
        assert mutated["spec"]["schedulerName"] == "kube-vgpu-scheduler"
        assert _requests(mutated, cfg) == _requests(pod, cfg), "the mutation must not change what is booked"
    again = client.review(review_of(mutated, version))["response"]
    assert again["allowed"] is True and "patch" not in again and "patchType" not in again, json.dumps(again)


@settings(max_examples=60, deadline=None)
@given(pod=pods(allow_bad=False), cfg=configs())
def test_no_vgpu_never_patched(pod: dict[str, Any], cfg: Config) -> None:
    """Strip every one of our resources: the answer must be an allow that at most removes system-owned
    labels, whatever else the pod has."""
    from webhook.mutate import review_pod
    for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        for lst in (c.get("resources") or {}).values():
            for k in [k for k in lst if k.startswith("nvidia.com/")]:
                del lst[k]
    d = review_pod(pod, cfg)
    assert d.allowed
    assert all(op == {"op": "remove", "path": "/metadata/labels/kube-vgpu.io~1webhook"} for op in d.patch)


def test_config_swap_used_by_property_test_reaches_app(clients: Any) -> None:
    srv, client = clients
    _set_config(srv, replace(Config(), webhook=replace(WebhookConfig(), mutate_bare_gpu=False)))
    assert client.review(review_of(base_pod({"limits": {GPU: "1"}})))["response"].get("patch") is None
    _set_config(srv, Config())
    assert client.review(review_of(base_pod({"limits": {GPU: "1"}})))["response"].get("patch")
