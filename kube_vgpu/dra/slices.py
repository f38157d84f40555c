"""Pure builder of the ``resource.k8s.io/v1`` ResourceSlices that publish a node's GPUs to DRA.

One pool per node (pool name = node name, ``spec.nodeName`` set), one device per physical GPU
named ``gpu-<index>``, shared by many claims (``allowMultipleAllocations: true``), each claim
consuming part of two capacities (names in :mod:`kube_vgpu.dra`):

* ``memory``: the GPU's schedulable memory in bytes (written as a ``<MiB>Mi`` quantity); a
  request is a whole number of MiB from 1 MiB to the whole GPU (``validRange`` min 1Mi, step 1Mi,
  max = capacity); a claim that does not name it consumes the whole GPU's memory (``default``).
* ``cores``: compute in percent of the GPU (``100 x coreScaling``); a request is 1..100 (step 1,
  at most the capacity); a claim that does not name it consumes 100 (the whole GPU's compute).

So a claim naming neither capacity (for example one made from an extended-resource request such
as ``nvidia.com/gpu: 1`` through the DeviceClass mapping) gets a whole GPU, like the extender
path's ``defaults.bareGpuExclusive``; to share a GPU a claim names both.

Feature gates (Kubernetes 1.36, all beta and on by default): ``allowMultipleAllocations`` and
``requestPolicy`` need DRAConsumableCapacity; device ``taints`` need DRADeviceTaints. A server
with a gate off drops the field silently: :mod:`deviceplugin.dra_publish` reads the slice back
and falls back to removing unhealthy GPUs when taints were dropped.

Nothing here talks to the API server; every function returns plain API JSON.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from ..errors import QuantityError
from ..model import GPUDevice
from ..quantity import parse_quantity
from ..views import ObjectView
from . import (
    ATTR_DRIVER_VERSION,
    ATTR_INDEX,
    ATTR_MEMORY_MIB,
    ATTR_MODEL,
    ATTR_NUMA,
    ATTR_UUID,
    CAPACITY_CORES,
    CAPACITY_MEMORY,
    DRIVER_NAME,
    TAINT_UNHEALTHY,
    device_name,
)

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

#: Devices per ResourceSlice: the API allows 128, but 64 once any device has taints; we always
#: keep to 64 so a GPU turning unhealthy never makes a slice invalid.
MAX_DEVICES_PER_SLICE = 64

#: Most compute one request may ask for on one GPU (percent).
MAX_CORES_PER_REQUEST = 100

#: Label on every slice we write (for ``kubectl get resourceslices -l``).
LABEL_DRIVER = "kube-vgpu.io/dra-driver"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_MAX_NAME = 253
_STRING_ATTR_MAX = 64  # API limit for a string attribute value
_SEMVER_PARTS = re.compile(r"^([0-9]+)\.([0-9]+)\.([0-9]+)$")


def slice_name(node: str, index: int = 0) -> str:
    """The name of the ``index``-th ResourceSlice of ``node``'s pool:
    ``<node>-vgpu.kube-vgpu.io-<index>`` (a long node name is shortened and suffixed with a hash
    of the full name so the result stays a valid, unique object name).

    Raises ValueError for an invalid node name or a negative index.
    """
    _check_node(node)
    if index < 0:
        raise ValueError(f"slice index: {index} is negative; allowed: 0 or more")
    suffix = f"-{DRIVER_NAME}-{index}"
    if len(node) + len(suffix) <= _MAX_NAME:
        return node + suffix
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    head = node[:_MAX_NAME - len(suffix) - 11].rstrip("-.")
    return f"{head}-{digest}{suffix}"


def driver_version_attribute(text: str) -> dict[str, str]:
    """The ``driverVersion`` attribute for an NVIDIA driver version string.

    ``550.54.15`` is a semantic version (``{"version": "550.54.15"}``), so CEL can compare it
    (``device.attributes["vgpu.kube-vgpu.io"].driverVersion.isGreaterThan(semver("550.0.0"))``);
    leading zeros, which semantic versions forbid, are dropped (``535.104.05`` becomes
    ``535.104.5``). Anything else (``560.28``, ``unknown``) is kept as a string attribute.

    Raises ValueError for an empty text or one longer than 64 characters.
    """
    text = text.strip()
    if not text or len(text) > _STRING_ATTR_MAX:
        raise ValueError(f"driverVersion: {text!r} must be 1-{_STRING_ATTR_MAX} characters")
    m = _SEMVER_PARTS.match(text)
    if m:
        return {"version": ".".join(str(int(p)) for p in m.groups())}
    return {"string": text}


def _check_node(node: str) -> None:
    if not isinstance(node, str) or not node or len(node) > _MAX_NAME or not _DNS_SUBDOMAIN.match(node):
        raise ValueError(f"node name: {node!r} is not a DNS subdomain (lowercase letters, digits, '-' and '.', "
                         f"at most {_MAX_NAME} characters)")


def _check_device(dev: GPUDevice) -> None:
    where = f"GPU {dev.index} ({dev.uuid})"
    if not dev.uuid or len(dev.uuid) > _STRING_ATTR_MAX:
        raise ValueError(f"{where}: uuid {dev.uuid!r} must be 1-{_STRING_ATTR_MAX} characters")
    if not dev.model or len(dev.model) > _STRING_ATTR_MAX:
        raise ValueError(f"{where}: model {dev.model!r} must be 1-{_STRING_ATTR_MAX} characters")
    # the API requires validRange min + step <= the capacity (1 + 1)
    if dev.memory_mib < 2:
        raise ValueError(f"{where}: memory_mib {dev.memory_mib} must be at least 2 MiB")
    if dev.cores < 2:
        raise ValueError(f"{where}: cores {dev.cores} must be at least 2 percent")
    if dev.numa < 0:
        raise ValueError(f"{where}: numa {dev.numa} is negative; allowed: 0 or more")


def device_entry(dev: GPUDevice, *, driver_version: str = "", taint_unhealthy: bool = True) -> dict[str, Any]:
    """The ``spec.devices[]`` entry of one GPU.

    driver_version: the NVIDIA driver version ("" = no ``driverVersion`` attribute).
    taint_unhealthy: an unhealthy GPU carries the NoSchedule taint :data:`kube_vgpu.dra.TAINT_UNHEALTHY`
    (claims already allocated keep it; no new claim gets it). With False the caller must leave
    unhealthy GPUs out instead (:func:`resource_slices` does).

    Raises ValueError naming the GPU and the field for a device the API would refuse.
    """
    _check_device(dev)
    attrs: dict[str, Any] = {
        ATTR_UUID: {"string": dev.uuid},
        ATTR_MODEL: {"string": dev.model},
        ATTR_INDEX: {"int": dev.index},
        ATTR_NUMA: {"int": dev.numa},
        ATTR_MEMORY_MIB: {"int": dev.memory_mib},
    }
    if driver_version:
        attrs[ATTR_DRIVER_VERSION] = driver_version_attribute(driver_version)
    max_cores = min(MAX_CORES_PER_REQUEST, dev.cores)
    entry: dict[str, Any] = {
        "name": device_name(dev.index),
        "attributes": attrs,
        "capacity": {
            CAPACITY_MEMORY: {
                "value": f"{dev.memory_mib}Mi",
                "requestPolicy": {
                    "default": f"{dev.memory_mib}Mi",
                    "validRange": {"min": "1Mi", "max": f"{dev.memory_mib}Mi", "step": "1Mi"},
                },
            },
            CAPACITY_CORES: {
                "value": str(dev.cores),
                "requestPolicy": {
                    "default": str(max_cores),
                    "validRange": {"min": "1", "max": str(max_cores), "step": "1"},
                },
            },
        },
        "allowMultipleAllocations": True,
    }
    if not dev.healthy and taint_unhealthy:
        entry["taints"] = [{"key": TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
    return entry


def resource_slices(node: str, devices: Sequence[GPUDevice], *, pool_generation: int, driver_version: str = "",
                    taint_unhealthy: bool = True, owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every ResourceSlice of ``node``'s pool: devices sorted by index, at most
    :data:`MAX_DEVICES_PER_SLICE` per slice, each slice naming the pool's ``generation`` and its
    ``resourceSliceCount``. A node without devices still has one (empty) slice, so consumers see
    a complete, empty pool rather than none.

    taint_unhealthy: True taints unhealthy GPUs (DRADeviceTaints); False leaves them out.
    owner: an ownerReference (the Node) put on every slice, or None.

    Raises ValueError for an invalid node name, a negative generation, two GPUs with the same
    index or UUID, or a GPU the API would refuse (see :func:`device_entry`).
    """
    _check_node(node)
    if pool_generation < 0:
        raise ValueError(f"pool generation: {pool_generation} is negative; allowed: 0 or more")
    seen_idx: set[int] = set()
    seen_uuid: set[str] = set()
    for d in devices:
        if d.index in seen_idx:
            raise ValueError(f"GPU index {d.index} appears twice on node {node}")
        if d.uuid in seen_uuid:
            raise ValueError(f"GPU uuid {d.uuid} appears twice on node {node}")
        seen_idx.add(d.index)
        seen_uuid.add(d.uuid)
    entries = [device_entry(d, driver_version=driver_version, taint_unhealthy=taint_unhealthy)
               for d in sorted(devices, key=lambda d: d.index) if d.healthy or taint_unhealthy]
    chunks = [entries[i:i + MAX_DEVICES_PER_SLICE] for i in range(0, len(entries), MAX_DEVICES_PER_SLICE)] or [[]]
    out = []
    for i, chunk in enumerate(chunks):
        meta: dict[str, Any] = {"name": slice_name(node, i), "labels": {LABEL_DRIVER: "true"}}
        if owner is not None:
            meta["ownerReferences"] = [owner]
        out.append({
            "apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
            "spec": {
                "driver": DRIVER_NAME,
                "nodeName": node,
                "pool": {"name": node, "generation": pool_generation, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        })
    return out


def resource_slice(node: str, devices: Sequence[GPUDevice], *, pool_generation: int, driver_version: str = "",
                   taint_unhealthy: bool = True, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one ResourceSlice of a node with at most :data:`MAX_DEVICES_PER_SLICE` GPUs (see
    :func:`resource_slices`). Raises ValueError as :func:`resource_slices` does, and for more GPUs
    than fit one slice."""
    slices = resource_slices(node, devices, pool_generation=pool_generation, driver_version=driver_version,
                             taint_unhealthy=taint_unhealthy, owner=owner)
    if len(slices) != 1:
        raise ValueError(f"node {node}: {len(devices)} GPUs need {len(slices)} ResourceSlices "
                         f"(at most {MAX_DEVICES_PER_SLICE} each); use resource_slices")
    return slices[0]


def _norm(v: Any, key: str = "") -> Any:
    """A comparable form: quantities parsed, taints without the server-set timeAdded."""
    if isinstance(v, dict):
        return {k: _norm(x, k) for k, x in v.items() if not (k == "timeAdded")}
    if isinstance(v, list):
        return [_norm(x, key) for x in v]
    if isinstance(v, str) and key in ("value", "default", "min", "max", "step"):
        try:
            q: Fraction = parse_quantity(v)
            return ("quantity", q)
        except QuantityError:
            return v
    return v


def same_content(published: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """True when a slice read from the API server says what ``wanted`` says, ignoring the pool
    generation, the server's canonical spelling of quantities (``1024Mi`` reads back as ``1Gi``)
    and the taints' server-set ``timeAdded``. Labels and ownerReferences we set are compared too."""
    def spec(o: dict[str, Any]) -> Any:
        s = dict(ObjectView(o).spec)
        pool = dict(s.get("pool") or {})
        pool.pop("generation", None)
        s["pool"] = pool
        s.setdefault("devices", [])
        return _norm(s)

    def meta(o: dict[str, Any]) -> Any:
        view = ObjectView(o)
        labels = {k: v for k, v in view.labels.items() if k == LABEL_DRIVER}
        owners = [{k: r.get(k) for k in ("apiVersion", "kind", "name", "uid")} for r in view.owner_references]
        return labels, owners

    return bool(spec(published) == spec(wanted) and meta(published) == meta(wanted))


def taints_dropped(published: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """True when ``wanted`` tainted a device and the server's copy has no taints on it: the
    DRADeviceTaints feature gate is off (the server drops disabled fields without an error)."""
    got = {d.get("name"): d for d in ObjectView(published).spec.get("devices") or ()}
    for d in ObjectView(wanted).spec.get("devices") or ():
        if d.get("taints") and not (got.get(d.get("name")) or {}).get("taints"):
            return True
    return False


def capacity_dropped(published: dict[str, Any]) -> bool:
    """True when the server's copy of a slice we wrote lacks ``allowMultipleAllocations`` on a
    device: the DRAConsumableCapacity feature gate is off, so every claim would take a whole GPU."""
    return any(not d.get("allowMultipleAllocations") for d in ObjectView(published).spec.get("devices") or ())
