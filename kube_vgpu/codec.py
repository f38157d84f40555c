"""Versioned annotation codec for the node inventory and the pod allocation.

Format v1 (compact JSON, keys sorted, documented in docs/protocol.md):

Node annotation ``kube-vgpu.io/node-inventory``::

    {"v":1,"hb":<unix seconds>,"devices":[{"uuid":"GPU-..","idx":0,"model":"NVIDIA H200",
      "mem":143771,"cores":100,"split":10,"healthy":true,"numa":0}, ...]}

Pod annotation ``kube-vgpu.io/allocation``::

    {"v":1,"node":"gpu-1","t":<unix seconds>,"containers":[{"name":"main","init":false,
      "devices":[{"uuid":"GPU-..","mem":3000,"cores":30}]}]}

Containers are identified by name (never by position), so an init container without GPUs cannot
shift an app container's allocation (KF-06). Decoding is strict: a wrong version, a missing or
mistyped field raises :class:`CodecError`.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import CodecError
from .model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation

VERSION = 1


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def _load(text: str, what: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise CodecError(f"{what}: annotation value must be a string, got {type(text).__name__}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise CodecError(f"{what}: not JSON ({e.msg} at {e.pos})") from None
    except (ValueError, RecursionError) as e:  # huge numbers, absurd nesting
        raise CodecError(f"{what}: not acceptable JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise CodecError(f"{what}: must be a JSON object")
    v = obj.get("v")
    if isinstance(v, bool) or v != VERSION:
        raise CodecError(f"{what}: unsupported version {obj.get('v')!r}; this build reads v{VERSION}")
    return obj


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise CodecError(f"{what}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) and kind is not bool and kind != (bool,):
        raise CodecError(f"{what}: field {key!r} has type bool")
    if not isinstance(v, kind):
        raise CodecError(f"{what}: field {key!r} has type {type(v).__name__}")
    return v


def encode_inventory(inv: NodeInventory) -> str:
    """Encode a node inventory to the annotation string (v1)."""
    return _dump({
        "v": VERSION,
        "hb": inv.heartbeat,
        "devices": [
            {"uuid": d.uuid, "idx": d.index, "model": d.model, "mem": d.memory_mib, "cores": d.cores,
             "split": d.split, "healthy": d.healthy, "numa": d.numa}
            for d in inv.devices
        ],
    })


def decode_inventory(text: str) -> NodeInventory:
    """Decode the node annotation. Raises CodecError on any malformed input."""
    what = "node inventory"
    obj = _load(text, what)
    hb = _get(obj, "hb", (int, float), what)
    devs = []
    for i, d in enumerate(_get(obj, "devices", list, what)):
        w = f"{what} device[{i}]"
        if not isinstance(d, dict):
            raise CodecError(f"{w}: must be an object")
        devs.append(GPUDevice(
            uuid=_get(d, "uuid", str, w), index=_get(d, "idx", int, w), model=_get(d, "model", str, w),
            memory_mib=_get(d, "mem", int, w), cores=_get(d, "cores", int, w), split=_get(d, "split", int, w),
            healthy=_get(d, "healthy", bool, w), numa=_get(d, "numa", int, w)))
    return NodeInventory(devices=tuple(devs), heartbeat=float(hb) if isinstance(hb, int) else hb)


def encode_allocation(alloc: PodAllocation) -> str:
    """Encode a pod allocation to the annotation string (v1)."""
    return _dump({
        "v": VERSION,
        "node": alloc.node,
        "t": alloc.time,
        "containers": [
            {"name": c.name, "init": c.init,
             "devices": [{"uuid": d.uuid, "mem": d.memory_mib, "cores": d.cores} for d in c.devices]}
            for c in alloc.containers
        ],
    })


def decode_allocation(text: str) -> PodAllocation:
    """Decode the pod annotation. Raises CodecError on any malformed input."""
    what = "pod allocation"
    obj = _load(text, what)
    t = _get(obj, "t", (int, float), what)
    conts = []
    for i, c in enumerate(_get(obj, "containers", list, what)):
        w = f"{what} container[{i}]"
        if not isinstance(c, dict):
            raise CodecError(f"{w}: must be an object")
        devs = []
        for j, d in enumerate(_get(c, "devices", list, w)):
            wd = f"{w} device[{j}]"
            if not isinstance(d, dict):
                raise CodecError(f"{wd}: must be an object")
            devs.append(DeviceBooking(uuid=_get(d, "uuid", str, wd), memory_mib=_get(d, "mem", int, wd),
                                      cores=_get(d, "cores", int, wd)))
        conts.append(ContainerAllocation(name=_get(c, "name", str, w), init=_get(c, "init", bool, w),
                                         devices=tuple(devs)))
    return PodAllocation(node=_get(obj, "node", str, what), containers=tuple(conts),
                         time=float(t) if isinstance(t, int) else t)
