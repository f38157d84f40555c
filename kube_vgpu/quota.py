"""GPU quota per namespace, counted on what the scheduler actually books.

Kubernetes' own ResourceQuota admission counts only the numbers written in a pod spec, so a pod
asking ``nvidia.com/gpumem-percentage`` (or relying on a default) books memory that admission never
sees. The extender therefore counts, per namespace, the GPU memory (MiB) and compute (percent
units: 2 GPUs at 30 % = 60) of every booking and promise, after percentages and defaults are
resolved, and holds it against the ``spec.hard`` of every ResourceQuota in the namespace that names
one of these keys (``R`` = the configured memory or cores resource name, e.g.
``nvidia.com/gpumem``)::

    requests.R    limits.R    R

All three mean the same here (a vGPU request's limit is its request). The tightest hard value of
all quotas in the namespace applies. Pure functions and small value types; the cache keeps the
quota objects (:class:`QuotaBook`), the extender asks :func:`exceeded` at filter and bind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ShapeError
from .model import ContainerRequest
from .quantity import QuantityError, parse_quantity
from .resources import ResourceNames
from .views import ObjectView, obj_field

#: the key prefixes under which a ResourceQuota may name an extended resource
PREFIXES = ("requests.", "limits.", "")


@dataclass(frozen=True, slots=True)
class Amount:
    """GPU memory (MiB) and compute (percent units) booked or asked. ``whole``: the GPUs among them
    that may be booked in full, ``(node, gpu uuid, MiB booked there, percent booked there)``: a GPU
    whose compute is all booked takes no other pod, so a memory quota charges its whole memory
    (:meth:`kube_vgpu.cluster.ClusterCache.quota_failure` resolves the sizes)."""

    mib: int = 0
    cores: int = 0
    whole: tuple[tuple[str, str, int, int], ...] = ()

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.mib + other.mib, self.cores + other.cores, self.whole + other.whole)


@dataclass(frozen=True, slots=True)
class Limit:
    """One hard value of one ResourceQuota: ``quota`` (its name), ``key`` (as written in
    ``spec.hard``), ``what`` (``mib`` or ``cores``), ``hard`` (MiB or percent units)."""

    quota: str
    key: str
    what: str
    hard: int


@dataclass(frozen=True, slots=True)
class Exceeded:
    """A quota the request would exceed: namespace, the limit, what is used and what is asked
    (both in the limit's unit)."""

    namespace: str
    limit: Limit
    used: int
    asked: int

    def text(self) -> str:
        """``namespace team-a, ResourceQuota gpu: limits.nvidia.com/gpumem used 16000 + asked
        16000 > hard 24000``."""
        lim = self.limit
        return (f"namespace {self.namespace}, ResourceQuota {lim.quota}: {lim.key} used {self.used} + asked "
                f"{self.asked} > hard {lim.hard}")


def limits_of(quota: Mapping[str, Any], names: ResourceNames) -> list[Limit]:
    """The hard values of a ResourceQuota object (JSON) for our memory and cores resources.
    A fractional value is held as its whole part (``requests.``-prefixed keys are not integer
    resources to kube-apiserver's validation, so ``requests.R: 1500500m`` can get through; reading it
    as "no limit" would fail open); a value that is not a quantity, or is negative, is skipped (the API server rejects both)."""
    try:
        view = ObjectView.of(quota)
        hard, name = obj_field(view.spec.get("hard"), "spec.hard"), view.name
    except ShapeError:  # not a ResourceQuota the API server would serve: it limits nothing
        return []
    out: list[Limit] = []
    for what, res in (("mib", names.gpumem), ("cores", names.gpucores)):
        for prefix in PREFIXES:
            key = prefix + res
            raw = hard.get(key)
            if raw is None:
                continue
            try:
                q = parse_quantity(str(raw))
            except QuantityError:
                continue
            if q < 0:
                continue
            out.append(Limit(name, key, what, int(q)))  # floor: asked amounts are whole numbers
    return out


class QuotaBook:
    """The ResourceQuotas of the cluster as far as our resources go (fed by a watch of
    ResourceQuotas); ``names``: the configured resource names (:meth:`set_names` on a reload)."""

    def __init__(self, names: ResourceNames):
        self.names = names
        #: (namespace, name) -> the quota's ``spec.hard`` (only quotas naming one of our keys)
        self._hard: dict[tuple[str, str], Mapping[str, Any]] = {}
        #: namespace -> every limit there
        self._limits: dict[str, list[Limit]] = {}

    def on_quota(self, kind: str, quota: Mapping[str, Any]) -> None:
        """Apply a ResourceQuota watch event (ADDED | MODIFIED | DELETED) or list item."""
        view = ObjectView(quota)
        ns, name = view.namespace, view.name
        if kind != "DELETED" and limits_of(quota, self.names):
            self._hard[(ns, name)] = quota
        elif self._hard.pop((ns, name), None) is None:
            return
        self._derive(ns)

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        """A relist: exactly these quotas."""
        self._hard, self._limits = {}, {}
        for q in items:
            self.on_quota("ADDED", q)

    def set_names(self, names: ResourceNames) -> None:
        """The resource names changed (config reload): read every quota again under them."""
        if names == self.names:
            return
        kept = list(self._hard.values())
        self.names = names
        self.replace(kept)

    def _derive(self, ns: str) -> None:
        lims = [lim for (qns, _), q in sorted(self._hard.items()) if qns == ns for lim in limits_of(q, self.names)]
        if lims:
            self._limits[ns] = lims
        else:
            self._limits.pop(ns, None)

    def limits(self, namespace: str) -> list[Limit]:
        """Every limit that applies in ``namespace`` (empty: no GPU quota there)."""
        return self._limits.get(namespace, [])

    def namespaces(self) -> list[str]:
        """The namespaces with a GPU quota, sorted."""
        return sorted(self._limits)


def exceeded(namespace: str, limits: Iterable[Limit], used: Amount, asked: Amount) -> Exceeded | None:
    """The first limit (tightest first) that ``used + asked`` goes over, or None when all hold.
    A request that asks nothing of a quantity never exceeds its limit (a namespace already over
    its quota, e.g. after the quota was lowered, still runs pods that ask no GPU memory)."""
    worst: Exceeded | None = None
    for lim in limits:
        u, a = (used.mib, asked.mib) if lim.what == "mib" else (used.cores, asked.cores)
        if a > 0 and u + a > lim.hard and (worst is None or lim.hard - u < worst.limit.hard - worst.used):
            worst = Exceeded(namespace, lim, u, a)
    return worst


def uncapped_compute(namespace: str, limits: Iterable[Limit], containers: Iterable[ContainerRequest],
                     resource: str) -> str | None:
    """Why a pod may not run where a compute quota applies, or None. A container that asks ``0``
    percent (``resource`` unset with ``defaults.cores: 0``, or written as 0) books no compute but
    runs with no SM limit: it may use the whole GPU. Where any of ``limits`` counts compute, such
    a container is refused, as kube-apiserver refuses a pod without a CPU limit where a
    ``limits.cpu`` quota applies. ``resource``: the configured compute resource name."""
    lim = next((x for x in limits if x.what == "cores"), None)
    if lim is None:
        return None
    bad = next((c.name for c in containers if c.cores <= 0), None)
    if bad is None:
        return None
    return (f"namespace {namespace}, ResourceQuota {lim.quota}: {lim.key} limits GPU compute, and container "
            f"{bad} asks no {resource} (0 or unset: no compute limit, the whole GPU); set {resource} to 1-100")


def usage_of(entries: Iterable[tuple[int, int, int, int]]) -> Amount:
    """The Amount of a booking's or promise's per-GPU usage tuples (index, MiB, cores, slots)."""
    mib = cores = 0
    for _, m, c, _s in entries:
        mib += m
        cores += c
    return Amount(mib, cores)
