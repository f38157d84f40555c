"""End-to-end scenarios on a real kube-apiserver + kube-scheduler with our webhook, extender and
device plugin (see README.md). Each prints a one-line summary."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import pytest

from .cluster import ROOT, SCHEDULER_NAME, wait_for, write_policy
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


def settle(core: Any, ns: str, quiet: float = 6.0, timeout: float = 240.0) -> dict[str, Any]:
    """Wait until the set of bound pods stops changing for ``quiet`` seconds."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(bound(core, ns))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return bound(core, ns)
        time.sleep(0.5)
    raise AssertionError("placements never settled")


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
    envs = wait_for(lambda: env["kubelet"].envs.get("limits"), 90, "Allocate for pod limits")
    e = envs["main"]
    assert e.get("CUDA_DEVICE_MEMORY_LIMIT_0") == "3000m", e
    assert e.get("CUDA_DEVICE_SM_LIMIT") == "30", e
    wait_for(lambda: core.read_namespaced_pod("limits", ns).status.phase == "Running", 30, "Running")
    print("\nE2E limits: pod mutated, bound to gpu-node-0, env CUDA_DEVICE_MEMORY_LIMIT_0=3000m CUDA_DEVICE_SM_LIMIT=30")


def test_100_mixed_pods_never_overcommit(env: dict[str, Any]) -> None:
    core, ns = env["core"], env["ns"]
    rng = random.Random(8)
    for i in range(100):
        core.create_namespaced_pod(ns, pod(f"mix-{i}", rng.choice([1000, 2000, 4000, 8000]),
                                           rng.choice([0, 10, 25, 50])))
    placed = settle(core, ns)
    use = check_no_overcommit(core, ns)
    assert len(placed) > 40, f"only {len(placed)} of 100 pods bound"
    print(f"\nE2E mixed: {len(placed)}/100 bound on {len(use)} GPUs, no overcommit")


def test_unfittable_pod_pending_with_reason(env: dict[str, Any]) -> None:
    core, ns = env["core"], env["ns"]
    core.create_namespaced_pod(ns, pod("too-big", 999999, 10))

    def event() -> str | None:
        for ev in core.list_namespaced_event(ns, field_selector="involvedObject.name=too-big").items:
            if ev.reason == "FailedScheduling" and "999999 MiB" in (ev.message or ""):
                return str(ev.message)
        return None
    msg = wait_for(event, 90, "FailedScheduling event with our reason")
    time.sleep(2)
    p = core.read_namespaced_pod("too-big", ns)
    assert not p.spec.node_name and p.status.phase == "Pending"
    print(f"\nE2E unfittable: Pending, event: {msg[:120]}")


def test_extender_restart_no_double_booking(env: dict[str, Any]) -> None:
    core, ns, comps = env["core"], env["ns"], env["comps"]
    for i in range(40):
        core.create_namespaced_pod(ns, pod(f"rs-{i}", 6000, 30))
        if i == 15:
            comps.restart_extender()
    placed = settle(core, ns)
    use = check_no_overcommit(core, ns)
    # 16 GPUs x 2 pods of 6000 MiB (3 would be 18000 > 16384): at most 32 fit
    assert 0 < len(placed) <= 32
    print(f"\nE2E extender restart: {len(placed)}/40 bound, {len(use)} GPUs, no double booking")


def test_policy_binpack_to_spread_live(env: dict[str, Any]) -> None:
    core, ns, comps = env["core"], env["ns"], env["comps"]

    def place(name: str) -> str:
        core.create_namespaced_pod(ns, pod(name, 1000, 5))
        return str(wait_for(lambda: core.read_namespaced_pod(name, ns).spec.node_name, 60, f"{name} bound"))

    first = [place(f"bp-{i}") for i in range(3)]
    assert len(set(first)) == 1, f"binpack spread pods over {first}"
    write_policy(comps.policy, "spread")
    time.sleep(5)  # the extender polls its config file every 2 s
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
    try:
        helm = subprocess.run([sys.executable, str(ROOT / "scripts" / "get_helm.py")], capture_output=True,
                              text=True, timeout=120).stdout.strip()
    except subprocess.TimeoutExpired:
        helm = ""
    if not helm:
        pytest.skip("helm unavailable (scripts/get_helm.py failed)")
    kc = str(env["cp"].kubeconfig)
    ns = f"{env['ns']}-helm"
    r = subprocess.run([helm, "install", "kube-vgpu", str(ROOT / "charts" / "kube-vgpu"), "--kubeconfig", kc,
                        "--namespace", ns, "--create-namespace", "--wait=false"],
                       capture_output=True, text=True, timeout=180)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        st = subprocess.run([helm, "status", "kube-vgpu", "--kubeconfig", kc, "--namespace", ns],
                            capture_output=True, text=True, timeout=60)
        assert "STATUS: deployed" in st.stdout, st.stdout + st.stderr
    finally:
        subprocess.run([helm, "uninstall", "kube-vgpu", "--kubeconfig", kc, "--namespace", ns],
                       capture_output=True, timeout=120)
    print("\nE2E helm: charts/kube-vgpu installed (STATUS: deployed) and uninstalled")
