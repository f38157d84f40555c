"""Regenerate the recorded cluster fixtures under tests/kubectl/data/ (run from the repo root).

The objects have the shape ``kubectl get nodes -o json`` / ``kubectl get pods -A -o json`` print;
the kube-vgpu annotations are written with the domain codec (encode_inventory / encode_allocation),
so the fixtures track the wire format. Scenario (``cluster.json``, taken at T = 2026-01-01):

* gpu-node-a: 2 x NVIDIA H200, four pods sharing them (one with an init container).
* gpu-node-b: 4 x A100 80GB, GPU 3 unhealthy; a 2-GPU exclusive job, a finished pod (holds
  nothing) and a pod still binding (allocation written, no nodeName yet).
* gpu-node-c: 1 x L4, cordoned, heartbeat 10 minutes old (stale).
* gpu-node-d: an inventory annotation of an unknown format version.
* cpu-node-1: no GPUs; a non-GPU pod.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kube_vgpu.codec import encode_allocation, encode_inventory
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation

T = 1767225600
DATA = Path(__file__).parent / "data"



UUIDS = {
    ("gpu-node-a", 0): "GPU-0fc3eda5-e98b-a25b-5b0d-cf5c855d1448",
    ("gpu-node-a", 1): "GPU-7a1e2c44-0d3b-4f6a-9e21-5b8c9d0e1f23",
    ("gpu-node-b", 0): "GPU-a100a000-1111-2222-3333-444455556666",
    ("gpu-node-b", 1): "GPU-a100a001-1111-2222-3333-444455556666",
    ("gpu-node-b", 2): "GPU-a100a002-1111-2222-3333-444455556666",
    ("gpu-node-b", 3): "GPU-a100a003-1111-2222-3333-444455556666",
    ("gpu-node-c", 0): "GPU-14c0ffee-aaaa-bbbb-cccc-ddddeeeeffff",
}


def node(name: str, devices: list[GPUDevice] | None, heartbeat: float = T - 12, *, cordoned: bool = False,
         raw_inventory: str | None = None, cpu: str = "64", mem: str = "528012348Ki") -> dict[str, Any]:
    ann: dict[str, str] = {"node.alpha.kubernetes.io/ttl": "0"}
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    alloc: dict[str, str] = {"cpu": cpu, "memory": mem, "pods": "110", "ephemeral-storage": "950Gi"}
    if devices is not None:
        ann["kube-vgpu.io/node-inventory"] = encode_inventory(NodeInventory(tuple(devices), heartbeat))
        labels["nvidia.com/gpu.present"] = "true"
        alloc["nvidia.com/gpu"] = str(sum(d.split for d in devices if d.healthy))
    if raw_inventory is not None:
        ann["kube-vgpu.io/node-inventory"] = raw_inventory
        labels["nvidia.com/gpu.present"] = "true"
        alloc["nvidia.com/gpu"] = "10"
    obj: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "48213", "labels": labels,
                     "annotations": ann, "creationTimestamp": "2025-11-02T09:14:31Z"},
        "spec": {"podCIDR": "10.244.1.0/24"},
        "status": {"capacity": dict(alloc), "allocatable": alloc,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "lastHeartbeatTime": "2025-12-31T23:59:40Z",
                                   "lastTransitionTime": "2025-11-02T09:15:02Z"}],
                   "nodeInfo": {"kubeletVersion": "v1.31.4", "containerRuntimeVersion": "containerd://1.7.24",
                                "osImage": "Ubuntu 22.04.5 LTS", "architecture": "amd64"}},
    }
    if cordoned:
        obj["spec"]["unschedulable"] = True
        obj["spec"]["taints"] = [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]
    return obj


def gpus(name: str, n: int, model: str, mem: int, unhealthy: tuple[int, ...] = ()) -> list[GPUDevice]:
    return [GPUDevice(UUIDS[(name, i)], i, model, mem, 100, 10, i not in unhealthy, i // 4) for i in range(n)]


def container(name: str, limits: dict[str, str], cpu: str = "2", mem: str = "8Gi") -> dict[str, Any]:
    return {"name": name, "image": "nvcr.io/nvidia/pytorch:24.12-py3",
            "resources": {"limits": {**limits, "cpu": cpu, "memory": mem}, "requests": {"cpu": cpu, "memory": mem}}}


def pod(ns: str, name: str, node_name: str | None, containers: list[dict[str, Any]],
        alloc: PodAllocation | None, *, init: list[dict[str, Any]] | None = None, phase: str = "Running",
        bind_phase: str = "success") -> dict[str, Any]:
    ann: dict[str, str] = {}
    labels = {"app": name.rsplit("-", 1)[0]}
    if alloc is not None:
        ann.update({"kube-vgpu.io/allocation": encode_allocation(alloc), "kube-vgpu.io/bind-phase": bind_phase,
                    "kube-vgpu.io/bind-time": str(int(alloc.time))})
        labels["kube-vgpu.io/node"] = alloc.node
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "kube-vgpu-scheduler" if alloc else
                            "default-scheduler", "restartPolicy": "Always"}
    if init:
        spec["initContainers"] = init
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}", "labels": labels,
                         "annotations": ann, "resourceVersion": "51007",
                         "creationTimestamp": "2025-12-31T20:00:00Z"},
            "spec": spec, "status": {"phase": phase, "qosClass": "Guaranteed"}}


def alloc(node_name: str, *containers: tuple[str, bool, list[tuple[str, int, int]]]) -> PodAllocation:
    return PodAllocation(node_name, tuple(ContainerAllocation(n, i, tuple(DeviceBooking(u, m, c) for u, m, c in ds))
                                          for n, i, ds in containers), time=T - 3600)


def cluster() -> dict[str, Any]:
    a0, a1 = UUIDS[("gpu-node-a", 0)], UUIDS[("gpu-node-a", 1)]
    b0, b1 = UUIDS[("gpu-node-b", 0)], UUIDS[("gpu-node-b", 1)]
    c0 = UUIDS[("gpu-node-c", 0)]
    nodes = [
        node("gpu-node-a", gpus("gpu-node-a", 2, "NVIDIA H200", 143771)),
        node("gpu-node-b", gpus("gpu-node-b", 4, "NVIDIA A100-SXM4-80GB", 81920, unhealthy=(3,)), T - 25),
        node("gpu-node-c", gpus("gpu-node-c", 1, "NVIDIA L4", 23034), T - 600, cordoned=True, cpu="16",
             mem="65842300Ki"),
        node("gpu-node-d", None, raw_inventory='{"v":2,"hb":1767225590,"gpus":[]}'),
        node("cpu-node-1", None, cpu="32", mem="131921052Ki"),
    ]
    g = "nvidia.com/gpumem"
    k = "nvidia.com/gpucores"
    pods = [
        pod("train", "llm-finetune-0", "gpu-node-a",
            [container("trainer", {g: "40000", k: "50"}, cpu="8", mem="64Gi")],
            alloc("gpu-node-a", ("trainer", False, [(a0, 40000, 50)]))),
        pod("default", "notebook-alice", "gpu-node-a",
            [container("jupyter", {g: "3000", k: "30"})],
            alloc("gpu-node-a", ("jupyter", False, [(a0, 3000, 30)]))),
        pod("default", "notebook-bob", "gpu-node-a",
            [container("jupyter", {g: "3000", k: "30"})],
            alloc("gpu-node-a", ("jupyter", False, [(a1, 3000, 30)]))),
        pod("inference", "vllm-7d9f8c6b5-x2kqp", "gpu-node-a",
            [container("vllm", {g: "24000", k: "40"}, cpu="4", mem="32Gi"),
             container("sidecar-metrics", {}, cpu="100m", mem="128Mi")],
            alloc("gpu-node-a", ("warmup", True, [(a1, 2000, 10)]), ("vllm", False, [(a1, 24000, 40)])),
            init=[container("warmup", {g: "2000", k: "10"}, cpu="1", mem="2Gi")]),
        pod("batch", "resnet-ddp-0", "gpu-node-b",
            [container("worker", {"nvidia.com/gpu": "2"}, cpu="16", mem="128Gi")],
            alloc("gpu-node-b", ("worker", False, [(b0, 81920, 100), (b1, 81920, 100)]))),
        pod("batch", "eval-done-1", "gpu-node-b",
            [container("eval", {g: "10000", k: "20"})],
            alloc("gpu-node-b", ("eval", False, [(UUIDS[("gpu-node-b", 2)], 10000, 20)])), phase="Succeeded"),
        pod("default", "pending-binding", None,
            [container("main", {g: "5000", k: "25"})],
            alloc("gpu-node-b", ("main", False, [(UUIDS[("gpu-node-b", 2)], 5000, 25)])), phase="Pending",
            bind_phase="allocating"),
        pod("edge", "l4-transcode-0", "gpu-node-c",
            [container("ffmpeg", {g: "6000", k: "50"})],
            alloc("gpu-node-c", ("ffmpeg", False, [(c0, 6000, 50)]))),
        pod("kube-system", "coredns-7db6d8ff4d-9xk2p", "cpu-node-1",
            [container("coredns", {}, cpu="100m", mem="170Mi")], None),
    ]
    return {"time": T, "nodes": {"apiVersion": "v1", "kind": "List", "items": nodes, "metadata": {}},
            "pods": {"apiVersion": "v1", "kind": "List", "items": pods, "metadata": {}}}


def empty() -> dict[str, Any]:
    return {"nodes": {"apiVersion": "v1", "kind": "List", "items": [node("cpu-node-1", None)]},
            "pods": {"apiVersion": "v1", "kind": "List", "items": []}}


SAMPLE_POD = """apiVersion: v1
kind: Pod
metadata:
  name: sample
  namespace: default
spec:
  containers:
    - name: cuda
      image: nvidia/cuda:12.4.1-base-ubuntu22.04
      command: [sleep, infinity]
      resources:
        limits:
          nvidia.com/gpumem: "3000"
          nvidia.com/gpucores: "30"
"""

BIG_POD = """apiVersion: v1
kind: Pod
metadata:
  name: big
  namespace: default
spec:
  containers:
    - name: main
      image: nvidia/cuda:12.4.1-base-ubuntu22.04
      resources:
        limits:
          nvidia.com/gpu: "2"
          nvidia.com/gpumem: "120000"
"""


def main() -> None:
    DATA.mkdir(exist_ok=True)
    (DATA / "cluster.json").write_text(json.dumps(cluster(), indent=1, sort_keys=True) + "\n")
    (DATA / "empty.json").write_text(json.dumps(empty(), indent=1, sort_keys=True) + "\n")
    (DATA / "pod-3000mib-30pct.yaml").write_text(SAMPLE_POD)
    (DATA / "pod-2x120000mib.yaml").write_text(BIG_POD)


if __name__ == "__main__":
    main()
