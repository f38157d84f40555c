"""gpushare compatibility (``compat.gpushare: true``) over real HTTPS, as the API server calls the webhook.

A pod written for Alibaba's gpushare (``aliyun.com/gpu-mem`` in GiB, ``aliyun.com/gpu-count``,
``aliyun.com/gpu-core.percentage``) is translated into our request at CREATE and then goes through
every webhook rule like any vGPU pod. The pod spec of gpushare's own user guide
(AliyunContainerService/gpushare-scheduler-extender docs/userguide.md: the ``binpack-1``
StatefulSet's template, ``aliyun.com/gpu-mem: 3`` "GiB") runs unchanged: the test shows the
translated request, the placement the extender's engine makes for it on a recorded cluster, and the
hard memory limit the device plugin writes for that booking (``kube_vgpu.envcontract.limits_file``,
the device plugin's writer).

Hostile tenant: every value that is not a whole number in range is refused naming the container,
the field, the value and what is allowed; mixing gpushare and our names, unequal requests/limits,
a memory total not divisible by the GPU count and compute shares over several GPUs are refused
(each would hand out something other than what was asked); the isolation rules run on the
translated pod (each escape below is denied); and with the key off nothing is translated.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from wh_helpers import Client, base_pod, decode_patch, review_of

from certs import pki, store
from kube_vgpu.config import Config, config_from_dict
from kube_vgpu.envcontract import limits_file
from kube_vgpu.model import DeviceBooking
from kube_vgpu.podspec import parse_pod
from kube_vgpu.resources import ANN_ALLOCATION
from kubectl_vgpu.cluster import load_snapshot
from kubectl_vgpu.simulate import simulate
from webhook.compat import GPUSHARE_NAMES
from webhook.server import BackgroundServer, WebhookServer

SNAPSHOT = Path(__file__).resolve().parents[1] / "kubectl" / "data" / "cluster.json"

#: gpushare-scheduler-extender docs/userguide.md, step 2, verbatim (apps/v1beta1 as published)
README_STATEFULSET = """
apiVersion: apps/v1beta1
kind: StatefulSet

metadata:
  name: binpack-1
  labels:
    app: binpack-1

spec:
  replicas: 3
  serviceName: "binpack-1"
  podManagementPolicy: "Parallel"
  selector: # define how the deployment finds the pods it manages
    matchLabels:
      app: binpack-1

  template: # define the pods specifications
    metadata:
      labels:
        app: binpack-1

    spec:
      containers:
      - name: binpack-1
        image: cheyang/gpu-player:v2
        resources:
          limits:
            # GiB
            aliyun.com/gpu-mem: 3
