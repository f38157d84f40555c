"""The chart's trust boundary: the ValidatingAdmissionPolicies (rendered CEL evaluated against the
attacks a tenant would try), one identity per component, and the signing-key Secret and its Jobs.

The policies' CEL is evaluated with cel-python (tests/chart/vap.py); tests/e2e runs the same
policies in a real kube-apiserver."""

from __future__ import annotations

import copy
import re
from types import ModuleType
from typing import Any

import pytest

from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    ANN_GPU_POLICY,
    ANN_NODE_INVENTORY,
    ANN_NODE_POLICY,
    ANN_PROGRESS_SIGNATURE,
    ANN_USE_GPUTYPE,
    HAMI_ANN_NODE_POLICY,
    LABEL_NODE,
    LABEL_WEBHOOK,
    SYSTEM_PREFIX,
    TENANT_KEYS,
    system_owned,
)

from .conftest import NAMESPACE, Renderer, find, find_all
from .test_chart import FULL, containers, rules
from .test_render import option_values

EXTENDER = f"system:serviceaccount:{NAMESPACE}:{FULL}-extender"
DEVICE_PLUGIN = f"system:serviceaccount:{NAMESPACE}:{FULL}-device-plugin"
TENANT = "system:serviceaccount:team-a:app"
KUBELET = "system:node:n1"
NODE_EXTRA = "authentication.kubernetes.io/node-name"

#: every key a pod might carry under our prefix and around it: the policy must deny exactly the
#: system-owned ones (kube_vgpu.resources.system_owned)
KEYS = sorted({ANN_ALLOCATION, ANN_BIND_PHASE, ANN_BIND_TIME, ANN_ALLOCATED_CONTAINERS, ANN_ALLOCATION_SIGNATURE,
               ANN_PROGRESS_SIGNATURE, ANN_NODE_INVENTORY, LABEL_NODE, LABEL_WEBHOOK, "kube-vgpu.io/future-key",
               "kube-vgpu.io/", *TENANT_KEYS, HAMI_ANN_NODE_POLICY, ANN_USE_GPUTYPE, "kube-vgpu.iox/a",
               "sub.kube-vgpu.io/a", "app"})


@pytest.fixture(scope="module")
def vap() -> ModuleType:
    pytest.importorskip("celpy", reason="cel-python (a dev dependency) evaluates the policies' CEL")
    from . import vap as mod
    return mod


@pytest.fixture(scope="module")
def docs(renderer: Renderer) -> list[dict[str, Any]]:
    return renderer.render()


def policy(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(docs, "ValidatingAdmissionPolicy", f"{FULL}-{name}")


def pod(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None, node: str | None = "n1",
        name: str = "p") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "team-a", "uid": "u1"}
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    if labels is not None:
        meta["labels"] = dict(labels)
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}], "schedulerName": "kube-vgpu-scheduler"}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": "Pending"}}


def node(name: str = "n1", annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
         taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    spec: dict[str, Any] = {"podCIDR": "10.0.0.0/24"}
    if taints:
        spec["taints"] = taints
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec}


def changed(obj: dict[str, Any], **meta: dict[str, str | None]) -> dict[str, Any]:
    """A copy of ``obj`` whose metadata maps are updated (None deletes a key), like a merge patch."""
    out = copy.deepcopy(obj)
    for field_name, updates in meta.items():
        m = out["metadata"].setdefault(field_name, {})
        for k, v in updates.items():
            if v is None:
                m.pop(k, None)
            else:
                m[k] = v
        if not m:
            del out["metadata"][field_name]
    return out


def req(vap: ModuleType, op: str, user: str, resource: str = "pods", sub: str = "", name: str = "p",
        node_name: str | None = None) -> Any:
    return vap.Request(op, resource, user, name=name, namespace="" if resource == "nodes" else "team-a",
                       sub_resource=sub, extra={NODE_EXTRA: [node_name]} if node_name else {})


# -- installed, and when -------------------------------------------------------------------------

