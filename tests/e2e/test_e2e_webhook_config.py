"""The chart's MutatingWebhookConfiguration in a real kube-apiserver, with a real ``kube-vgpu webhook``.

A control plane of its own (etcd + kube-apiserver; no kubelet, no scheduler): the chart is rendered
with helm for the API server's version and its MutatingWebhookConfiguration is created as rendered
(rules, ``matchConditions`` in CEL, ``namespaceSelector``, ``failurePolicy``), except that
``clientConfig.service`` is replaced by ``clientConfig.url: https://127.0.0.1:PORT/mutate`` of a
``kube-vgpu webhook`` process started here, with the caBundle of its ``kube-vgpu certs`` CA (a
configuration naming a Service would make the API server dial out through the host resolver).

The API server compiles the CEL when the configuration is created; then a tenant ServiceAccount with
namespace-scoped pod rights shows which requests reach the webhook (counted in the webhook's
``kube_vgpu_webhook_requests_total``) and what it decides: pods naming a vGPU resource in limits,
only in requests, only in an init container, or only ``nvidia.com/gpu``, are mutated or denied for
an isolation violation naming the container, whatever their labels or ``schedulerName``; a plain pod
is not sent; a forged ``kube-vgpu.io/allocation`` is stripped; ephemeral containers added through
``pods/ephemeralcontainers`` are checked and hidden from the GPUs; a tenant UPDATE of
``kube-vgpu.io/`` keys is denied while the system's own writes are not sent; a namespace labelled
``kube-vgpu.io/webhook=ignore`` (and the release namespace) is not sent; and with the webhook down,
``failurePolicy: Fail`` refuses vGPU pods and tenant changes of the system's records, while plain
pods are still created, pods edited and the extender's writes admitted.

Run: ``KUBE_BIN_DIR=... pytest tests/e2e/test_e2e_webhook_config.py -m e2e -x -s`` (tests/e2e/README.md).
"""

from __future__ import annotations

import base64
import copy
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.envcontract import SM_LIMIT, VISIBLE_DEVICES
from kube_vgpu.resources import (
    ANN_ALLOCATION,
    ANN_NODE_POLICY,
    LABEL_NODE,
    LABEL_WEBHOOK,
    LABEL_WEBHOOK_IGNORE,
)

from .cluster import (
    ROOT,
    SCHEDULER_NAME,
    Components,
    ControlPlane,
    helm_binary,
    wait_for,
    write_kubeconfig,
    write_policy,
)

pytestmark = pytest.mark.e2e

RELEASE, NS, TENANT_NS, IGNORED_NS = "kv", "kube-vgpu", "team-a", "team-ignored"
FULL = f"{RELEASE}-kube-vgpu"
EXTENDER_SA = f"{FULL}-extender"
GPUMEM = "nvidia.com/gpumem"
GPU = "nvidia.com/gpu"
WEBHOOK_NAME = "mutate.kube-vgpu.io"


