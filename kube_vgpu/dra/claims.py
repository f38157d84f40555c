"""Read an allocated ``resource.k8s.io/v1`` ResourceClaim: what our driver's devices grant (pure).

The kubelet plugin prepares a claim from its **status** only: ``status.allocation`` is written by
kube-scheduler's allocator (tenants cannot write a claim's status), while the claim's spec is the
tenant's wish. The shape read (as the v1 API serves it)::

    metadata: {namespace, name, uid}
    status:
      allocation:
        devices:
          results:
          - request: gpu            # "<request>" or "<request>/<subrequest>"
            driver: vgpu.kube-vgpu.io
            pool: <node name>
            device: gpu-0
            shareID: 2f6c...        # optional: one share of a device allocated to many claims
            adminAccess: false      # optional
            consumedCapacity:       # optional: present for devices that allow multiple allocations
              memory: 3000Mi        # bytes
              cores: "30"           # percent
      reservedFor: [{resource: pods, name, uid}]

Rules (:func:`read_claim`):

* Results of other drivers are skipped (still type-checked as results).
* ``consumedCapacity`` absent: the device was allocated **whole** (a class or cluster without
  consumable capacity): the grant says so explicitly (:attr:`Grant.whole`, ``memory_mib`` None,
  cores 100); the plugin resolves it to the GPU's whole memory.
* ``consumedCapacity`` present: ``memory`` is required (bytes, at least 1 MiB; MiB rounded down, so
  the limit never exceeds what was booked); ``cores`` absent means the caller's ``default_cores``
  (the class default), else a whole number 1..100 (0 is refused: the env contract reads 0 as "no SM
  limit", which nobody booked). Any other capacity name is refused.
* ``adminAccess: true`` is refused (:class:`ClaimError`): an admin-access device consumes no
  capacity, so serving it would hand a container a GPU without any limit nobody booked.
* Several results of one request on one device (shares) are kept apart; the plugin sums them per GPU.

Every refusal is a :class:`ClaimError` naming the field (JSON path), the value and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kube_vgpu.errors import QuantityError, VGPUError, json_type
from kube_vgpu.quantity import parse_quantity

from . import CAPACITY_CORES, CAPACITY_MEMORY, DRIVER_NAME

#: a DNS label (a device name in a pool)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
#: a pool name: one or more DNS subdomains separated by slashes, at most 253 characters
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[a-z0-9]([-a-z0-9.]*[a-z0-9])?)*$")
#: a request name (``<request>`` or ``<request>/<subrequest>``, DNS labels)
_REQUEST = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(/[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$")
#: a UID as Kubernetes formats it (k8s-uuid: lower-case 8-4-4-4-12 hex)
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
#: capacities a result of our driver may consume
CAPACITIES = (CAPACITY_MEMORY, CAPACITY_CORES)
_MIB = 1 << 20


class ClaimError(VGPUError):
    """A ResourceClaim cannot be prepared: ``field`` (its JSON path, e.g.
    ``status.allocation.devices.results[0].consumedCapacity.memory``) holds ``value``; ``allowed``
    says what may be there."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        shown = repr(value) if isinstance(value, str | int | float | bool) or value is None else json_type(value)
        if isinstance(shown, str) and len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"ResourceClaim {field}={shown} is not allowed; allowed: {allowed}")


@dataclass(frozen=True, slots=True)
class Grant:
    """One device result of our driver.

    request: the request name (``<request>`` or ``<request>/<subrequest>``); pool: the pool (our
    node's name); device: the device name (``gpu-<index>``); memory_mib: MiB consumed, None when the
    device was allocated whole; cores: percent consumed (1..100; 100 for a whole device); share_id:
    the share's id when the device is shared, else None.
    """

    request: str
    pool: str
    device: str
    memory_mib: int | None
    cores: int
    share_id: str | None = None

    @property
    def whole(self) -> bool:
        """True when the device was allocated whole (no consumed capacity: all of its memory)."""
        return self.memory_mib is None


@dataclass(frozen=True, slots=True)
class Consumer:
    """One entry of ``status.reservedFor``: resource (e.g. ``pods``), name, uid."""

    resource: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ClaimGrants:
    """What an allocated claim grants through our driver: identity, our results in status order,
    and who the claim is reserved for."""

    namespace: str
    name: str
    uid: str
    grants: tuple[Grant, ...]
    reserved_for: tuple[Consumer, ...]


def _obj(v: object, field: str, *, optional: bool = False) -> Mapping[str, Any] | None:
    if v is None and optional:
        return None
    if not isinstance(v, Mapping):
        raise ClaimError(field, v, "an object")
    return v


def _str(v: object, field: str, pattern: re.Pattern[str] | None = None, allowed: str = "a non-empty string",
         max_len: int = 253) -> str:
    if not isinstance(v, str) or not v or len(v) > max_len or (pattern is not None and not pattern.match(v)):
        raise ClaimError(field, v, allowed)
    return v


