"""GPU-aware preemption end to end: real PriorityClasses, kube-scheduler's own preemption calling
the extender's ``preemptVerb`` (see docs/preemption.md), and the victims it evicts.

``gpu-node-1`` (4 GPUs of 16384 MiB, 64 CPUs) is filled with 16 low-priority slices (4096 MiB and
25 % of one GPU, 4 CPUs each): every GPU holds four, every CPU is requested. A high-priority pod
then asks for a whole GPU (16384 MiB, 100 %) and 4 CPUs on that node. kube-scheduler's own dry run
sees only the CPUs and proposes one slice; the extender answers with the slices of that slice's GPU.
Exactly those four pods are evicted, and the high-priority pod binds to that GPU.
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import pytest

from .cluster import wait_for
from .conftest import GPU_MEM, NODES

pytestmark = pytest.mark.e2e

NODE = NODES[1]  # no device plugin there: the fake kubelet plays its part


def slice_pod(name: str, priority_class: str, mem: int, cores: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"priorityClassName": priority_class, "nodeSelector": {"kubernetes.io/hostname": NODE},
                     "containers": [{"name": "main", "image": "busybox", "resources": {
                         "requests": {"cpu": "4"},
                         "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mem),
                                    "nvidia.com/gpucores": str(cores)}}}]}}


def gpu_of(p: Any) -> str:
    from kube_vgpu.codec import decode_allocation
    from kube_vgpu.resources import ANN_ALLOCATION

    (dev,) = decode_allocation((p.metadata.annotations or {})[ANN_ALLOCATION]).containers[0].devices
    return str(dev.uuid)


def preempt_kept(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^kube_vgpu_scheduler_preempt_nodes_total\{outcome="kept"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_high_priority_whole_gpu_evicts_exactly_one_cards_slices(env: dict[str, Any]) -> None:
    from kubernetes import client

    core, ns, api = env["core"], env["ns"], env["api"]
    sched = client.SchedulingV1Api(api)
    low, high = f"{ns}-low", f"{ns}-high"
    for name, value in ((low, 100), (high, 1000)):
        sched.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                     "metadata": {"name": name}, "value": value, "preemptionPolicy":
                                     "PreemptLowerPriority"})
    try:
        for i in range(16):
            core.create_namespaced_pod(ns, slice_pod(f"low-{i}", low, GPU_MEM // 4, 25))
        lows = wait_for(lambda: (lambda ps: ps if len(ps) == 16 and all(
            p.spec.node_name == NODE and p.status.phase == "Running" for p in ps) else None)(
            core.list_namespaced_pod(ns).items), 180, "16 low-priority slices bound and Running", every=1.0)
        assert all(p.spec.priority == 100 for p in lows)
        by_gpu: dict[str, set[str]] = {}
        for p in lows:
            by_gpu.setdefault(gpu_of(p), set()).add(p.metadata.name)
        assert sorted(len(v) for v in by_gpu.values()) == [4, 4, 4, 4], by_gpu
        kept_before = preempt_kept(env["comps"].extender_port)

        core.create_namespaced_pod(ns, slice_pod("vip", high, GPU_MEM, 100))
        vip = wait_for(lambda: (lambda p: p if p.spec.node_name else None)(core.read_namespaced_pod("vip", ns)),
                       180, "the high-priority pod bound", every=1.0)
        assert vip.spec.priority == 1000 and vip.spec.node_name == NODE
        card = gpu_of(vip)
        left = {p.metadata.name for p in core.list_namespaced_pod(ns).items} - {"vip"}
        evicted = {p.metadata.name for p in lows} - left
        # exactly the four slices of the card the high-priority pod got, nothing else
        assert evicted == by_gpu[card], (evicted, by_gpu, card)
        assert len(left) == 12
        assert preempt_kept(env["comps"].extender_port) > kept_before, "kube-scheduler never called /preempt"
        print(f"\nE2E preempt: vip (priority 1000, whole GPU) bound to {NODE} {card}; evicted exactly that "
              f"card's slices {sorted(evicted)}; 12 other slices kept")
    finally:
        for name in (low, high):
            try:
                sched.delete_priority_class(name)
            except client.ApiException:
                pass
