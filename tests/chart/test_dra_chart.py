"""The chart's DRA parts (dra.enabled): DeviceClasses, the dra-plugin container, its RBAC (exactly the
calls of deviceplugin/dra_publish.py and the claim read) and the ResourceSlice admission policy
(evaluated with cel-python here; tests/e2e/test_e2e_dra.py runs it in a real kube-apiserver)."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import pytest

from kube_vgpu.dra import DRIVER_NAME
from kube_vgpu.dra.slices import resource_slice
from kube_vgpu.model import GPUDevice
from tests.fakeapi import FakeKubeAPI

from .conftest import NAMESPACE, Renderer, find, find_all
from .test_chart import FULL, containers
from .test_rbac import DEVICE_PLUGIN_METHODS, Call, check, recorded

ON: dict[str, Any] = {"dra": {"enabled": True}}
KUBE = "1.36.0"
DP_SA = f"{FULL}-device-plugin"
DP_USER = f"system:serviceaccount:{NAMESPACE}:{DP_SA}"
NODE_EXTRA = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def docs(renderer: Renderer) -> list[dict[str, Any]]:
    return renderer.render(ON, kube_version=KUBE)


def _ds(docs: list[dict[str, Any]], name: str = "device-plugin") -> dict[str, Any]:
    return find(docs, "DaemonSet", name)


def _terms(ds: dict[str, Any]) -> list[list[dict[str, Any]]]:
    aff = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [t["matchExpressions"] for t in aff["nodeSelectorTerms"]]


def test_off_by_default(renderer: Renderer) -> None:
    d = renderer.render(kube_version=KUBE)
    assert find_all(d, "DeviceClass") == []
    assert [x["metadata"]["name"] for x in find_all(d, "DaemonSet")] == [f"{FULL}-device-plugin"]
    assert not any(e["key"] == "kube-vgpu.io/dra-node" for t in _terms(_ds(d)) for e in t)
    assert not [x for x in find_all(d, "ClusterRole") if x["metadata"]["name"].endswith("dra-plugin")]
    assert not [x for x in find_all(d, "ValidatingAdmissionPolicy") if x["metadata"]["name"].endswith("dra-slices")]


def test_device_class_selects_our_driver(docs: list[dict[str, Any]]) -> None:
    [dc] = find_all(docs, "DeviceClass")
    assert dc["apiVersion"] == "resource.k8s.io/v1" and dc["metadata"]["name"] == DRIVER_NAME
    assert dc["spec"]["selectors"] == [{"cel": {"expression": f"device.driver == '{DRIVER_NAME}'"}}]
    assert "extendedResourceName" not in dc["spec"]  # the mapping is off by default


def test_extended_resource_mapping_and_model_classes(renderer: Renderer) -> None:
    d = renderer.render({"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": "nvidia.com/gpu"},
                                 "modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200",
                                                   "extendedResourceName": "example.com/h200"}]}}, kube_version=KUBE)
    by = {x["metadata"]["name"]: x["spec"] for x in find_all(d, "DeviceClass")}
    assert by[DRIVER_NAME]["extendedResourceName"] == "nvidia.com/gpu"
    h200 = by["h200.vgpu.kube-vgpu.io"]
    assert h200["extendedResourceName"] == "example.com/h200"
    expr = " ".join(h200["selectors"][0]["cel"]["expression"].split())
    assert expr == (f"device.driver == '{DRIVER_NAME}' && device.attributes['{DRIVER_NAME}'].model == 'NVIDIA H200'")


@pytest.mark.parametrize(("values", "needle"), [
    ({"dra": {"enabled": True, "deviceClass": {"extendedResourceName": "not a name"}}}, "extendedResourceName"),
    ({"dra": {"enabled": True, "modelClasses": [{"name": "x", "model": "it's"}]}}, "model"),
    ({"dra": {"enabled": True, "modelClasses": [{"model": "NVIDIA H200"}]}}, "name"),
    ({"dra": {"enabled": True, "cdiDir": "/var/run"}}, "cdiDir"),
    ({"dra": {"enabled": "yes"}}, "enabled"),
    ({"dra": {"enabled": True, "nodes": "some"}}, "nodes"),
    ({"dra": {"enabled": True, "nodeLabel": "bad label"}}, "nodeLabel"),
])
def test_bad_values_refused_by_schema(renderer: Renderer, values: dict[str, Any], needle: str) -> None:
    r = renderer.template(values, kube_version=KUBE)
    assert r.returncode != 0 and needle in r.stderr, r.stderr


def test_refused_where_it_cannot_work(renderer: Renderer) -> None:
    r = renderer.template(ON, kube_version="1.33.0")
    assert r.returncode != 0 and "dra.enabled=true needs Kubernetes >= 1.34" in r.stderr
    r = renderer.template({**ON, "devicePlugin": {"enabled": False}}, kube_version=KUBE)
    assert r.returncode != 0 and "needs devicePlugin.enabled=true" in r.stderr


@pytest.mark.parametrize("dra", [
    {"deviceClass": {"extendedResourceName": "nvidia.com/gpu"}},
    {"nodes": "labelled", "modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200",
                                            "extendedResourceName": "nvidia.com/gpu"}]},
], ids=["device-class", "model-class"])
def test_mapping_the_gpu_resource_is_refused_on_labelled_nodes(renderer: Renderer, dra: dict[str, Any]) -> None:
    """With dra.nodes=labelled the device-plugin nodes advertise nvidia.com/gpu as vGPU slots only our
    scheduler may book, so the webhook routes every pod asking for it there, and our extender never
    places on a DRA node: the mapping would serve no pod (docs/dra.md)."""
    r = renderer.template({"dra": {"enabled": True, **dra}}, kube_version=KUBE)
    assert r.returncode != 0, r.stdout[:200]
    for needle in ("extendedResourceName=nvidia.com/gpu", "config.resourceNames.gpu", "dra.nodes=labelled",
                   "Allowed: dra.nodes=all"):
        assert needle in r.stderr, r.stderr
    r = renderer.template({"dra": {"enabled": True, "deviceClass": {"extendedResourceName": "example.com/vgpu"}},
                           "config": {"resourceNames": {"gpu": "example.com/vgpu"}}}, kube_version=KUBE)
    assert r.returncode != 0 and "extendedResourceName=example.com/vgpu" in r.stderr, r.stderr
    assert renderer.render({"dra": {"enabled": True, **dra, "nodes": "all"}}, kube_version=KUBE)


@pytest.mark.parametrize("name", ["nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores",
                                  "nvidia.com/priority"])
def test_mapping_a_vgpu_amount_is_refused(renderer: Renderer, name: str) -> None:
    """The mapping counts whole GPUs: nvidia.com/gpumem: 3000 would ask for 3000 of them."""
    for dra in ({"deviceClass": {"extendedResourceName": name}},
                {"modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200", "extendedResourceName": name}]}):
        r = renderer.template({"dra": {"enabled": True, "nodes": "all", **dra}}, kube_version=KUBE)
        assert r.returncode != 0 and f"dra extendedResourceName={name} is one of config.resourceNames" in r.stderr, \
            r.stderr


def test_one_node_component_per_node(docs: list[dict[str, Any]], renderer: Renderer) -> None:
    """Labelled nodes run the DRA plugin and the device plugin keeps off them; with nodes=all no
    device plugin at all: a GPU is never offered by both paths."""
    notin = {"key": "kube-vgpu.io/dra-node", "operator": "NotIn", "values": ["true"]}
    isin = {"key": "kube-vgpu.io/dra-node", "operator": "In", "values": ["true"]}
    dp, drad = _ds(docs), _ds(docs, "dra-plugin")
    assert _terms(dp) and all(notin in t for t in _terms(dp))
    assert _terms(drad) and all(isin in t for t in _terms(drad))
    assert [t[0] for t in _terms(dp)] == [t[0] for t in _terms(drad)]  # the same GPU-node selection
    d = renderer.render({"dra": {"enabled": True, "nodes": "all"}}, kube_version=KUBE)
    assert [x["metadata"]["name"] for x in find_all(d, "DaemonSet")] == [f"{FULL}-dra-plugin"]
    assert not any(e["key"] == "kube-vgpu.io/dra-node" for t in _terms(_ds(d, "dra-plugin")) for e in t)
    d = renderer.render({"dra": {"enabled": True}, "devicePlugin": {"selectGPUNodes": False}}, kube_version=KUBE)
    assert _terms(_ds(d)) == [[notin]] and _terms(_ds(d, "dra-plugin")) == [[isin]]
    r = renderer.template({"dra": {"enabled": True}, "devicePlugin": {"affinity": {"nodeAffinity": {}}}},
                          kube_version=KUBE)
    assert r.returncode != 0 and "leave devicePlugin.affinity empty" in r.stderr


def test_dra_plugin_container(docs: list[dict[str, Any]]) -> None:
    ds = _ds(docs, "dra-plugin")
    spec = ds["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == DP_SA
    assert list(containers(ds, init=True)) == ["install-shim"]
    c = containers(ds)["dra-plugin"]
    args = c["args"]
    assert args[0] == "dra-plugin"
    for want in ("--node-name=$(NODE_NAME)", f"--plugin-dir=/var/lib/kubelet/plugins/{DRIVER_NAME}",
                 "--registry-dir=/var/lib/kubelet/plugins_registry", "--cdi-dir=/var/run/cdi",
                 "--config=/etc/kube-vgpu/config.yaml", "--shim-host-path=/usr/local/vgpu/libvgpu.so",
                 "--cache-host-dir=/var/lib/kube-vgpu/containers", "--metrics-port=9395"):
        assert want in args
    # every flag the chart passes is one `kube-vgpu dra-plugin` knows
    from deviceplugin.dra.main import parser
    parser().parse_args([a.replace("$(NODE_NAME)", "n1") for a in args[1:]])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    for path in ("/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"):
        assert vols[mounts[path]["name"]]["hostPath"]["path"] == path
        assert not mounts[path].get("readOnly")
    assert not mounts["/usr/local/vgpu"].get("readOnly")  # the plugin keeps ld.so.preload beside the shim
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def _publisher_calls(fake: FakeKubeAPI) -> set[Call]:
    """Every public method of SlicePublisher, through every write it can make."""
    from deviceplugin.dra_publish import SlicePublisher

    fake.create_object("nodes", {"metadata": {"name": "n1"}})
    pub = SlicePublisher(fake.api_client(), "n1")
    gpus = [GPUDevice(uuid=f"GPU-{i}", index=i, model="NVIDIA H200", memory_mib=1024) for i in range(70)]
    fake.clear_requests()
    pub.publish(gpus)        # create (two slices)
    pub.publish(gpus[:2])    # update, then delete the leftover
    pub.current()
    pub.remove()             # delete
    public = {n for n in dir(SlicePublisher) if not n.startswith("_")}
    assert public == {"publish", "remove", "current", "run"}, "a new public method: exercise it here"
    return recorded(fake)


def test_node_component_rbac_is_exactly_its_calls(docs: list[dict[str, Any]], fake: FakeKubeAPI) -> None:
    from deviceplugin.kube import ApiKubeClient

    calls = _publisher_calls(fake)
    assert Call("create", "resource.k8s.io", "resourceslices", "", "") in calls
    assert Call("delete", "resource.k8s.io", "resourceslices", "", f"n1-{DRIVER_NAME}-1") in calls
    fake.create_object("namespaces", {"metadata": {"name": "team-a"}})
    fake.create_object("pods", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
                       namespace="team-a")
    fake.clear_requests()
    k = ApiKubeClient(api_client=fake.api_client())
    for fn in DEVICE_PLUGIN_METHODS.values():
        fn(k, fake)
    calls |= recorded(fake)
    # the kubelet plugin reads the claim kubelet asks it to prepare: every method of its API layer
    from deviceplugin.dra.kube import ApiClaimClient

    public = {n for n in dir(ApiClaimClient) if not n.startswith("_")}
    assert public == {"get_claim"}, "a new public method of ApiClaimClient: exercise it here"
    fake.create_object("resourceclaims", {"metadata": {"name": "claim-1"}, "spec": {}}, namespace="team-a")
    fake.clear_requests()
    ApiClaimClient(fake.api_client()).get_claim("team-a", "claim-1")
    calls |= recorded(fake)
    assert Call("get", "resource.k8s.io", "resourceclaims", "team-a", "claim-1") in calls
    check(docs, DP_SA, calls)


# -- the ResourceSlice admission policy --------------------------------------------------------------

@pytest.fixture(scope="module")
def vap() -> ModuleType:
    pytest.importorskip("celpy", reason="cel-python (a dev dependency) evaluates the policies' CEL")
    from . import vap as mod
    return mod


def _slice(node: str = "n1", driver: str = DRIVER_NAME, pool: str | None = None) -> dict[str, Any]:
    s = resource_slice(node, [GPUDevice(uuid="GPU-1", index=0, model="NVIDIA H200", memory_mib=1024)],
                       pool_generation=1)
    s["spec"]["driver"] = driver
    if pool is not None:
        s["spec"]["pool"]["name"] = pool
    return s


def _decide(vap: ModuleType, docs: list[dict[str, Any]], op: str, user: str, obj: dict[str, Any] | None,
            old: dict[str, Any] | None = None, node: str | None = None) -> Any:
    pol = find(docs, "ValidatingAdmissionPolicy", f"{FULL}-dra-slices")
    name = (obj or old or {}).get("metadata", {}).get("name", "")
    r = vap.Request(op, "resourceslices", user, name=name, group="resource.k8s.io",
                    extra={NODE_EXTRA: [node]} if node else {})
    return vap.decide(pol, r, obj, old)


def test_slice_policy_installed_and_bound(docs: list[dict[str, Any]], renderer: Renderer) -> None:
    pol = find(docs, "ValidatingAdmissionPolicy", f"{FULL}-dra-slices")
    assert pol["spec"]["matchConstraints"]["matchPolicy"] == "Equivalent"  # v1beta* requests too
    b = find(docs, "ValidatingAdmissionPolicyBinding", f"{FULL}-dra-slices")
    assert b["spec"]["validationActions"] == ["Deny"]
    off = renderer.render({"dra": {"enabled": True, "sliceNodeRestriction": False}}, kube_version=KUBE)
    assert not [x for x in find_all(off, "ValidatingAdmissionPolicy") if x["metadata"]["name"].endswith("dra-slices")]


@pytest.mark.parametrize("user", ["system:serviceaccount:team-a:app", "admin", "system:node:n1",
                                  f"system:serviceaccount:{NAMESPACE}:{FULL}-scheduler"])
def test_others_cannot_create_or_change_our_slices(vap: ModuleType, docs: list[dict[str, Any]], user: str) -> None:
    d = _decide(vap, docs, "CREATE", user, _slice(), node="n1")
    assert d.matched and d.denied
    assert f"written only by the kube-vgpu node component ({DP_USER}); {user} may not CREATE" in d.denied[0]
    new = copy.deepcopy(_slice())
    new["spec"]["devices"][0]["capacity"]["memory"]["value"] = "999999Mi"
    assert not _decide(vap, docs, "UPDATE", user, new, _slice(), node="n1").allowed


def test_others_may_delete_and_other_drivers_are_not_ours(vap: ModuleType, docs: list[dict[str, Any]]) -> None:
    # the garbage collector and kubelet delete slices of gone nodes / plugins
    assert _decide(vap, docs, "DELETE", "system:node:n1", None, _slice()).allowed
    # another driver's slice: not this policy's business
    assert not _decide(vap, docs, "CREATE", "admin", _slice(driver="gpu.example.com"), node="n1").matched


def test_node_component_writes_only_its_own_node(vap: ModuleType, docs: list[dict[str, Any]]) -> None:
    assert _decide(vap, docs, "CREATE", DP_USER, _slice("n1"), node="n1").allowed
    assert _decide(vap, docs, "UPDATE", DP_USER, _slice("n1"), _slice("n1"), node="n1").allowed
    assert _decide(vap, docs, "DELETE", DP_USER, None, _slice("n1"), node="n1").allowed
    d = _decide(vap, docs, "CREATE", DP_USER, _slice("n2"), node="n1")
    assert d.denied and "node component of node n1 may write only the ResourceSlices of its own node" in d.denied[0]
    assert not _decide(vap, docs, "DELETE", DP_USER, None, _slice("n2"), node="n1").allowed
    # the pool of another node's name, on our node
    assert not _decide(vap, docs, "CREATE", DP_USER, _slice("n1", pool="n2"), node="n1").allowed
    # a token that names no node (not bound to a pod)
    d = _decide(vap, docs, "CREATE", DP_USER, _slice("n1"))
    assert d.denied and "token names no node" in d.denied[0]


@pytest.mark.parametrize("values", [
    {"dra": {"enabled": True, "deviceClass": {"extendedResourceName": "example.com/dra-gpu"},
             "modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200"}]}},
    {"dra": {"enabled": True, "nodes": "all", "deviceClass": {"extendedResourceName": "nvidia.com/gpu"}}},
], ids=["labelled", "all"])
def test_rendered_dra_manifests_validate(renderer: Renderer, values: dict[str, Any]) -> None:
    """Every object (DeviceClasses, DaemonSets, RBAC, policy) against Kubernetes' own 1.36 schemas."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = renderer.render(values, kube_version=KUBE)
    kinds = {d["kind"] for d in docs}
    assert {"DeviceClass", "DaemonSet", "ValidatingAdmissionPolicy"} <= kinds
    for d in docs:
        try:
            kubernetes_validate.validate(d, KUBE, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for {KUBE}: {e.message}")
        if d["kind"] == "DeviceClass":
            assert "namespace" not in d["metadata"]


def test_the_dra_plugin_is_scraped_and_alerted_on_and_nodes_all_leaves_no_device_plugin_target(
        renderer: Renderer) -> None:
    mon = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    d = renderer.render({**mon, "dra": {"enabled": True}}, kube_version=KUBE)
    svc = find(d, "Service", "dra-plugin")
    ds = _ds(d, "dra-plugin")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    port = svc["spec"]["ports"][0]
    assert port["name"] == "http-metrics" and port["targetPort"] == "metrics"
    assert any(p["name"] == "metrics" for c in containers(ds).values() for p in c.get("ports", []))
    sm = find(d, "ServiceMonitor", "dra-plugin")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "http-metrics"
    rules = {r["alert"]: r for g in find(d, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert rules["KubeVgpuDRAPluginDown"]["expr"] == f'up{{job="{svc["metadata"]["name"]}"}} == 0'
    assert find(d, "Service", "device-plugin") and find(d, "ServiceMonitor", "device-plugin")  # labelled: both
    every = renderer.render({**mon, "dra": {"enabled": True, "nodes": "all"}}, kube_version=KUBE)
    names = {(o["kind"], o["metadata"]["name"]) for o in every}
    assert ("Service", f"{FULL}-device-plugin") not in names and ("ServiceMonitor", f"{FULL}-device-plugin") not in names
    assert ("ServiceMonitor", f"{FULL}-dra-plugin") in names
    off = renderer.render(mon)
    assert "KubeVgpuDRAPluginDown" not in {r["alert"] for g in find(off, "PrometheusRule")["spec"]["groups"]
                                           for r in g["rules"]}
