"""What the rendered chart must say: webhook selectors, extender config, RBAC verbs, hooks, the
device plugin's host mounts, and that the policy ConfigMap is exactly the domain config."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_vgpu.config import Config, config_to_dict, load_config_text

from .conftest import CHART, NAMESPACE, Renderer, find, find_all
from .test_render import option_values

FULL = "kv-kube-vgpu"


def containers(obj: dict[str, Any], init: bool = False) -> dict[str, dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers" if init else "containers", [])}


def scheduler_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = find(docs, "ConfigMap", f"{FULL}-kube-scheduler")
    return yaml.safe_load(cm["data"]["config.yaml"])


def rules(role: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    out = set()
    for r in role["rules"]:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.add((g, res, tuple(sorted(r["verbs"])), tuple(r.get("resourceNames", ()))))
    return out


# -- the webhook ----------------------------------------------------------------------------------

def test_webhook_configuration(renderer: Renderer) -> None:
    mwc = find(renderer.render(), "MutatingWebhookConfiguration")
    (wh,) = mwc["webhooks"]
    assert wh["failurePolicy"] == "Fail"  # only the requests its matchConditions select reach it
    assert wh["sideEffects"] == "None"
    assert 1 <= wh["timeoutSeconds"] <= 5
    assert wh["admissionReviewVersions"] == ["v1", "v1beta1"]
    assert wh["reinvocationPolicy"] == "IfNeeded"
    assert wh["rules"] == [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                            "resources": ["pods", "pods/ephemeralcontainers"], "scope": "Namespaced"}]
    svc = wh["clientConfig"]["service"]
    assert svc == {"name": f"{FULL}-webhook", "namespace": NAMESPACE, "path": "/mutate", "port": 443}
    ns = wh["namespaceSelector"]["matchExpressions"]
    assert {"key": "kube-vgpu.io/webhook", "operator": "NotIn", "values": ["ignore"]} in ns
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": ["kube-system", NAMESPACE]} in ns
    assert "objectSelector" not in wh  # pod labels are the tenant's: they never opt out
    assert "caBundle" not in wh["clientConfig"]  # the certs Job patches it in


def test_webhook_extra_exclusions_and_selectors(renderer: Renderer) -> None:
    wh = find(renderer.render(option_values("foreign-deny")), "MutatingWebhookConfiguration")["webhooks"][0]
    ns = wh["namespaceSelector"]["matchExpressions"]
    names = next(e for e in ns if e["key"] == "kubernetes.io/metadata.name")
    assert names["values"] == ["kube-system", NAMESPACE, "monitoring", "gpu-operator"]
    assert {"key": "tenant", "operator": "Exists"} in ns


def test_webhook_release_in_kube_system_not_listed_twice(renderer: Renderer) -> None:
    r = renderer.run(["template", "kv", str(CHART), "--namespace", "kube-system", "--kube-version", "1.31.0"])
    assert r.returncode == 0, r.stderr
    mwc = next(d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "MutatingWebhookConfiguration")
    names = next(e for e in mwc["webhooks"][0]["namespaceSelector"]["matchExpressions"]
                 if e["key"] == "kubernetes.io/metadata.name")
    assert names["values"] == ["kube-system"]


def test_webhook_pod(renderer: Renderer) -> None:
    docs = renderer.render()
    dep = find(docs, "Deployment", f"{FULL}-webhook")
    c = containers(dep)["webhook"]
    assert c["args"][0] == "webhook"
    assert "--tls-cert-file=/etc/kube-vgpu/tls/tls.crt" in c["args"]
    assert "--tls-key-file=/etc/kube-vgpu/tls/tls.key" in c["args"]
    assert "--port=8443" in c["args"] and "--config=/etc/kube-vgpu/config.yaml" in c["args"]
    spec = dep["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    tls = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == f"{FULL}-webhook-tls"
    assert all("subPath" not in m for m in c["volumeMounts"])  # live reload of cert and config
    svc = find(docs, "Service", f"{FULL}-webhook")
    assert svc["spec"]["ports"][0]["port"] == 443 and svc["spec"]["ports"][0]["targetPort"] == "https"
    # The webhook has no API access at all.
    subjects = [s for b in find_all(docs, "ClusterRoleBinding") + find_all(docs, "RoleBinding")
                for s in b["subjects"]]
    assert not any(s["name"] == f"{FULL}-webhook" for s in subjects)


def test_certs_hook_jobs(renderer: Renderer) -> None:
    docs = renderer.render()
    pre = find(docs, "Job", f"{FULL}-certs-pre")
    post = find(docs, "Job", f"{FULL}-certs-post")
    assert pre["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert post["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    pre_args = containers(pre)["certs"]["args"]
    post_args = containers(post)["certs"]["args"]
    for args in (pre_args, post_args):
        assert args[0] == "certs"
        assert f"--namespace={NAMESPACE}" in args
        assert f"--service={FULL}-webhook" in args
        assert f"--secret-name={FULL}-webhook-tls" in args
    assert not any(a.startswith("--webhook-config-name") for a in pre_args)  # the MWC does not exist yet
    assert f"--webhook-config-name={FULL}-webhook" in post_args
    # Its RBAC exists before the Jobs run (hooks with a lower weight) and is exactly this.
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        obj = find(docs, kind, f"{FULL}-certs")
        ann = obj["metadata"]["annotations"]
        assert "pre-install" in ann["helm.sh/hook"] and "post-install" in ann["helm.sh/hook"]
        assert int(ann["helm.sh/hook-weight"]) < int(pre["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert rules(find(docs, "Role", f"{FULL}-certs")) == {("", "secrets", ("create", "get", "update"), ())}
    assert rules(find(docs, "ClusterRole", f"{FULL}-certs")) == {
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("get", "patch"), (f"{FULL}-webhook",))}
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io")]


def test_cert_manager_mode(renderer: Renderer) -> None:
    docs = renderer.render(option_values("cert-manager"))
    # no certificate Jobs; the signing keys Job runs in both modes
    assert [j["metadata"]["name"] for j in find_all(docs, "Job")] == [f"{FULL}-signing-keys"]
    cert = find(docs, "Certificate", f"{FULL}-webhook")
    assert cert["spec"]["secretName"] == f"{FULL}-webhook-tls"
    assert f"{FULL}-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = find(docs, "Issuer")
    assert issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["issuerRef"] == {"name": issuer["metadata"]["name"], "kind": "Issuer",
                                         "group": "cert-manager.io"}
    mwc = find(docs, "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{FULL}-webhook"


def test_cert_manager_existing_issuer(renderer: Renderer) -> None:
    docs = renderer.render(option_values("cert-manager-issuer"))
    assert not find_all(docs, "Issuer")
    cert = find(docs, "Certificate")
    assert cert["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


# -- the scheduler --------------------------------------------------------------------------------

EXTENDER_FIELDS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
                   "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources",
                   "ignorable"}
KSC_FIELDS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "healthzBindAddress",
              "metricsBindAddress", "enableProfiling", "enableContentionProfiling", "percentageOfNodesToScore",
              "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders",
              "delayCacheUntilActive"}
LE_FIELDS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock", "resourceName",
             "resourceNamespace"}


def test_kube_scheduler_configuration(renderer: Renderer) -> None:
    ksc = scheduler_config(renderer.render())
    # kube-scheduler decodes its config strictly: no unknown field may appear.
    assert set(ksc) <= KSC_FIELDS
    assert set(ksc["leaderElection"]) <= LE_FIELDS
    assert ksc["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert ksc["kind"] == "KubeSchedulerConfiguration"
    assert ksc["profiles"] == [{"schedulerName": "kube-vgpu-scheduler"}]
    le = ksc["leaderElection"]
    assert le["leaderElect"] is False
    assert le["resourceNamespace"] == NAMESPACE and le["resourceName"] == f"{FULL}-kube-scheduler"
    (ext,) = ksc["extenders"]
    assert set(ext) <= EXTENDER_FIELDS
    assert ext["urlPrefix"] == "http://127.0.0.1:8888"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    assert ext["preemptVerb"] == "preempt"  # GPU-aware victims (scheduler/preempt.py)
    assert ext["weight"] == 1 and ext["nodeCacheCapable"] is True and ext["enableHTTPS"] is False
    assert re.fullmatch(r"\d+s", ext["httpTimeout"]) and int(ext["httpTimeout"][:-1]) <= 30
    assert ext["managedResources"] == [
        {"name": n, "ignoredByScheduler": True}
        for n in ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores",
                  "nvidia.com/priority")]
    assert ksc["percentageOfNodesToScore"] == 100


def test_scheduler_deployment(renderer: Renderer) -> None:
    docs = renderer.render()
    dep = find(docs, "Deployment", f"{FULL}-scheduler")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # never two unelected kube-schedulers
    cs = containers(dep)
    assert set(cs) == {"kube-scheduler", "extender"}
    ks = cs["kube-scheduler"]
    assert ks["image"] == "registry.k8s.io/kube-scheduler:v1.31.0"
    assert "--config=/etc/kubernetes/kube-vgpu/config.yaml" in ks["command"]
    ext = cs["extender"]
    assert ext["args"][:2] == ["scheduler", "--config=/etc/kube-vgpu/config.yaml"]
    # the unauthenticated extender API (filter/prioritize/bind) listens on loopback only; kube-scheduler
    # in the same pod calls http://127.0.0.1:8888. Metrics and probes have their own listener.
    assert "--port=8888" in ext["args"] and "--bind-address=127.0.0.1" in ext["args"]
    assert "--metrics-port=8889" in ext["args"] and "--metrics-bind-address=0.0.0.0" in ext["args"]
    assert not any(a.startswith("--bind-address=") and a != "--bind-address=127.0.0.1" for a in ext["args"])
    assert "--leader-elect=false" in ext["args"]  # one replica; the binary elects a leader by default
    assert ext["ports"] == [{"name": "http-metrics", "containerPort": 8889, "protocol": "TCP"}]
    assert ext["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http-metrics"}
    assert ext["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http-metrics"}
    svc = find(docs, "Service", f"{FULL}-scheduler")
    assert svc["spec"]["ports"] == [{"name": "http-metrics", "port": 8889, "targetPort": "http-metrics",
                                     "protocol": "TCP"}]
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == f"{FULL}-scheduler"
    policy = next(v for v in spec["volumes"] if v["name"] == "policy")
    assert policy["configMap"]["name"] == f"{FULL}-config"
    assert all("subPath" not in m for m in ext["volumeMounts"])  # live reload needs a directory mount
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/kube-scheduler-config" in ann and "checksum/config" not in ann
    assert not find_all(docs, "PodDisruptionBudget")


@pytest.mark.parametrize(("kube_version", "tag"), [("1.29.3", "v1.29.3"), ("v1.30.2-eks-7f9249a", "v1.30.2"),
                                                   ("1.33.1-gke.1000", "v1.33.1")])
def test_kube_scheduler_tag_follows_cluster(renderer: Renderer, kube_version: str, tag: str) -> None:
    dep = find(renderer.render(kube_version=kube_version), "Deployment", f"{FULL}-scheduler")
    assert containers(dep)["kube-scheduler"]["image"] == f"registry.k8s.io/kube-scheduler:{tag}"


def test_kube_scheduler_tag_override(renderer: Renderer) -> None:
    docs = renderer.render(option_values("custom-paths"))
    dep = find(docs, "Deployment", f"{FULL}-scheduler")
    assert containers(dep)["kube-scheduler"]["image"] == "mirror.example.com/kube-scheduler:v1.30.4"
    args = containers(dep)["extender"]["args"]
    assert "--leader-elect" in args and f"--lease-name={FULL}-extender" in args
    assert "--leader-elect-mode=own" in args
    assert f"--lease-namespace={NAMESPACE}" in args


def test_ha_leader_election_and_pdbs(renderer: Renderer) -> None:
    docs = renderer.render(option_values("ha"))
    ksc = scheduler_config(docs)
    assert ksc["leaderElection"]["leaderElect"] is True
    # the extender binds only where kube-scheduler leads: it follows kube-scheduler's own Lease
    args = containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]["args"]
    assert "--leader-elect-mode=follow" in args
    assert f"--lease-name={ksc['leaderElection']['resourceName']}" in args
    dep = find(docs, "Deployment", f"{FULL}-scheduler")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    pdbs = {p["metadata"]["name"]: p for p in find_all(docs, "PodDisruptionBudget")}
    assert set(pdbs) == {f"{FULL}-scheduler", f"{FULL}-webhook"}
    for comp in ("scheduler", "webhook"):
        assert pdbs[f"{FULL}-{comp}"]["spec"]["minAvailable"] == 1
        assert pdbs[f"{FULL}-{comp}"]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == comp
    assert find(docs, "MutatingWebhookConfiguration")["webhooks"][0]["failurePolicy"] == "Fail"
    aff = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert aff["preferredDuringSchedulingIgnoredDuringExecution"]


def test_kube_scheduler_rbac_exact(renderer: Renderer) -> None:
    """kube-scheduler keeps the control-plane scheduler's roles; the extender's rules (compared
    with the calls its code makes) are in test_rbac.py."""
    docs = renderer.render()
    assert rules(find(docs, "Role", f"{FULL}-kube-scheduler")) == {("", "configmaps", ("get", "list", "watch"), ())}
    bound = {(b["roleRef"]["kind"], b["roleRef"]["name"])
             for b in find_all(docs, "ClusterRoleBinding") + find_all(docs, "RoleBinding")
             if any(s["name"] == f"{FULL}-scheduler" for s in b["subjects"])}
    assert bound == {("ClusterRole", "system:kube-scheduler"), ("ClusterRole", "system:volume-scheduler"),
                     ("Role", f"{FULL}-kube-scheduler"), ("Role", "extension-apiserver-authentication-reader")}
    # with leader election, its own Lease (and creating it) on top
    docs = renderer.render(option_values("ha"))
    assert rules(find(docs, "Role", f"{FULL}-kube-scheduler")) == {
        ("coordination.k8s.io", "leases", ("get", "update"), (f"{FULL}-kube-scheduler",)),
        ("coordination.k8s.io", "leases", ("create",), ()),
        ("", "configmaps", ("get", "list", "watch"), ())}


def test_custom_resource_names(renderer: Renderer) -> None:
    docs = renderer.render(option_values("custom-resource-names"))
    ksc = scheduler_config([{**d, "metadata": {**d["metadata"], "name": d["metadata"]["name"].replace(
        "vgpu-", f"{FULL}-", 1)}} if d["kind"] == "ConfigMap" else d for d in docs])
    assert ksc["profiles"] == [{"schedulerName": "vgpu-scheduler"}]
    assert [m["name"] for m in ksc["extenders"][0]["managedResources"]] == [
        "example.com/vgpu", "example.com/vgpu-memory", "example.com/vgpu-memory-percentage",
        "example.com/vgpu-cores", "example.com/vgpu-priority"]
    assert all(m["ignoredByScheduler"] for m in ksc["extenders"][0]["managedResources"])
    names = {d["metadata"]["name"] for d in docs}
    assert {"vgpu-scheduler", "vgpu-webhook", "vgpu-device-plugin", "vgpu-config"} <= names
    cfg = load_config_text(find(docs, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    assert cfg.resource_names.gpumem == "example.com/vgpu-memory"


# -- the device plugin ----------------------------------------------------------------------------

def test_device_plugin_daemonset(renderer: Renderer) -> None:
    docs = renderer.render()
    ds = find(docs, "DaemonSet", f"{FULL}-device-plugin")
    spec = ds["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert "nodeSelector" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["key"] for t in terms] == ["feature.node.kubernetes.io/pci-10de.present",
                                                                "nvidia.com/gpu.present"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["device-plugins"]["hostPath"] == {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}
    assert vols["shim"]["hostPath"]["path"] == "/usr/local/vgpu"
    assert vols["cache"]["hostPath"]["path"] == "/var/lib/kube-vgpu/containers"
    c = containers(ds)["device-plugin"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["args"][0] == "device-plugin"
    for flag in ("--device-plugin-dir=/var/lib/kubelet/device-plugins", "--shim-host-path=/usr/local/vgpu/libvgpu.so",
                 "--cache-host-dir=/var/lib/kube-vgpu/containers", "--metrics-port=9394",
                 "--config=/etc/kube-vgpu/config.yaml"):
        assert flag in c["args"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    init = containers(ds, init=True)["install-shim"]
    script = init["command"][-1]
    assert 'src="/opt/kube-vgpu/lib/libvgpu.so"' in script and "mv -f" in script  # atomic replace on the host
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/usr/local/vgpu"}
    assert "checksum/config" in ds["spec"]["template"]["metadata"]["annotations"]


def test_device_plugin_custom_paths(renderer: Renderer) -> None:
    ds = find(renderer.render(option_values("custom-paths")), "DaemonSet", f"{FULL}-device-plugin")
    spec = ds["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"] == {"gpu": "on"} and "affinity" not in spec
    c = containers(ds)["device-plugin"]
    assert "--shim-host-path=/opt/kube-vgpu/lib/libvgpu.so" in c["args"]
    assert "--device-plugin-dir=/var/snap/microk8s/common/var/lib/kubelet/device-plugins" in c["args"]
    vols = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for name, path in vols.items():
        assert mounts[name] == path  # the same path inside as on the host


def test_no_role_grants_wildcards_or_secrets_cluster_wide(renderer: Renderer) -> None:
    for name in ("default", "ha", "cert-manager", "monitoring"):
        docs = renderer.render(option_values(name))
        for role in find_all(docs, "ClusterRole") + find_all(docs, "Role"):
            for r in role["rules"]:
                assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
                if role["kind"] == "ClusterRole":
                    assert "secrets" not in r["resources"]


# -- every pod ------------------------------------------------------------------------------------

def _pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workloads, a CronJob as its Job template."""
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "Job")] + [
        d["spec"]["jobTemplate"] | {"kind": "Job", "metadata": d["metadata"]} for d in docs if d["kind"] == "CronJob"]