"""

ON = {"compat": {"gpushare": True}}


def readme_pod() -> dict[str, Any]:
    """The pod the StatefulSet controller creates from the README's template (API-server defaults added)."""
    tpl = yaml.safe_load(README_STATEFULSET)["spec"]["template"]
    pod = base_pod()
    pod["metadata"] = {"name": "binpack-1-0", "namespace": "default", **tpl["metadata"]}
    c = pod["spec"]["containers"][0]
    c.update(tpl["spec"]["containers"][0])
    return pod


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    store.write_files(d, pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-vgpu"), ["127.0.0.1"]))
    return d


class Hooks:
    """One HTTPS webhook per config, started on first use."""

    def __init__(self, tls: Path) -> None:
        self.tls = tls
        self.running: dict[str, tuple[BackgroundServer, Client, Config]] = {}

    def client(self, raw: dict[str, Any]) -> tuple[Client, Config]:
        key = repr(sorted(raw.items()))
        if key not in self.running:
            cfg = config_from_dict(raw)
            bg = BackgroundServer(WebhookServer(cfg, str(self.tls / "tls.crt"), str(self.tls / "tls.key"),
                                                host="127.0.0.1", port=0))
            bg.__enter__()
            self.running[key] = (bg, Client(bg.port, self.tls / "ca.crt"), cfg)
        _, c, cfg = self.running[key]
        return c, cfg

    def close(self) -> None:
        for bg, c, _ in self.running.values():
            c.close()
            bg.__exit__(None, None, None)


@pytest.fixture(scope="module")
def hooks(tls: Path) -> Iterator[Hooks]:
    h = Hooks(tls)
    yield h
    h.close()


def create(hooks: Hooks, pod: dict[str, Any], raw: dict[str, Any] | None = None) -> tuple[dict[str, Any], Config]:
    client, cfg = hooks.client(ON if raw is None else raw)
    return client.review(review_of(copy.deepcopy(pod))), cfg


def admitted(resp: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    r = resp["response"]
    assert r["allowed"], r.get("status")
    return jsonpatch.apply_patch(pod, decode_patch(resp))


def denied(resp: dict[str, Any]) -> tuple[int, str]:
    r = resp["response"]
    assert not r["allowed"], "expected a denial"
    return r["status"]["code"], r["status"]["message"]


def gs_pod(lim: dict[str, Any] | None = None, req: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if lim is not None:
        res["limits"] = lim
    if req is not None:
        res["requests"] = req
    pod = base_pod(res, **spec)
    pod["spec"]["containers"][0]["name"] = "train"
    return pod


def res_of(pod: dict[str, Any], i: int = 0, key: str = "containers") -> dict[str, Any]:
    return pod["spec"][key][i]["resources"]


# --- the README pod, end to end ---------------------------------------------------------------------

def test_readme_pod_runs_unchanged_translated_placed_and_hard_limited(hooks: Hooks) -> None:
    pod = readme_pod()
    resp, cfg = create(hooks, pod)
    out = admitted(resp, pod)
    r = resp["response"]
    assert any("aliyun.com/gpu-mem=3 translated to nvidia.com/gpu=1, nvidia.com/gpumem=3072" in w
               for w in r["warnings"]), r["warnings"]
    lim = res_of(out)["limits"]
    assert lim == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3072", "nvidia.com/gpucores": "0"}
    assert not any(n in part for part in res_of(out).values() for n in GPUSHARE_NAMES)
    assert out["spec"]["schedulerName"] == cfg.scheduler_name
    assert {"name": "kube-vgpu-shm", "mountPath": "/dev/shm"} in out["spec"]["containers"][0]["volumeMounts"]
    # gpushare's env, as its user guide reads it for TensorFlow's memory fraction (3 of 3 GiB visible)
    env = {e["name"]: e["value"] for e in out["spec"]["containers"][0]["env"]}
    assert env == {"ALIYUN_COM_GPU_MEM_CONTAINER": "3", "ALIYUN_COM_GPU_MEM_DEV": "3"}
    # the request every component parses from the admitted pod
    req = parse_pod(out, cfg)
    (c,) = req.app
    assert (c.count, c.memory_mib, c.memory_percent, c.cores) == (1, 3072, 0, 0)
    # placed by the extender's engine on a recorded cluster; the device plugin's limits file for it
    sim = simulate(load_snapshot(SNAPSHOT), req, cfg, ["binpack"])
    (res,) = sim.results
    assert res.node is not None, sim.rejected
    (gpus,) = res.gpus
    bookings = [DeviceBooking(g["uuid"], g["memoryMiB"], g["cores"]) for g in gpus]
    text = limits_file(bookings)
    assert f"memory_mib_0={3 * 1024}\n" in text and "devices=1\n" in text, text
    # idempotent: a second review (reinvocationPolicy IfNeeded) changes nothing
    again, _ = create(hooks, out)
    assert again["response"]["allowed"] and "patch" not in again["response"]


def test_mib_unit_and_count_and_cores_translate_with_configured_names(hooks: Hooks) -> None:
    raw = {"compat": {"gpushare": True, "gpushareMemoryUnit": "MiB"},
           "resourceNames": {"gpu": "example.com/vgpu", "gpumem": "example.com/vgpu-mem",
                             "gpucores": "example.com/vgpu-cores"}}
    pod = gs_pod({"aliyun.com/gpu-mem": "5000", "aliyun.com/gpu-core.percentage": "30"},
                 {"aliyun.com/gpu-mem": "5000", "aliyun.com/gpu-core.percentage": "30"})
    out = admitted(create(hooks, pod, raw)[0], pod)
    want = {"example.com/vgpu": "1", "example.com/vgpu-mem": "5000", "example.com/vgpu-cores": "30"}
    assert res_of(out)["limits"] == want and res_of(out)["requests"] == want


def test_gpu_count_splits_the_total_and_the_ack_label_works_too(hooks: Hooks) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 8, "aliyun.com/gpu-count": 2})
    out = admitted(create(hooks, pod)[0], pod)
    assert res_of(out)["limits"]["nvidia.com/gpu"] == "2"
    assert res_of(out)["limits"]["nvidia.com/gpumem"] == "4096"  # 8 GiB over 2 GPUs: 4 GiB each, 8 GiB in all
    labelled = gs_pod({"aliyun.com/gpu-mem": 8})
    labelled["metadata"]["labels"] = {"aliyun.com/gpu-count": "2"}
    out = admitted(create(hooks, labelled)[0], labelled)
    assert (res_of(out)["limits"]["nvidia.com/gpu"], res_of(out)["limits"]["nvidia.com/gpumem"]) == ("2", "4096")
    env = {e["name"]: e["value"] for e in out["spec"]["containers"][0]["env"]}
    assert (env["ALIYUN_COM_GPU_MEM_CONTAINER"], env["ALIYUN_COM_GPU_MEM_DEV"]) == ("8", "4")
    own = gs_pod({"aliyun.com/gpu-mem": 2})
    own["spec"]["containers"][0]["env"] = [{"name": "ALIYUN_COM_GPU_MEM_DEV", "value": "16"}]
    out = admitted(create(hooks, own)[0], own)
    assert out["spec"]["containers"][0]["env"] == [{"name": "ALIYUN_COM_GPU_MEM_DEV", "value": "16"},
                                                   {"name": "ALIYUN_COM_GPU_MEM_CONTAINER", "value": "2"}]
    only_count = gs_pod({"aliyun.com/gpu-count": 1})
    out = admitted(create(hooks, only_count)[0], only_count)
    assert res_of(out)["limits"]["nvidia.com/gpu"] == "1"  # a whole card (defaults.bareGpuExclusive)
    assert res_of(out)["limits"]["nvidia.com/gpumem-percentage"] == "100"


def test_defaults_gpu_count_never_multiplies_a_gpushare_request(hooks: Hooks) -> None:
    """gpushare's gpu-mem is one GPU's share; defaults.gpuCount: 4 must not book 4 x 3 GiB."""
    raw = {"compat": {"gpushare": True}, "defaults": {"gpuCount": 4}}
    pod = gs_pod({"aliyun.com/gpu-mem": 3})
    out = admitted(create(hooks, pod, raw)[0], pod)
    (c,) = parse_pod(out, config_from_dict(raw)).app
    assert (c.count, c.memory_mib) == (1, 3072)


def test_init_containers_are_translated_and_non_gpu_containers_hidden(hooks: Hooks) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 2})
    pod["spec"]["initContainers"] = [{"name": "prep", "image": "x", "resources": {"limits": {"aliyun.com/gpu-mem": 1}}}]
    pod["spec"]["containers"].append({"name": "log", "image": "x"})
    out = admitted(create(hooks, pod)[0], pod)
    assert res_of(out, 0, "initContainers")["limits"]["nvidia.com/gpumem"] == "1024"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"} in out["spec"]["containers"][1]["env"]


