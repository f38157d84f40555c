"""The DRA path on a real control plane: kube-scheduler allocates GPU slices from our ResourceSlices.

A control plane of its own (etcd, kube-apiserver, kube-controller-manager for the resourceclaim
controller and the garbage collector, kube-scheduler with only the default profile: no extender),
with the DRA feature gates of ``cluster.DRA_FEATURE_GATES``. Four fake nodes x 4 GPUs of 24576 MiB:
``dra-node-0`` runs the real node component (``kube-vgpu dra-plugin`` on simulated GPUs, registered
with the fake DRA kubelet of tests/fakes/dra_kubelet.py), the other three are published in-process by
:class:`deviceplugin.dra_publish.SlicePublisher`. The DeviceClass is the chart's (rendered with helm).

Scenarios: slices as the API server stores them; 100 pods with claims of mixed sizes (from
ResourceClaimTemplates) all allocated with no GPU over its memory or cores, each claim consuming
exactly what it asked; whole-GPU claims (no capacity named) fill exactly the GPUs left free and the
rest wait until the mixed pods are deleted; NodePrepareResources on dra-node-0 gives the container its
limits; the extended-resource mapping of ``nvidia.com/gpu`` serves whole GPUs, also with
``kube-vgpu webhook`` on the chart's policy for ``dra.nodes=all``; the Node's deletion takes its
slices with it; and the admission policy and RBAC against a tenant and a node component writing
another node's slices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.dra_publish import SlicePublisher
from kube_vgpu.dra import CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME, TAINT_UNHEALTHY
from kube_vgpu.model import GPUDevice
from kube_vgpu.quantity import parse_quantity

from .cluster import (
    DRA_FEATURE_GATES,
    ROOT,
    ControlPlane,
    Proc,
    _https_ok,
    free_port,
    helm_binary,
    kube_vgpu,
    wait_for,
    write_kubeconfig,
)

pytestmark = pytest.mark.e2e

NODES = [f"dra-node-{i}" for i in range(4)]
PLUGIN_NODE = NODES[0]
GPUS, GPU_MIB = 4, 24576
NS, TENANT_NS = "dra-e2e", "team-a"
RELEASE, CHART_NS = "kv", "kube-vgpu"
FULL = f"{RELEASE}-kube-vgpu"
G, V = "resource.k8s.io", "v1"
#: the mixed sizes: (MiB, percent); pod i asks SIZES[i % len(SIZES)]
SIZES = [(1000, 5), (2000, 10), (3000, 15), (4000, 20), (2500, 10), (1500, 15), (3500, 5), (3000, 30)]


def _scheduler(cp: ControlPlane, work: Path) -> Proc:
    binary = cp.binary("kube-scheduler")
    if binary is None:
        raise FileNotFoundError("kube-scheduler not in KUBE_BIN_DIR")
    cfg = work / "kube-scheduler-dra.yaml"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cp.kubeconfig)}, "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": "default-scheduler"}]}))
    port = free_port()
    p = Proc("kube-scheduler-dra", [binary, f"--config={cfg}", "--bind-address=127.0.0.1", f"--secure-port={port}",
                                    f"--feature-gates={DRA_FEATURE_GATES}"], work)
    wait_for(lambda: p.check() or _https_ok(f"https://127.0.0.1:{port}/readyz"), 60, "kube-scheduler /readyz")
    return p


def _chart(version: str, kinds: tuple[str, ...], *sets: str) -> list[dict[str, Any]]:
    r = subprocess.run([helm_binary(), "template", RELEASE, str(ROOT / "charts" / "kube-vgpu"), "--namespace", CHART_NS,
                        "--kube-version", version, "--set", "dra.enabled=true", *(a for x in sets for a in ("--set", x))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] in kinds]


def _plugin_root(work: Path) -> dict[str, str]:
    """Directories of the node component on dra-node-0 (short: unix socket paths are limited)."""
    import tempfile

    root = tempfile.mkdtemp(prefix="drae2e", dir="/tmp")
    d = {k: f"{root}/{k}" for k in ("plugin", "reg", "cdi", "shim", "cache", "dev")}
    for p in d.values():
        os.makedirs(p)
    Path(d["shim"], "libvgpu.so").write_bytes(b"\x7fELF")
    for n in [f"nvidia{i}" for i in range(GPUS)] + ["nvidiactl", "nvidia-uvm"]:
        Path(d["dev"], n).write_text("")
    d["root"] = root
    return d


@pytest.fixture(scope="module")
def dra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import shutil

    from kubernetes import client, config

    sys.path.insert(0, str(ROOT))
    from tests.fakes.dra_kubelet import FakeDRAKubelet

    work = tmp_path_factory.mktemp("e2e-dra")
    cp = ControlPlane(work)
    procs: list[Proc] = []
    kubelet = None
    dirs = _plugin_root(work)
    try:
        try:
            cp.start()
        except FileNotFoundError as e:
            pytest.skip(f"e2e: {e}")
        if cp.bin_dir is None:
            pytest.skip("the DRA scenario installs cluster-wide objects: only on its own KUBE_BIN_DIR control plane")
        if not cp.has_controller_manager:
            pytest.skip("the DRA scenario needs kube-controller-manager (resourceclaim controller, garbage collector)")
        assert cp.kubeconfig is not None
        admin = config.new_client_from_config(config_file=str(cp.kubeconfig))
        version = client.VersionApi(admin).get_code()
        if (int(version.major), int(version.minor.rstrip("+"))) < (1, 36):
            pytest.skip(f"kube-apiserver {version.git_version}: consumable capacity is beta (on) from 1.36")
        core, co = client.CoreV1Api(admin), client.CustomObjectsApi(admin)
        procs.append(_scheduler(cp, work))
        alloc = {"cpu": "64", "memory": "512Gi", "pods": "250"}
        for name in NODES:
            core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                              "status": {"capacity": alloc, "allocatable": alloc, "conditions": [
                                  {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake"}]}})
        for name in NODES:
            wait_for(lambda name=name: core.patch_node(name, {"spec": {"taints": []}}) and
                     not core.read_node(name).spec.taints, 20, f"{name} without taints")
        for ns in (NS, TENANT_NS, CHART_NS):
            core.create_namespace({"metadata": {"name": ns}})
            wait_for(lambda ns=ns: core.read_namespaced_service_account("default", ns), 60, f"{ns}/default SA")
        ver = version.git_version.lstrip("v").split("-")[0]
        for dc in _chart(ver, ("DeviceClass",)):
            co.create_cluster_custom_object(G, V, "deviceclasses", dc)
        # dra-node-0: the real node component on simulated GPUs, and the fake kubelet it registers with
        kubelet = FakeDRAKubelet(dirs["reg"])
        kubelet.start()
        procs.append(Proc("dra-plugin", kube_vgpu(
            "dra-plugin", "--node-name", PLUGIN_NODE, "--kubeconfig", str(cp.kubeconfig),
            "--simulate-gpus", f"{GPUS}x{GPU_MIB}", "--plugin-dir", dirs["plugin"], "--registry-dir", dirs["reg"],
            "--cdi-dir", dirs["cdi"], "--shim-host-path", f"{dirs['shim']}/libvgpu.so",
            "--cache-host-dir", dirs["cache"], "--dev-root", dirs["dev"], "--log-level", "info"), work,
            env={**os.environ, "PYTHONPATH": str(ROOT)}))
        kubelet.wait_registered(DRIVER_NAME, timeout=120)
        # the other nodes: published in-process by the same SlicePublisher the plugin uses
        pubs = {}
        for n, name in enumerate(NODES[1:], start=1):
            pubs[name] = SlicePublisher(admin, name, driver_version="550.54.15")
            pubs[name].publish([GPUDevice(uuid=f"GPU-{n:04d}-{i:04d}", index=i, model="NVIDIA H200",
                                          memory_mib=GPU_MIB) for i in range(GPUS)])
        wait_for(lambda: len(_slices(co)) == len(NODES), 60, "a ResourceSlice per node")
        yield {"cp": cp, "admin": admin, "core": core, "co": co, "pubs": pubs, "kubelet": kubelet, "dirs": dirs,
               "work": work, "version": ver}
    finally:
        if kubelet is not None:
            kubelet.stop()
        for p in reversed(procs):
            p.stop()
        cp.stop()
        shutil.rmtree(dirs["root"], ignore_errors=True)


def _slices(co: Any) -> list[dict[str, Any]]:
    items = co.list_cluster_custom_object(G, V, "resourceslices")["items"]
    return [s for s in items if s["spec"]["driver"] == DRIVER_NAME]


def _claim_template(name: str, mib: int | None, cores: int | None) -> dict[str, Any]:
    req: dict[str, Any] = {"deviceClassName": DRIVER_NAME}
    caps = {k: v for k, v in ((CAPACITY_MEMORY, f"{mib}Mi" if mib else None),
                              (CAPACITY_CORES, str(cores) if cores else None)) if v}
    if caps:
        req["capacity"] = {"requests": caps}
    return {"apiVersion": f"{G}/{V}", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": req}]}}}}


def _pod(name: str, template: str, batch: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
        "terminationGracePeriodSeconds": 0}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"batch": batch}}, "spec": spec}


def _ensure_template(co: Any, name: str, mib: int | None, cores: int | None) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        co.create_namespaced_custom_object(G, V, NS, "resourceclaimtemplates", _claim_template(name, mib, cores))
    except ApiException as e:
        if e.status != 409:
            raise


def _bound(core: Any, batch: str) -> dict[str, str]:
    return {p.metadata.name: p.spec.node_name for p in core.list_namespaced_pod(NS, label_selector=f"batch={batch}").items
            if p.spec.node_name}


def _usage(co: Any) -> tuple[dict[tuple[str, str], dict[str, Any]], list[dict[str, Any]]]:
    """Consumed capacity per (pool, device) summed over every allocated claim, and the claims."""
    claims = co.list_namespaced_custom_object(G, V, NS, "resourceclaims")["items"]
    use: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"memory": 0, "cores": 0, "claims": 0})
    for c in claims:
        for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or ():
            assert r["driver"] == DRIVER_NAME
            u = use[(r["pool"], r["device"])]
            cc = r.get("consumedCapacity") or {}
            u["memory"] += parse_quantity(cc.get(CAPACITY_MEMORY, "0"))
            u["cores"] += parse_quantity(cc.get(CAPACITY_CORES, "0"))
            u["claims"] += 1
    return use, claims


def _assert_within_capacity(co: Any) -> dict[tuple[str, str], dict[str, Any]]:
    caps = {}
    for s in _slices(co):
        for d in s["spec"]["devices"]:
            caps[(s["spec"]["pool"]["name"], d["name"])] = (parse_quantity(d["capacity"][CAPACITY_MEMORY]["value"]),
                                                            parse_quantity(d["capacity"][CAPACITY_CORES]["value"]))
    use, _ = _usage(co)
    for key, u in use.items():
        assert key in caps, f"a claim was allocated {key}, which no slice publishes"
        mem, cores = caps[key]
        assert u["memory"] <= mem, f"{key}: {float(u['memory'] / 2**20)} MiB allocated of {float(mem / 2**20)}"
        assert u["cores"] <= cores, f"{key}: {u['cores']} cores allocated of {cores}"
    return use


def _delete_batch(core: Any, co: Any, batch: str) -> None:
    core.delete_collection_namespaced_pod(NS, label_selector=f"batch={batch}", grace_period_seconds=0)
    wait_for(lambda: not core.list_namespaced_pod(NS, label_selector=f"batch={batch}").items, 120, f"{batch} pods gone")


# ---------------------------------------------------------------- scenarios

def test_slices_as_stored(dra: dict[str, Any]) -> None:
    """The API server keeps every field we publish (DRAConsumableCapacity and DRADeviceTaints on)."""
    co = dra["co"]
    slices = {s["spec"]["nodeName"]: s for s in _slices(co)}
    assert sorted(slices) == NODES
    for node, s in slices.items():
        assert s["spec"]["pool"]["name"] == node and s["spec"]["pool"]["resourceSliceCount"] == 1
        assert [d["name"] for d in s["spec"]["devices"]] == [f"gpu-{i}" for i in range(GPUS)]
        for d in s["spec"]["devices"]:
            assert d["allowMultipleAllocations"] is True
            assert d["capacity"][CAPACITY_MEMORY]["requestPolicy"]["validRange"]["step"] == "1Mi"
            assert parse_quantity(d["capacity"][CAPACITY_MEMORY]["value"]) == GPU_MIB * 2**20
        assert s["metadata"]["ownerReferences"][0]["kind"] == "Node"
    for pub in dra["pubs"].values():
        assert pub.consumable_capacity is True
    # an unhealthy GPU is tainted and the server keeps the taint
    pub = dra["pubs"][NODES[3]]
    devs = [GPUDevice(uuid=f"GPU-0003-{i:04d}", index=i, model="NVIDIA H200", memory_mib=GPU_MIB, healthy=i != 2)
            for i in range(GPUS)]
    gen = pub.publish(devs)
    s = next(x for x in _slices(co) if x["spec"]["nodeName"] == NODES[3])
    assert s["spec"]["pool"]["generation"] == gen
    assert [t["key"] for t in s["spec"]["devices"][2]["taints"]] == [TAINT_UNHEALTHY] and pub.device_taints is True
    pub.publish([GPUDevice(uuid=f"GPU-0003-{i:04d}", index=i, model="NVIDIA H200", memory_mib=GPU_MIB)
                 for i in range(GPUS)])
    s = next(x for x in _slices(co) if x["spec"]["nodeName"] == NODES[3])
    assert "taints" not in s["spec"]["devices"][2]
    print(f"E2E dra slices: {len(slices)} nodes x {GPUS} GPUs published, generation {gen + 1} after a health flip")


def test_100_mixed_claims_within_capacity_then_freed(dra: dict[str, Any]) -> None:
    core, co = dra["core"], dra["co"]
    for mib, cores in SIZES:
        _ensure_template(co, f"t-{mib}-{cores}", mib, cores)
    _ensure_template(co, "whole", None, None)
    t0 = time.monotonic()
    for i in range(100):
        mib, cores = SIZES[i % len(SIZES)]
        core.create_namespaced_pod(NS, _pod(f"mixed-{i:03d}", f"t-{mib}-{cores}", "mixed"))
    wait_for(lambda: len(_bound(core, "mixed")) == 100, 600, "100 DRA pods bound", every=0.5)
    dt = time.monotonic() - t0
    use = _assert_within_capacity(co)
    _, claims = _usage(co)
    by_pod = {}
    for c in claims:
        owner = (c["metadata"].get("ownerReferences") or [{}])[0].get("name", "")
        if not owner.startswith("mixed-"):
            continue
        i = int(owner.split("-")[1])
        mib, cores = SIZES[i % len(SIZES)]
        [r] = c["status"]["allocation"]["devices"]["results"]
        cc = r["consumedCapacity"]
        assert parse_quantity(cc[CAPACITY_MEMORY]) == mib * 2**20 and parse_quantity(cc[CAPACITY_CORES]) == cores, cc
        by_pod[owner] = r["pool"]
        assert r.get("shareID"), "a shared device's allocation carries a shareID"
    bound = _bound(core, "mixed")
    assert by_pod == bound, "every pod runs on the node of its claim's pool"
    total_mem = float(sum(u["memory"] for u in use.values()) / 2**20)
    total_cores = int(sum(u["cores"] for u in use.values()))
    print(f"E2E dra mixed: 100 claims allocated in {dt:.1f}s ({100 / dt:.1f} pods/s) on {len(use)} GPUs, "
          f"{total_mem:.0f} MiB and {total_cores} cores; max per GPU "
          f"{float(max(u['memory'] for u in use.values()) / 2**20):.0f}/{GPU_MIB} MiB, "
          f"{int(max(u['cores'] for u in use.values()))}/100 cores")

    # whole GPUs (a claim naming no capacity takes all of both): exactly the free GPUs fit now
    free = GPUS * len(NODES) - len(use)
    for i in range(GPUS * len(NODES)):
        core.create_namespaced_pod(NS, _pod(f"whole-{i:02d}", "whole", "whole"))

    def settled(n: int) -> bool:
        pods = core.list_namespaced_pod(NS, label_selector="batch=whole").items
        waiting = [p for p in pods if not p.spec.node_name and any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in p.status.conditions or ())]
        return len(_bound(core, "whole")) == n and len(waiting) == len(pods) - n
    wait_for(lambda: settled(free), 300, f"{free} whole-GPU pods bound, the rest unschedulable", every=0.5)
    _assert_within_capacity(co)

    # deleting the mixed pods of one node frees its GPUs: exactly that many more whole-GPU pods fit
    t1 = time.monotonic()
    last = [p for p, n in bound.items() if n == NODES[-1]]
    for p in last:
        core.delete_namespaced_pod(p, NS, grace_period_seconds=0)
    emptied = sum(1 for pool, _ in use if pool == NODES[-1])  # GPUs there that held mixed claims
    wait_for(lambda: settled(free + emptied), 300, f"{free + emptied} whole-GPU pods bound after freeing {NODES[-1]}",
             every=0.5)
    use = _assert_within_capacity(co)
    assert {pool for (pool, _), u in use.items() if u["claims"] == 1 and u["cores"] == 100} >= {NODES[-1]}
    # and deleting the rest: every whole-GPU pod fits
    _delete_batch(core, co, "mixed")
    wait_for(lambda: len(_bound(core, "whole")) == GPUS * len(NODES), 600, "every whole-GPU pod bound", every=0.5)
    use = _assert_within_capacity(co)
    assert len(use) == GPUS * len(NODES) and all(u["claims"] == 1 and u["cores"] == 100 for u in use.values())
    print(f"E2E dra freed: {free} GPUs free with the 100 mixed pods; deleting the {len(last)} on {NODES[-1]} let "
          f"exactly {emptied} whole-GPU pods in, deleting all let all {GPUS * len(NODES)} in "
          f"({time.monotonic() - t1:.1f}s)")
    _delete_batch(core, co, "whole")
    wait_for(lambda: not _usage(co)[0], 120, "every claim released")


def test_prepare_on_the_plugin_node(dra: dict[str, Any]) -> None:
    """examples/dra/gpu-slice.yaml, placed on dra-node-0: kubelet's NodePrepareResources gives the
    container its limits and CDI devices."""
    core, co, kubelet = dra["core"], dra["co"], dra["kubelet"]
    template, pod_obj = yaml.safe_load_all((ROOT / "examples" / "dra" / "gpu-slice.yaml").read_text())
    co.create_namespaced_custom_object(G, V, NS, "resourceclaimtemplates", template)
    pod_obj["metadata"]["labels"] = {"batch": "prep"}
    pod_obj["spec"]["nodeSelector"] = {"kubernetes.io/hostname": PLUGIN_NODE}  # the node with the real plugin
    name = pod_obj["metadata"]["name"]
    core.create_namespaced_pod(NS, pod_obj)
    wait_for(lambda: _bound(core, "prep").get(name) == PLUGIN_NODE, 120, f"{name} bound to the plugin node")
    pod = core.read_namespaced_pod(name, NS)
    [st] = pod.status.resource_claim_statuses
    claim = co.get_namespaced_custom_object(G, V, NS, "resourceclaims", st.resource_claim_name)
    uid = claim["metadata"]["uid"]
    [r] = claim["status"]["allocation"]["devices"]["results"]
    assert r["pool"] == PLUGIN_NODE
    resp = kubelet.prepare(DRIVER_NAME, [(NS, uid, claim["metadata"]["name"])]).claims[uid]
    assert resp.error == "", resp.error
    assert [d.device_name for d in resp.devices] == [r["device"]]
    assert list(resp.devices[0].cdi_device_ids)
    limits = Path(dra["dirs"]["cache"]) / f"dra-{uid}.limits" / "vgpu.limits"
    kv = dict(line.split("=", 1) for line in limits.read_text().splitlines() if line and not line.startswith("#"))
    assert (kv["memory_mib_0"], kv["cores_0"]) == ("3000", "30")
    cdi = list(Path(dra["dirs"]["cdi"]).glob(f"*{uid}*.json"))
    assert cdi, "a CDI spec for the claim"
    kubelet.unprepare(DRIVER_NAME, [(NS, uid, claim["metadata"]["name"])])
    assert not limits.exists() and not list(Path(dra["dirs"]["cdi"]).glob(f"*{uid}*.json"))
    print(f"E2E dra prepare: examples/dra/gpu-slice.yaml's claim on {r['pool']}/{r['device']} prepared (memory_mib_0=3000, cores_0=30, "
          f"CDI {resp.devices[0].cdi_device_ids[0]}) and unprepared")
    _delete_batch(core, co, "prep")


def test_extended_resource_mapping_gives_whole_gpus(dra: dict[str, Any]) -> None:
    """dra.deviceClass.extendedResourceName=nvidia.com/gpu: pods asking for nvidia.com/gpu: 1 on nodes
    without a device plugin advertising it get a claim on the class, i.e. a whole GPU each."""
    core, co = dra["core"], dra["co"]
    [dc] = _chart(dra["version"], ("DeviceClass",), "dra.nodes=all", "dra.deviceClass.extendedResourceName=nvidia.com/gpu")
    assert dc["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    old = co.get_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME)
    dc["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
    co.replace_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME, dc)
    total = GPUS * len(NODES)
    try:
        for i in range(total + 1):
            core.create_namespaced_pod(NS, {"metadata": {"name": f"ext-{i:02d}", "labels": {"batch": "ext"}}, "spec": {
                "terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": "busybox", "resources": {
                    "limits": {"nvidia.com/gpu": "1"}}}]}})

        def settled() -> bool:
            pods = core.list_namespaced_pod(NS, label_selector="batch=ext").items
            waiting = [p for p in pods if not p.spec.node_name and any(
                c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or ())]
            return len(_bound(core, "ext")) == total and len(waiting) == 1
        wait_for(settled, 300, f"{total} nvidia.com/gpu pods bound through DRA, one left over", every=0.5)
        use = _assert_within_capacity(co)
        assert len(use) == total and all(u["claims"] == 1 and u["cores"] == 100 and u["memory"] == GPU_MIB * 2**20
                                         for u in use.values())
        print(f"E2E dra extended resource: {total} pods asking nvidia.com/gpu: 1 got one whole GPU each "
              f"through the class, the {total + 1}th waits")
    finally:
        _delete_batch(core, co, "ext")
        old = co.get_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME)
        old["spec"].pop("extendedResourceName", None)
        co.replace_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME, old)
    wait_for(lambda: not _usage(co)[0], 120, "every claim released")


def test_extended_resource_mapping_with_the_webhook_on(dra: dict[str, Any]) -> None:
    """The same mapping with ``kube-vgpu webhook`` running on the policy the chart renders for
    ``dra.nodes=all`` + ``extendedResourceName: nvidia.com/gpu``: a pod asking only ``nvidia.com/gpu``
    is left to the default scheduler and gets a whole GPU through the class (routed to
    kube-vgpu-scheduler, whose extender never places on a DRA node, it would wait forever); a pod
    asking gpumem is still routed to kube-vgpu-scheduler; a forged system annotation is removed and
    an isolation violation refused, by the real API server calling the webhook."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from .cluster import SCHEDULER_NAME, Components

    core, co, cp = dra["core"], dra["co"], dra["cp"]
    sets = ("dra.nodes=all", "dra.deviceClass.extendedResourceName=nvidia.com/gpu")
    [dc] = _chart(dra["version"], ("DeviceClass",), *sets)
    [cm] = [d for d in _chart(dra["version"], ("ConfigMap",), *sets) if d["metadata"]["name"] == f"{FULL}-config"]
    comps = Components(cp, dra["work"] / "webhook-mapping")
    comps.policy.write_text(cm["data"]["config.yaml"])
    comps.start_webhook()
    admreg = client.AdmissionregistrationV1Api(dra["admin"])
    mwc = comps.webhook_configuration(NS)
    old = co.get_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME)
    dc["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
    co.replace_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME, dc)
    n = 3

    def pod(name: str, limits: dict[str, str], **meta: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {"batch": "extwh"}, **meta}, "spec": {
            "terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": "busybox", "resources": {
                "limits": limits}}]}}

    try:
        admreg.create_mutating_webhook_configuration(mwc)

        tries = iter(range(10_000))

        def webhook_answers() -> bool:
            """A pod with a forged system annotation: kept only until the API server calls the webhook
            (the configuration reaches it asynchronously), then created without the annotation."""
            name = f"extwh-probe-{next(tries)}"
            core.create_namespaced_pod(NS, pod(name, {"nvidia.com/gpu": "1"},
                                               annotations={"kube-vgpu.io/allocation": "forged"}))
            if "kube-vgpu.io/allocation" in (core.read_namespaced_pod(name, NS).metadata.annotations or {}):
                core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
                return False
            return True
        wait_for(webhook_answers, 60, "the API server calls the webhook (forged annotation removed)")
        for i in range(n - 1):
            core.create_namespaced_pod(NS, pod(f"extwh-{i}", {"nvidia.com/gpu": "1"}))
        created = core.list_namespaced_pod(NS, label_selector="batch=extwh").items
        assert len(created) == n
        for p in created:
            assert p.spec.scheduler_name == "default-scheduler", p.metadata.name
            assert p.spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}, p.metadata.name
        wait_for(lambda: len(_bound(core, "extwh")) == n, 300, f"{n} nvidia.com/gpu pods bound through DRA")
        use = _assert_within_capacity(co)
        assert len(use) == n and all(u["claims"] == 1 and u["cores"] == 100 for u in use.values())
        core.create_namespaced_pod(NS, pod("extwh-vgpu", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}))
        assert core.read_namespaced_pod("extwh-vgpu", NS).spec.scheduler_name == SCHEDULER_NAME
        bad = pod("extwh-bad", {"nvidia.com/gpu": "1"})
        bad["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]
        with pytest.raises(ApiException) as e:
            core.create_namespaced_pod(NS, bad)
        assert e.value.status == 403 and "env LD_PRELOAD" in str(e.value.body), e.value.body
        print(f"E2E dra extended resource with the webhook: {n} pods asking nvidia.com/gpu: 1 left to "
              f"default-scheduler got a whole GPU each; a gpumem pod routed to {SCHEDULER_NAME}; LD_PRELOAD refused")
    finally:
        try:
            admreg.delete_mutating_webhook_configuration(mwc["metadata"]["name"])
        except ApiException:
            pass
        _delete_batch(core, co, "extwh")
        comps.stop()
        old = co.get_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME)
        old["spec"].pop("extendedResourceName", None)
        co.replace_cluster_custom_object(G, V, "deviceclasses", DRIVER_NAME, old)
    wait_for(lambda: not _usage(co)[0], 120, "every claim released")