@pytest.mark.parametrize("name", ["default", "ha", "cert-manager"])
def test_pods_carry_no_system_owned_labels_and_are_restricted(renderer: Renderer, name: str) -> None:
    from kube_vgpu.resources import system_owned
    for w in _pods(renderer.render(option_values(name))):
        tpl = w["spec"]["template"]
        # the chart's ValidatingAdmissionPolicy refuses pods created with them (the webhook skips
        # the release namespace through its namespaceSelector instead)
        meta = tpl["metadata"]
        assert not [k for k in {**meta.get("labels", {}), **meta.get("annotations", {})} if system_owned(k)], \
            w["metadata"]["name"]
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True
            assert "privileged" not in sc or sc["privileged"] is False
            assert c.get("resources", {}).get("limits", {}).get("memory"), c["name"]
            if w["kind"] != "DaemonSet":
                assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, c["name"]


# -- the policy ConfigMap is the domain config ----------------------------------------------------

@pytest.mark.parametrize("name", ["default", "foreign-deny", "custom-resource-names"])
def test_policy_configmap_loads_with_domain_schema(renderer: Renderer, name: str) -> None:
    docs = renderer.render(option_values(name))
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    cfg = load_config_text(cm["data"]["config.yaml"])  # raises ConfigError on any key the domain rejects
    if name == "foreign-deny":
        assert cfg.webhook.foreign_schedulers == "deny" and cfg.scheduling.node_policy == "spread"
        assert cfg.nodes[0].split_count == 4 and cfg.nodes[0].exclude_gpus == ("3",)


