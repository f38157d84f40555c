"""The chart's ValidatingAdmissionPolicies in a real kube-apiserver, played as a hostile tenant.

A control plane of its own (etcd + kube-apiserver, + kube-controller-manager when present): only
the chart's policies, bindings, ServiceAccounts and the extender's and device plugin's RBAC are
applied (rendered with helm); no webhook configuration is registered. A tenant ServiceAccount with
namespace-scoped pod rights (create/update/patch, and pods/binding create, the worst case) tries
the annotation, label and Binding attacks and is refused with messages naming the key; the
extender's ServiceAccount writes the same keys; the device plugin's ServiceAccount, with a token
bound to a pod on node n1, may touch only n1 and the pods bound to it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_BIND_PHASE,
    ANN_NODE_INVENTORY,
    ANN_NODE_POLICY,
    LABEL_NODE,
)

from .cluster import ROOT, ControlPlane, helm_binary, wait_for, write_kubeconfig

pytestmark = pytest.mark.e2e

RELEASE, NS, TENANT_NS = "kv", "kube-vgpu", "team-a"
FULL = f"{RELEASE}-kube-vgpu"
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kubernetes import client, config

    work = tmp_path_factory.mktemp("e2e-policies")
    cp = ControlPlane(work)
    try:
        try:
            cp.start()
        except FileNotFoundError as e:
            pytest.skip(f"e2e: {e}")
        if cp.bin_dir is None:
            pytest.skip("the policy scenario installs cluster-wide policies: only on its own KUBE_BIN_DIR control plane")
        assert cp.kubeconfig is not None
        admin = config.new_client_from_config(config_file=str(cp.kubeconfig))
        version = client.VersionApi(admin).get_code()
        if (int(version.major), int(version.minor.rstrip("+"))) < (1, 30):
            pytest.skip(f"kube-apiserver {version.git_version}: ValidatingAdmissionPolicy v1 needs 1.30")
        yield {"cp": cp, "admin": admin, "version": version.git_version.lstrip("v").split("-")[0], "work": work}
    finally:
        cp.stop()


def _as(cluster: dict[str, Any], token: str, name: str) -> Any:
    from kubernetes import config

    c = yaml.safe_load(Path(cluster["cp"].kubeconfig).read_text())["clusters"][0]["cluster"]
    return config.new_client_from_config(config_file=str(write_kubeconfig(
        cluster["work"] / f"kc-{name}", c["server"], token, c["certificate-authority-data"])))


def _token(core: Any, ns: str, sa: str, pod: Any = None) -> str:
    from kubernetes import client

    ref = client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod.metadata.name,
                                        uid=pod.metadata.uid) if pod is not None else None
    tr = core.create_namespaced_service_account_token(sa, ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600, bound_object_ref=ref)))
    return str(tr.status.token)


def _forbidden(fn: Any, *args: Any, **kw: Any) -> str:
    """The message of the 403 a call must get."""
    from kubernetes.client.rest import ApiException

    try:
        fn(*args, **kw)
    except ApiException as e:
        assert e.status == 403, f"expected 403 Forbidden, got {e.status}: {e.body}"
        return str(e.body)
    raise AssertionError("the request was admitted")


def _pod(name: str, annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
         node: str | None = None, sa: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}], "schedulerName": "kube-vgpu-scheduler"}
    if node:
        spec["nodeName"] = node
    if sa:
        spec["serviceAccountName"] = sa
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}, "labels": labels or {}}, "spec": spec}


def test_tenant_cannot_forge_or_edit_system_records(cluster: dict[str, Any]) -> None:
    from kubernetes import client, utils

    admin = cluster["admin"]
    core = client.CoreV1Api(admin)
    r = subprocess.run([helm_binary(), "template", RELEASE, str(ROOT / "charts" / "kube-vgpu"), "--namespace", NS,
                        "--kube-version", cluster["version"]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    ours = {f"{FULL}-extender", f"{FULL}-device-plugin"}
    wanted = [d for d in docs if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert len(wanted) == 6
    wanted += [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] in ours]
    wanted += [d for d in docs if d["kind"] in RBAC_KINDS and d["metadata"]["name"] in ours]
    for ns in (NS, TENANT_NS):
        core.create_namespace({"metadata": {"name": ns}})
        try:  # without kube-controller-manager nobody creates it
            core.create_namespaced_service_account(ns, {"metadata": {"name": "default"}})
        except client.ApiException as e:
            if e.status != 409:
                raise
    for d in wanted:
        utils.create_from_dict(admin, d)
    for n in ("n1", "n2"):
        core.create_node({"metadata": {"name": n, "annotations": {ANN_NODE_INVENTORY: "{}"}}})

    # the tenant: pod rights in its namespace only (pods/binding too: the worst case)
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(TENANT_NS, {"metadata": {"name": "tenant"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "update", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]}]})
    core.create_namespaced_service_account(TENANT_NS, {"metadata": {"name": "tenant"}})
    rbac.create_namespaced_role_binding(TENANT_NS, {"metadata": {"name": "tenant"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": TENANT_NS}]})
    tenant = client.CoreV1Api(_as(cluster, _token(core, TENANT_NS, "tenant"), "tenant"))
    extender = client.CoreV1Api(_as(cluster, _token(core, NS, f"{FULL}-extender"), "extender"))

    # the policies take effect once the API server has loaded them
    forged = _pod("forged", {ANN_ALLOCATION: '{"v":1}'})

    def refused() -> bool:
        try:
            tenant.create_namespaced_pod(TENANT_NS, forged, dry_run="All")
        except client.ApiException as e:
            return e.status == 403
        return False
    wait_for(refused, 60, "the admission policies in effect")

    # 1. create with system-owned annotation / label: refused, naming the key
    msg = _forbidden(tenant.create_namespaced_pod, TENANT_NS, forged)
    assert f"pod annotation {ANN_ALLOCATION} is written only by the kube-vgpu system" in msg, msg
    msg = _forbidden(tenant.create_namespaced_pod, TENANT_NS, _pod("squat", labels={LABEL_NODE: "n1"}))
    assert f"pod label {LABEL_NODE} is written only by the kube-vgpu system" in msg, msg
    # a pod with the tenant keys is fine
    tenant.create_namespaced_pod(TENANT_NS, _pod("p", {ANN_NODE_POLICY: "spread"}, {"app": "x"}))

    # 2. the extender's ServiceAccount writes the record; the tenant can neither change nor drop it
    extender.patch_namespaced_pod("p", TENANT_NS, {"metadata": {
        "annotations": {ANN_ALLOCATION: '{"v":1}', ANN_BIND_PHASE: "allocating"}, "labels": {LABEL_NODE: "n1"}}})
    tenant_user = f"system:serviceaccount:{TENANT_NS}:tenant"
    for what, patch, key in (
            ("edit the allocation", {"annotations": {ANN_ALLOCATION: '{"v":1,"x":1}'}}, ANN_ALLOCATION),
            ("claim success", {"annotations": {ANN_BIND_PHASE: "success"}}, ANN_BIND_PHASE),
            ("drop the allocation", {"annotations": {ANN_ALLOCATION: None}}, ANN_ALLOCATION),
            ("move the node label", {"labels": {LABEL_NODE: "n2"}}, LABEL_NODE)):
        msg = _forbidden(tenant.patch_namespaced_pod, "p", TENANT_NS, {"metadata": patch})
        assert f"{key} is written only by the kube-vgpu system" in msg and tenant_user in msg, (what, msg)
    # ... nor through a Binding, whose annotations the API server copies onto the pod
    binding = client.V1Binding(metadata=client.V1ObjectMeta(name="p", annotations={ANN_ALLOCATED_CONTAINERS: "c"}),
                               target=client.V1ObjectReference(kind="Node", name="n1", api_version="v1"))
    msg = _forbidden(tenant.create_namespaced_pod_binding, "p", TENANT_NS, binding, _preload_content=False)
    assert f"{ANN_ALLOCATED_CONTAINERS} is written only by the kube-vgpu system" in msg, msg
    # the tenant's own metadata stays editable; the record is untouched
    tenant.patch_namespaced_pod("p", TENANT_NS, {"metadata": {"labels": {"app": "y"},
                                                              "annotations": {ANN_NODE_POLICY: "binpack"}}})
    got = core.read_namespaced_pod("p", TENANT_NS).metadata
    assert got.annotations[ANN_ALLOCATION] == '{"v":1}' and got.labels[LABEL_NODE] == "n1"

    # 3. the device plugin of node n1 (token bound to its pod on n1)
    core.create_namespaced_pod(NS, _pod("dp-n1", node="n1", sa=f"{FULL}-device-plugin"))
    dp_pod = core.read_namespaced_pod("dp-n1", NS)
    dp = client.CoreV1Api(_as(cluster, _token(core, NS, f"{FULL}-device-plugin", dp_pod), "dp"))

    def node_policy_in_effect() -> bool:  # each policy takes effect on its own once loaded
        try:
            dp.patch_node("n2", {"metadata": {"annotations": {ANN_NODE_INVENTORY: "{}"}}}, dry_run="All")
        except client.ApiException as e:
            return e.status == 403
        return False
    wait_for(node_policy_in_effect, 60, "the device plugin's node policy in effect")
    dp.patch_node("n1", {"metadata": {"annotations": {ANN_NODE_INVENTORY: '{"v":2}'}}})
    msg = _forbidden(dp.patch_node, "n2", {"metadata": {"annotations": {ANN_NODE_INVENTORY: "{}"}}})
    assert "may change only its own Node, not node n2" in msg, msg
    msg = _forbidden(dp.patch_node, "n1", {"metadata": {"labels": {"gpu": "on"}}})
    assert "may change only annotations" in msg, msg
    core.create_namespaced_pod(TENANT_NS, _pod("on-n1", node="n1"))
    core.create_namespaced_pod(TENANT_NS, _pod("on-n2", node="n2"))

    def pod_policy_in_effect() -> bool:
        try:
            dp.patch_namespaced_pod("on-n2", TENANT_NS, {"metadata": {"annotations": {ANN_BIND_PHASE: "x"}}},
                                    dry_run="All")
        except client.ApiException as e:
            return e.status == 403
        return False
    wait_for(pod_policy_in_effect, 60, "the device plugin's pod policy in effect")
    dp.patch_namespaced_pod("on-n1", TENANT_NS, {"metadata": {"annotations": {ANN_BIND_PHASE: "success",
                                                                              ANN_ALLOCATED_CONTAINERS: "c"}}})
    msg = _forbidden(dp.patch_namespaced_pod, "on-n2", TENANT_NS, {"metadata": {"annotations": {ANN_BIND_PHASE: "x"}}})
    assert "may change only pods bound to that node" in msg, msg
    msg = _forbidden(dp.patch_namespaced_pod, "on-n1", TENANT_NS, {"metadata": {"annotations": {ANN_ALLOCATION: "{}"}}})
    assert f"not {ANN_ALLOCATION}" in msg, msg
    # a token that names no node (not bound to a pod) is refused, saying why
    unbound = client.CoreV1Api(_as(cluster, _token(core, NS, f"{FULL}-device-plugin"), "dp-unbound"))
    msg = _forbidden(unbound.patch_node, "n1", {"metadata": {"annotations": {ANN_NODE_INVENTORY: "{}"}}})
    assert "token names no node" in msg, msg

    # 4. everyday traffic passes: a status update (the kubelet's path) of a pod with a record
    core.patch_namespaced_pod_status("p", TENANT_NS, {"status": {"phase": "Running"}})

    # 5. the CEL type-checks against the real schemas (status written by kube-controller-manager)
    adm = client.AdmissionregistrationV1Api(admin)
    if cluster["cp"].has_controller_manager:
        for name in (f"{FULL}-system-metadata", f"{FULL}-device-plugin-node", f"{FULL}-device-plugin-pods"):
            pol = wait_for(lambda name=name: _checked(adm, name), 60, f"{name} type-checked")
            warnings = pol.status.type_checking.expression_warnings if pol.status.type_checking else None
            assert not warnings, [(w.field_ref, w.warning) for w in warnings or []]
    checked = "type-checked" if cluster["cp"].has_controller_manager else "not type-checked (no kube-controller-manager)"
    print(f"\nE2E policies: kube-apiserver {cluster['version']}: tenant refused (create with annotation/label, "
          f"edit/drop/move record, Binding annotations); extender allowed; device plugin held to node n1; CEL {checked}")


def _checked(adm: Any, name: str) -> Any:
    pol = adm.read_validating_admission_policy(name)
    st = pol.status
    return pol if st is not None and st.observed_generation == pol.metadata.generation else None
