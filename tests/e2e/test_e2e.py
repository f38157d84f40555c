"""End-to-end scenarios on a real kube-apiserver + kube-scheduler with our webhook, extender and
device plugin (see README.md). Each prints a one-line summary."""

from __future__ import annotations

import random
import re
import subprocess
from collections import defaultdict
from typing import Any

import pytest

from .cluster import ROOT, SCHEDULER_NAME, helm_binary, wait_for, write_policy
from .conftest import DP_NODE, GPU_MEM, NODES, SPLIT

pytestmark = pytest.mark.e2e


def pod(name: str, mem: int, cores: int, *, node: str | None = None, labels: dict[str, str] | None = None,
        ) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox", "resources": {"limits": {
        "nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mem), "nvidia.com/gpucores": str(cores)}}}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def bound(core: Any, ns: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in core.list_namespaced_pod(ns).items if p.spec.node_name}


def unfittable(p: Any, use: dict[str, tuple[int, int, int]]) -> bool:
    """True when the one-GPU pod ``p`` fits on no GPU of the fake nodes given ``use`` (per GPU uuid:
    MiB, cores, slots booked), by the fit rules of docs/placement.md."""
    from kube_vgpu.quantity import parse_whole

    from .conftest import GPUS_PER_NODE, gpu_uuid

    lim = p.spec.containers[0].resources.limits  # as the API server normalises them: "8000" reads "8k"
    mem, cores = parse_whole(lim["nvidia.com/gpumem"]), parse_whole(lim.get("nvidia.com/gpucores", "0"))
    for n in range(len(NODES)):
        for i in range(GPUS_PER_NODE):
            m, c, k = use.get(gpu_uuid(n, i), (0, 0, 0))
            if cores == 0 and c >= 100:  # a GPU whose compute is fully booked takes no cores-0 request
                continue
            if cores == 100 and (m or c or k):  # an exclusive request needs an idle GPU
                continue
            if m + mem <= GPU_MEM and c + cores <= 100 and k + 1 <= SPLIT:
                return False
    return True


def settle_all_fitting(core: Any, ns: str, timeout: float = 240.0) -> dict[str, Any]:
    """Wait until every pod still pending fits nowhere (so every pod that fits got bound), then
    return the bound pods. A pod left pending that would fit is a lost placement, not a pass."""
    def done() -> dict[str, Any] | None:
        pods = core.list_namespaced_pod(ns).items
        placed = {p.metadata.name: p for p in pods if p.spec.node_name}
        use = check_no_overcommit(core, ns)
        waiting = [p for p in pods if not p.spec.node_name]
        return placed if all(unfittable(p, use) for p in waiting) else None
    return dict(wait_for(done, timeout, "every pending pod to be unfittable (all that fit bound)", every=1.0))


def check_no_overcommit(core: Any, ns: str) -> dict[str, tuple[int, int, int]]:
    """Sum every bound pod's allocation per GPU; none may exceed memory, cores or slots."""
    from kube_vgpu.codec import decode_allocation
    from kube_vgpu.resources import ANN_ALLOCATION

    use: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for p in bound(core, ns).values():
        ann = p.metadata.annotations or {}
        assert ANN_ALLOCATION in ann, f"{p.metadata.name} bound without {ANN_ALLOCATION}"
        alloc = decode_allocation(ann[ANN_ALLOCATION])
        assert alloc.node == p.spec.node_name, f"{p.metadata.name}: annotation node {alloc.node} != {p.spec.node_name}"
        node_idx = NODES.index(p.spec.node_name)
        for uuid, (mem, cores, slots) in alloc.usage().items():
            assert uuid.startswith(f"GPU-{node_idx:08d}-"), f"{p.metadata.name}: GPU {uuid} not on its node"
            u = use[uuid]
            u[0], u[1], u[2] = u[0] + mem, u[1] + cores, u[2] + slots
    for uuid, (mem, cores, slots) in use.items():
        assert mem <= GPU_MEM and cores <= 100 and slots <= SPLIT, f"{uuid} overcommitted: {mem} MiB {cores}% {slots}"
    return {k: (v[0], v[1], v[2]) for k, v in use.items()}