def _list(v: object, field: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise ClaimError(field, v, "a list")
    return v


def _memory_mib(v: object, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, str | int):
        raise ClaimError(field, v, "a quantity of bytes (e.g. 3000Mi), at least 1Mi")
    try:
        q = parse_quantity(v)
    except QuantityError:
        raise ClaimError(field, v, "a quantity of bytes (e.g. 3000Mi), at least 1Mi") from None
    if q < _MIB:
        raise ClaimError(field, v, "a quantity of bytes (e.g. 3000Mi), at least 1Mi")
    return int(q // _MIB)


def _cores(v: object, field: str) -> int:
    allowed = ("a whole number of percent 1..100 (e.g. \"30\"; 0 would run without an SM limit while "
               "booking no compute)")
    if isinstance(v, bool) or not isinstance(v, str | int):
        raise ClaimError(field, v, allowed)
    try:
        q = parse_quantity(v)
    except QuantityError:
        raise ClaimError(field, v, allowed) from None
    if q.denominator != 1 or not 1 <= q <= 100:
        raise ClaimError(field, v, allowed)
    return int(q)


def _grant(r: Mapping[str, Any], at: str, default_cores: int) -> Grant:
    request = _str(r.get("request"), f"{at}.request", _REQUEST,
                   "a request name: a DNS label, or <request>/<subrequest>", 127)
    pool = _str(r.get("pool"), f"{at}.pool", _POOL, "a pool name: DNS subdomains separated by '/', "
                "at most 253 characters")
    device = _str(r.get("device"), f"{at}.device", _DNS_LABEL, "a device name: a DNS label", 63)
    admin = r.get("adminAccess")
    if admin is not None and not isinstance(admin, bool):
        raise ClaimError(f"{at}.adminAccess", admin, "true, false or absent")
    if admin:
        raise ClaimError(f"{at}.adminAccess", admin,
                         f"false or absent: {DRIVER_NAME} does not serve admin access (an admin-access device "
                         "consumes no capacity, so it would run without any booked limit)")
    share = r.get("shareID")
    if share is not None:
        share = _str(share, f"{at}.shareID", _UUID, "a UID (lower-case 8-4-4-4-12 hex digits) or absent", 36)
    consumed = _obj(r.get("consumedCapacity"), f"{at}.consumedCapacity", optional=True)
    if consumed is None:
        return Grant(request=request, pool=pool, device=device, memory_mib=None, cores=100, share_id=share)
    for k in consumed:
        if k not in CAPACITIES:
            raise ClaimError(f"{at}.consumedCapacity", k,
                             f"capacity names {', '.join(CAPACITIES)} only (this driver publishes no other)")
    if CAPACITY_MEMORY not in consumed:
        raise ClaimError(f"{at}.consumedCapacity.{CAPACITY_MEMORY}", None,
                         "a quantity of bytes (every share consumes memory)")
    mem = _memory_mib(consumed[CAPACITY_MEMORY], f"{at}.consumedCapacity.{CAPACITY_MEMORY}")
    cores = (_cores(consumed[CAPACITY_CORES], f"{at}.consumedCapacity.{CAPACITY_CORES}")
             if CAPACITY_CORES in consumed else default_cores)
    return Grant(request=request, pool=pool, device=device, memory_mib=mem, cores=cores, share_id=share)


def read_claim(claim: object, *, driver: str = DRIVER_NAME, default_cores: int = 100) -> ClaimGrants:
    """The grants of ``driver`` in an allocated ResourceClaim (API JSON, see the module docstring).

    default_cores: percent used when a result consumes capacity but names no ``cores`` (1..100).
    Returns the claim's identity, our results in status order (none when every result is another
    driver's) and its ``reservedFor`` consumers.

    Raises:
        ClaimError: the claim is not allocated, or a field has the wrong type or an invalid value, or
            one of our results asks for admin access; the message names the field, value and what is
            allowed.
        ValueError: ``default_cores`` outside 1..100 (a caller's mistake).
    """
    if isinstance(default_cores, bool) or not isinstance(default_cores, int) or not 1 <= default_cores <= 100:
        raise ValueError(f"default_cores={default_cores!r}: allowed: a whole percent 1..100")
    c = _obj(claim, "(claim)")
    assert c is not None
    meta = _obj(c.get("metadata"), "metadata")
    assert meta is not None
    namespace = _str(meta.get("namespace"), "metadata.namespace")
    name = _str(meta.get("name"), "metadata.name")
    uid = _str(meta.get("uid"), "metadata.uid", max_len=128)
    status = _obj(c.get("status"), "status", optional=True) or {}
    alloc = _obj(status.get("allocation"), "status.allocation", optional=True)
    if alloc is None:
        raise ClaimError("status.allocation", None, "an allocation: the claim must be allocated before it is prepared")
    devices = _obj(alloc.get("devices"), "status.allocation.devices", optional=True) or {}
    grants: list[Grant] = []
    for i, r in enumerate(_list(devices.get("results"), "status.allocation.devices.results")):
        at = f"status.allocation.devices.results[{i}]"
        res = _obj(r, at)
        assert res is not None
        d = _str(res.get("driver"), f"{at}.driver", allowed="a driver name (non-empty string)", max_len=63)
        if d != driver:
            continue
        grants.append(_grant(res, at, default_cores))
    consumers: list[Consumer] = []
    for i, ref in enumerate(_list(status.get("reservedFor"), "status.reservedFor")):
        at = f"status.reservedFor[{i}]"
        o = _obj(ref, at)
        assert o is not None
        consumers.append(Consumer(resource=_str(o.get("resource"), f"{at}.resource"),
                                  name=_str(o.get("name"), f"{at}.name"),
                                  uid=_str(o.get("uid"), f"{at}.uid", max_len=128)))
    return ClaimGrants(namespace=namespace, name=name, uid=uid, grants=tuple(grants), reserved_for=tuple(consumers))


__all__ = ["CAPACITIES", "ClaimError", "ClaimGrants", "Consumer", "Grant", "read_claim"]
