"""The extender ranking the nodes of DRA claim pods (dra.extenderScoring) on a real control plane.

etcd, kube-apiserver and kube-scheduler v1.36 with the DRA feature gates (no kubelet, no
kube-controller-manager: claims are named by the pods, not made from templates). kube-scheduler runs
the chart's KubeSchedulerConfiguration extenders (rendered with helm, ``dra.extenderScoring=true``)
against ``kube-vgpu scheduler --dra-scoring=true``. Two fake nodes of 2 GPUs x 24576 MiB publish their
ResourceSlices through :class:`deviceplugin.dra_publish.SlicePublisher`; a filler pod pinned to
``dra-a`` gets a claim of 10000 MiB / 40 cores allocated there by kube-scheduler itself (and 32 of
its 64 CPUs). Then pods with a claim of 3000 MiB / 30 cores each, free to go anywhere:

* a second kube-scheduler without extenders places one on ``dra-b`` (its LeastAllocated and
  BalancedAllocation scores prefer the node with free CPUs);
* with the extender on binpack, the next lands on ``dra-a``, the node with more GPU capacity in
  use (0.41 against 0.22 of HAMi's usage score), against kube-scheduler's own preference;
* with the extender on spread, the next lands on ``dra-b``.

And with ``dra.extenderScoring`` off the chart renders no second extender entry.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from deviceplugin.dra_publish import SlicePublisher
from kube_vgpu.dra import DEVICE_CLASS, DRIVER_NAME
from kube_vgpu.model import GPUDevice

from .cluster import (
    DRA_FEATURE_GATES,
    ROOT,
    SCHEDULER_NAME,
    Components,
    ControlPlane,
    Proc,
    _https_ok,
    create_gpu_nodes,
    create_namespace,
    free_port,
    helm_binary,
    wait_for,
    write_policy,
)

pytestmark = pytest.mark.e2e

NODES = ["dra-a", "dra-b"]
NS = "dra-score"
G, V = "resource.k8s.io", "v1"
CHART = ROOT / "charts" / "kube-vgpu"
#: the profile of the kube-scheduler without extenders
PLAIN = "plain-dra"


def _chart_extenders(scoring: bool) -> list[dict[str, Any]]:
    """The extenders of the chart's KubeSchedulerConfiguration (helm template)."""
    out = subprocess.run([helm_binary(), "template", "kv", str(CHART), "--namespace", "kube-vgpu",
                          "--kube-version", "1.36.0", "--set", "dra.enabled=true",
                          "--set", f"dra.extenderScoring={'true' if scoring else 'false'}"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for d in yaml.safe_load_all(out):
        if d and d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-kube-scheduler"):
            return list(yaml.safe_load(d["data"]["config.yaml"])["extenders"])
    raise AssertionError("no kube-scheduler ConfigMap rendered")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kubernetes import client, config

    work = tmp_path_factory.mktemp("e2e-dra-scoring")
    cp = ControlPlane(work, controller_manager=False)
    comps = Components(cp, work)
    publishers: list[SlicePublisher] = []
    try:
        cp.start()
        assert cp.kubeconfig is not None
        api = config.new_client_from_config(str(cp.kubeconfig))
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        create_gpu_nodes(core, NODES, gpus=2, memory_mib=24576, split=10, uuid=lambda n, i: f"GPU-{n}-{i}")
        create_namespace(core, NS)
        custom.create_cluster_custom_object(G, V, "deviceclasses", {
            "apiVersion": f"{G}/{V}", "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER_NAME}'"}}]}})
        for n in NODES:
            pub = SlicePublisher(api, n)
            pub.publish([GPUDevice(uuid=f"GPU-{n}-{i}", index=i, model="NVIDIA H200", memory_mib=24576)
                         for i in range(2)])
            publishers.append(pub)
        write_policy(comps.policy, "binpack")
        comps.start_extender("--dra-scoring=true")
        # kube-scheduler with the chart's extender entries, pointed at this extender
        extenders = _chart_extenders(scoring=True)
        for e in extenders:
            e["urlPrefix"] = f"http://127.0.0.1:{comps.extender_port}"
        cfg = work / "kube-scheduler.yaml"
        cfg.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(cp.kubeconfig)}, "leaderElection": {"leaderElect": False},
            "percentageOfNodesToScore": 100, "profiles": [{"schedulerName": SCHEDULER_NAME}],
            "extenders": extenders}))
        # and a second kube-scheduler without extenders (profile PLAIN): what kube-scheduler alone picks
        plain = work / "kube-scheduler-plain.yaml"
        plain.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(cp.kubeconfig)}, "leaderElection": {"leaderElect": False},
            "percentageOfNodesToScore": 100, "profiles": [{"schedulerName": PLAIN}]}))
        binary = cp.binary("kube-scheduler")
        assert binary is not None
        for name, path in (("kube-scheduler", cfg), ("kube-scheduler-plain", plain)):
            port = free_port()
            comps.procs[name] = ks = Proc(name, [
                binary, f"--config={path}", "--bind-address=127.0.0.1", f"--secure-port={port}",
                f"--feature-gates={DRA_FEATURE_GATES}"], work)
            wait_for(lambda ks=ks, port=port: ks.check() or _https_ok(f"https://127.0.0.1:{port}/readyz"), 60,
                     f"{name} /readyz")
        yield {"core": core, "custom": custom, "comps": comps, "extenders": extenders}
    except BaseException:
        print(comps.logs(), cp.logs())
        raise
    finally:
        comps.stop()
        cp.stop()