def test_pod_gets_memory_and_sm_limits(env: dict[str, Any]) -> None:
    core, ns = env["core"], env["ns"]
    created = core.create_namespaced_pod(ns, pod("limits", 3000, 30, node=DP_NODE))
    assert created.spec.scheduler_name == SCHEDULER_NAME
    assert any(v.empty_dir is not None and v.empty_dir.medium == "Memory" for v in created.spec.volumes or []), \
        "webhook did not add the shm volume"
    wait_for(lambda: core.read_namespaced_pod("limits", ns).status.phase == "Running", 90,
             "pod limits admitted by the fake kubelet and Running")
    a = env["kubelet"].admitted["limits"]["main"]
    assert a.started and a.error is None, a.error
    lim = a.limits  # the read-only limits file the container sees (written by the device plugin)
    assert lim is not None, "no limits file"
    assert lim.get("memory_mib_0") == "3000" and lim.get("cores_0") == "30", lim
    print(f"\nE2E limits: pod mutated, bound to {DP_NODE}, limits file memory_mib_0=3000 cores_0=30")


def test_100_mixed_pods_never_overcommit(env: dict[str, Any]) -> None:
    core, ns = env["core"], env["ns"]
    rng = random.Random(8)
    for i in range(100):
        core.create_namespaced_pod(ns, pod(f"mix-{i}", rng.choice([1000, 2000, 4000, 8000]),
                                           rng.choice([0, 10, 25, 50])))
    placed = settle_all_fitting(core, ns)
    use = check_no_overcommit(core, ns)
    assert len(placed) > 40, f"only {len(placed)} of 100 pods bound"
    print(f"\nE2E mixed: {len(placed)}/100 bound on {len(use)} GPUs, no overcommit, every pending pod unfittable")


def test_unfittable_pod_pending_with_reason(env: dict[str, Any]) -> None:
    core, ns = env["core"], env["ns"]
    core.create_namespaced_pod(ns, pod("too-big", 999999, 10))

    def event() -> str | None:
        for ev in core.list_namespaced_event(ns, field_selector="involvedObject.name=too-big").items:
            if ev.reason == "FailedScheduling" and "999999 MiB" in (ev.message or ""):
                return str(ev.message)
        return None
    msg = wait_for(event, 90, "FailedScheduling event with our reason")
    p = core.read_namespaced_pod("too-big", ns)
    assert not p.spec.node_name and p.status.phase == "Pending"
    print(f"\nE2E unfittable: Pending, event: {msg[:120]}")


def test_extender_restart_no_double_booking(env: dict[str, Any]) -> None:
    core, ns, comps = env["core"], env["ns"], env["comps"]
    for i in range(40):
        core.create_namespaced_pod(ns, pod(f"rs-{i}", 6000, 30))
        if i == 15:
            comps.restart_extender()
    # 16 GPUs x 2 pods of 6000 MiB (3 would be 18000 > 16384; 2 x 30% cores and 2 slots fit): exactly 32
    wait_for(lambda: len(bound(core, ns)) >= 32, 240, "32 pods bound")
    placed = settle_all_fitting(core, ns)
    use = check_no_overcommit(core, ns)
    assert len(placed) == 32, f"{len(placed)} of 40 bound, 32 fit"
    assert len(use) == 16 and all(u == (12000, 60, 2) for u in use.values()), use
    print(f"\nE2E extender restart: {len(placed)}/40 bound, {len(use)} GPUs x 2 pods, no double booking")