def test_policies_and_bindings_installed(docs: list[dict[str, Any]]) -> None:
    pols = {p["metadata"]["name"]: p for p in find_all(docs, "ValidatingAdmissionPolicy")}
    binds = {b["metadata"]["name"]: b for b in find_all(docs, "ValidatingAdmissionPolicyBinding")}
    assert set(pols) == {f"{FULL}-system-metadata", f"{FULL}-device-plugin-node", f"{FULL}-device-plugin-pods"}
    assert set(binds) == set(pols)
    for name, b in binds.items():
        assert b["spec"] == {"policyName": name, "validationActions": ["Deny"]}
        assert pols[name]["apiVersion"] == b["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert pols[name]["spec"]["failurePolicy"] == "Fail"


@pytest.mark.parametrize(("values", "kube", "want"), [
    ({}, "1.30.0", 3), ({}, "1.29.9", 0), ({}, "v1.30.2-eks-7f9249a", 3),
    ({"admissionPolicies": {"enabled": False}}, "1.31.0", 0),
    ({"admissionPolicies": {"devicePluginNodeRestriction": False}}, "1.31.0", 1),
    ({"devicePlugin": {"enabled": False}}, "1.31.0", 1),
])
def test_policies_follow_values_and_cluster_version(renderer: Renderer, values: dict[str, Any], kube: str,
                                                    want: int) -> None:
    docs = renderer.render(values, kube)
    assert len(find_all(docs, "ValidatingAdmissionPolicy")) == want
    assert len(find_all(docs, "ValidatingAdmissionPolicyBinding")) == want


def test_policies_forced_on_an_old_cluster_fail_clearly(renderer: Renderer) -> None:
    r = renderer.template({"admissionPolicies": {"enabled": True}}, kube_version="1.29.4")
    assert r.returncode != 0
    assert "admissionPolicies.enabled=true needs Kubernetes >= 1.30" in r.stderr, r.stderr


# -- the keys come from kube_vgpu.resources ------------------------------------------------------

def _literals(obj: Any) -> set[str]:
    text = repr(obj)
    return set(re.findall(r"'(kube-vgpu\.io/[^']*)'", text.replace("\\'", "'")))


def test_cel_names_exactly_the_python_keys(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    sysmeta = policy(docs, "system-metadata")
    variables = {v["name"]: v["expression"] for v in sysmeta["spec"]["variables"]}
    assert sorted(vap.evaluate(variables["tenantKeys"], {})) == sorted(TENANT_KEYS)
    # the prefix and the tenant keys are the only kube-vgpu.io/ strings of the system-metadata policy
    assert _literals(sysmeta["spec"]) == {SYSTEM_PREFIX, *TENANT_KEYS}
    for name, keys in (("device-plugin-node", [ANN_NODE_INVENTORY]),
                       ("device-plugin-pods", [ANN_BIND_PHASE, ANN_ALLOCATED_CONTAINERS, ANN_PROGRESS_SIGNATURE])):
        dp = policy(docs, name)
        allowed = next(v["expression"] for v in dp["spec"]["variables"] if v["name"] == "allowed")
        assert sorted(vap.evaluate(allowed, {})) == sorted(keys)
        assert _literals(dp["spec"]) == set(keys)


def test_system_users_are_the_component_service_accounts(renderer: Renderer, docs: list[dict[str, Any]],
                                                          vap: ModuleType) -> None:
    expr = next(v["expression"] for v in policy(docs, "system-metadata")["spec"]["variables"]
                if v["name"] == "systemUser")
    users = {u for u in (EXTENDER, DEVICE_PLUGIN, f"system:serviceaccount:{NAMESPACE}:{FULL}-scheduler", TENANT,
                         KUBELET, f"system:serviceaccount:{NAMESPACE}:{FULL}-webhook")
             if vap.evaluate(expr, {"request": vap.json_to_cel({"userInfo": {"username": u}})})}
    assert users == {EXTENDER, DEVICE_PLUGIN}
    # the ServiceAccounts the pods run as (the extender's through its token Secret)
    ds = find(docs, "DaemonSet", f"{FULL}-device-plugin")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == f"{FULL}-device-plugin"
    secret = find(docs, "Secret", f"{FULL}-extender-token")
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == f"{FULL}-extender"
    # without its own ServiceAccount, the extender writes as the pod's
    docs2 = renderer.render({"scheduler": {"extender": {"ownServiceAccount": False}}})
    expr2 = next(v["expression"] for v in policy(docs2, "system-metadata")["spec"]["variables"]
                 if v["name"] == "systemUser")
    assert f"{FULL}-scheduler'" not in expr and f"{FULL}-scheduler\"" in expr2 and f"{FULL}-extender" not in expr2


def test_webhook_config_lists_the_same_system_users(renderer: Renderer) -> None:
    from kube_vgpu.config import load_config_text
    docs = renderer.render()
    cfg = load_config_text(find(docs, "ConfigMap", f"{FULL}-config")["data"]["config.yaml"])
    assert sorted(cfg.webhook.system_users) == sorted([EXTENDER, DEVICE_PLUGIN])
    # an admin's extra users are kept
    if _accepts_system_users():
        docs = renderer.render({"config": {"webhook": {"systemUsers": ["break-glass-admin"]}}})
        cfg = load_config_text(find(docs, "ConfigMap", f"{FULL}-config")["data"]["config.yaml"])
        assert sorted(cfg.webhook.system_users) == sorted([EXTENDER, DEVICE_PLUGIN, "break-glass-admin"])


def _accepts_system_users() -> bool:
    """Whether values.schema.json already lists config.webhook.systemUsers."""
    import json

    from .conftest import CHART
    schema = json.loads((CHART / "values.schema.json").read_text())
    return "systemUsers" in schema["properties"]["config"]["properties"]["webhook"]["properties"]


# -- system-owned pod metadata: the attacks -----------------------------------------------------

@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("where", ["annotations", "labels"])
def test_pod_create_denied_exactly_for_system_owned_keys(docs: list[dict[str, Any]], vap: ModuleType, key: str,
                                                         where: str) -> None:
    meta = {key: "x", "team": "a"}
    p = pod(meta, None, node=None) if where == "annotations" else pod(None, meta, node=None)
    for user in (TENANT, EXTENDER):  # the system never creates pods with them either
        d = vap.decide(policy(docs, "system-metadata"), req(vap, "CREATE", user), p)
        assert d.matched
        if system_owned(key):
            assert len(d.denied) == 1, d.denied
            what = "annotation" if where == "annotations" else "label"
            assert d.denied[0].startswith(f"pod {what} {key} is written only by the kube-vgpu system"), d.denied
        else:
            assert d.allowed, d.denied


def test_pod_create_without_metadata_maps_is_allowed(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    d = vap.decide(policy(docs, "system-metadata"), req(vap, "CREATE", TENANT), pod(node=None))
    assert d.matched and d.allowed, d.denied


def test_forged_allocation_message_names_every_key(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    p = pod({ANN_ALLOCATION: "{}", ANN_BIND_PHASE: "success", ANN_NODE_POLICY: "spread"}, {LABEL_NODE: "n1"},
            node=None)
    d = vap.decide(policy(docs, "system-metadata"), req(vap, "CREATE", TENANT), p)
    assert d.denied == [
        f"pod annotation {ANN_ALLOCATION}, {ANN_BIND_PHASE} is written only by the kube-vgpu system and cannot "
        f"be set when a pod is created; under kube-vgpu.io/ a pod may set only {', '.join(sorted(TENANT_KEYS))}",
        f"pod label {LABEL_NODE} is written only by the kube-vgpu system and cannot be set when a pod is "
        f"created; under kube-vgpu.io/ a pod may set only {', '.join(sorted(TENANT_KEYS))}"]


BOUND = pod({ANN_ALLOCATION: '{"v":1}', ANN_ALLOCATION_SIGNATURE: "v1:k1:sig", ANN_BIND_PHASE: "allocating",
             ANN_BIND_TIME: "1700000000", ANN_NODE_POLICY: "binpack", "team": "a"}, {LABEL_NODE: "n1", "app": "x"})


@pytest.mark.parametrize(("what", "update"), [
    ("edit the allocation", {"annotations": {ANN_ALLOCATION: '{"v":1,"big":true}'}}),
    ("claim success", {"annotations": {ANN_BIND_PHASE: "success"}}),
    ("drop the allocation (free the GPU)", {"annotations": {ANN_ALLOCATION: None}}),
    ("copy a signature", {"annotations": {ANN_PROGRESS_SIGNATURE: "v1:k1:other"}}),
    ("move the node label", {"labels": {LABEL_NODE: "n2"}}),
    ("drop the node label", {"labels": {LABEL_NODE: None}}),
    ("add a future system key", {"annotations": {"kube-vgpu.io/future": "1"}}),
])
@pytest.mark.parametrize("sub", ["", "status"])
def test_tenant_cannot_change_system_metadata(docs: list[dict[str, Any]], vap: ModuleType, what: str,
                                              update: dict[str, dict[str, str | None]], sub: str) -> None:
    new = changed(BOUND, **update)
    (field_name, keys), = update.items()
    d = vap.decide(policy(docs, "system-metadata"), req(vap, "UPDATE", TENANT, sub=sub), new, BOUND)
    assert d.matched
    kind = "annotation" if field_name == "annotations" else "label"
    assert d.denied == [f"pod {kind} {', '.join(keys)} is written only by the kube-vgpu system (the extender and "
                        f"device plugin ServiceAccounts); {TENANT} may not add, change or remove it"], what
    for user in (EXTENDER, DEVICE_PLUGIN):
        assert vap.decide(policy(docs, "system-metadata"), req(vap, "UPDATE", user, sub=sub), new, BOUND).allowed


@pytest.mark.parametrize("update", [
    {"annotations": {"team": "b", "new": "1"}}, {"labels": {"app": None}},
    {"annotations": {ANN_NODE_POLICY: "spread", ANN_GPU_POLICY: "binpack"}}, {},
])
def test_other_updates_pass(docs: list[dict[str, Any]], vap: ModuleType, update: dict[str, dict[str, str | None]]) -> None:
    new = changed(BOUND, **update)
    for user, sub in ((TENANT, ""), (KUBELET, "status"), ("system:serviceaccount:kube-system:replicaset-controller", "")):
        d = vap.decide(policy(docs, "system-metadata"), req(vap, "UPDATE", user, sub=sub), new, BOUND)
        assert d.matched and d.allowed, d.denied


def test_status_update_of_pod_without_annotations(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    old = pod(node="n1")
    new = copy.deepcopy(old)
    new["status"] = {"phase": "Running"}
    d = vap.decide(policy(docs, "system-metadata"), req(vap, "UPDATE", KUBELET, sub="status"), new, old)
    assert d.matched and d.allowed, d.denied


def test_binding_cannot_carry_system_annotations(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    """The API server copies a Binding's annotations onto the pod."""
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p", "namespace": "team-a",
                                                                   "annotations": {ANN_ALLOCATION: "{}"}},
               "target": {"kind": "Node", "name": "n1"}}
    pol = policy(docs, "system-metadata")
    d = vap.decide(pol, req(vap, "CREATE", TENANT, sub="binding"), binding)
    assert d.matched and len(d.denied) == 1 and ANN_ALLOCATION in d.denied[0] and TENANT in d.denied[0]
    assert vap.decide(pol, req(vap, "CREATE", EXTENDER, sub="binding"), binding).allowed
    plain = {**binding, "metadata": {"name": "p", "namespace": "team-a"}}
    assert vap.decide(pol, req(vap, "CREATE", "system:kube-scheduler", sub="binding"), plain).allowed


# -- the device plugin's node -------------------------------------------------------------------

INV = node("n1", {ANN_NODE_INVENTORY: '{"v":1}', "other": "x"})


def test_device_plugin_may_write_its_node_inventory(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    pol = policy(docs, "device-plugin-node")
    new = changed(INV, annotations={ANN_NODE_INVENTORY: '{"v":2}'})
    d = vap.decide(pol, req(vap, "UPDATE", DEVICE_PLUGIN, "nodes", name="n1", node_name="n1"), new, INV)
    assert d.matched and d.allowed, d.denied


@pytest.mark.parametrize(("attack", "node_name", "new", "message"), [
    ("another node's inventory", "n1", changed(node("n2", {ANN_NODE_INVENTORY: "{}"}), annotations={ANN_NODE_INVENTORY: "x"}),
     "the kube-vgpu device plugin of node n1 may change only its own Node, not node n2"),
    ("a node label", "n1", changed(INV, labels={"gpu": "on"}),
     "the kube-vgpu device plugin may change only annotations, not the spec, labels, finalizers or owner references "
     "of node n1"),
    ("another annotation", "n1", changed(INV, annotations={"other": "y"}),
     f"the kube-vgpu device plugin may change only the annotations {ANN_NODE_INVENTORY} of a node, not other"),
    ("a taint", "n1", {**INV, "spec": {**INV["spec"], "taints": [{"key": "k", "effect": "NoSchedule"}]}},
     "the kube-vgpu device plugin may change only annotations, not the spec, labels, finalizers or owner references "
     "of node n1"),
])
def test_device_plugin_node_attacks(docs: list[dict[str, Any]], vap: ModuleType, attack: str, node_name: str,
                                    new: dict[str, Any], message: str) -> None:
    old = node("n2", {ANN_NODE_INVENTORY: "{}"}) if attack == "another node's inventory" else INV
    d = vap.decide(policy(docs, "device-plugin-node"),
                   req(vap, "UPDATE", DEVICE_PLUGIN, "nodes", name=new["metadata"]["name"], node_name=node_name), new, old)
    assert d.matched and message in d.denied, (attack, d.denied)


def test_device_plugin_may_write_progress_of_pods_on_its_node(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    new = changed(BOUND, annotations={ANN_BIND_PHASE: "success", ANN_ALLOCATED_CONTAINERS: "c",
                                      ANN_PROGRESS_SIGNATURE: "v1:k1:x"})
    d = vap.decide(policy(docs, "device-plugin-pods"), req(vap, "UPDATE", DEVICE_PLUGIN, node_name="n1"), new, BOUND)
    assert d.matched and d.allowed, d.denied
    # the system-metadata policy lets it too
    assert vap.decide(policy(docs, "system-metadata"), req(vap, "UPDATE", DEVICE_PLUGIN), new, BOUND).allowed


@pytest.mark.parametrize(("attack", "op", "sub", "new", "old", "message"), [
    ("a pod on another node", "UPDATE", "", changed(pod({ANN_BIND_PHASE: "allocating"}, node="n2"),
                                                    annotations={ANN_BIND_PHASE: "success"}),
     pod({ANN_BIND_PHASE: "allocating"}, node="n2"),
     "the kube-vgpu device plugin of node n1 may change only pods bound to that node, not pod team-a/p"),
    ("an unbound pod", "UPDATE", "", changed(pod({}, node=None), annotations={ANN_BIND_PHASE: "success"}),
     pod({}, node=None), "the kube-vgpu device plugin of node n1 may change only pods bound to that node, not pod team-a/p"),
    ("the allocation", "UPDATE", "", changed(BOUND, annotations={ANN_ALLOCATION: "{}"}), BOUND,
     f"the kube-vgpu device plugin may change only the annotations {ANN_ALLOCATED_CONTAINERS}, {ANN_BIND_PHASE}, "
     f"{ANN_PROGRESS_SIGNATURE} of a pod, not {ANN_ALLOCATION}"),
    ("a pod label", "UPDATE", "", changed(BOUND, labels={"app": "y"}), BOUND,
     "the kube-vgpu device plugin may change only annotations, not the spec, labels, finalizers or owner references "
     "of pod p"),
    ("pods/status", "UPDATE", "status", changed(BOUND, annotations={ANN_BIND_PHASE: "success"}), BOUND,
     "the kube-vgpu device plugin may only update pods, not UPDATE status"),
    ("delete a pod", "DELETE", "", None, BOUND, "the kube-vgpu device plugin may only update pods, not DELETE"),
    ("create a pod", "CREATE", "", pod(node="n1"), None, "the kube-vgpu device plugin may only update pods, not CREATE"),
])
def test_device_plugin_pod_attacks(docs: list[dict[str, Any]], vap: ModuleType, attack: str, op: str, sub: str,
                                   new: dict[str, Any] | None, old: dict[str, Any] | None, message: str) -> None:
    d = vap.decide(policy(docs, "device-plugin-pods"), req(vap, op, DEVICE_PLUGIN, sub=sub, node_name="n1"), new, old)
    assert d.matched and message in d.denied, (attack, d.denied)


def test_device_plugin_token_without_node_is_refused(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    new = changed(INV, annotations={ANN_NODE_INVENTORY: "x"})
    d = vap.decide(policy(docs, "device-plugin-node"), req(vap, "UPDATE", DEVICE_PLUGIN, "nodes", name="n1"), new, INV)
    assert d.matched and any("needs a bound ServiceAccount token from Kubernetes >= 1.30" in m for m in d.denied)


def test_device_plugin_policies_ignore_other_users_and_resources(docs: list[dict[str, Any]], vap: ModuleType) -> None:
    new_node, new_pod = changed(INV, labels={"gpu": "on"}), changed(BOUND, labels={"app": "z"})
    for user in (TENANT, EXTENDER, KUBELET):
        assert not vap.decide(policy(docs, "device-plugin-node"), req(vap, "UPDATE", user, "nodes", name="n1"),
                              new_node, INV).matched
        assert not vap.decide(policy(docs, "device-plugin-pods"), req(vap, "UPDATE", user), new_pod, BOUND).matched
    # each policy matches only its resource
    assert not vap.decide(policy(docs, "device-plugin-node"), req(vap, "UPDATE", DEVICE_PLUGIN, node_name="n1"),
                          new_pod, BOUND).matched
    assert not vap.decide(policy(docs, "device-plugin-pods"), req(vap, "UPDATE", DEVICE_PLUGIN, "nodes", name="n1",
                                                                  node_name="n1"), new_node, INV).matched


# -- identities ---------------------------------------------------------------------------------

def test_extender_runs_as_its_own_service_account(docs: list[dict[str, Any]]) -> None:
    dep = find(docs, "Deployment", f"{FULL}-scheduler")
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == f"{FULL}-scheduler"  # kube-scheduler's identity
    cs = containers(dep)
    sa_path = "/var/run/secrets/kubernetes.io/serviceaccount"
    ext_mounts = {m["mountPath"]: m for m in cs["extender"]["volumeMounts"]}
    assert ext_mounts[sa_path]["readOnly"] is True
    vol = next(v for v in spec["volumes"] if v["name"] == ext_mounts[sa_path]["name"])
    assert vol["secret"]["secretName"] == f"{FULL}-extender-token"
    assert {i["key"] for i in vol["secret"]["items"]} == {"token", "ca.crt", "namespace"}
    assert sa_path not in {m["mountPath"] for m in cs["kube-scheduler"].get("volumeMounts", [])}
    secret = find(docs, "Secret", f"{FULL}-extender-token")
    assert secret["type"] == "kubernetes.io/service-account-token"
    sa = find(docs, "ServiceAccount", f"{FULL}-extender")
    assert sa["automountServiceAccountToken"] is False
    # no other pod mounts it
    for w in [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")]:
        vols = w["spec"]["template"]["spec"].get("volumes", [])
        users = [v for v in vols if v.get("secret", {}).get("secretName") == f"{FULL}-extender-token"]
        assert not users or w is dep


def test_one_service_account_per_component(docs: list[dict[str, Any]]) -> None:
    sas = {s["metadata"]["name"] for s in find_all(docs, "ServiceAccount")}
    assert {f"{FULL}-scheduler", f"{FULL}-extender", f"{FULL}-device-plugin", f"{FULL}-webhook", f"{FULL}-certs",
            f"{FULL}-signing-keys-hook", f"{FULL}-rotate-keys"} == sas
    workloads = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["serviceAccountName"]
                 for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    assert len(set(workloads.values())) == len(workloads)


def test_extender_shares_the_pod_identity_when_asked(renderer: Renderer) -> None:
    docs = renderer.render({"scheduler": {"extender": {"ownServiceAccount": False}}})
    assert not [s for s in find_all(docs, "ServiceAccount") if s["metadata"]["name"] == f"{FULL}-extender"]
    assert not [s for s in find_all(docs, "Secret") if s["metadata"]["name"] == f"{FULL}-extender-token"]
    ext = containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]
    assert "/var/run/secrets/kubernetes.io/serviceaccount" not in {m["mountPath"] for m in ext["volumeMounts"]}
    crb = find(docs, "ClusterRoleBinding", f"{FULL}-extender")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULL}-scheduler", "namespace": NAMESPACE}]


# -- the signing keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["default", "ha", "cert-manager"])
def test_signing_keys_mounted_read_only_with_the_flag(renderer: Renderer, name: str) -> None:
    docs = renderer.render(option_values(name))
    for kind, wname, cname in (("Deployment", f"{FULL}-scheduler", "extender"),
                               ("DaemonSet", f"{FULL}-device-plugin", "device-plugin")):
        w = find(docs, kind, wname)
        c = containers(w)[cname]
        assert "--signing-keys-dir=/etc/kube-vgpu/signing" in c["args"]
        m = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/kube-vgpu/signing")
        assert m["readOnly"] is True and "subPath" not in m  # rotations reach the running process
        vol = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == m["name"])
        assert vol["secret"]["secretName"] == f"{FULL}-signing-keys"
        assert vol["secret"]["defaultMode"] & 0o077 == vol["secret"]["defaultMode"] & 0o070  # no world bits
        for other in containers(w).values():
            if other is not c:
                assert m["name"] not in {x["name"] for x in other.get("volumeMounts", [])}
    # the webhook never sees the keys
    web = find(docs, "Deployment", f"{FULL}-webhook")
    assert not [v for v in web["spec"]["template"]["spec"]["volumes"]
                if v.get("secret", {}).get("secretName") == f"{FULL}-signing-keys"]


def test_extender_can_read_the_keys(docs: list[dict[str, Any]]) -> None:
    """The extender runs as uid/gid 65532: the 0440 files must belong to its group."""
    dep = find(docs, "Deployment", f"{FULL}-scheduler")
    spec = dep["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "signing-keys")
    assert vol["secret"]["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == containers(dep)["extender"]["securityContext"]["runAsGroup"]


@pytest.mark.parametrize("name", ["default", "cert-manager"])
def test_signing_keys_hook_job(renderer: Renderer, name: str) -> None:
    docs = renderer.render(option_values(name))
    job = find(docs, "Job", f"{FULL}-signing-keys")
    ann = job["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"  # before the pods that mount the Secret
    args = containers(job)["signing-keys"]["args"]
    assert args[:3] == ["certs", "signing-keys", "ensure"]
    assert f"--secret={NAMESPACE}/{FULL}-signing-keys" in args
    assert {"--rotate-after-days=90", "--activate-after-seconds=600", "--keep-old-days=30"} <= set(args)
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    assert sa == f"{FULL}-signing-keys-hook"
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        obj = find(docs, kind, sa)
        hook = obj["metadata"]["annotations"]
        assert hook["helm.sh/hook"] == ann["helm.sh/hook"]
        assert int(hook["helm.sh/hook-weight"]) < int(ann["helm.sh/hook-weight"])
    _check_key_rbac(docs, sa)


def _check_key_rbac(docs: list[dict[str, Any]], sa: str) -> None:
    # get/update only the key Secret; create cannot be limited to a name; pods: list only
    assert rules(find(docs, "Role", sa)) == {("", "secrets", ("get", "update"), (f"{FULL}-signing-keys",)),
                                             ("", "secrets", ("create",), ())}
    assert rules(find(docs, "ClusterRole", sa)) == {("", "pods", ("list",), ())}
    bound = {(b["kind"], b["roleRef"]["name"]) for b in find_all(docs, "RoleBinding") + find_all(docs, "ClusterRoleBinding")
             if any(s["name"] == sa for s in b["subjects"])}
    assert bound == {("RoleBinding", sa), ("ClusterRoleBinding", sa)}


def test_rotation_cronjob(renderer: Renderer, docs: list[dict[str, Any]]) -> None:
    cj = find(docs, "CronJob", f"{FULL}-rotate-keys")
    assert len(cj["metadata"]["name"]) <= 52  # CronJob name limit
    assert cj["spec"]["concurrencyPolicy"] == "Forbid"
    tpl = cj["spec"]["jobTemplate"]["spec"]["template"]
    assert tpl["spec"]["containers"][0]["args"] == containers(find(docs, "Job", f"{FULL}-signing-keys"))[
        "signing-keys"]["args"]
    sa = tpl["spec"]["serviceAccountName"]
    assert sa == f"{FULL}-rotate-keys" and "helm.sh/hook" not in find(docs, "ServiceAccount", sa)["metadata"].get(
        "annotations", {})
    _check_key_rbac(docs, sa)
    off = renderer.render({"signingKeys": {"rotation": {"enabled": False}}})
    assert not find_all(off, "CronJob")
    assert not [s for s in find_all(off, "ServiceAccount") if s["metadata"]["name"] == f"{FULL}-rotate-keys"]


def test_no_signing_keys_without_their_users(renderer: Renderer) -> None:
    docs = renderer.render({"scheduler": {"enabled": False}, "devicePlugin": {"enabled": False}})
    assert not [d for d in docs if "signing-keys" in d["metadata"]["name"] or "rotate-keys" in d["metadata"]["name"]]


def test_signing_key_values_are_checked(renderer: Renderer) -> None:
    r = renderer.template({"signingKeys": {"rotateAfterDays": 0}})
    assert r.returncode != 0 and "signingKeys.rotateAfterDays" in r.stderr
