"""Versioned annotation codec for the node inventory and the pod allocation.

Format v1 (compact JSON, keys sorted, documented in docs/protocol.md):

Node annotation ``kube-vgpu.io/node-inventory``::

    {"v":1,"hb":<unix seconds>,"devices":[{"uuid":"GPU-..","idx":0,"model":"NVIDIA H200",
      "mem":143771,"cores":100,"split":10,"healthy":true,"numa":0}, ...]}

Pod annotation ``kube-vgpu.io/allocation``::

    {"v":1,"node":"gpu-1","t":<unix seconds>,"containers":[{"name":"main","init":false,
      "devices":[{"uuid":"GPU-..","mem":3000,"cores":30}]}]}

Optional fields, written only when set (a reader that does not know a field ignores it): a
device's ``links`` (interconnect ranks) and, for a GPU in dynamic-MIG mode, ``mig`` (its profile
table) and ``migprofiles`` (the allowed profiles); a booking's ``mig`` (MIG profile) and ``start``
(first memory slice) for a dynamic-MIG instance.

Containers are identified by name (never by position), so an init container without GPUs cannot
shift an app container's allocation (KF-06). Decoding is strict: a wrong version, a missing or
mistyped field raises :class:`CodecError`, and so does a value out of its plausible range
(negative or absurd MiB/cores/split, duplicate GPU uuids, duplicate container names): these
records are also written back by users able to edit their pods, so the reader trusts nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import CodecError, ShapeError
from .mig import MEMORY_SLICES, TABLES
from .model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation
from .resources import ANN_ALLOCATION
from .views import ObjectView

VERSION = 1


#: the largest interconnect rank a links entry may carry (kube_vgpu.topology: NVLINK + links)
MAX_LINK_RANK = 64


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


#: plausible ranges (inclusive) of the numeric fields; anything else is a corrupt or tampered record
MAX_MIB = 1 << 24  # 16 TiB per GPU in MiB
MAX_CORES = 10_000  # percent; 100 x the largest core scaling
MAX_SPLIT = 1024


def _objects(obj: dict[str, Any], key: str, what: str, item: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``<what> <item>[i]``, the object) for each item of the list ``obj[key]``. Raises CodecError
    when the list is missing or an item is not an object."""
    for i, d in enumerate(_get(obj, key, list, what)):
        w = f"{what} {item}[{i}]"
        if not isinstance(d, dict):
            raise CodecError(f"{w}: must be an object")
        yield w, d


def _uuid(d: dict[str, Any], w: str, seen: set[str], twice: str) -> str:
    """``d["uuid"]``, added to ``seen``. Raises CodecError when it is missing, empty or already in
    ``seen`` (``twice`` says how, e.g. ``listed twice``)."""
    uuid: str = _get(d, "uuid", str, w)
    if not uuid or uuid in seen:
        raise CodecError(f"{w}: uuid {uuid!r} is empty or {twice}")
    seen.add(uuid)
    return uuid


def _int_in(obj: dict[str, Any], key: str, lo: int, hi: int, what: str) -> int:
    v: int = _get(obj, key, int, what)
    if not lo <= v <= hi:
        raise CodecError(f"{what}: field {key!r} = {v} is out of range; allowed {lo}..{hi}")
    return v


def _time(obj: dict[str, Any], key: str, what: str) -> float:
    v = _get(obj, key, (int, float), what)
    if not math.isfinite(v) or v < 0:
        raise CodecError(f"{what}: field {key!r} = {v!r} is not a time (finite unix seconds >= 0)")
    return float(v)


def encode_inventory(inv: NodeInventory) -> str:
    """Encode a node inventory to the annotation string (v1). ``links`` (each device's interconnect
    rank to every device, :mod:`kube_vgpu.topology`) is written only when published: a reader that
    does not know the field ignores it."""
    devices = []
    for d in inv.devices:
        dev: dict[str, Any] = {"uuid": d.uuid, "idx": d.index, "model": d.model, "mem": d.memory_mib,
                               "cores": d.cores, "split": d.split, "healthy": d.healthy, "numa": d.numa}
        if d.links:
            dev["links"] = list(d.links)
        if d.mig:
            dev["mig"] = d.mig
            dev["migprofiles"] = list(d.mig_profiles)
        devices.append(dev)
    return _dump({"v": VERSION, "hb": inv.heartbeat, "devices": devices})


def decode_inventory(text: str) -> NodeInventory:
    """Decode the node annotation. Raises CodecError on any malformed input."""
    what = "node inventory"
    obj = _load(text, what)
    hb = _time(obj, "hb", what)
    devs = []
    seen: set[str] = set()
    for w, d in _objects(obj, "devices", what, "device"):
        uuid = _uuid(d, w, seen, "listed twice")
        links: tuple[int, ...] = ()
        if "links" in d:
            raw = _get(d, "links", list, w)
            if any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_LINK_RANK for x in raw):
                raise CodecError(f"{w}: field 'links' must be a list of integers 0..{MAX_LINK_RANK}")
            links = tuple(raw)
        mig, mig_profiles = _mig_fields(d, w)
        devs.append(GPUDevice(
            uuid=uuid, index=_int_in(d, "idx", 0, 4096, w), model=_get(d, "model", str, w),
            memory_mib=_int_in(d, "mem", 1, MAX_MIB, w), cores=_int_in(d, "cores", 1, MAX_CORES, w),
            split=_int_in(d, "split", 1, MAX_SPLIT, w), healthy=_get(d, "healthy", bool, w),
            numa=_int_in(d, "numa", -1, 4096, w), links=links, mig=mig, mig_profiles=mig_profiles))
    if any(d.links for d in devs) and any(len(d.links) != len(devs) for d in devs):
        raise CodecError(f"{what}: every device's 'links' must list one rank per device ({len(devs)})")
    return NodeInventory(devices=tuple(devs), heartbeat=hb)