# --- a hostile tenant: values ------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("aliyun.com/gpu-mem", "0.5", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "500m", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "-1", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "0", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "3Gi", "a whole number of GiB, 1..1024"),  # 3 x 2^30 "GiB"
    ("aliyun.com/gpu-mem", "1025", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "1e300", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-mem", "lots", "a whole number of GiB, 1..1024"),
    ("aliyun.com/gpu-count", "1.5", "a whole number of GPUs, 1..128"),
    ("aliyun.com/gpu-count", "0", "a whole number of GPUs, 1..128"),
    ("aliyun.com/gpu-count", "129", "a whole number of GPUs, 1..128"),
    ("aliyun.com/gpu-core.percentage", "101", "a whole number of percent of one GPU, 1..100"),
    ("aliyun.com/gpu-core.percentage", "12.5", "a whole number of percent of one GPU, 1..100"),
    ("aliyun.com/gpu-core.percentage", "-5", "a whole number of percent of one GPU, 1..100"),
])
def test_bad_values_are_refused_naming_container_field_value_and_range(hooks: Hooks, name: str, value: str,
                                                                       allowed: str) -> None:
    lim = {"aliyun.com/gpu-mem": "4", name: value}
    code, msg = denied(create(hooks, gs_pod(lim))[0])
    assert code == 400
    assert f"container 'train': resources.limits[{name}]={value!r}" in msg and allowed in msg, msg


