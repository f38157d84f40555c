"""What is free on each GPU of the DRA path, per node, from ResourceSlices and ResourceClaims (pure).

The extender scores the nodes of pods that carry claims against kube-vgpu's DeviceClass
(``scheduler/drascore.py``). It needs, per node, each GPU's capacity and what allocated claims
already consume of it; this module derives that from the API objects, with no I/O:

* :func:`pools` reads our driver's ResourceSlices (``spec.driver`` = :data:`DRIVER_NAME`; every
  other driver's slice is skipped): per pool the devices of its newest generation, each with its
  ``memory`` (bytes, read as whole MiB, rounded down) and ``cores`` capacity, whether it may be
  shared (``allowMultipleAllocations``) and whether a ``NoSchedule`` / ``NoExecute`` taint keeps
  claims off it. A pool whose newest generation has fewer slices than its ``resourceSliceCount``
  is incomplete and left out (kube-scheduler's allocator does not allocate from it either).
* :func:`node_capacity` adds the ResourceClaims: every result of our driver in a claim's
  ``status.allocation`` (written by kube-scheduler, never by a tenant) consumes what its
  ``consumedCapacity`` says, whether or not the claim is reserved for a pod yet (a claim in
  flight holds its share). Rules that never free capacity on doubt: memory is rounded **up** to
  whole MiB; a result without ``consumedCapacity``, or with one that cannot be read, takes the
  whole device; what is consumed beyond a capacity leaves 0, never less. Claims without an
  allocation consume nothing (nothing was allocated); results of other drivers are skipped.
  Annotations and labels are never read.
* :func:`claim_requests` reads what a pod's claim asks of our DeviceClasses (the claim's
  ``spec``, the tenant's wish: used to *predict* a placement, never to book anything).

Units: memory in MiB, cores in percent of one GPU (the device's ``cores`` capacity), as
:mod:`kube_vgpu.model`. Errors name the field, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

from kube_vgpu.errors import QuantityError, ShapeError, VGPUError
from kube_vgpu.quantity import parse_quantity
from kube_vgpu.views import ObjectView

from . import ATTR_INDEX, ATTR_MODEL, ATTR_UUID, CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME

_MIB = 1 << 20
#: taint effects that keep new claims off a device (kube-scheduler's allocator skips such devices)
_BLOCKING = frozenset({"NoSchedule", "NoExecute"})


class ClaimSpecError(VGPUError):
    """A claim's ``spec`` cannot be read as a request of our DeviceClasses: ``field`` (its JSON path)
    holds ``value``; ``allowed`` says what may be there."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value) if isinstance(value, str | int | float | bool) or value is None else type(value).__name__
        super().__init__(f"ResourceClaim {field}={shown[:80]} is not allowed; allowed: {allowed}")


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One GPU of a pool: ``name`` (``gpu-<index>``), NVML ``index`` (-1 unknown), ``uuid``,
    ``model``, ``memory_mib`` and ``cores`` capacity, ``shared``: many claims may hold it
    (``allowMultipleAllocations``), ``healthy``: no NoSchedule/NoExecute taint."""

    name: str
    index: int
    uuid: str
    model: str
    memory_mib: int
    cores: int
    shared: bool = True
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Use:
    """What allocated claims hold of one device: MiB, cores and how many shares (results)."""

    memory_mib: int = 0
    cores: int = 0
    shares: int = 0

    def plus(self, memory_mib: int, cores: int) -> Use:
        """This use with one more share of ``memory_mib`` and ``cores``."""
        return Use(self.memory_mib + memory_mib, self.cores + cores, self.shares + 1)


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """One node's GPUs on the DRA path (published order) and what allocated claims hold of each
    (``used`` aligned with ``devices``)."""

    node: str
    pool: str
    devices: tuple[DraDevice, ...]
    used: tuple[Use, ...]

    def free(self, i: int) -> tuple[int, int]:
        """(MiB, cores) still free on device ``i`` (never below 0)."""
        d, u = self.devices[i], self.used[i]
        return max(0, d.memory_mib - u.memory_mib), max(0, d.cores - u.cores)


@dataclass(frozen=True, slots=True)
class DraRequest:
    """One request of a claim against one of our DeviceClasses: ``name`` (``<claim>/<request>``),
    ``count`` devices, each with ``memory_mib`` (None: the class default, the whole GPU's memory)
    and ``cores`` (None: the default, 100), ``model``: the GPU model the DeviceClass selects ("" any)."""

    name: str
    count: int
    memory_mib: int | None
    cores: int | None
    model: str = ""


@lru_cache(maxsize=4096)
def _parsed(v: str | int) -> Fraction | None:
    try:
        return parse_quantity(v)
    except QuantityError:
        return None


def _quantity(v: object) -> Fraction | None:
    if isinstance(v, bool) or not isinstance(v, str | int):
        return None
    return _parsed(v)  # the same few spellings ("81920Mi", "30") come back all the time


def _cap(capacity: Mapping[str, Any], name: str) -> Fraction | None:
    c = capacity.get(name)
    return _quantity(c.get("value")) if isinstance(c, Mapping) else None


def _attr(attrs: Mapping[str, Any], name: str, kind: str) -> Any:
    a = attrs.get(name)
    return a.get(kind) if isinstance(a, Mapping) else None


def _device(d: object) -> DraDevice | None:
    """A slice's device entry, or None when it cannot offer anything (no name, no readable
    ``memory`` / ``cores`` capacity)."""
    if not isinstance(d, Mapping) or not isinstance(d.get("name"), str) or not d.get("name"):
        return None
    capacity = d.get("capacity")
    attrs = d.get("attributes")
    if not isinstance(capacity, Mapping):
        return None
    attrs = attrs if isinstance(attrs, Mapping) else {}
    mem, cores = _cap(capacity, CAPACITY_MEMORY), _cap(capacity, CAPACITY_CORES)
    if mem is None or cores is None or mem < _MIB or cores < 1:
        return None
    index = _attr(attrs, ATTR_INDEX, "int")
    uuid, model = _attr(attrs, ATTR_UUID, "string"), _attr(attrs, ATTR_MODEL, "string")
    taints = d.get("taints")
    healthy = not (isinstance(taints, list)
                   and any(isinstance(t, Mapping) and t.get("effect") in _BLOCKING for t in taints))
    return DraDevice(name=d["name"], index=index if isinstance(index, int) and not isinstance(index, bool) else -1,
                     uuid=uuid if isinstance(uuid, str) else "", model=model if isinstance(model, str) else "",
                     memory_mib=int(mem // _MIB), cores=int(cores), shared=d.get("allowMultipleAllocations") is True,
                     healthy=healthy)


def pools(slices: Iterable[Mapping[str, Any]], driver: str = DRIVER_NAME) -> dict[str, tuple[str, tuple[DraDevice, ...]]]:
    """Per pool name: (node name, devices) from ``driver``'s ResourceSlices (module docstring).
    Devices are in the allocator's order: slices sorted by name, devices in published order.
    Slices without ``spec.nodeName`` (not bound to one node), of another driver, malformed, or
    of an older generation than the pool's newest are skipped; incomplete pools are left out."""
    newest: dict[str, int] = {}
    seen: list[tuple[str, int, int, str, str, list[Any]]] = []
    for s in slices:
        try:
            view = ObjectView(s)
        except ShapeError:
            continue
        spec = view.spec
        if spec.get("driver") != driver:
            continue
        node, pool = spec.get("nodeName"), spec.get("pool")
        if not isinstance(node, str) or not node or not isinstance(pool, Mapping):
            continue
        pname, gen, count = pool.get("name"), pool.get("generation"), pool.get("resourceSliceCount")
        if not isinstance(pname, str) or not pname:
            continue
        gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else 0
        count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
        devices = spec.get("devices")
        try:
            name = view.name
        except ShapeError:
            continue
        seen.append((pname, gen, count, node, name, devices if isinstance(devices, list) else []))
        newest[pname] = max(newest.get(pname, gen), gen)
    by_pool: dict[str, list[tuple[str, int, str, list[Any]]]] = {}
    for pname, gen, count, node, name, devices in seen:
        if gen == newest[pname]:
            by_pool.setdefault(pname, []).append((name, count, node, devices))
    out: dict[str, tuple[str, tuple[DraDevice, ...]]] = {}
    for pname, items in by_pool.items():
        nodes = {node for _, _, node, _ in items}
        if len(items) < max(c for _, c, _, _ in items) or len(nodes) != 1:
            continue  # incomplete, or one pool claimed by two nodes: offers nothing we can trust
        devs: list[DraDevice] = []
        names: set[str] = set()
        for _, _, _, devices in sorted(items, key=lambda t: t[0]):
            for d in devices:
                dev = _device(d)
                if dev is not None and dev.name not in names:
                    names.add(dev.name)
                    devs.append(dev)
        out[pname] = (nodes.pop(), tuple(devs))
    return out