def test_values_config_defaults_equal_domain_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    ours = {"apiVersion": "kube-vgpu.io/v1", **values["config"]}
    assert load_config_text(yaml.safe_dump(ours)) == Config()
    assert ours == config_to_dict(Config())


# -- values: documented, schema-checked -----------------------------------------------------------

def _leaf_paths(obj: Any, prefix: str = "") -> set[str]:
    if isinstance(obj, dict) and obj:
        out = set()
        for k, v in obj.items():
            out |= _leaf_paths(v, f"{prefix}.{k}" if prefix else k)
        return out
    return {prefix}


def _schema_has(schema: dict[str, Any], path: str) -> bool:
    node = schema
    for part in path.split("."):
        props = node.get("properties")
        if props is None:
            return node.get("type") == "object" or "additionalProperties" in node
        if part not in props:
            return False
        node = props[part]
    return True


def test_every_value_is_in_the_schema() -> None:
    import json
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing = [p for p in _leaf_paths(values) if not _schema_has(schema, p)]
    assert not missing


RAW_K8S_BLOCKS = {"resources", "securityContext", "capabilities", "tolerations", "env", "nodeSelector"}


def test_every_value_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.\-/]*):(\s|$)", line)
        if not m:
            continue
        indent = len(m.group(1))
        parent = next((pm.group(2) for j in range(i - 1, -1, -1)
                       if (pm := re.match(r"^(\s*)([A-Za-z][\w.\-/]*):", lines[j])) and len(pm.group(1)) < indent),
                      None)
        if parent in RAW_K8S_BLOCKS:  # plain Kubernetes fields inside a documented block
            continue
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not prev.startswith("#"):
            undocumented.append(f"{i + 1}: {line.strip()}")
    assert not undocumented, "values.yaml keys without a comment above:\n" + "\n".join(undocumented)