def test_refusals_that_would_hand_out_more_than_asked(hooks: Hooks) -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any] | None, str]] = [
        # mixing both vocabularies: which one would win? neither
        ({"aliyun.com/gpu-mem": 1, "nvidia.com/gpumem": "80000"}, None,
         "resources.limits[nvidia.com/gpumem]='80000' is invalid; allowed: either the gpushare resources"),
        ({"aliyun.com/gpu-mem": 1}, {"nvidia.com/gpu": "4"}, "resources.requests[nvidia.com/gpu]='4'"),
        # requests larger than limits
        ({"aliyun.com/gpu-mem": 1}, {"aliyun.com/gpu-mem": 64},
         "resources.requests[aliyun.com/gpu-mem]=64 is invalid; allowed: the same value as resources.limits"),
        # 3 GiB over 2 GPUs: 1.5 GiB each would have to be rounded
        ({"aliyun.com/gpu-mem": 3, "aliyun.com/gpu-count": 2}, None,
         "resources.limits[aliyun.com/gpu-mem]=3 is invalid; allowed: a whole multiple of aliyun.com/gpu-count (2)"),
        # 30% of one GPU must not become 30% of each of 4
        ({"aliyun.com/gpu-mem": 8, "aliyun.com/gpu-count": 4, "aliyun.com/gpu-core.percentage": 30}, None,
         "resources.limits[aliyun.com/gpu-core.percentage]=30 is invalid; allowed: only with one GPU"),
        # compute without memory would default to the whole card's memory
        ({"aliyun.com/gpu-core.percentage": 30}, None, "only together with aliyun.com/gpu-mem"),
    ]
    for lim, req, want in cases:
        code, msg = denied(create(hooks, gs_pod(lim, req))[0])
        assert code == 400 and msg.startswith("container 'train': ") and want in msg, (lim, req, msg)


def test_a_count_label_that_disagrees_or_is_bad_is_refused(hooks: Hooks) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 8, "aliyun.com/gpu-count": 4})
    pod["metadata"]["labels"] = {"aliyun.com/gpu-count": "2"}
    code, msg = denied(create(hooks, pod)[0])
    assert "resources.limits[aliyun.com/gpu-count]=4" in msg and "label aliyun.com/gpu-count=2" in msg, msg
    pod["metadata"]["labels"] = {"aliyun.com/gpu-count": "two"}
    code, msg = denied(create(hooks, pod)[0])
    assert code == 400 and "pod: metadata.labels[aliyun.com/gpu-count]='two'" in msg, msg


# --- a hostile tenant: isolation on the translated pod ---------------------------------------------

@pytest.mark.parametrize(("change", "field"), [
    (lambda p: p["spec"]["containers"][0].__setitem__("env", [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80g"}]),
     "env CUDA_DEVICE_MEMORY_LIMIT_0"),
    (lambda p: p["spec"]["containers"][0].__setitem__("env", [{"name": "LD_PRELOAD", "value": ""}]), "env LD_PRELOAD"),
    (lambda p: p["spec"]["containers"][0].__setitem__("env", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
     "env NVIDIA_VISIBLE_DEVICES"),
    (lambda p: p["spec"]["containers"][0].__setitem__("securityContext", {"privileged": True}),
     "securityContext.privileged"),
    (lambda p: p["spec"]["containers"][0].__setitem__("volumeMounts", [{"name": "v", "mountPath": "/usr/local/vgpu"}]),
     "volumeMounts[0].mountPath"),
    (lambda p: p["spec"].__setitem__("hostPID", True), "spec.hostPID"),
    (lambda p: p["spec"]["volumes"].append({"name": "dev", "hostPath": {"path": "/dev/nvidia0"}}), "hostPath.path"),
    (lambda p: p["spec"].__setitem__("runtimeClassName", "runc"), "spec.runtimeClassName"),
    (lambda p: p["spec"]["containers"][0].__setitem__("securityContext", {"capabilities": {"add": ["SYS_ADMIN"]}}),
     "securityContext.capabilities.add[0]"),
    (lambda p: p["spec"]["containers"][0].__setitem__("envFrom", [{"configMapRef": {"name": "limits"}}]), "envFrom[0]"),
    (lambda p: p["spec"]["containers"][0].__setitem__("env", [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]),
     "env CUDA_DISABLE_CONTROL"),
    (lambda p: p["spec"].__setitem__("initContainers", [{"name": "prep", "image": "x", "securityContext": {
        "privileged": True}, "resources": {"limits": {"aliyun.com/gpu-mem": 1}}}]), "init container 'prep'"),
])
def test_isolation_rules_run_on_the_translated_pod(hooks: Hooks, change: Any, field: str) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 3})
    change(pod)
    code, msg = denied(create(hooks, pod)[0])
    assert code == 403 and field in msg, msg
    # control: the same pod without the escape is admitted
    assert create(hooks, gs_pod({"aliyun.com/gpu-mem": 3}))[0]["response"]["allowed"]


def test_a_debug_container_added_to_a_translated_pod_is_checked(hooks: Hooks) -> None:
    """UPDATE through pods/ephemeralcontainers: the stored pod names our resources after the
    translation, so a privileged debug container is denied as for any vGPU pod."""
    pod = gs_pod({"aliyun.com/gpu-mem": 3})
    stored = admitted(create(hooks, pod)[0], pod)
    new = copy.deepcopy(stored)
    new["spec"]["ephemeralContainers"] = [{"name": "dbg", "image": "x", "securityContext": {"privileged": True}}]
    rev = review_of(new)
    rev["request"].update(operation="UPDATE", subResource="ephemeralcontainers", oldObject=stored)
    client, _ = hooks.client(ON)
    r = client.review(rev)["response"]
    assert not r["allowed"] and "ephemeral container 'dbg': securityContext.privileged" in r["status"]["message"]


def test_forged_system_keys_are_stripped_and_preset_node_refused(hooks: Hooks) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 3})
    pod["metadata"]["annotations"] = {ANN_ALLOCATION: '{"forged": true}'}
    out = admitted(create(hooks, pod)[0], pod)
    assert ANN_ALLOCATION not in out["metadata"]["annotations"]
    code, msg = denied(create(hooks, gs_pod({"aliyun.com/gpu-mem": 3}, nodeName="gpu-node-a"))[0])
    assert code == 403 and "spec.nodeName='gpu-node-a' is preset" in msg