def test_node_deletion_takes_its_slices(dra: dict[str, Any]) -> None:
    core, co, admin = dra["core"], dra["co"], dra["admin"]
    core.create_node({"metadata": {"name": "dra-gone"}})
    SlicePublisher(admin, "dra-gone").publish([GPUDevice(uuid="GPU-gone", index=0, model="m", memory_mib=1024)])
    assert any(s["spec"]["nodeName"] == "dra-gone" for s in _slices(co))
    core.delete_node("dra-gone")
    wait_for(lambda: not any(s["spec"]["nodeName"] == "dra-gone" for s in _slices(co)), 120,
             "the garbage collector deleting the gone node's ResourceSlice")


# ---------------------------------------------------------------- attacks (run last: the policy stays)

def _as(dra: dict[str, Any], token: str, name: str) -> Any:
    from kubernetes import config

    c = yaml.safe_load(Path(dra["cp"].kubeconfig).read_text())["clusters"][0]["cluster"]
    return config.new_client_from_config(config_file=str(write_kubeconfig(
        dra["work"] / f"kc-{name}", c["server"], token, c["certificate-authority-data"])))


def _token(core: Any, ns: str, sa: str, pod: Any = None) -> str:
    from kubernetes import client

    ref = client.V1BoundObjectReference(kind="Pod", api_version="v1", name=pod.metadata.name,
                                        uid=pod.metadata.uid) if pod is not None else None
    tr = core.create_namespaced_service_account_token(sa, ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600, bound_object_ref=ref)))
    return str(tr.status.token)