@pytest.mark.parametrize(("values", "message"), [
    ({"webhook": {"timeoutSeconds": 10}}, "webhook.timeoutSeconds"),
    ({"webhook": {"failurePolicy": "Sometimes"}}, "webhook.failurePolicy"),
    ({"webhook": {"certs": {"mode": "vault"}}}, "webhook.certs.mode"),
    ({"config": {"scheduling": {"nodePolicy": "random"}}}, "config.scheduling.nodePolicy"),
    ({"config": {"devices": {"splitCount": 0}}}, "config.devices.splitCount"),
    ({"config": {"defaults": {"memoryPercentage": 101}}}, "config.defaults.memoryPercentage"),
    ({"config": {"webhook": {"privileged": "maybe"}}}, "config.webhook.privileged"),
    ({"config": {"schedulng": {}}}, "schedulng"),
    ({"scheduler": {"replicas": 0}}, "scheduler.replicas"),
    ({"scheduler": {"extender": {"httpTimeout": "ten"}}}, "scheduler.extender.httpTimeout"),
    ({"devicePlugin": {"pluginDir": "relative/path"}}, "devicePlugin.pluginDir"),
    ({"logLevel": "verbose"}, "logLevel"),
    ({"scheduler": {"replica": 2}}, "replica"),
])
def test_bad_values_fail_with_schema_message(renderer: Renderer, values: dict[str, Any], message: str) -> None:
    r = renderer.template(values)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize("key", ["devicePlugin.shimHostDir", "devicePlugin.cacheHostDir", "devicePlugin.pluginDir",
                                 "devicePlugin.podResourcesDir", "dra.pluginsDir", "dra.registryDir", "dra.cdiDir"])