def test_off_by_default_and_foreign_schedulers_left_alone(hooks: Hooks) -> None:
    pod = gs_pod({"aliyun.com/gpu-mem": 3})
    r = create(hooks, pod, {})[0]["response"]  # compat.gpushare defaults to false
    assert r["allowed"] and "patch" not in r
    foreign = gs_pod({"aliyun.com/gpu-mem": 3}, schedulerName="volcano")
    r = create(hooks, foreign)[0]["response"]
    assert r["allowed"] and "patch" not in r  # another scheduler's pod: not translated, not routed


# --- property: never more than asked ----------------------------------------------------------------

_VALUES = st.one_of(st.integers(-3, 2000), st.sampled_from(["0.5", "1.0", "2e0", "500m", "1Gi", "7", "12", "-2",
                                                           "1e9", "junk", "100", "101"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mem=st.none() | _VALUES, count=st.none() | _VALUES, core=st.none() | _VALUES,
       label=st.none() | st.sampled_from(["1", "2", "4", "0", "x"]), in_requests=st.booleans(),
       unit=st.sampled_from(["GiB", "MiB"]), default_count=st.integers(1, 8))
def test_translation_books_exactly_what_was_asked_or_refuses(mem: Any, count: Any, core: Any, label: str | None,
                                                             in_requests: bool, unit: str, default_count: int) -> None:
    """Whatever a tenant writes: a refusal (400, naming the container or the pod label), or a pod
    that books exactly gpu-mem in total, on as many GPUs as asked, with the compute asked."""
    from kube_vgpu.quantity import parse_whole
    from webhook.admission import answer

    lim = {n: v for n, v in (("aliyun.com/gpu-mem", mem), ("aliyun.com/gpu-count", count),
                             ("aliyun.com/gpu-core.percentage", core)) if v is not None}
    if not lim:
        return
    pod = gs_pod(lim, dict(lim) if in_requests else None)
    if label is not None:
        pod["metadata"]["labels"] = {"aliyun.com/gpu-count": label}
    cfg = config_from_dict({"compat": {"gpushare": True, "gpushareMemoryUnit": unit},
                            "defaults": {"gpuCount": default_count}})
    resp, _ = answer(review_of(copy.deepcopy(pod)), cfg)
    r = resp["response"]
    event("allowed" if r["allowed"] else "refused")
    if not r["allowed"]:
        assert r["status"]["code"] == 400, r["status"]
        assert r["status"]["message"].startswith(("container 'train': ", "pod: metadata.labels")), r["status"]
        return
    out = jsonpatch.apply_patch(pod, decode_patch(resp))
    assert not any(n in part for part in res_of(out).values() for n in GPUSHARE_NAMES)
    (c,) = parse_pod(out, cfg).app
    asked_count = parse_whole(count) if count is not None else (int(label) if label and mem is not None else 1)
    assert c.count == asked_count
    if mem is not None:
        assert c.count * c.memory_mib == parse_whole(mem) * {"GiB": 1024, "MiB": 1}[unit]
    if core is not None:
        assert c.cores == parse_whole(core) and c.count == 1
    again, _ = answer(review_of(out), cfg)
    assert again["response"]["allowed"] and "patch" not in again["response"]