def _forbidden(fn: Any, *args: Any, status: int = 403, **kw: Any) -> str:
    """The body of the refusal a call must get (403, or the given status)."""
    from kubernetes.client.exceptions import ApiException

    try:
        fn(*args, **kw)
    except ApiException as e:
        assert e.status == status, f"expected {status}, got {e.status}: {e.body}"
        return str(e.body)
    raise AssertionError("the request was admitted")


def test_tenant_and_foreign_node_cannot_write_slices_or_claim_status(dra: dict[str, Any]) -> None:
    from kubernetes import client, utils

    admin, core, co = dra["admin"], dra["core"], dra["co"]
    docs = _chart(dra["version"], ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ServiceAccount",
                                   "ClusterRole", "ClusterRoleBinding"))
    wanted = [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy") and "dra-slices" in
              d["metadata"]["name"]]
    assert len(wanted) == 2
    wanted += [d for d in docs if d["metadata"]["name"] in (f"{FULL}-device-plugin", f"{FULL}-dra-plugin")
               and d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    for d in wanted:
        utils.create_from_dict(admin, d)
    probe = SlicePublisher(admin, NODES[1])

    def policy_live() -> bool:
        try:
            probe.publish([GPUDevice(uuid="GPU-probe", index=0, model="m", memory_mib=1024)])
        except client.ApiException as e:
            return e.status == 403
        try:  # admitted before the policy took effect: put it back
            probe.publish([GPUDevice(uuid=f"GPU-0001-{i:04d}", index=i, model="NVIDIA H200", memory_mib=GPU_MIB)
                           for i in range(GPUS)])
        except client.ApiException as e:
            # the policy took effect between the two writes (the probe's slice stays: the node
            # component publishes this node's real GPUs again below). Without this, the next probe
            # would find its own slice already in place, write nothing, and never see the policy.
            return e.status == 403
        return False
    wait_for(policy_live, 60, "the ResourceSlice policy in effect (even cluster-admin refused)", every=1.0)

    # a tenant with (worst case) cluster-wide rights on ResourceSlices and the edit role in its namespace
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_cluster_role({"metadata": {"name": "tenant-slices"}, "rules": [
        {"apiGroups": [G], "resources": ["resourceslices"], "verbs": ["get", "list", "create", "update", "delete"]},
        {"apiGroups": [G], "resources": ["resourceclaims/status"], "verbs": ["get", "update", "patch"]}]})
    core.create_namespaced_service_account(TENANT_NS, {"metadata": {"name": "app"}})
    subj = [{"kind": "ServiceAccount", "name": "app", "namespace": TENANT_NS}]
    rbac.create_cluster_role_binding({"metadata": {"name": "tenant-slices"}, "subjects": subj, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tenant-slices"}})
    rbac.create_namespaced_role_binding(TENANT_NS, {"metadata": {"name": "tenant-edit"}, "subjects": subj,
                                                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                                "kind": "ClusterRole", "name": "edit"}})
    tenant = client.CustomObjectsApi(_as(dra, _token(core, TENANT_NS, "app"), "tenant"))
    from kube_vgpu.dra.slices import resource_slice

    forged = resource_slice(NODES[2], [GPUDevice(uuid="GPU-forged", index=9, model="NVIDIA H200",
                                                 memory_mib=10 * GPU_MIB)], pool_generation=99)
    forged["metadata"]["name"] = "forged"
    msg = _forbidden(tenant.create_cluster_custom_object, G, V, "resourceslices", forged)
    assert "written only by the kube-vgpu node component" in msg
    real = next(s for s in _slices(co) if s["spec"]["nodeName"] == NODES[2])
    real["spec"]["devices"][0]["capacity"][CAPACITY_MEMORY]["value"] = f"{10 * GPU_MIB}Mi"
    _forbidden(tenant.replace_cluster_custom_object, G, V, "resourceslices", real["metadata"]["name"], real)
    # another driver's slice: RBAC lets it through, so the policy above is what protects ours
    other = dict(forged, metadata={"name": "other-driver"}, spec={**forged["spec"], "driver": "gpu.example.com"})
    tenant.create_cluster_custom_object(G, V, "resourceslices", other)
    co.delete_cluster_custom_object(G, V, "resourceslices", "other-driver")

    # the tenant writes an allocation into its own claim's status (it may update resourceclaims/status)
    _ensure_template(co, "t-1000-5", 1000, 5)
    claim = {"apiVersion": f"{G}/{V}", "kind": "ResourceClaim", "metadata": {"name": "mine"},
             "spec": _claim_template("x", 1000, 5)["spec"]["spec"]}
    tclaims = client.CustomObjectsApi(_as(dra, _token(core, TENANT_NS, "app"), "tenant2"))
    tclaims.create_namespaced_custom_object(G, V, TENANT_NS, "resourceclaims", claim)
    forged_status = {"status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": DRIVER_NAME, "pool": NODES[2], "device": "gpu-0",
        "consumedCapacity": {CAPACITY_MEMORY: f"{GPU_MIB}Mi", CAPACITY_CORES: "100"}}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODES[2]]}]}]}}}}
    # DRAResourceClaimGranularStatusAuthorization: status.allocation needs resourceclaims/binding (422 Forbidden field)
    msg = _forbidden(tclaims.patch_namespaced_custom_object_status, G, V, TENANT_NS, "resourceclaims", "mine",
                     forged_status, status=422)
    assert "status.allocation" in msg and "resourceclaims/binding" in msg, msg
    assert not (co.get_namespaced_custom_object(G, V, TENANT_NS, "resourceclaims", "mine").get("status") or {}).get(
        "allocation")

    # the node component of dra-node-1 (token bound to a pod there) may publish only dra-node-1
    dp_pod = core.create_namespaced_pod(CHART_NS, {"metadata": {"name": "dp-1"}, "spec": {
        "nodeName": NODES[1], "serviceAccountName": f"{FULL}-device-plugin",
        "containers": [{"name": "c", "image": "busybox"}]}})
    dp = _as(dra, _token(core, CHART_NS, f"{FULL}-device-plugin", dp_pod), "dp-1")
    own = SlicePublisher(dp, NODES[1])
    gen = own.publish([GPUDevice(uuid=f"GPU-0001-{i:04d}", index=i, model="NVIDIA H200", memory_mib=GPU_MIB,
                                 healthy=i != 0) for i in range(GPUS)])
    assert own.current()[0]["spec"]["pool"]["generation"] == gen
    msg = _forbidden(SlicePublisher(dp, NODES[2]).publish, [GPUDevice(uuid="GPU-x", index=0, model="m", memory_mib=1024)])
    assert f"node component of node {NODES[1]} may write only the ResourceSlices of its own node" in msg
    print("E2E dra attacks: tenant slice create/update refused (403), claim-status forgery refused (422, needs resourceclaims/binding); node component "
          f"publishes {NODES[1]} (generation {gen}) and is refused on {NODES[2]}")