def test_policy_binpack_to_spread_live(env: dict[str, Any]) -> None:
    core, ns, comps = env["core"], env["ns"], env["comps"]

    def place(name: str) -> str:
        core.create_namespaced_pod(ns, pod(name, 1000, 5))
        return str(wait_for(lambda: core.read_namespaced_pod(name, ns).spec.node_name, 60, f"{name} bound"))

    first = [place(f"bp-{i}") for i in range(3)]
    assert len(set(first)) == 1, f"binpack spread pods over {first}"
    log = comps.procs["extender"].log
    before = log.read_text(errors="replace").count('"policy config reloaded"')
    write_policy(comps.policy, "spread")
    wait_for(lambda: log.read_text(errors="replace").count('"policy config reloaded"') > before, 60,
             "the extender to reload its policy file")
    later = [place(f"sp-{i}") for i in range(3)]
    assert first[0] not in later and len(set(later)) == 3, f"spread put pods on {later} (binpack node {first[0]})"
    print(f"\nE2E policy: binpack -> {first[0]} x3, spread -> {sorted(later)} without restart")


def test_deployment_scale_0_20_0_20(env: dict[str, Any]) -> None:
    if not env["cp"].has_controller_manager:
        pytest.skip("needs kube-controller-manager in KUBE_BIN_DIR")
    from kubernetes import client

    core, ns = env["core"], env["ns"]
    apps = client.AppsV1Api(env["api"])
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "scale"},
           "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "scale"}},
                    "template": {"metadata": {"labels": {"app": "scale"}},
                                 "spec": pod("x", 2000, 10)["spec"]}}}
    apps.create_namespaced_deployment(ns, dep)
    try:
        for want in (20, 0, 20):
            apps.patch_namespaced_deployment_scale("scale", ns, {"spec": {"replicas": want}})
            wait_for(lambda want=want: len([p for p in core.list_namespaced_pod(ns, label_selector="app=scale").items
                                            if p.spec.node_name and p.status.phase == "Running"]) == want
                     and len(core.list_namespaced_pod(ns, label_selector="app=scale").items) == want,
                     180, f"{want} pods bound and Running")
            check_no_overcommit(core, ns)
    finally:
        apps.delete_namespaced_deployment("scale", ns)
    print("\nE2E deployment: 0 -> 20 -> 0 -> 20 all bound, nothing leaked")


def test_helm_install_chart(env: dict[str, Any]) -> None:
    helm = helm_binary()
    kc = str(env["cp"].kubeconfig)
    ns = f"{env['ns']}-helm"
    from kubernetes import client

    adm = client.AdmissionregistrationV1Api(env["api"])

    def service_webhooks() -> list[str]:
        """Webhook configurations that name a Service: with no cluster DNS, kube-apiserver would
        resolve it through the host's resolver and dial out. None may ever be live here."""
        out = []
        for cfg in (adm.list_mutating_webhook_configuration().items
                    + adm.list_validating_webhook_configuration().items):
            out += [f"{cfg.metadata.name}/{w.name}" for w in cfg.webhooks or [] if w.client_config.service]
        return out

    assert service_webhooks() == []
    # --no-hooks: the pre-install Jobs (webhook certificate, signing keys) have no kubelet to run them;
    # webhook.enabled=false: the chart's webhook configuration names a Service (see above)
    r = subprocess.run([helm, "install", "kube-vgpu", str(ROOT / "charts" / "kube-vgpu"), "--kubeconfig", kc,
                        "--namespace", ns, "--create-namespace", "--wait=false", "--no-hooks",
                        "--set", "webhook.enabled=false"],
                       capture_output=True, text=True, timeout=180)
    try:
        assert service_webhooks() == []
        assert r.returncode == 0, r.stderr[-3000:]
        st = subprocess.run([helm, "status", "kube-vgpu", "--kubeconfig", kc, "--namespace", ns],
                            capture_output=True, text=True, timeout=60)
        assert "STATUS: deployed" in st.stdout, st.stdout + st.stderr
        apps = client.AppsV1Api(env["api"])
        assert [d.metadata.name for d in apps.list_namespaced_daemon_set(ns).items] == ["kube-vgpu-device-plugin"]
        assert [d.metadata.name for d in apps.list_namespaced_deployment(ns).items] == ["kube-vgpu-scheduler"]
    finally:
        subprocess.run([helm, "uninstall", "kube-vgpu", "--kubeconfig", kc, "--namespace", ns, "--no-hooks"],
                       capture_output=True, timeout=120)
    assert service_webhooks() == []
    print("\nE2E helm: charts/kube-vgpu installed (--no-hooks, webhook off: no Service-named webhook at any "
          "time), STATUS: deployed, uninstalled")