def _claim(custom: Any, name: str, mib: int, cores: int) -> None:
    custom.create_namespaced_custom_object(G, V, NS, "resourceclaims", {
        "apiVersion": f"{G}/{V}", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DEVICE_CLASS, "capacity": {"requests": {"memory": f"{mib}Mi", "cores": str(cores)}}}}]}}})


def _pod(core: Any, name: str, claim: str, node: str | None = None, scheduler: str = SCHEDULER_NAME,
         cpu: str = "") -> None:
    res: dict[str, Any] = {"claims": [{"name": "gpu"}]}
    if cpu:
        res["requests"] = {"cpu": cpu}
    spec: dict[str, Any] = {
        "schedulerName": scheduler, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [{"name": "c", "image": "busybox", "resources": res}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": spec})


def _placed(env: dict[str, Any], pod: str) -> str:
    core, comps = env["core"], env["comps"]
    return str(wait_for(lambda: core.read_namespaced_pod(pod, NS).spec.node_name, 60 * 3,
                        f"{pod} bound\n{comps.logs()}"))


def _node_of_claim(env: dict[str, Any], claim: str) -> str:
    c = env["custom"].get_namespaced_custom_object(G, V, NS, "resourceclaims", claim)
    return str(c["status"]["allocation"]["devices"]["results"][0]["pool"])


def _restart_extender(comps: Components) -> None:
    """Start the extender again with DRA scoring (and the current policy file): its /readyz answers
    once slices and claims are listed, so every allocation made so far is in its view."""
    comps.procs.pop("extender").stop(signal.SIGKILL)
    comps.start_extender("--dra-scoring=true")


def test_chart_renders_a_second_entry_only_when_on(env: dict[str, Any]) -> None:
    on, off = env["extenders"], _chart_extenders(scoring=False)
    assert [e.get("prioritizeVerb") for e in on] == ["prioritize", "dra-prioritize"]
    assert len(off) == 1 and off[0]["prioritizeVerb"] == "prioritize"


def test_binpack_sends_the_claim_pod_to_the_used_node_spread_to_the_empty_one(env: dict[str, Any]) -> None:
    core, custom, comps = env["core"], env["custom"], env["comps"]
    # the filler holds GPU capacity on dra-a and half its CPUs: kube-scheduler's own scores
    # (LeastAllocated, BalancedAllocation) prefer dra-b from now on
    _claim(custom, "filler", 10000, 40)
    _pod(core, "filler", "filler", node="dra-a", cpu="32")
    assert _placed(env, "filler") == "dra-a" and _node_of_claim(env, "filler") == "dra-a"
    _claim(custom, "control", 3000, 30)
    _pod(core, "control", "control", scheduler=PLAIN)
    assert _placed(env, "control") == "dra-b"  # kube-scheduler alone: the emptier node
    # the extender must have seen the filler's allocation before the next pod is scored
    _restart_extender(comps)
    _claim(custom, "binpacked", 3000, 30)
    _pod(core, "binpacked", "binpacked")
    assert _placed(env, "binpacked") == "dra-a"
    assert _node_of_claim(env, "binpacked") == "dra-a"

    write_policy(comps.policy, "spread")
    _restart_extender(comps)
    _claim(custom, "spread", 3000, 30)
    _pod(core, "spread", "spread")
    assert _placed(env, "spread") == "dra-b"
    assert _node_of_claim(env, "spread") == "dra-b"