def _mig_fields(d: dict[str, Any], w: str) -> tuple[str, tuple[str, ...]]:
    """A device's dynamic-MIG fields (``mig``: a profile table key; ``migprofiles``: names of that
    table's profiles), ("", ()) when absent. Raises CodecError naming the field and what is allowed."""
    if "mig" not in d:
        return "", ()
    table = _get(d, "mig", str, w)
    if table not in TABLES:
        raise CodecError(f"{w}: field 'mig' = {table!r} is not a known MIG profile table; allowed: "
                         f"{', '.join(sorted(TABLES))}")
    raw = _get(d, "migprofiles", list, w) if "migprofiles" in d else []
    names = {p.name for p in TABLES[table].profiles}
    if any(not isinstance(x, str) or x not in names for x in raw) or len(set(raw)) != len(raw):
        raise CodecError(f"{w}: field 'migprofiles' must list distinct profiles of {table}: "
                         f"{', '.join(p.name for p in TABLES[table].profiles)}")
    return table, tuple(raw)


def _booking(d: DeviceBooking) -> dict[str, Any]:
    out: dict[str, Any] = {"uuid": d.uuid, "mem": d.memory_mib, "cores": d.cores}
    if d.profile:  # a dynamic-MIG instance (written only then: older readers ignore the fields)
        out["mig"] = d.profile
        out["start"] = d.start
    return out


def encode_allocation(alloc: PodAllocation) -> str:
    """Encode a pod allocation to the annotation string (v1). A dynamic-MIG booking adds its
    profile (``mig``) and first memory slice (``start``)."""
    return _dump({
        "v": VERSION,
        "node": alloc.node,
        "t": alloc.time,
        "containers": [
            {"name": c.name, "init": c.init, "devices": [_booking(d) for d in c.devices]}
            for c in alloc.containers
        ],
    })


def decode_allocation(text: str) -> PodAllocation:
    """Decode the pod annotation. Raises CodecError on any malformed input."""
    what = "pod allocation"
    obj = _load(text, what)
    t = _time(obj, "t", what)
    conts = []
    names: set[tuple[str, bool]] = set()
    for w, c in _objects(obj, "containers", what, "container"):
        devs = []
        uuids: set[str] = set()
        for wd, d in _objects(c, "devices", w, "device"):
            uuid = _uuid(d, wd, uuids, "booked twice for one container")
            profile, start = "", 0
            if "mig" in d:
                profile = _get(d, "mig", str, wd)
                if not profile or len(profile) > 32:
                    raise CodecError(f"{wd}: field 'mig' = {profile!r} must be a MIG profile name (1..32 characters)")
                start = _int_in(d, "start", 0, MEMORY_SLICES - 1, wd)
            devs.append(DeviceBooking(uuid=uuid, memory_mib=_int_in(d, "mem", 0, MAX_MIB, wd),
                                      cores=_int_in(d, "cores", 0, MAX_CORES, wd), profile=profile, start=start))
        key = (_get(c, "name", str, w), _get(c, "init", bool, w))
        if not key[0] or key in names:
            raise CodecError(f"{w}: container name {key[0]!r} is empty or listed twice")
        names.add(key)
        conts.append(ContainerAllocation(name=key[0], init=key[1], devices=tuple(devs)))
    return PodAllocation(node=_get(obj, "node", str, what), containers=tuple(conts), time=t)


# -- reading the record off a Pod (the one place that does; callers choose raise or skip) --------


def allocation_text(pod: Mapping[str, Any] | ObjectView) -> str | None:
    """The raw ``kube-vgpu.io/allocation`` annotation of a Pod JSON object, or None when the pod
    carries none (absent or empty). Reads only: the signature is not checked here
    (:mod:`kube_vgpu.signing`). Raises CodecError when the value is not a string."""
    try:
        text = ObjectView.of(pod).annotations.get(ANN_ALLOCATION)
    except ShapeError:  # no annotations to read (its shape check reports the object)
        return None
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise CodecError(f"allocation: annotation value must be a string, got {type(text).__name__}")
    return text


def read_allocation(pod: Mapping[str, Any] | ObjectView) -> PodAllocation | None:
    """The pod's decoded allocation record, or None when it carries none. Not verified: call it on
    pods whose record was verified, or where an unverified record only informs (inspect).
    Raises CodecError naming what is wrong with a record that is there."""
    text = allocation_text(pod)
    return None if text is None else decode_allocation(text)


def allocation_or_none(pod: Mapping[str, Any] | ObjectView) -> PodAllocation | None:
    """:func:`read_allocation`, with an undecodable record treated as no record: for readers that
    skip such pods (metrics, ordering, a listing of verified pods); the scheduler owns the record
    and reports it. Never raises."""
    try:
        return read_allocation(pod)
    except CodecError:
        return None

