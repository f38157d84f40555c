"""The pods and containers behind kubelet's device plugin calls (pure functions, no I/O).

The scheduler extender records, on each pod it binds, the GPUs it booked per container
(``kube-vgpu.io/allocation``, signed) and sets ``kube-vgpu.io/bind-phase=allocating``.

* PreStartContainer (exact): kubelet's PodResources API names the pod and container holding the
  device IDs; :func:`identified` takes that container's booking from the pod's trusted view and
  :func:`check_assignment` checks the IDs are on exactly the booked GPUs.
* GetPreferredAllocation (a guess that only steers kubelet's choice): :func:`pending_containers`
  lists the containers kubelet may be allocating now, in admission order, and
  :func:`preferred_allocation` answers with slots on the first one's GPUs. :func:`with_held` removes
  the containers kubelet already holds devices for (PodResources).

Facts about kubelet the guess relies on: kubelet admits pods one at a time and, for each pod,
allocates its containers in spec order (init containers first), so for every pending pod only its
*next* pending container can be the one being allocated; it calls GetPreferredAllocation right
before Allocate for the same container.

Admission order. Which pending pod kubelet is admitting now is guessed from the order pods became
bound to the node, and the bind-time annotation is *not* that order: the scheduler extender writes
it before it posts the Binding, so two concurrent binds can commit in the opposite order, and kubelet
sees pods in the order their ``spec.nodeName`` appeared (its watch, i.e. etcd order). So the plugin
watches the pods of its node and gives each pod an :class:`Arrival` (a sequence number) the first time
it sees it bound; :func:`pending_containers` orders by arrival. Pods already bound when the plugin
started (the initial list) have no sequence number: they come first, ordered by the ``PodScheduled``
condition's ``lastTransitionTime``, then bind time. A pending pod is *demoted* (ordered after every
other pending pod, and so never the target of a preference while another pod of that size waits)

* when a pod that arrived after it has already had a container allocated: kubelet admits pods one at
  a time in arrival order, so a pod it skipped is not the one being admitted now (it was rejected by
  another admission handler, or its phase just has not turned Failed yet); or
* when it has stayed pending for longer than ``stale_after`` seconds since it was first seen bound.

Trust. Pod annotations can be written by the pod's owner, so nothing in them is taken on its word
(:func:`trusted_view`): a pod's allocation record counts only when its
``kube-vgpu.io/allocation-signature`` verifies for the pod's uid, this node, its bind-time and the
exact record (the scheduler extender wrote it), and its progress (``kube-vgpu.io/bind-phase``,
``kube-vgpu.io/allocated-containers``) only when the ``kube-vgpu.io/progress-signature`` this plugin
wrote verifies; otherwise the plugin's own in-memory record of what it wrote, else "just bound,
nothing allocated". A pod kubelet has already admitted (it has container statuses) has nothing
pending. A GPU pod on this node without a verified record (no record, forged, edited, copied from
another pod, or bound by another scheduler or a preset ``spec.nodeName``) is *refused*: it keeps its
place in the admission order (with no devices) and :func:`identified` refuses it with a message
naming the pod and the reason.

Pod objects are Kubernetes API JSON (``dict``, camelCase keys) as returned by ``GET /api/v1/pods``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kube_vgpu import envcontract
from kube_vgpu.codec import allocation_or_none, decode_allocation, read_allocation
from kube_vgpu.errors import CodecError, QuantityError
from kube_vgpu.model import DeviceBooking
from kube_vgpu.podspec import whole_resource
from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    BIND_ALLOCATING,
    BIND_SUCCESS,
    ResourceNames,
    system_owned,
)
from kube_vgpu.signing import KeyRing, verify_record, verify_record_progress
from kube_vgpu.views import ContainerView, PodView

__all__ = ["ANN_ALLOCATED_CONTAINERS"]

#: separator between the GPU uuid and the slot number in advertised device IDs (``GPU-..::3``)
SLOT_SEP = "::"


class MatchError(Exception):
    """A container cannot be given limits (unknown holder, untrusted pod, no booking, GPUs other than
    the booked ones, 0 MiB); the message names the pod and container and says why."""


def slot_id(uuid: str, k: int) -> str:
    """The device ID of vGPU slot ``k`` (0-based) of the GPU ``uuid``: ``<uuid>::<k>``."""
    return f"{uuid}{SLOT_SEP}{k}"


def slot_uuid(device_id: str) -> str:
    """The physical GPU uuid behind a slot ID (an ID without ``::`` is taken as a uuid itself)."""
    return device_id.rsplit(SLOT_SEP, 1)[0]


#: the slot part of a dynamic-MIG placement's device ID starts with this
MIG_SLOT_PREFIX = "mig-"


def mig_slot_id(uuid: str, profile: str, start: int) -> str:
    """The device ID of one MIG placement of a GPU in dynamic-MIG mode (docs/mig.md):
    ``<uuid>::mig-<profile>@<first memory slice>``, e.g. ``GPU-..::mig-1g.18gb@6``."""
    return f"{uuid}{SLOT_SEP}{MIG_SLOT_PREFIX}{profile}@{start}"


def mig_slot_placement(device_id: str) -> tuple[str, int] | None:
    """(profile, first memory slice) of a dynamic-MIG placement ID (:func:`mig_slot_id`), or None
    for any other ID."""
    _, sep, slot = device_id.rpartition(SLOT_SEP)
    if not sep or not slot.startswith(MIG_SLOT_PREFIX):
        return None
    profile, at, start = slot[len(MIG_SLOT_PREFIX):].rpartition("@")
    if not at or not profile or not start.isdigit():
        return None
    return profile, int(start)


@dataclass(frozen=True, slots=True)
class PendingContainer:
    """A GPU container bound to this node whose Allocate has not been answered yet.

    devices: the scheduler's bookings in visible-device order (memory MiB, cores percent);
    disable_control: the container's env opts out (``CUDA_DISABLE_CONTROL`` ``true``/``1``, see
    :func:`disables_control`); priority: the
    container's ``nvidia.com/priority`` limit or None; in_progress: some other container of the pod
    was already allocated; allocated: names already allocated in the pod; remaining: names still
    pending in the pod *including* this one; order: sort key (admission order); demoted: the pod
    is no longer believed to be next in kubelet's admission queue (see the module docstring), it sorts
    after every candidate that is not.
    """

    namespace: str
    pod: str
    uid: str
    container: str
    init: bool
    devices: tuple[DeviceBooking, ...]
    disable_control: bool
    priority: int | None
    in_progress: bool
    allocated: tuple[str, ...]
    remaining: tuple[str, ...]
    order: tuple[Any, ...]
    demoted: bool = False
    #: the container requests the gpu resource but the allocation record books no GPU for it
    #: (``devices`` is empty); kubelet will ask for it, and it must be refused, never matched elsewhere
    unbooked: bool = False
    #: why the pod has no trusted allocation record ("" = it has one): kubelet may be asking for
    #: this container, and it must be refused, never matched to another pod's booking
    refused: str = ""
    #: GPUs the container asks for (its gpu resource), for refused containers (None: unreadable)
    want: int | None = None

    @property
    def key(self) -> str:
        """``namespace/pod/container``."""
        return f"{self.namespace}/{self.pod}/{self.container}"

    @property
    def uuids(self) -> frozenset[str]:
        return frozenset(d.uuid for d in self.devices)

    def fits(self, n: int) -> bool:
        """Whether a kubelet request for ``n`` devices may be for this container."""
        if self.refused:
            return self.want is None or self.want == n
        return self.unbooked or len(self.devices) == n

    def describe(self) -> str:
        if self.refused:
            return f"{self.key} [refused: {self.refused}]"
        if self.unbooked:
            return f"{self.key} [no GPU booked]"
        devs = ", ".join(f"{d.uuid} {d.memory_mib}MiB {d.cores}%" for d in self.devices)
        extra = " control disabled" if self.disable_control else ""
        return f"{self.key} [{devs}]{extra}"


def _ann(pod: Mapping[str, Any] | PodView) -> Mapping[str, Any]:
    return PodView.of(pod).annotations


def allocated_names(pod: Mapping[str, Any] | PodView) -> tuple[str, ...]:
    """Container names recorded in ``kube-vgpu.io/allocated-containers`` (order kept, no blanks)."""
    raw = _ann(pod).get(ANN_ALLOCATED_CONTAINERS, "")
    return tuple(n for n in (s.strip() for s in raw.split(",")) if n)


def _requests_gpu(ctr: Mapping[str, Any], gpu: str) -> bool:
    """Whether the container asks for ``gpu`` (a whole count > 0, read by podspec's exact rule); a
    value that is not a whole quantity still names the resource (the webhook and the extender
    refuse such a pod, kubelet would still call Allocate for it)."""
    try:
        n = whole_resource(ctr, gpu)
    except QuantityError:
        return True
    return n is not None and n > 0


def _int_resource(ctr: Mapping[str, Any], name: str) -> int | None:
    """Resource ``name`` of a container by podspec's exact whole-number rule, or None when absent
    or not a whole number (the webhook and the extender report bad values)."""
    try:
        return whole_resource(ctr, name)
    except QuantityError:
        return None


def disables_control(value: Any) -> bool:
    """Whether a ``CUDA_DISABLE_CONTROL`` value opts out of enforcement: exactly what the shim accepts
    (``libvgpu/src/core.c``): ``true`` in any case, or ``1``. The one place the plugin decides this."""
    v = "" if value is None else str(value)
    return v.lower() == "true" or v == "1"


def _disable_control(ctr: Mapping[str, Any]) -> bool:
    for e in ctr.get("env") or ():
        if e.get("name") == envcontract.DISABLE_CONTROL and disables_control(e.get("value")):
            return True
    return False


def _float(v: Any, default: float) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


@dataclass(frozen=True, slots=True)
class Arrival:
    """When this plugin first saw a pod bound to its node.

    seq: a number that increases with every pod seen (watch order = the order kubelet sees pods), or
    None for a pod that was already bound when the plugin started (the initial list); seen: the
    monotonic clock at that moment (the start of the staleness period).
    """

    seq: int | None
    seen: float


def _scheduled_time(pod: PodView) -> str:
    """``lastTransitionTime`` of the pod's ``PodScheduled=True`` condition (RFC 3339, sorts as text), or ""."""
    for c in pod.conditions():
        if c.get("type") == "PodScheduled" and c.get("status") == "True":
            return str(c.get("lastTransitionTime") or "")
    return ""


def arrival_key(pod: Mapping[str, Any] | PodView, arrivals: Mapping[str, Arrival] | None) -> tuple[Any, ...]:
    """Sort key for the order in which ``pod`` became bound to the node (the order kubelet admits in).

    Pods from the initial list (or every pod, when ``arrivals`` is None) come first, by PodScheduled
    time, then bind time (``kube-vgpu.io/bind-time``, else the allocation record's time, else 0),
    creation time, namespace, name; then pods seen arriving, by sequence number; then pods not seen
    yet (a listing can be ahead of the watch), by the same fallback as the initial list.
    """
    view = PodView.of(pod)
    ann = view.annotations
    rec_time = 0.0
    if ANN_BIND_TIME not in ann:
        rec = allocation_or_none(view)
        rec_time = rec.time if rec is not None else 0.0
    fallback = (_scheduled_time(view), _float(ann.get(ANN_BIND_TIME), rec_time),
                view.creation_timestamp, view.namespace, view.name)
    if arrivals is None:
        return (0, 0, *fallback)
    a = arrivals.get(view.uid)
    if a is None:
        return (2, 0, *fallback)
    if a.seq is None:
        return (0, 0, *fallback)
    return (1, a.seq, *fallback)


@dataclass(frozen=True, slots=True)
class Progress:
    """What this plugin wrote on a pod: for the record with ``allocation_signature``, the bind
    phase and the containers it answered Allocate for (kept in memory: a tenant cannot edit it)."""

    allocation_signature: str
    phase: str
    containers: tuple[str, ...]


def trusted_view(pods: Iterable[Mapping[str, Any]], node: str, ring: KeyRing,
                 written: Mapping[str, Progress] | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The pods bound to ``node`` as far as their annotations can be trusted (pure, no I/O).

    Returns (views, refused). Each view is a shallow copy of a pod whose system-owned annotations
    (``kube-vgpu.io/...``, see :func:`kube_vgpu.resources.system_owned`) are replaced by trusted
    values: for a pod whose allocation signature verifies (uid, ``node``, bind-time, the exact
    record) the record, its signature and bind-time, and as progress the annotations' bind-phase
    and allocated-containers if the progress signature verifies, else ``allocating`` with nothing
    allocated; joined with ``written`` (this plugin's own record per uid, for the same allocation
    signature). A pod kubelet has admitted (container statuses) shows every container allocated.
    refused: uid -> reason, for pods without a trusted record (their views carry no record).
    ``ring``: the current key ring; ``written``: uid -> :class:`Progress`.
    """
    written = written or {}
    views: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    for pod in pods:
        pv = PodView.of(pod)
        if pv.node_name != node:
            continue
        uid = pv.uid
        raw = pv.annotations
        ann: dict[str, str] = {k: v for k, v in raw.items() if not system_owned(k)}
        text = raw.get(ANN_ALLOCATION)
        sig = raw.get(ANN_ALLOCATION_SIGNATURE)
        v = verify_record(ring, raw, uid, node)
        why = "" if v.ok else v.reason
        if v.ok:
            try:
                rec_node = decode_allocation(str(text)).node
            except CodecError as e:
                why = f"allocation record undecodable: {e}"
            else:
                if rec_node != node:
                    why = f"allocation record is for node {rec_node!r}, the pod is bound to {node!r}"
        mine = written.get(uid)
        done: tuple[str, ...] = ()
        phase = BIND_ALLOCATING
        if why:
            refused[uid] = why
            if mine is not None:  # allocated by us, then its record was edited: what we answered stays done
                done = mine.containers
        else:
            assert isinstance(text, str) and isinstance(sig, str)
            ann.update({ANN_ALLOCATION: text, ANN_ALLOCATION_SIGNATURE: sig})
            if ANN_BIND_TIME in raw:
                ann[ANN_BIND_TIME] = str(raw[ANN_BIND_TIME])
            p_phase, p_done = raw.get(ANN_BIND_PHASE), raw.get(ANN_ALLOCATED_CONTAINERS)
            if verify_record_progress(ring, raw, uid, sig):
                phase = str(p_phase or BIND_ALLOCATING)
                done = tuple(n for n in (x.strip() for x in str(p_done or "").split(",")) if n)
            if mine is not None and mine.allocation_signature == sig:
                done = done + tuple(n for n in mine.containers if n not in done)
                if mine.phase == BIND_SUCCESS:
                    phase = BIND_SUCCESS
        if pv.admitted:  # kubelet has admitted it (status written only by kubelet): every Allocate is done
            names = [c.name for c in pv.all_containers()]
            done = done + tuple(n for n in names if n and n not in done)
            phase = BIND_SUCCESS
        if not why:
            ann[ANN_BIND_PHASE] = phase
        if done:
            ann[ANN_ALLOCATED_CONTAINERS] = ",".join(done)
        view = dict(pv.raw)
        view["metadata"] = {**pv.meta, "annotations": ann}
        views.append(view)
    return views, refused


def pending_containers(pods: Iterable[Mapping[str, Any]], node: str,
                       names: ResourceNames | None = None, *,
                       arrivals: Mapping[str, Arrival] | None = None,
                       now: float | None = None, stale_after: float | None = None,
                       refused: Mapping[str, str] | None = None) -> list[PendingContainer]:
    """The next pending GPU container of every pod waiting for Allocate on ``node``, in admission order.

    A pod counts when it is not being deleted, its phase is not Succeeded/Failed, its bind phase is
    ``allocating``, its allocation record decodes and names ``node``. Its pending containers are the
    recorded containers with devices, not yet in ``kube-vgpu.io/allocated-containers``, that still
    exist in the spec and request the gpu resource (kubelet only calls Allocate for those), ordered as
    kubelet visits them (init containers, then app containers, each in spec order). Pods with an
    undecodable record are skipped (the scheduler owns that record).

    Order: pods part-way through first, then pods not demoted, then demoted ones, each by
    :func:`arrival_key`. arrivals: per pod uid, from the plugin's pod watch (None: order by the
    initial-list fallback only, and no staleness). A pod not part-way through is demoted when a pod
    with a later arrival key already has a container allocated, or when ``now - seen`` exceeds
    ``stale_after`` (both given, and the pod has an arrival).

    refused: uid -> reason for pods without a trusted record (from :func:`trusted_view`, whose views
    ``pods`` should be): their next GPU container not yet allocated is listed too, with no devices,
    ``refused`` set and ``want`` its GPU count, so that it takes its place in the admission order.
    """
    refused = refused or {}
    names = names or ResourceNames()
    views = [PodView.of(p) for p in pods]
    # the latest arrival among pods kubelet already admitted (a container allocated by us)
    admitted_keys = [arrival_key(p, arrivals) for p in views
                     if allocated_names(p) and p.node_name in ("", node)]
    latest_admitted = max(admitted_keys) if admitted_keys else None
    out: list[PendingContainer] = []
    for pod in views:
        ann = pod.annotations
        if not pod.active:
            continue
        why = refused.get(pod.uid, "")
        if why:
            if pod.node_name != node:
                continue
            alloc = None
        else:
            if ann.get(ANN_BIND_PHASE) != BIND_ALLOCATING or ANN_ALLOCATION not in ann:
                continue
            if pod.node_name not in ("", node):
                continue
            alloc = allocation_or_none(pod)
            if alloc is None or alloc.node != node:
                continue
        done = allocated_names(pod)
        pending: list[tuple[ContainerView, tuple[DeviceBooking, ...]]] = []
        for ctr in pod.all_containers():
            name = ctr.name
            rec = alloc.container(name, ctr.init) if alloc is not None else None
            if name in done or not _requests_gpu(ctr.raw, names.gpu):
                continue
            # a GPU container without a booking stays pending (devices empty): kubelet allocates it in
            # this order, so the guess must not skip to the next container (identified() refuses it)
            pending.append((ctr, rec.devices if rec is not None else ()))
        if not pending:
            continue
        ctr, devices = pending[0]
        in_progress = bool(done)
        akey = arrival_key(pod, arrivals)
        demoted = False
        if not in_progress:
            if latest_admitted is not None and latest_admitted > akey:
                demoted = True  # kubelet admitted a pod bound after this one: it skipped this one
            a = (arrivals or {}).get(pod.uid)
            if a is not None and now is not None and stale_after is not None and now - a.seen > stale_after:
                demoted = True
        out.append(PendingContainer(
            namespace=pod.namespace, pod=pod.name, uid=pod.uid,
            container=ctr.name, init=ctr.init, devices=devices,
            disable_control=_disable_control(ctr.raw), priority=_int_resource(ctr.raw, names.priority),
            in_progress=in_progress, allocated=done, remaining=tuple(p[0].name for p in pending),
            order=(0 if in_progress else 1, 1 if demoted else 0, *akey), demoted=demoted,
            unbooked=not devices and not why, refused=why, want=_int_resource(ctr.raw, names.gpu) if why else None))
    out.sort(key=lambda p: p.order)
    return out


def identified(pod: Mapping[str, Any] | PodView, container: str, node: str, names: ResourceNames | None = None, *,
               refused: str = "") -> PendingContainer:
    """The container ``container`` of ``pod`` (a :func:`trusted_view` view), which kubelet's
    PodResources API named as the holder of a device set: its booking from the verified record.

    refused: the reason ``pod`` has no trusted record ("" = it has one). ``allocated`` lists the
    pod's containers already recorded as started (not ``container``), ``remaining`` its GPU
    containers not recorded yet, ``container`` included. Raises MatchError (naming the pod and the
    container) when the pod is refused, the container is not in its spec or does not request the gpu
    resource, the record does not decode or names another node, or no GPU is booked for it.
    """
    names = names or ResourceNames()
    view = PodView.of(pod)
    ns, name, uid = view.namespace, view.name, view.uid
    where = f"pod {ns}/{name} container {container}"
    if refused:
        raise MatchError(f"{where}: {refused}; refusing to start it with GPUs: only a pod the kube-vgpu "
                         f"scheduler placed on this node (with a verified {ANN_ALLOCATION_SIGNATURE}) is served "
                         f"(it did not place this pod on this node)")
    ctrs = view.all_containers()
    found = next((c for c in ctrs if c.name == container), None)
    if found is None:
        raise MatchError(f"{where}: no such container in the pod's spec")
    ctr, init = found.raw, found.init
    if not _requests_gpu(ctr, names.gpu):
        raise MatchError(f"{where}: does not request {names.gpu} in its spec, yet kubelet assigned it GPUs")
    try:
        alloc = read_allocation(view)
    except CodecError as e:
        raise MatchError(f"{where}: allocation record undecodable: {e}") from e
    if alloc is None:
        raise MatchError(f"{where}: no allocation record ({ANN_ALLOCATION})")
    if alloc.node != node:
        raise MatchError(f"{where}: allocation record is for node {alloc.node!r}, not {node!r}")
    rec = alloc.container(container, init)
    done = tuple(n for n in allocated_names(view) if n != container)
    pending = tuple(c.name for c in ctrs if _requests_gpu(c.raw, names.gpu) and c.name not in done)
    pc = PendingContainer(namespace=ns, pod=name, uid=uid, container=container, init=init,
                          devices=rec.devices if rec is not None else (), disable_control=_disable_control(ctr),
                          priority=_int_resource(ctr, names.priority), in_progress=bool(done), allocated=done,
                          remaining=pending, order=(), unbooked=rec is None or not rec.devices)
    if pc.unbooked:
        raise MatchError(f"{where}: requests the GPU resource but no GPU is booked for it in {ANN_ALLOCATION}; "
                         f"refusing to hand out an unlimited limit")
    return pc


def check_assignment(pc: PendingContainer, device_ids: Sequence[str]) -> None:
    """Whether kubelet's device IDs for the identified container ``pc`` are on exactly the GPUs
    booked for it, and the booking can be enforced.

    Raises MatchError naming the pod, container, booked and assigned GPUs when they differ (kubelet
    chose GPUs the guess of GetPreferredAllocation meant for another pod: starting the container
    would put it on GPUs booked for someone else), or when a GPU is booked with 0 MiB (the shim
    would read 0 as no limit) and the container did not opt out.
    """
    where = f"pod {pc.namespace}/{pc.pod} container {pc.container}"
    assigned = sorted({slot_uuid(i) for i in device_ids})
    booked = sorted(pc.uuids)
    if assigned != booked or len(device_ids) != len(pc.devices):
        raise MatchError(f"{where}: kubelet assigned GPUs {', '.join(assigned)} (device IDs "
                         f"{', '.join(sorted(device_ids))}) but the scheduler booked {', '.join(booked)} for it; "
                         f"refusing to start it on GPUs booked for another pod (no limits written). The pod "
                         f"must be recreated (delete it; its controller makes a new one)")
    # a dynamic-MIG booking is one placement: kubelet's ID must be exactly it (another placement is
    # another pod's instance, or one the scheduler did not book)
    by_gpu = {slot_uuid(i): mig_slot_placement(i) for i in device_ids}
    for d in pc.devices:
        want = (d.profile, d.start) if d.profile else None
        if by_gpu.get(d.uuid) != want:
            got = by_gpu.get(d.uuid)
            raise MatchError(f"{where} GPU {d.uuid}: kubelet assigned "
                             f"{'MIG placement ' + got[0] + '@' + str(got[1]) if got else 'a vGPU slot'} but the "
                             f"scheduler booked {'MIG placement ' + d.profile + '@' + str(d.start) if d.profile else 'a vGPU slot'}; "
                             f"refusing to start it on an instance booked for another pod (no limits written)")
    if not pc.disable_control:
        zero = [d.uuid for d in pc.devices if d.memory_mib <= 0]
        if zero:
            raise MatchError(f"{where} GPU {', '.join(zero)}: 0 MiB booked; refusing to hand out an unlimited "
                             f"limit (the shim reads 0 as no limit)")


def with_held(views: Iterable[Mapping[str, Any]], held: Mapping[tuple[str, str], Iterable[str]]) -> list[dict[str, Any]]:
    """``views`` with the containers kubelet already holds devices for (``held``: (namespace, pod
    name) -> container names, from kubelet's PodResources API) added to their allocated containers,
    so that GetPreferredAllocation does not guess a container kubelet has already served (pure)."""
    out = []
    for v in views:
        pv = PodView.of(v)
        extra = list(held.get((pv.namespace, pv.name), ()))
        if not extra:
            out.append(dict(v))
            continue
        done = list(allocated_names(pv))
        done += [n for n in extra if n not in done]
        ann = {**pv.annotations, ANN_ALLOCATED_CONTAINERS: ",".join(done)}
        out.append({**v, "metadata": {**pv.meta, "annotations": ann}})
    return out


def preferred_allocation(available: Sequence[str], must_include: Sequence[str], size: int,
                         candidates: Sequence[PendingContainer]) -> tuple[list[str], PendingContainer | None]:
    """Answer one GetPreferredAllocation container request.

    Picks the first candidate (admission order: part-way pods first, demoted pods last) with ``size``
    GPUs, and returns
    ``size`` IDs from ``available``: the ``must_include`` IDs, then the lowest free slot of each booked
    GPU not yet covered, then other available IDs (one per GPU not yet covered first). Returns (ids, the candidate the answer was made for, or None).
    """
    chosen: list[str] = [i for i in must_include if i in available][:size]
    target = next((c for c in candidates if (c.refused and c.fits(size)) or (c.devices and len(c.devices) == size)),
                  None)
    if target is not None:
        covered = {slot_uuid(i) for i in chosen}
        for d in target.devices:
            if len(chosen) >= size or d.uuid in covered:
                continue
            slots = sorted((i for i in available if slot_uuid(i) == d.uuid and i not in chosen
                            and mig_slot_placement(i) == ((d.profile, d.start) if d.profile else None)),
                           key=_slot_sort_key)
            if slots:
                chosen.append(slots[0])
                covered.add(d.uuid)
    # fill up: one slot per GPU not yet covered first (a container wants distinct GPUs), then any
    for distinct in (True, False):
        for i in sorted(available, key=_slot_sort_key):
            if len(chosen) >= size:
                break
            if i in chosen or (distinct and slot_uuid(i) in {slot_uuid(x) for x in chosen}):
                continue
            chosen.append(i)
    return chosen, target


def _slot_sort_key(device_id: str) -> tuple[str, int]:
    uuid, _, k = device_id.rpartition(SLOT_SEP)
    try:
        return (uuid, int(k))
    except ValueError:
        return (device_id, 0)