def _metrics_total(port: int) -> float:
    """Sum of ``kube_vgpu_webhook_requests_total`` over all outcomes: the AdmissionReviews answered."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kube_vgpu_webhook_requests_total{"))


def _as(cp: ControlPlane, work: Path, token: str, name: str) -> Any:
    from kubernetes import config

    assert cp.kubeconfig is not None
    c = yaml.safe_load(cp.kubeconfig.read_text())["clusters"][0]["cluster"]
    return config.new_client_from_config(config_file=str(write_kubeconfig(
        work / f"kc-{name}", c["server"], token, c["certificate-authority-data"])))


def _token(core: Any, ns: str, sa: str) -> str:
    from kubernetes import client

    tr = core.create_namespaced_service_account_token(sa, ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)))
    return str(tr.status.token)


def _refused(fn: Any, *args: Any, status: int = 403, **kw: Any) -> str:
    """The message of the error a call must get (``status``)."""
    from kubernetes.client.rest import ApiException

    try:
        fn(*args, **kw)
    except ApiException as e:
        assert e.status == status, f"expected HTTP {status}, got {e.status}: {e.body}"
        return str(e.body)
    raise AssertionError("the request was admitted")


def _pod(name: str, *, limits: dict[str, str] | None = None, requests: dict[str, str] | None = None,
         init: bool = False, env: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
         labels: dict[str, str] | None = None, scheduler: str | None = None) -> dict[str, Any]:
    """A pod whose container ``gpu`` (an init container with ``init``) carries the resources and env;
    an app container ``app`` is always there."""
    res: dict[str, Any] = {}
    if limits:
        res["limits"] = limits
    if requests:
        res["requests"] = requests
    c: dict[str, Any] = {"name": "gpu", "image": "busybox", "resources": res}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "busybox"}]}
    if init:
        spec["initContainers"] = [c]
    else:
        spec["containers"].insert(0, c)
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}}, "spec": spec}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kubernetes import client, config

    work = tmp_path_factory.mktemp("e2e-webhook-config")
    cp = ControlPlane(work)
    comps = Components(cp, work)
    try:
        try:
            cp.start()
        except FileNotFoundError as e:
            pytest.skip(f"e2e: {e}")
        if cp.bin_dir is None:
            pytest.skip("the webhook-configuration scenario installs a cluster-wide webhook: only on its own "
                        "KUBE_BIN_DIR control plane")
        assert cp.kubeconfig is not None
        admin = config.new_client_from_config(config_file=str(cp.kubeconfig))
        version = client.VersionApi(admin).get_code()
        if (int(version.major), int(version.minor.rstrip("+"))) < (1, 30):
            pytest.skip(f"kube-apiserver {version.git_version}: matchConditions v1 needs 1.30")
        write_policy(comps.policy, "binpack")
        comps.start_webhook()
        yield {"cp": cp, "comps": comps, "admin": admin, "work": work,
               "version": version.git_version.lstrip("v").split("-")[0]}
    finally:
        comps.stop()
        cp.stop()


@pytest.fixture(scope="module")
def env(cluster: dict[str, Any]) -> dict[str, Any]:
    """The chart's webhook configuration (pointed at the local webhook) in place, namespaces and the tenant."""
    from kubernetes import client

    admin, comps = cluster["admin"], cluster["comps"]
    core = client.CoreV1Api(admin)
    r = subprocess.run([helm_binary(), "template", RELEASE, str(ROOT / "charts" / "kube-vgpu"), "--namespace", NS,
                        "--kube-version", cluster["version"]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (rendered,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "MutatingWebhookConfiguration"]
    mwc = copy.deepcopy(rendered)
    (wh,) = mwc["webhooks"]
    assert wh["failurePolicy"] == "Fail", "the chart's default failurePolicy"
    assert wh.get("matchConditions"), f"the chart renders no matchConditions for {cluster['version']}"
    assert "service" in wh["clientConfig"]
    wh["clientConfig"] = {"url": f"https://127.0.0.1:{comps.webhook_port}/mutate",
                          "caBundle": base64.b64encode(comps.ca_pem).decode()}
    assert "service" not in str(wh["clientConfig"])  # never a Service: the API server would resolve it

    adm = client.AdmissionregistrationV1Api(admin)
    # the API server compiles the CEL of matchConditions here: an error is a 422 and fails the test
    adm.create_mutating_webhook_configuration(mwc)
    stored = adm.read_mutating_webhook_configuration(mwc["metadata"]["name"]).webhooks[0]
    assert [m.name for m in stored.match_conditions] == [m["name"] for m in wh["matchConditions"]]
    assert [m.expression for m in stored.match_conditions] == [m["expression"] for m in wh["matchConditions"]]
    assert stored.namespace_selector.to_dict()["match_expressions"] == [
        {"key": e["key"], "operator": e["operator"], "values": e["values"]}
        for e in rendered["webhooks"][0]["namespaceSelector"]["matchExpressions"]]

    for ns, labels in ((NS, {}), (TENANT_NS, {}), (IGNORED_NS, {LABEL_WEBHOOK: LABEL_WEBHOOK_IGNORE})):
        core.create_namespace({"metadata": {"name": ns, "labels": labels}})
        for sa in ("default", "tenant") if ns == TENANT_NS else ("default",):
            try:  # without kube-controller-manager nobody creates the default one
                core.create_namespaced_service_account(ns, {"metadata": {"name": sa}})
            except client.ApiException as e:
                if e.status != 409:
                    raise
    # the tenant: pod rights in its namespace only, ephemeral containers included
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(TENANT_NS, {"metadata": {"name": "tenant"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "update", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["get", "update", "patch"]}]})
    rbac.create_namespaced_role_binding(TENANT_NS, {"metadata": {"name": "tenant"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": TENANT_NS}]})
    # the extender's ServiceAccount (one of the chart's webhook systemUsers) may patch pods in team-a
    core.create_namespaced_service_account(NS, {"metadata": {"name": EXTENDER_SA}})
    rbac.create_namespaced_role_binding(TENANT_NS, {"metadata": {"name": "extender"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": EXTENDER_SA, "namespace": NS}]})
    tenant = client.CoreV1Api(_as(cluster["cp"], cluster["work"], _token(core, TENANT_NS, "tenant"), "tenant"))
    extender = client.CoreV1Api(_as(cluster["cp"], cluster["work"], _token(core, NS, EXTENDER_SA), "extender"))

    # the configuration takes effect once the API server's informer has it
    probe = _pod("probe", limits={GPUMEM: "1000"})

    def in_effect() -> bool:
        got = tenant.create_namespaced_pod(TENANT_NS, probe, dry_run="All")
        return bool(got.spec.scheduler_name == SCHEDULER_NAME)
    wait_for(in_effect, 60, "the webhook configuration in effect")
    return {**cluster, "core": core, "tenant": tenant, "extender": extender, "port": comps.webhook_port}


class Reviews:
    """Counts the AdmissionReviews the webhook answers during a ``with`` block (its /metrics)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.n = 0.0

    def __enter__(self) -> Reviews:
        self.before = _metrics_total(self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        # the counter is incremented before the answer is sent, so the API server's reply comes later
        self.n = _metrics_total(self.port) - self.before


VGPU_SHAPES: dict[str, dict[str, Any]] = {
    "gpumem-limits": {"limits": {GPUMEM: "1000"}},
    "gpumem-requests-only": {"requests": {GPUMEM: "1000"}},
    "gpumem-init-container-only": {"limits": {GPUMEM: "1000"}, "init": True},
    "gpu-only": {"limits": {GPU: "1"}},
}


@pytest.mark.parametrize("shape", list(VGPU_SHAPES))
def test_vgpu_pods_reach_the_webhook(env: dict[str, Any], shape: str) -> None:
    from kubernetes.utils import parse_quantity

    tenant, port = env["tenant"], env["port"]
    kw = VGPU_SHAPES[shape]
    kind = "init container" if kw.get("init") else "container"
    # an isolation violation is denied, naming the container
    with Reviews(port) as seen:
        msg = _refused(tenant.create_namespaced_pod, TENANT_NS, _pod(f"bad-{shape}", env={SM_LIMIT: "100"}, **kw))
    assert seen.n == 1, seen.n
    assert f"{kind} 'gpu': env {SM_LIMIT}=" in msg and WEBHOOK_NAME in msg, msg
    # ... whatever the pod's labels (a pod label never opts out) or scheduler
    with Reviews(port) as seen:
        msg = _refused(tenant.create_namespaced_pod, TENANT_NS, _pod(
            f"optout-{shape}", env={SM_LIMIT: "100"}, labels={LABEL_WEBHOOK: LABEL_WEBHOOK_IGNORE},
            scheduler="nobody", **kw))
    assert seen.n == 1 and f"{kind} 'gpu': env {SM_LIMIT}=" in msg, (seen.n, msg)
    # a clean one is routed to our scheduler, its vGPU values in limits
    with Reviews(port) as seen:
        got = tenant.create_namespaced_pod(TENANT_NS, _pod(f"ok-{shape}", **kw))
    assert seen.n == 1, seen.n
    assert got.spec.scheduler_name == SCHEDULER_NAME
    (c,) = got.spec.init_containers if kw.get("init") else got.spec.containers[:1]
    assert GPU in c.resources.limits, c.resources
    if GPUMEM in (kw.get("limits") or kw.get("requests") or {}):
        assert parse_quantity(c.resources.limits[GPUMEM]) == 1000, c.resources  # the API server writes "1k"
    print(f"\nE2E webhook config: {shape}: sent, isolation violation denied ({kind} 'gpu'), "
          f"clean pod routed to {SCHEDULER_NAME}")


def test_plain_pod_is_not_sent_and_forged_records_are_stripped(env: dict[str, Any]) -> None:
    tenant, port = env["tenant"], env["port"]
    with Reviews(port) as seen:
        got = tenant.create_namespaced_pod(TENANT_NS, _pod("plain", annotations={"example.com/a": "b"},
                                                                   labels={"app": "x"}))
    assert seen.n == 0, f"a plain pod reached the webhook ({seen.n} reviews)"
    assert got.spec.scheduler_name == "default-scheduler"

    forged = {ANN_ALLOCATION: '{"v":1}', ANN_NODE_POLICY: "spread"}
    for name, kw in (("forged-plain", {}), ("forged-vgpu", {"limits": {GPUMEM: "1000"}})):
        with Reviews(port) as seen:
            got = tenant.create_namespaced_pod(TENANT_NS, _pod(name, annotations=forged,
                                                              labels={LABEL_NODE: "gpu-node-0", "app": "x"}, **kw))
        assert seen.n == 1, (name, seen.n)
        meta = env["core"].read_namespaced_pod(name, TENANT_NS).metadata
        assert ANN_ALLOCATION not in (meta.annotations or {}), (name, meta.annotations)
        assert LABEL_NODE not in (meta.labels or {}), (name, meta.labels)
        assert meta.annotations[ANN_NODE_POLICY] == "spread" and meta.labels["app"] == "x", meta
    print("\nE2E webhook config: plain pod not sent; forged allocation annotation and node label stripped "
          "(plain and vGPU pods), tenant keys kept")


def test_ephemeral_containers_of_vgpu_pods(env: dict[str, Any]) -> None:
    tenant, port = env["tenant"], env["port"]
    tenant.create_namespaced_pod(TENANT_NS, _pod("debug-me", limits={GPUMEM: "1000"}))

    def debug(name: str, **extra: Any) -> dict[str, Any]:
        return {"spec": {"ephemeralContainers": [
            {"name": name, "image": "busybox", "targetContainerName": "gpu", **extra}]}}

    with Reviews(port) as seen:
        msg = _refused(tenant.patch_namespaced_pod_ephemeralcontainers, "debug-me", TENANT_NS,
                       debug("root", securityContext={"privileged": True}))
    assert seen.n == 1, seen.n
    assert "ephemeral container 'root'" in msg and "privileged" in msg, msg
    with Reviews(port) as seen:
        tenant.patch_namespaced_pod_ephemeralcontainers("debug-me", TENANT_NS, debug("dbg"))
    assert seen.n == 1, seen.n
    (ec,) = env["core"].read_namespaced_pod("debug-me", TENANT_NS).spec.ephemeral_containers
    assert ec.name == "dbg" and {e.name: e.value for e in ec.env or []} == {VISIBLE_DEVICES: "none"}, ec

    # a plain pod's debug container is not sent (nothing to protect there)
    tenant.create_namespaced_pod(TENANT_NS, _pod("debug-plain"))
    with Reviews(port) as seen:
        tenant.patch_namespaced_pod_ephemeralcontainers("debug-plain", TENANT_NS, debug("dbg"))
    assert seen.n == 0, seen.n
    print("\nE2E webhook config: ephemeral containers of a vGPU pod: privileged denied, plain one gets "
          f"{VISIBLE_DEVICES}=none; a plain pod's not sent")


def test_updates_of_system_keys(env: dict[str, Any]) -> None:
    tenant, extender, core, port = env["tenant"], env["extender"], env["core"], env["port"]
    tenant.create_namespaced_pod(TENANT_NS, _pod("upd", limits={GPUMEM: "1000"}))
    tenant_user = f"system:serviceaccount:{TENANT_NS}:tenant"
    for what, patch in (("add the allocation", {"annotations": {ANN_ALLOCATION: '{"v":1}'}}),
                        ("add the node label", {"labels": {LABEL_NODE: "gpu-node-0"}})):
        with Reviews(port) as seen:
            msg = _refused(tenant.patch_namespaced_pod, "upd", TENANT_NS, {"metadata": patch})
        assert seen.n == 1, (what, seen.n)
        key = next(iter(next(iter(patch.values()))))
        assert key in msg and tenant_user in msg, (what, msg)
    # everyday edits are not sent; a tenant key is sent and allowed
    with Reviews(port) as seen:
        tenant.patch_namespaced_pod("upd", TENANT_NS, {"metadata": {"labels": {"app": "y"}}})
    assert seen.n == 0, seen.n
    with Reviews(port) as seen:
        tenant.patch_namespaced_pod("upd", TENANT_NS, {"metadata": {"annotations": {ANN_NODE_POLICY: "binpack"}}})
    assert seen.n == 1, seen.n
    # the extender's writes are not sent (this webhook process has no --system-user: it would deny them)
    with Reviews(port) as seen:
        extender.patch_namespaced_pod("upd", TENANT_NS, {"metadata": {
            "annotations": {ANN_ALLOCATION: '{"v":1}'}, "labels": {LABEL_NODE: "gpu-node-0"}}})
    assert seen.n == 0, seen.n
    meta = core.read_namespaced_pod("upd", TENANT_NS).metadata
    assert meta.annotations[ANN_ALLOCATION] == '{"v":1}' and meta.labels[LABEL_NODE] == "gpu-node-0"
    # ... and the tenant can neither change nor drop what the extender wrote
    for what, patch in (("edit", {ANN_ALLOCATION: '{"v":2}'}), ("drop", {ANN_ALLOCATION: None})):
        with Reviews(port) as seen:
            msg = _refused(tenant.patch_namespaced_pod, "upd", TENANT_NS, {"metadata": {"annotations": patch}})
        assert seen.n == 1 and ANN_ALLOCATION in msg, (what, seen.n, msg)
    # a plain edit of a pod that carries the system's keys is not sent (the keys compare equal)
    with Reviews(port) as seen:
        tenant.patch_namespaced_pod("upd", TENANT_NS, {"metadata": {"labels": {"app": "z"},
                                                                    "annotations": {"example.com/a": "b"}}})
    assert seen.n == 0, seen.n
    print("\nE2E webhook config: tenant UPDATE adding/editing/dropping kube-vgpu.io/ keys denied; plain edits "
          "not sent; the extender's writes not sent")


def test_excluded_namespaces_are_not_sent(env: dict[str, Any]) -> None:
    core, port = env["core"], env["port"]
    for ns in (IGNORED_NS, NS):
        with Reviews(port) as seen:
            got = core.create_namespaced_pod(ns, _pod("skipped", limits={GPUMEM: "1000"}, env={SM_LIMIT: "100"}))
        assert seen.n == 0, (ns, seen.n)
        assert got.spec.scheduler_name == "default-scheduler", ns
    print(f"\nE2E webhook config: namespace labelled {LABEL_WEBHOOK}={LABEL_WEBHOOK_IGNORE} and the release "
          "namespace not sent")


def test_webhook_down_fails_closed_for_vgpu_pods_only(env: dict[str, Any]) -> None:
    tenant, comps = env["tenant"], env["comps"]
    comps.procs["webhook"].stop()
    msg = _refused(tenant.create_namespaced_pod, TENANT_NS, _pod("down-vgpu", limits={GPUMEM: "1000"}), status=500)
    assert "failed calling webhook" in msg and WEBHOOK_NAME in msg, msg
    msg = _refused(tenant.create_namespaced_pod, TENANT_NS, _pod("down-gpu", limits={GPU: "1"}), status=500)
    assert WEBHOOK_NAME in msg, msg
    got = tenant.create_namespaced_pod(TENANT_NS, _pod("down-plain"))
    assert got.spec.scheduler_name == "default-scheduler"
    tenant.patch_namespaced_pod("down-plain", TENANT_NS, {"metadata": {"labels": {"app": "z"}}})
    # a vGPU pod holding the system's records (test_updates_of_system_keys): everyday edits and the
    # system's own writes go on without the webhook; a tenant change of a record is refused
    tenant.patch_namespaced_pod("upd", TENANT_NS, {"metadata": {"labels": {"app": "down"}}})
    env["extender"].patch_namespaced_pod("upd", TENANT_NS, {"metadata": {"annotations": {ANN_ALLOCATION: '{"v":3}'}}})
    msg = _refused(tenant.patch_namespaced_pod, "upd", TENANT_NS,
                   {"metadata": {"annotations": {ANN_ALLOCATION: '{"v":4}'}}}, status=500)
    assert WEBHOOK_NAME in msg, msg
    assert env["core"].read_namespaced_pod("upd", TENANT_NS).metadata.annotations[ANN_ALLOCATION] == '{"v":3}'
    print("\nE2E webhook config: webhook down: vGPU pods and tenant record changes refused (failurePolicy Fail); "
          "plain pods created, pods edited, the extender's writes admitted")