@pytest.mark.parametrize(("path", "why"), [
    # the shape, judged by the schema
    ("/", "schema"), ("//", "schema"), ("/usr/local/vgpu/", "schema"), ("relative", "schema"), ("/opt//", "schema"),
    # judged by the templates, which name the value and what is allowed (the schema's "not" did not)
    ("/..", ". or .. component"), ("/usr/..", ". or .. component"), ("/opt/./x", ". or .. component"),
    ("/etc", "is a system directory"), ("/usr/local", "is a system directory"), ("/var/lib", "is a system directory"),
])
def test_host_dirs_must_be_dedicated_directories(renderer: Renderer, key: str, path: str, why: str) -> None:
    section, name = key.split(".")
    r = renderer.template({section: {name: path}})
    assert r.returncode != 0, f"{key}={path!r} rendered"
    if why == "schema":
        assert "values don't meet the specifications of the schema" in r.stderr
        assert key in r.stderr, r.stderr
    else:
        assert f'{key}="{path}"' in r.stderr and why in r.stderr and "allowed:" in r.stderr, r.stderr


def test_shim_host_dir_root_never_renders_a_root_mount(renderer: Renderer) -> None:
    r = renderer.template({"devicePlugin": {"shimHostDir": "/"}})
    assert r.returncode != 0 and "//libvgpu.so" not in r.stdout


@pytest.mark.parametrize("values", [
    {"devicePlugin": {"shimHostDir": "/a"}},
    {"devicePlugin": {"shimHostDir": "/usr/local/vgpu", "cacheHostDir": "/var/lib/kube-vgpu/containers"}},
    {"devicePlugin": {"shimHostDir": "/opt/kube-vgpu/lib", "pluginDir": "/var/lib/kubelet/device-plugins"}},
])
def test_dedicated_host_dirs_are_accepted(renderer: Renderer, values: dict[str, Any]) -> None:
    r = renderer.template(values)
    assert r.returncode == 0, r.stderr


