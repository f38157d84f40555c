"""Builders of the DRA objects the extender's scoring reads, shaped as resource.k8s.io/v1 serves them:
ResourceSlices from the real slice builder (kube_vgpu.dra.slices), ResourceClaims allocated the way
kube-scheduler v1.36 writes them (tests/dra/data/claims_kube_scheduler_1_36.json), pods with claims."""

from __future__ import annotations

import itertools
import uuid as uuidlib
from typing import Any

from kube_vgpu.dra import DEVICE_CLASS, DRIVER_NAME
from kube_vgpu.dra.slices import resource_slice
from kube_vgpu.model import GPUDevice

Obj = dict[str, Any]
_uids = itertools.count(1)


def uid() -> str:
    """A fresh Kubernetes-style UID."""
    return str(uuidlib.UUID(int=next(_uids)))


def node_slice(node: str, n: int = 2, mem: int = 24576, model: str = "NVIDIA A10", generation: int = 1,
               healthy: tuple[bool, ...] = ()) -> Obj:
    """Our driver's ResourceSlice for ``node`` with ``n`` GPUs of ``mem`` MiB (slices.resource_slice)."""
    devs = [GPUDevice(uuid=f"GPU-{node}-{i}", index=i, model=model, memory_mib=mem,
                      healthy=healthy[i] if i < len(healthy) else True) for i in range(n)]
    return resource_slice(node, devs, pool_generation=generation)


def claim(name: str, ns: str = "team-a", *, memory: str | None = "3000Mi", cores: str | None = "30", count: int = 1,
          device_class: str = DEVICE_CLASS, owner: Obj | None = None, annotations: dict[str, str] | None = None,
          results: list[Obj] | None = None) -> Obj:
    """A ResourceClaim asking ``count`` devices of ``device_class`` with the given capacity requests;
    ``results``: its status.allocation.devices.results (None: not allocated)."""
    req: Obj = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    wants = {k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None}
    if wants:
        req["capacity"] = {"requests": wants}
    meta: Obj = {"name": name, "namespace": ns, "uid": uid(), "resourceVersion": "1"}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    if annotations:
        meta["annotations"] = annotations
    c: Obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta,
              "spec": {"devices": {"requests": [{"name": "gpu", "exactly": req}]}}}
    if results is not None:
        c["status"] = {"allocation": {"devices": {"results": results}}}
    return c


def result(node: str, device: str, memory: str | None = "3000Mi", cores: str | None = "30",
           driver: str = DRIVER_NAME) -> Obj:
    """One allocation result as kube-scheduler writes it (consumedCapacity when memory is given)."""
    r: Obj = {"request": "gpu", "driver": driver, "pool": node, "device": device, "shareID": uid()}
    if memory is not None:
        r["consumedCapacity"] = {"memory": memory, **({"cores": cores} if cores is not None else {})}
    return r


def claim_pod(name: str, ns: str = "team-a", *, claims: tuple[str, ...] = (), templates: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None, pod_uid: str | None = None) -> Obj:
    """A pod using ``claims`` by name and, for each ``templates`` entry {pod claim name: generated
    claim name}, a template claim whose generated name is in status.resourceClaimStatuses."""
    refs: list[Obj] = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    statuses = []
    for pname, gen in (templates or {}).items():
        refs.append({"name": pname, "resourceClaimTemplateName": "tmpl"})
        statuses.append({"name": pname, "resourceClaimName": gen})
    p: Obj = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": name, "namespace": ns, "uid": uid() if pod_uid is None else pod_uid, "annotations": dict(annotations or {})},
              "spec": {"schedulerName": "kube-vgpu-scheduler", "resourceClaims": refs,
                       "containers": [{"name": "c", "image": "busybox",
                                       "resources": {"claims": [{"name": r["name"]} for r in refs]}}]}}
    if statuses:
        p["status"] = {"resourceClaimStatuses": statuses}
    return p


def owner(pod: Obj) -> Obj:
    """The ownerReference kube-controller-manager puts on a pod's generated claim."""
    return {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}
