"""Small builders for hand-made clusters and pods (placement tests)."""

from __future__ import annotations

from typing import Any

from kube_vgpu.config import Config
from kube_vgpu.model import GPUDevice
from kube_vgpu.placement import ClusterState, Engine
from kube_vgpu.podspec import parse_pod


def gpus(node: str, sizes: list[int], model: str = "NVIDIA A10", split: int = 10) -> tuple[GPUDevice, ...]:
    return tuple(GPUDevice(uuid=f"GPU-{node}-{i}", index=i, model=model, memory_mib=m, split=split)
                 for i, m in enumerate(sizes))


def pod(name: str, *containers: dict[str, Any], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A Pod dict; each container is a limits dict (names may omit the nvidia.com/ prefix)."""
    def c(i: int, lim: dict[str, Any], prefix: str) -> dict[str, Any]:
        full = {(k if "/" in k else f"nvidia.com/{k}"): v for k, v in lim.items()}
        return {"name": f"{prefix}{i}", "image": "x", "resources": {"limits": full}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "annotations": annotations or {}},
        "spec": {"containers": [c(i, lim, "c") for i, lim in enumerate(containers)],
                 "initContainers": [c(i, lim, "init") for i, lim in enumerate(init or [])]},
    }


def engine(nodes: dict[str, tuple[GPUDevice, ...]], policy: str = "binpack", gpu_policy: str = "spread") -> Engine:
    st = ClusterState()
    for name, devs in nodes.items():
        st.set_node(name, devs)
    return Engine(st, policy, gpu_policy)


def req(p: dict[str, Any], config: Config | None = None):  # type: ignore[no-untyped-def]
    return parse_pod(p, config or Config())


def place(e: Engine, p: dict[str, Any]):  # type: ignore[no-untyped-def]
    """Choose + book like the extender's bind; returns the allocation or None."""
    r = req(p)
    d = e.choose(r)
    if d is None:
        return None
    alloc = e.allocation(r, d.node, d.plan, now=1.0)
    e.book(r, alloc)
    return alloc


def gpu_used(e: Engine, node: str) -> list[tuple[int, int, int]]:
    """Per GPU of ``node``: (booked MiB, booked cores, used slots)."""
    n = e.state.nodes[node]
    return [(d.memory_mib - n.free_mem[i], d.cores - n.free_cores[i], d.split - n.free_slots[i])
            for i, d in enumerate(n.devices)]