def test_host_dir_defaults_are_the_device_plugins_and_the_webhook_protects_them() -> None:
    """The chart's default shim and cache host directories are the device plugin's own defaults
    (kube_vgpu.envcontract), and the webhook's built-in protected host paths cover them even when
    the chart's --protected-host-path flags are missing."""
    from deviceplugin import startup
    from kube_vgpu import envcontract
    from webhook.isolation import PROTECTED_HOST_PATHS, path_overlaps

    dp = yaml.safe_load((CHART / "values.yaml").read_text())["devicePlugin"]
    assert dp["shimHostDir"] + "/libvgpu.so" == envcontract.SHIM_HOST_PATH
    assert dp["cacheHostDir"] == envcontract.CACHE_HOST_DIR
    p = argparse.ArgumentParser()
    startup.add_shim_flags(p, cache_help="")
    args = p.parse_args([])
    assert (args.shim_host_path, args.cache_host_dir) == (envcontract.SHIM_HOST_PATH, envcontract.CACHE_HOST_DIR)
    for path in (dp["shimHostDir"], envcontract.SHIM_HOST_PATH, dp["cacheHostDir"]):
        assert any(path_overlaps(path, p) for p in PROTECTED_HOST_PATHS), path


def test_scheduler_name_default_scheduler_is_rejected(renderer: Renderer) -> None:
    r = renderer.template({"config": {"schedulerName": "default-scheduler"}})
    assert r.returncode != 0
    assert "config.schedulerName" in r.stderr, r.stderr
    # without the schema (helm --skip-schema-validation) the templates still refuse, saying why
    r = renderer.template({"config": {"schedulerName": "default-scheduler"}}, extra=["--skip-schema-validation"])
    assert r.returncode != 0
    assert "config.schedulerName=default-scheduler" in r.stderr
    assert "race the control plane's default-scheduler" in r.stderr, r.stderr


@pytest.mark.parametrize(("values", "shown"), [
    ({"config": {"scheduling": {"inventoryStaleSeconds": 10}}},
     "config.scheduling.inventoryStaleSeconds=10 must be at least 2 x devicePlugin.heartbeatSeconds=30 (60)"),
    ({"devicePlugin": {"heartbeatSeconds": 1000}},
     "config.scheduling.inventoryStaleSeconds=120 must be at least 2 x devicePlugin.heartbeatSeconds=1000 (2000)"),
    ({"config": {"scheduling": {"inventoryStaleSeconds": 59.5}}},
     "config.scheduling.inventoryStaleSeconds=59.5 must be at least 2 x devicePlugin.heartbeatSeconds=30 (60)"),
])
def test_heartbeat_that_guarantees_stale_inventories_fails(renderer: Renderer, values: dict[str, Any],
                                                           shown: str) -> None:
    r = renderer.template(values)
    assert r.returncode != 0
    assert shown in r.stderr, r.stderr


@pytest.mark.parametrize("values", [
    {"config": {"scheduling": {"inventoryStaleSeconds": 60}}},
    {"config": {"scheduling": {"inventoryStaleSeconds": 2000}}, "devicePlugin": {"heartbeatSeconds": 1000}},
    # no device plugin in this release: its heartbeat value is not what runs
    {"config": {"scheduling": {"inventoryStaleSeconds": 10}}, "devicePlugin": {"enabled": False}},
])
def test_heartbeat_within_staleness_renders(renderer: Renderer, values: dict[str, Any]) -> None:
    r = renderer.template(values)
    assert r.returncode == 0, r.stderr


def test_extender_ports_must_differ(renderer: Renderer) -> None:
    r = renderer.template({"scheduler": {"extender": {"metricsPort": 8888}}})
    assert r.returncode != 0
    assert "scheduler.extender.metricsPort=8888 must differ from scheduler.extender.port=8888" in r.stderr


def test_custom_extender_ports(renderer: Renderer) -> None:
    docs = renderer.render({"scheduler": {"extender": {"port": 9000, "metricsPort": 9001}}})
    assert scheduler_config(docs)["extenders"][0]["urlPrefix"] == "http://127.0.0.1:9000"
    ext = containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]
    assert "--port=9000" in ext["args"] and "--metrics-port=9001" in ext["args"]
    assert [p["containerPort"] for p in ext["ports"]] == [9001]
    svc = find(docs, "Service", f"{FULL}-scheduler")
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9001, "http-metrics")]


def test_replicas_without_leader_election_fail_clearly(renderer: Renderer) -> None:
    r = renderer.template({"scheduler": {"replicas": 2, "leaderElection": {"enabled": False}}})
    assert r.returncode != 0
    assert "scheduler.leaderElection.enabled=false with scheduler.replicas=2" in r.stderr