@dataclass(frozen=True, slots=True)
class Share:
    """One result of our driver in a claim's allocation: ``pool``, ``device``, ``memory_mib``
    consumed (rounded up; None: the whole device: no ``consumedCapacity``, or one that cannot be
    read) and ``cores`` (None: not named, the request policy's default ``min(100, capacity)``)."""

    pool: str
    device: str
    memory_mib: int | None
    cores: int | None


def _share(r: Mapping[str, Any], pool: str, device: str) -> Share:
    whole = Share(pool, device, None, None)
    cc = r.get("consumedCapacity")
    if not isinstance(cc, Mapping):
        return whole
    mem, cores = _quantity(cc.get(CAPACITY_MEMORY)), _quantity(cc.get(CAPACITY_CORES))
    if mem is None or mem < 0 or (CAPACITY_CORES in cc and (cores is None or cores < 0)):
        return whole
    mib = -(-mem.numerator // (mem.denominator * _MIB))  # ceil(bytes / MiB)
    c = -(-cores.numerator // cores.denominator) if cores is not None else None
    return Share(pool, device, int(mib), None if c is None else int(c))


def claim_shares(claim: Mapping[str, Any], driver: str = DRIVER_NAME) -> tuple[Share, ...]:
    """The shares ``claim`` holds of ``driver``'s devices: its ``status.allocation`` results of that
    driver (none when it is not allocated). Never raises: a malformed claim holds nothing it cannot
    name (no pool or device), and a result it names but whose consumption cannot be read holds the
    whole device."""
    try:
        status = ObjectView(claim).status
    except ShapeError:
        return ()
    alloc = status.get("allocation")
    devices = alloc.get("devices") if isinstance(alloc, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return ()
    out = []
    for r in results:
        if not isinstance(r, Mapping) or r.get("driver") != driver:
            continue
        pool, dev = r.get("pool"), r.get("device")
        if isinstance(pool, str) and isinstance(dev, str):
            out.append(_share(r, pool, dev))
    return tuple(out)


class Totals:
    """What all shares hold, per (pool, device): summed MiB and cores, how many shares, how many of
    them take the whole device, and how many take the cores default. Shares are added and removed
    one claim at a time (a watch event), so keeping a cluster's totals current costs O(results)."""

    __slots__ = ("_sums",)

    def __init__(self) -> None:
        #: (pool, device) -> [MiB, cores, shares, whole shares, shares taking the cores default]
        self._sums: dict[tuple[str, str], list[int]] = {}

    def add(self, shares: Iterable[Share], sign: int = 1) -> None:
        """Add ``shares`` (``sign`` -1: remove shares added before)."""
        for sh in shares:
            t = self._sums.get((sh.pool, sh.device))
            if t is None:
                t = self._sums[(sh.pool, sh.device)] = [0, 0, 0, 0, 0]
            t[2] += sign
            if sh.memory_mib is None:
                t[3] += sign
            else:
                t[0] += sign * sh.memory_mib
                if sh.cores is None:
                    t[4] += sign
                else:
                    t[1] += sign * sh.cores
            if not t[2]:
                del self._sums[(sh.pool, sh.device)]

    def use(self, pool: str, dev: DraDevice) -> Use:
        """What the shares hold of ``dev`` in ``pool``: a whole share counts the device's capacity."""
        t = self._sums.get((pool, dev.name))
        if t is None:
            return Use()
        return Use(t[0] + t[3] * dev.memory_mib, t[1] + t[3] * dev.cores + t[4] * min(100, dev.cores), t[2])

    def capacity(self, node: str, pool: str, devices: tuple[DraDevice, ...]) -> NodeCapacity:
        """``node``'s capacity: ``devices`` (of ``pool``) and what the shares hold of each."""
        return NodeCapacity(node=node, pool=pool, devices=devices,
                            used=tuple(self.use(pool, d) for d in devices))


def nodes_of(by_pool: Mapping[str, tuple[str, tuple[DraDevice, ...]]]) -> dict[str, str]:
    """Node name -> its pool (the first by pool name when a node has several of our pools)."""
    out: dict[str, str] = {}
    for pname in sorted(by_pool):
        out.setdefault(by_pool[pname][0], pname)
    return out


def node_capacity(slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]],
                  driver: str = DRIVER_NAME) -> dict[str, NodeCapacity]:
    """Per node: its pool's GPUs and what the allocated claims hold of each (module docstring).
    A node with several pools of our driver keeps the first by pool name (kube-vgpu publishes
    one per node). Never raises for malformed objects: they are skipped, or (a result of ours
    that cannot be read) counted as holding the whole device. Results naming a device that is
    not published hold nothing."""
    by_pool = pools(slices, driver)
    totals = Totals()
    for c in claims:
        totals.add(claim_shares(c, driver))
    return {node: totals.capacity(node, pname, by_pool[pname][1]) for node, pname in nodes_of(by_pool).items()}


def _request_quantity(v: object, field: str, cores: bool) -> int:
    q = _quantity(v)
    if cores:
        if q is None or q.denominator != 1 or not 1 <= q <= 100:
            raise ClaimSpecError(field, v, "a whole number of percent 1..100 (e.g. \"30\")")
        return int(q)
    if q is None or q <= 0:
        raise ClaimSpecError(field, v, "a positive quantity of bytes (e.g. 3000Mi)")
    return int(-(-q.numerator // (q.denominator * _MIB)))  # the allocator rounds up to the 1Mi step (min 1Mi)


def claim_requests(claim: Mapping[str, Any], classes: Mapping[str, str]) -> tuple[DraRequest, ...]:
    """The requests of ``claim`` (a ResourceClaim) against our DeviceClasses: ``classes`` maps a
    DeviceClass name to the GPU model it selects ("" = every kube-vgpu GPU). Requests of other
    classes are skipped. Only ``exactly`` requests with ``allocationMode: ExactCount`` (the
    default) are read.

    Raises ClaimSpecError (naming the field) for a request of one of our classes that cannot be
    predicted: ``firstAvailable`` naming one of our classes, ``allocationMode: All``, a count
    outside 1..64, an unknown capacity name, or a memory / cores amount out of range."""
    try:
        view = ObjectView(claim)
        spec, cname = view.spec, view.name
    except ShapeError as e:
        raise ClaimSpecError(e.path, None, "a ResourceClaim object") from None
    devices = spec.get("devices")
    reqs = devices.get("requests") if isinstance(devices, Mapping) else None
    if reqs is None:
        return ()
    if not isinstance(reqs, list):
        raise ClaimSpecError("spec.devices.requests", reqs, "a list")
    out: list[DraRequest] = []
    for k, r in enumerate(reqs):
        at = f"spec.devices.requests[{k}]"
        if not isinstance(r, Mapping):
            raise ClaimSpecError(at, r, "an object")
        fa = r.get("firstAvailable")
        if isinstance(fa, list) and any(isinstance(s, Mapping) and s.get("deviceClassName") in classes for s in fa):
            raise ClaimSpecError(f"{at}.firstAvailable", "(list)",
                                 "exactly requests only: the extender does not predict firstAvailable")
        ex = r.get("exactly")
        if not isinstance(ex, Mapping) or ex.get("deviceClassName") not in classes:
            continue
        at = f"{at}.exactly"
        mode = ex.get("allocationMode", "ExactCount")
        if mode not in (None, "ExactCount"):
            raise ClaimSpecError(f"{at}.allocationMode", mode, "ExactCount (the extender does not predict All)")
        count = ex.get("count", 1)
        if count is None:
            count = 1
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
            raise ClaimSpecError(f"{at}.count", count, "a whole number 1..64")
        cap = ex.get("capacity")
        wants = cap.get("requests") if isinstance(cap, Mapping) else None
        if wants is not None and not isinstance(wants, Mapping):
            raise ClaimSpecError(f"{at}.capacity.requests", wants, "an object")
        wants = wants or {}
        for key in wants:
            if key not in (CAPACITY_MEMORY, CAPACITY_CORES):
                raise ClaimSpecError(f"{at}.capacity.requests", key, f"{CAPACITY_MEMORY} and {CAPACITY_CORES} only")
        mem = (_request_quantity(wants[CAPACITY_MEMORY], f"{at}.capacity.requests.{CAPACITY_MEMORY}", False)
               if CAPACITY_MEMORY in wants else None)
        cores = (_request_quantity(wants[CAPACITY_CORES], f"{at}.capacity.requests.{CAPACITY_CORES}", True)
                 if CAPACITY_CORES in wants else None)
        rname = r.get("name") if isinstance(r.get("name"), str) else str(k)
        out.append(DraRequest(name=f"{cname}/{rname}", count=count, memory_mib=mem, cores=cores,
                              model=classes[ex["deviceClassName"]]))
    return tuple(out)


def allocated(claim: Mapping[str, Any]) -> bool:
    """True when the claim has a ``status.allocation`` (then it is bound to a node already)."""
    try:
        return ObjectView(claim).status.get("allocation") is not None
    except ShapeError:
        return True  # unreadable: treat as decided elsewhere (the caller does not predict it)


__all__ = ["ClaimSpecError", "DraDevice", "DraRequest", "NodeCapacity", "Share", "Totals", "Use", "allocated",
           "claim_requests", "claim_shares", "node_capacity", "nodes_of", "pools"]