def test_gpu_quota_counts_percentage_requests(env: dict[str, Any]) -> None:
    """A real ResourceQuota: kube-apiserver's quota admission sees no gpumem in a pod that asks
    gpumem-percentage, so it admits it; the extender counts what it books and refuses it with a
    reason naming the quota. A pod within quota still binds; raising the quota lets the refused
    pod bind (live)."""
    from kubernetes.client.exceptions import ApiException

    core, ns = env["core"], env["ns"]
    hard = GPU_MEM // 2  # MiB
    # extended resources are quota'd with the requests. prefix (or bare); record what the API
    # server says about HAMi's limits. form
    try:
        core.create_namespaced_resource_quota(ns, {"metadata": {"name": "hami-form"},
                                                   "spec": {"hard": {"limits.nvidia.com/gpumem": str(hard)}}})
        limits_form = "accepted"
        core.delete_namespaced_resource_quota("hami-form", ns)
    except ApiException as e:
        limits_form = f"refused ({e.status})"
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "gpu"},
                                               "spec": {"hard": {"requests.nvidia.com/gpumem": str(hard)}}})
    try:
        wait_for(lambda: (core.read_namespaced_resource_quota("gpu", ns).status.hard or {}), 60,
                 "the quota controller to fill in the quota's status")
        big = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pct"}, "spec": {"containers": [
            {"name": c, "image": "busybox", "resources": {"limits": {"nvidia.com/gpumem-percentage": "40"}}}
            for c in ("a", "b")]}}
        core.create_namespaced_pod(ns, big)  # admitted: the spec names no gpumem
        asked = 2 * (GPU_MEM * 40 // 100)

        def event() -> str | None:
            for ev in core.list_namespaced_event(ns, field_selector="involvedObject.name=pct").items:
                if ev.reason == "FailedScheduling" and "GPU quota exceeded" in (ev.message or ""):
                    return str(ev.message)
            return None
        msg = wait_for(event, 90, "FailedScheduling event naming the GPU quota")
        # "used" is what the extender still holds in the namespace: the previous test's pods are gone
        # from the API, but on a loaded machine their deletions may not have reached the extender's
        # watch yet, and it keeps a booking until it sees the pod go
        m = re.search(rf"namespace {ns}, ResourceQuota gpu: requests.nvidia.com/gpumem used (\d+) \+ asked {asked} > "
                      rf"hard {hard}", msg)
        assert m is not None and int(m.group(1)) + asked > hard, msg
        core.create_namespaced_pod(ns, pod("small", 1000, 0))
        wait_for(lambda: core.read_namespaced_pod("small", ns).spec.node_name, 90, "the pod within quota bound")
        assert not core.read_namespaced_pod("pct", ns).spec.node_name
        core.patch_namespaced_resource_quota("gpu", ns, {"spec": {"hard": {"requests.nvidia.com/gpumem":
                                                                           str(asked + 1000)}}})
        wait_for(lambda: core.read_namespaced_pod("pct", ns).spec.node_name, 120,
                 "the refused pod bound once the quota was raised")
    finally:
        core.delete_namespaced_resource_quota("gpu", ns)
    print(f"\nE2E quota: percentage pod refused ({msg[msg.find('GPU quota'):][:110]}), bound after the quota "
          f"was raised; ResourceQuota with limits.nvidia.com/gpumem: {limits_form}")