@pytest.mark.parametrize(("timings", "ok"), [
    ({}, True),
    ({"leaseDuration": "1m30s", "renewDeadline": "1m", "retryPeriod": "10s"}, True),
    ({"leaseDuration": "10.5s", "renewDeadline": "10s", "retryPeriod": "8s"}, True),
    ({"renewDeadline": "20s"}, False),     # longer than the 15s lease
    ({"renewDeadline": "15s"}, False),     # equal to it
    ({"retryPeriod": "9s"}, False),        # renewDeadline 10s <= 1.2 x 9s (client-go's jitter)
    ({"retryPeriod": "0s"}, False),
    ({"renewDeadline": "500ms"}, False),
])
def test_lease_timings_kube_scheduler_refuses_are_refused(renderer: Renderer, timings: dict[str, str], ok: bool) -> None:
    """kube-scheduler exits at start unless leaseDuration > renewDeadline > 1.2 x retryPeriod > 0;
    the chart rendered such timings, and values.yaml only said so in a comment."""
    r = renderer.template({"scheduler": {"replicas": 2, "leaderElection": timings}})
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert "scheduler.leaderElection: leaseDuration=" in r.stderr and "allowed: leaseDuration > renewDeadline" in r.stderr
    # with one replica there is no election, and kube-scheduler does not validate the timings
    assert renderer.template({"scheduler": {"replicas": 1, "leaderElection": timings}}).returncode == 0


def test_servicemonitors(renderer: Renderer) -> None:
    docs = renderer.render(option_values("monitoring"))
    sms = {s["metadata"]["name"]: s for s in find_all(docs, "ServiceMonitor")}
    assert set(sms) == {f"{FULL}-scheduler", f"{FULL}-webhook", f"{FULL}-device-plugin"}
    for name, sm in sms.items():
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        comp = name.removeprefix(f"{FULL}-")
        svc = find(docs, "Service", name)
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        port = sm["spec"]["endpoints"][0]["port"]
        assert port in {p["name"] for p in svc["spec"]["ports"]}, comp
    assert sms[f"{FULL}-webhook"]["spec"]["endpoints"][0]["scheme"] == "https"
    # the scheduler is scraped on the observability listener, never on the extender API's port
    assert sms[f"{FULL}-scheduler"]["spec"]["endpoints"][0]["port"] == "http-metrics"
    (sport,) = find(docs, "Service", f"{FULL}-scheduler")["spec"]["ports"]
    assert (sport["name"], sport["port"]) == ("http-metrics", 8889)
    assert not find_all(renderer.render(), "ServiceMonitor")


def test_chart_files_exist() -> None:
    for f in ("Chart.yaml", "values.yaml", "values.schema.json", "templates/NOTES.txt"):
        assert Path(CHART / f).is_file()


# -- the rendered args are accepted by the real command-line parsers ------------------------------

PARSERS = {"scheduler": ("scheduler.server", "build_parser"), "webhook": ("webhook.server", "build_parser"),
           "certs": ("certs.main", "build_parser"), "device-plugin": ("deviceplugin.main", "parser"),
           "signing-keys": ("certs.signing_keys", "build_parser")}


@pytest.mark.parametrize("name", ["default", "ha", "custom-paths"])
def test_rendered_args_parse_with_component_parsers(renderer: Renderer, name: str) -> None:
    import importlib
    seen = set()
    for w in _pods(renderer.render(option_values(name))):
        for c in w["spec"]["template"]["spec"]["containers"]:
            args = c.get("args")
            if not args or args[0] not in PARSERS:
                continue
            if args[:2] == ["certs", "signing-keys"]:  # `kube-vgpu certs signing-keys ...`
                args = ["signing-keys", *args[2:]]
            mod_name, fn = PARSERS[args[0]]
            try:
                parser = getattr(importlib.import_module(mod_name), fn)()
            except ImportError as e:
                pytest.skip(f"{mod_name} not importable here: {e}")
            # $(NODE_NAME) is expanded by the kubelet; any value parses.
            ns = parser.parse_args([a.replace("$(NODE_NAME)", "node-1") for a in args[1:]])
            assert ns is not None
            seen.add(args[0])
    assert {"scheduler", "webhook", "device-plugin", "signing-keys"} <= seen


@pytest.mark.parametrize("handover", [None, 45, 0])
def test_device_plugin_gets_the_pod_resources_socket_and_no_hand_over_flag(renderer: Renderer, handover: Any) -> None:
    """The device plugin asks kubelet's PodResources API (socket mounted read-only); the deprecated
    bindHandoverSeconds no longer reaches it (--pending-stale-seconds keeps the plugin's default)."""
    values = {} if handover is None else {"config": {"scheduling": {"bindHandoverSeconds": handover}}}
    ds = find(renderer.render(values), "DaemonSet", f"{FULL}-device-plugin")
    c = containers(ds)["device-plugin"]
    assert not [a for a in c["args"] if a.startswith("--pending-stale-seconds")]
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in c["args"]
    (m,) = [m for m in c["volumeMounts"] if m["name"] == "pod-resources"]
    assert m == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
    (v,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "pod-resources"]
    assert v["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}


def test_device_plugin_trial_mode_value(renderer: Renderer) -> None:
    """devicePlugin.simulateGPUs reaches the device plugin as --simulate-gpus (off by default), the
    rendered flag parses with the device plugin's own parser and spec check, and the schema refuses
    a value the device plugin would refuse."""
    from deviceplugin.main import parser
    from deviceplugin.simgpu import parse_spec

    plain = containers(find(renderer.render(), "DaemonSet", f"{FULL}-device-plugin"))["device-plugin"]["args"]
    assert not any(a.startswith("--simulate-gpus") for a in plain)
    ds = find(renderer.render({"devicePlugin": {"simulateGPUs": "2x81920:H100-sim,1x16384"}}), "DaemonSet",
              f"{FULL}-device-plugin")
    args = containers(ds)["device-plugin"]["args"]
    assert "--simulate-gpus=2x81920:H100-sim,1x16384" in args
    ns = parser().parse_args([a.replace("$(NODE_NAME)", "n1") for a in args[1:]])
    assert parse_spec(ns.simulate_gpus) == [(2, 81920, "H100-sim"), (1, 16384, "Simulated GPU (no isolation)")]
    r = renderer.template({"devicePlugin": {"simulateGPUs": "4xlots"}})
    assert r.returncode != 0 and "simulateGPUs" in r.stderr, r.stderr


@pytest.mark.parametrize("spec", ["0x100", "4x0", "4x2000000", "40x10,30x10", "65x1", "2x81920:H100-sim, 0x16384"])
def test_simulated_gpu_numbers_the_device_plugin_refuses_are_refused_by_helm(renderer: Renderer, spec: str) -> None:
    """A spec of the right form but with numbers the device plugin refuses at start (0 GPUs, 0 MiB or
    more than 1 TiB, more than 64 GPUs) once installed and crash-looped every device plugin pod."""
    from deviceplugin.simgpu import SimulateSpecError, parse_spec

    with pytest.raises(SimulateSpecError):
        parse_spec(spec)
    r = renderer.template({"devicePlugin": {"simulateGPUs": spec}})
    assert r.returncode != 0 and f"devicePlugin.simulateGPUs={spec!r}".replace("'", '"') in r.stderr, r.stderr
    assert "allowed: comma-separated COUNTxMIB[:MODEL] groups" in r.stderr, r.stderr


def test_each_component_image_can_be_overridden(renderer: Renderer) -> None:
    """image.overrides.<component> replaces repository and/or tag for that component only; the
    others keep the global image (the published name and the chart's appVersion by default)."""
    def images(values: dict[str, Any] | None) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for w in _pods(renderer.render(values)):
            spec = w["spec"]["template"]["spec"] if "template" in w["spec"] else w["spec"]
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if c["image"].split(":")[0].endswith(("kube-vgpu", "mirror/kv-webhook")):
                    out.setdefault(w["metadata"]["name"], set()).add(c["image"])
        return out
    default = images(None)
    assert {i for s in default.values() for i in s} == {"ghcr.io/kube-vgpu/kube-vgpu:0.1.0"}
    got = images({"image": {"tag": "0.2.0", "overrides": {"webhook": {"repository": "mirror/kv-webhook"},
                                                          "devicePlugin": {"tag": "0.2.1"}}}})
    assert got[f"{FULL}-webhook"] == {"mirror/kv-webhook:0.2.0"}
    assert got[f"{FULL}-device-plugin"] == {"ghcr.io/kube-vgpu/kube-vgpu:0.2.1"}
    assert got[f"{FULL}-scheduler"] == {"ghcr.io/kube-vgpu/kube-vgpu:0.2.0"}


def test_device_plugin_selinux_options(renderer: Renderer) -> None:
    """devicePlugin.seLinuxOptions reaches the pod's securityContext (OpenShift/SELinux); none by default."""
    ds = find(renderer.render(), "DaemonSet", f"{FULL}-device-plugin")
    assert "seLinuxOptions" not in (ds["spec"]["template"]["spec"].get("securityContext") or {})
    ds = find(renderer.render({"devicePlugin": {"seLinuxOptions": {"type": "spc_t"}}}), "DaemonSet",
              f"{FULL}-device-plugin")
    assert ds["spec"]["template"]["spec"]["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}


@pytest.mark.parametrize(("value", "want"), [(None, True), (False, False)])
def test_extender_filter_best_node_value(renderer: Renderer, value: bool | None, want: bool) -> None:
    """scheduler.extender.filterBestNode (default true) reaches the extender as --filter-best-node, and
    the extender's own parser reads the value the chart meant."""
    from scheduler.server import build_parser

    values = {} if value is None else {"scheduler": {"extender": {"filterBestNode": value}}}
    args = containers(find(renderer.render(values), "Deployment", f"{FULL}-scheduler"))["extender"]["args"]
    assert f"--filter-best-node={str(want).lower()}" in args
    assert build_parser().parse_args([a for a in args[1:] if a.startswith("--filter-best-node")] +
                                     ["--signing-keys-dir", "/k"]).filter_best_node is want


@pytest.mark.parametrize("spec", ["64x1", "1x1048576", "32x24576:A,32x1"])
def test_simulated_gpu_numbers_at_the_limits_are_installed(renderer: Renderer, spec: str) -> None:
    from deviceplugin.simgpu import parse_spec

    assert parse_spec(spec)
    r = renderer.template({"devicePlugin": {"simulateGPUs": spec}})
    assert r.returncode == 0, r.stderr
