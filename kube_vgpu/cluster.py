"""The cluster as vGPU placement sees it: nodes and vGPU pods (as list+watch or a snapshot give
them) turned into an incremental ClusterState with its bookings. The scheduler extender keeps one
live; ``kubectl vgpu simulate`` loads one from a snapshot (components share it from here, never
from each other).

All methods are synchronous and must run on one thread (the service's event loop): the placement
engine's :class:`~kube_vgpu.placement.ClusterState` is not thread-safe, and running
``plan_for`` + ``book`` without an ``await`` in between is what makes concurrent binds to one node
safe (no lock needed).

Inputs are plain ``core/v1`` JSON dicts (``Node``, ``Pod``) exactly as the API server sends them.

Rules:

* A node is a placement candidate only if it carries a decodable ``kube-vgpu.io/node-inventory``
  annotation whose heartbeat is younger than ``scheduling.inventoryStaleSeconds`` and its
  ``status.allocatable[<gpu resource>]`` is > 0; otherwise :attr:`ClusterCache.unavailable` holds
  the reason shown to kube-scheduler. An unavailable node keeps its bookings.
* A pod's booking comes from its ``kube-vgpu.io/allocation`` annotation (restart recovery, other
  replicas' binds: booked with ``check=False``) or from the extender's own bind (``scheduler/bindstate.py``).
* Only records the vGPU system wrote are booked: the ``kube-vgpu.io/allocation-signature`` must
  verify (:mod:`kube_vgpu.signing`) for the pod's uid, its ``spec.nodeName`` (the record's node
  while unbound), its bind-time and the exact allocation text. An unsigned, badly signed or
  replayed record books nothing and is logged once per pod uid (``on_reject`` counts it). A pod
  booked from a verified record keeps that booking whatever later happens to its annotations
  (edited, removed, replaced) until it is deleted or finishes: tenant edits can neither free
  capacity nor reserve any. Without keys (``keys=None``: an offline snapshot view such as
  ``kubectl vgpu simulate``, never the extender) a record that decodes is taken as written.
* Upgrade from unsigned records (``scheduling.adoptUnsignedBefore``): an unsigned record of a pod
  bound, naming this scheduler and created before that time is booked too, and ``on_resign`` asks
  the service to sign it; so is a record signed with a key that is no longer the active one.
* A signed record is still checked against the pod's own (immutable) request on the node's GPUs
  (number of devices, ``memory_on``/``cores_on`` per device); on a mismatch a warning is logged and
  the request is booked on the recorded GPUs, never less than either says (missing or unknown GPUs
  are completed with other GPUs of the node). A request that cannot be parsed keeps the record's
  values (never below zero).
* Pods deleted, or in phase Succeeded/Failed, release their booking at once; terminating pods
  (``deletionTimestamp`` set) keep it until the DELETED event.
* No bind waits for the device plugin: the plugin identifies each container exactly through
  kubelet's PodResources API (docs/device-plugin.md), so several pods may be bound to a node and
  pending device allocation at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .codec import decode_allocation, decode_inventory, read_allocation
from .config import Config, rfc3339_seconds
from .cordon import apply_cordon, cordoned_tokens
from .errors import CodecError, QuantityError
from .mig import TABLES, instance_cores
from .model import ContainerAllocation, DeviceBooking, PodAllocation, PodRequest
from .placement import Booking, ClusterState, OvercommitError
from .placement.fastpath import NO_INVENTORY, ExtenderEngine
from .placement.liveshapes import default_shapes
from .placement.state import NodeState
from .placement.status import Code, FitFailure
from .podspec import parse_pod
from .quantity import parse_quantity
from .quota import Amount, QuotaBook, exceeded, uncapped_compute, usage_of
from .resources import (
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_TIME,
    ANN_NODE_INVENTORY,
    ANN_PROGRESS_SIGNATURE,
)
from .signing import MISSING, VERSION, KeySource, verify_record, verify_record_progress
from .taints import Taint, node_taints
from .views import NodeView, PodView

log = logging.getLogger("kube_vgpu.cluster")

@dataclass(slots=True)
class NodeInfo:
    """What the cache keeps of a Node: heartbeat (unix s), allocatable vGPU slots, inventory state."""

    heartbeat: float = 0.0
    allocatable: int = 0
    inventory_error: str | None = None
    has_inventory: bool = False
    #: taints that keep pods off the node (NoSchedule, NoExecute; ``spec.unschedulable`` as one)
    taints: tuple[Taint, ...] = ()


@dataclass(slots=True)
class PodInfo:
    """What the cache keeps of a vGPU pod with an allocation annotation."""

    uid: str
    node: str
    bound: bool
    allocation: PodAllocation  #: as the annotation says (what is booked may be more, see module doc)
    request: PodRequest | None = None  #: the pod's parsed request; None: unparseable or unknown
    #: key id that signed the record it was booked from (None: our own bind, not seen back yet, or
    #: booked without a signed record: adopted, running pod's request, no keys)
    kid: str | None = None
    #: ``spec.priority`` (set by the API server's Priority admission from the PriorityClass, immutable;
    #: 0 when absent, as kube-scheduler reads it); None until a watch event of the pod was seen
    #: (our own bind, not seen back yet): such a pod is never proposed as a preemption victim
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """A pod's allocation record the vGPU system wrote: decoded, its text, the signature and the
    key id that verified it (both None without keys)."""

    allocation: PodAllocation
    text: str
    signature: str | None
    kid: str | None


@dataclass(frozen=True, slots=True)
class Rejected:
    """Why a pod's allocation record is not booked: ``code`` (a :mod:`kube_vgpu.signing` code,
    ``undecodable`` or ``other-node``) and a human-readable ``reason``."""

    code: str
    reason: str


def allocation_amount(alloc: PodAllocation) -> Amount:
    """GPU memory and compute an allocation holds (init containers collapsed as booked); GPUs where
    it books 100 percent or more of compute are listed in ``whole`` (see :class:`Amount`)."""
    mib = cores = 0
    whole: list[tuple[str, str, int, int]] = []
    for uuid, (m, c, _s) in alloc.usage().items():
        mib += m
        cores += c
        if c >= 100:
            whole.append((alloc.node, uuid, m, c))
    return Amount(mib, cores, tuple(sorted(whole)))


def pod_priority(pod: Mapping[str, Any] | PodView) -> int:
    """A Pod dict's ``spec.priority`` as kube-scheduler reads it (``corev1helpers.PodPriority``): the
    integer the API server's Priority admission set from the pod's PriorityClass, 0 when absent (or
    not an integer)."""
    v = PodView.of(pod).spec.get("priority")
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def pod_key(pod: Mapping[str, Any] | PodView) -> str:
    """``namespace/name`` of a Pod dict (:attr:`kube_vgpu.views.PodView.key`). Raises ShapeError
    for a malformed metadata."""
    return PodView.of(pod).key


class ClusterCache:
    """Nodes, vGPU pods and bookings, kept from watch events; the engine on top.

    config: the domain config (resource names, stale threshold, policies); clock: unix seconds;
    keys: the signing key ring that records must verify with (None: records are not verified, for
    offline snapshot views only; see the module docstring).
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.time, keys: KeySource | None = None):
        self.config = config
        self.clock = clock
        self.keys = keys
        #: the ResourceQuotas that name our memory or cores resources (kube_vgpu/quota.py)
        self.quotas = QuotaBook(config.resource_names)
        #: pod key -> (the inputs of its last verified record, that Record): see read_record;
        #: dropped when the pod is forgotten
        self._record_memo: dict[str, tuple[tuple[Any, ...], Record]] = {}
        #: uid -> rejection code of pods whose record was refused (logged once per uid)
        self._rejected: dict[str, str] = {}
        #: called with the rejection code once per pod uid whose record is refused (metrics)
        self.on_reject: Callable[[str], None] | None = None
        #: called with the pod (API JSON) whose booked record the service should sign again with the
        #: active key: adopted unsigned records, records signed with a key no longer active
        self.on_resign: Callable[[dict[str, Any]], None] | None = None
        self._adopt_before = self._cutoff(config)
        self.state = ClusterState()
        self.engine = ExtenderEngine(self.state, config.scheduling.node_policy, config.scheduling.gpu_policy,
                             shapes=default_shapes())
        self.nodes: dict[str, NodeInfo] = {}
        #: node name -> why it is not a candidate (stale, no allocatable, bad inventory)
        self.unavailable: dict[str, FitFailure] = {}
        self.pods: dict[str, PodInfo] = {}
        self.pods_by_node: dict[str, set[str]] = {}
        #: pod key -> uid of the pod that owns the booking in ``state.bookings``
        self.booked_uid: dict[str, str] = {}
        self.on_change: Callable[[], None] | None = None

    # -- configuration ------------------------------------------------------------------------
    def apply_config(self, config: Config) -> None:
        """Switch to a new config (policies, stale threshold, resource names). Raises ValueError."""
        s = config.scheduling
        if (s.node_policy, s.gpu_policy) != (self.engine.node_policy, self.engine.gpu_policy):
            self.engine.configure(s.node_policy, s.gpu_policy)
        self.config = config
        self.quotas.set_names(config.resource_names)
        self._adopt_before = self._cutoff(config)
        self.refresh_availability()

    # -- nodes --------------------------------------------------------------------------------
    def _availability(self, name: str, info: NodeInfo, now: float) -> FitFailure | None:
        if info.inventory_error is not None:
            return FitFailure(Code.BAD_INVENTORY, detail=info.inventory_error)
        if not info.has_inventory:
            return NO_INVENTORY if name in self.state.nodes else None
        limit = self.config.scheduling.inventory_stale_seconds
        if now - info.heartbeat > limit:
            return FitFailure(Code.STALE_INVENTORY, need=int(limit))
        if info.allocatable <= 0:
            return FitFailure(Code.NO_ALLOCATABLE, detail=self.config.resource_names.gpu)
        return None

    def _set_available(self, name: str, now: float) -> None:
        info = self.nodes.get(name)
        why = None if info is None else self._availability(name, info, now)
        if why is None:
            self.unavailable.pop(name, None)
        elif self.unavailable.get(name) != why:
            self.unavailable[name] = why

    def refresh_availability(self) -> None:
        """Re-check every node's heartbeat age (call periodically, e.g. every second)."""
        now = self.clock()
        for name in self.nodes:
            self._set_available(name, now)

    def on_node(self, kind: str, node: dict[str, Any]) -> None:
        """Apply a Node watch event (kind ADDED | MODIFIED | DELETED) or a list item (ADDED)."""
        view = NodeView(node)
        name = view.name
        if not name:
            return
        if kind == "DELETED":
            self.remove_node(name)
            return
        info = self.nodes.get(name) or NodeInfo()
        info.taints = node_taints(node)
        alloc_raw = view.allocatable.get(self.config.resource_names.gpu)
        try:
            info.allocatable = int(parse_quantity(alloc_raw)) if alloc_raw is not None else 0
        except QuantityError:
            info.allocatable = 0
        text = view.annotations.get(ANN_NODE_INVENTORY)
        info.inventory_error = None
        if text is None:
            info.has_inventory = False
        else:
            try:
                inv = decode_inventory(text)
            except CodecError as e:
                info.inventory_error = str(e)
                info.has_inventory = False
                log.warning("node inventory annotation invalid", extra={"node": name, "error": str(e)})
            else:
                info.has_inventory = True
                info.heartbeat = inv.heartbeat
                known = name in self.state.nodes
                before = self.state.nodes[name] if known else None
                devices = apply_cordon(inv.devices, cordoned_tokens(view.annotations))
                n = self.state.set_node(name, devices, 0, 0, inv.heartbeat)
                if n is not before:
                    self._rebook_node(name)
        self.nodes[name] = info
        self._set_available(name, self.clock())

    def remove_node(self, name: str) -> None:
        """Forget a node (its bookings go with it; pods re-book if the node comes back)."""
        self.nodes.pop(name, None)
        self.unavailable.pop(name, None)
        if name in self.state.nodes:
            self.state.remove_node(name)
            for key in list(self.booked_uid):
                if key not in self.state.bookings:
                    self.booked_uid.pop(key, None)
        self._changed()

    def replace_nodes(self, items: Iterable[dict[str, Any]]) -> None:
        """A relist: make the node set equal to ``items``."""
        seen = set()
        for n in items:
            seen.add(NodeView(n).name)
            self.on_node("ADDED", n)
        for name in list(self.nodes):
            if name not in seen:
                self.remove_node(name)

    def _rebook_node(self, name: str) -> None:
        for key in sorted(self.pods_by_node.get(name, ())):
            info = self.pods.get(key)
            if info is not None and key not in self.state.bookings:
                self._book_record(key, info)

    # -- pods ---------------------------------------------------------------------------------
    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _book_record(self, key: str, info: PodInfo) -> None:
        node = self.state.nodes.get(info.allocation.node)
        if node is None:
            return  # node not known yet; booked when it appears
        try:
            self.state.book(key, self._verified(key, info, node), check=False)
        except OvercommitError:
            return
        self.booked_uid[key] = info.uid
        self._changed()

    @staticmethod
    def _clamped(c: ContainerAllocation) -> ContainerAllocation:
        if all(d.memory_mib >= 0 and d.cores >= 0 for d in c.devices):
            return c
        return ContainerAllocation(c.name, c.init, tuple(
            DeviceBooking(d.uuid, max(0, d.memory_mib), max(0, d.cores)) for d in c.devices))

    def _verified(self, key: str, info: PodInfo, node: NodeState) -> PodAllocation:
        """What to book for an annotated pod: the annotation if it matches the pod's request on
        ``node``'s GPUs; else, per requested container, the request on the annotated GPUs (the
        larger of both values per GPU; GPUs missing or unknown to the node completed with other
        GPUs of the node), the annotation's other containers kept. No request: the annotation,
        values clamped to >= 0."""
        a = info.allocation
        req = info.request
        if req is None:
            clamped = tuple(self._clamped(c) for c in a.containers)
            return a if clamped == a.containers else PodAllocation(a.node, clamped, a.time)
        problems: list[str] = []
        conts: list[ContainerAllocation] = []
        done: set[tuple[str, bool]] = set()
        for r in req.containers:
            done.add((r.name, r.init))
            c = a.container(r.name, r.init)
            if c is None:
                problems.append(f"container {r.name}: not in the annotation")
            elif len(c.devices) != r.count:
                problems.append(f"container {r.name}: {len(c.devices)} GPU(s) annotated, request is {r.count}")
            chosen: list[tuple[int, DeviceBooking | None]] = []
            seen: set[str] = set()
            for d in c.devices if c is not None else ():
                i = node.by_uuid.get(d.uuid)
                if i is None or d.uuid in seen:
                    problems.append(f"container {r.name}: GPU {d.uuid} is not on node {node.name}")
                    continue
                seen.add(d.uuid)
                chosen.append((i, d))
            for i, dev in enumerate(node.devices):  # never fewer GPUs than requested
                if len(chosen) >= r.count:
                    break
                if dev.uuid not in seen:
                    seen.add(dev.uuid)
                    chosen.append((i, None))
            books = []
            for i, ann in chosen:
                dev = node.devices[i]
                mem, cores = r.memory_on(dev), r.cores_on(dev)
                if ann is not None and ann.profile and dev.mig:  # a dynamic-MIG instance
                    p = next((p for p in TABLES[dev.mig].profiles if p.name == ann.profile), None)
                    if p is None or p.memory_mib < mem or (ann.memory_mib, ann.cores) != (
                            p.memory_mib, instance_cores(p, dev.cores)):
                        problems.append(f"container {r.name}: GPU {ann.uuid} annotated MIG {ann.profile} "
                                        f"{ann.memory_mib} MiB/{ann.cores}%, request is {mem} MiB")
                    books.append(ann)  # the signed instance stands: it is what the node creates
                    continue
                if ann is not None and (ann.memory_mib, ann.cores) != (mem, cores):
                    problems.append(f"container {r.name}: GPU {ann.uuid} annotated {ann.memory_mib} MiB/"
                                    f"{ann.cores}%, request is {mem} MiB/{cores}%")
                books.append(DeviceBooking(dev.uuid, max(mem, ann.memory_mib if ann else 0),
                                           max(cores, ann.cores if ann else 0)))
            conts.append(ContainerAllocation(r.name, r.init, tuple(books)))
        conts.extend(self._clamped(c) for c in a.containers if (c.name, c.init) not in done)
        if not problems:
            return a
        log.warning("pod allocation annotation does not match the pod's request; booking the request",
                    extra={"pod": key, "node": node.name, "error": "; ".join(problems)[:1000]})
        return PodAllocation(a.node, tuple(conts), a.time)

    def _request(self, key: str, pod: dict[str, Any]) -> PodRequest | None:
        try:
            return parse_pod(pod, self.config)
        except Exception as e:  # noqa: BLE001 - RequestError, or a spec the API server let through
            log.warning("pod request cannot be parsed; booking its allocation annotation as is",
                        extra={"pod": key, "error": str(e)[:500]})
            return None

    def _release(self, key: str) -> Booking | None:
        b = self.state.release(key)
        self.booked_uid.pop(key, None)
        if b is not None:
            self._changed()
        return b

    def _forget(self, key: str, uid: str | None) -> None:
        self._record_memo.pop(key, None)
        info = self.pods.get(key)
        if info is not None and (uid is None or info.uid == uid):
            self.pods.pop(key, None)
            s = self.pods_by_node.get(info.node)
            if s is not None:
                s.discard(key)
                if not s:
                    self.pods_by_node.pop(info.node, None)
        self._forgotten(key, uid)
        if key in self.state.bookings and (uid is None or self.booked_uid.get(key) == uid):
            self._release(key)

    # -- allocation records -------------------------------------------------------------------
    @staticmethod
    def _cutoff(config: Config) -> float | None:
        t = config.scheduling.adopt_unsigned_before
        return rfc3339_seconds(t) if t else None  # validated by the config loader

    def read_record(self, pod: Mapping[str, Any] | PodView) -> Record | Rejected | None:
        """The pod's allocation record if the vGPU system wrote it (signature verified for the pod's
        uid, ``spec.nodeName`` or, unbound, the record's node, its bind-time and the exact text),
        else why not; None when the pod carries no record. Pure (reads the current key ring)."""
        view = PodView.of(pod)
        ann = view.annotations
        text = ann.get(ANN_ALLOCATION)
        if not text:
            return None
        if not isinstance(text, str):
            return Rejected("undecodable", "allocation record is not a string")
        node, uid = view.node_name, view.uid
        memo: tuple[Any, ...] | None = None
        if self.keys is not None and node:
            # verification and decoding are a pure function of these (the key ring by identity: a
            # reload replaces it), so a watch event that changes none of them (status updates, the
            # device plugin's progress) reuses the verdict instead of another HMAC and decode
            memo = (self.keys.current(), uid, node, text,
                    ann.get(ANN_ALLOCATION_SIGNATURE), ann.get(ANN_BIND_TIME))
            hit = self._record_memo.get(view.key)
            if hit is not None and hit[0][0] is memo[0] and hit[0][1:] == memo[1:]:
                return hit[1]
        alloc: PodAllocation | None = None
        if self.keys is None or not node:
            try:
                alloc = decode_allocation(text)
            except CodecError as e:
                return Rejected("undecodable", f"allocation record undecodable: {e}")
            if self.keys is None:
                return Record(alloc, text, None, None)
        assert self.keys is not None
        sig = ann.get(ANN_ALLOCATION_SIGNATURE)
        v = verify_record(self.keys.current(), ann, uid, node or (alloc.node if alloc is not None else ""))
        if not v.ok:
            return Rejected(v.code, v.reason)
        if alloc is None:
            try:
                alloc = decode_allocation(text)
            except CodecError as e:  # a record this build cannot read (version skew)
                return Rejected("undecodable", f"signed allocation record undecodable: {e}")
        if node and alloc.node != node:
            return Rejected("other-node", f"signed allocation record names node {alloc.node!r}, the pod is "
                                          f"bound to {node!r}")
        assert isinstance(sig, str)
        rec = Record(alloc, text, sig, v.kid)
        if memo is not None:
            self._record_memo[view.key] = (memo, rec)
        return rec

    def remember_written(self, key: str, uid: str, node: str, annotations: dict[str, str],
                         allocation: PodAllocation) -> None:
        """Seed the record memo with a record this process has just signed and written (its own
        bind): the watch event that brings it back then needs no HMAC and no decode. It is used
        only for a pod whose annotations are exactly these, under the key ring that signed them."""
        if self.keys is None:
            return
        ring = self.keys.current()
        text = annotations.get(ANN_ALLOCATION)
        sig = annotations.get(ANN_ALLOCATION_SIGNATURE)
        if not text or not sig:
            return
        memo = (ring, uid, node, text, sig, annotations.get(ANN_BIND_TIME))
        self._record_memo[key] = (memo, Record(allocation, text, sig, ring.active))

    def stale_key(self, pod: Mapping[str, Any] | PodView, rec: Record) -> bool:
        """True if the verified record ``rec``, or its verified progress, is signed with a key that is
        no longer the active one (signing it again lets the retired key be removed)."""
        if self.keys is None or rec.kid is None:
            return False
        ring = self.keys.current()
        if rec.kid != ring.active:
            return True
        view = PodView.of(pod)
        ann = view.annotations
        psig = ann.get(ANN_PROGRESS_SIGNATURE)
        if not isinstance(psig, str) or psig.startswith(f"{VERSION}:{ring.active}:"):
            return False
        return verify_record_progress(ring, ann, view.uid, rec.signature).ok

    def stale_keys(self) -> list[str]:
        """Keys of bound pods that may be booked from a record signed with a key that is no longer
        the active one: their record's key id differs, or is not known (our own bind whose watch
        events came before it was recorded). After a key rotation the service reads them back and
        signs again those that are stale (:meth:`stale_key`)."""
        if self.keys is None:
            return []
        active = self.keys.current().active
        return [k for k, info in self.pods.items() if info.bound and info.kid != active]

    def _adopt(self, key: str, pod: dict[str, Any], rec: Rejected) -> tuple[PodAllocation | None, str]:
        """Book an unsigned record under ``scheduling.adoptUnsignedBefore``? (allocation, "") or
        (None, why not; "" when the option is off or the record is not unsigned)."""
        cutoff = self._adopt_before
        if cutoff is None or rec.code != MISSING:
            return None, ""
        view = PodView.of(pod)
        node = view.node_name
        if not node:
            return None, "not adopted: the pod is not bound"
        if view.spec.get("schedulerName") != self.config.scheduler_name:
            return None, f"not adopted: the pod names scheduler {view.spec.get('schedulerName')!r}"
        created = view.meta.get("creationTimestamp")
        try:
            t = rfc3339_seconds(str(created))
        except ValueError:
            return None, f"not adopted: creationTimestamp {created!r} unreadable"
        if t >= cutoff:
            return None, (f"not adopted: created {created}, not before scheduling.adoptUnsignedBefore "
                          f"{self.config.scheduling.adopt_unsigned_before}")
        try:
            alloc = read_allocation(pod)
        except CodecError as e:
            return None, f"not adopted: allocation record undecodable: {e}"
        if alloc is None:  # MISSING signature on a record that is there: cannot happen; never adopt nothing
            return None, "not adopted: no allocation record"
        log.info("adopting an unsigned allocation record (scheduling.adoptUnsignedBefore); it will be signed",
                 extra={"pod": key, "node": node})
        if self.on_resign is not None:
            self.on_resign(pod)
        return alloc, ""

    def _running(self, pod: dict[str, Any], node: str) -> PodAllocation | None:
        """For a pod bound to ``node`` that kubelet has admitted (container statuses, written only by
        kubelet) and that asks for the gpu resource, but carries no verifiable record: the device
        plugin served it, so it had a signed record then, and its owner has edited or removed it
        since. An empty allocation on ``node`` (booking completes the pod's own request on the
        node's first GPUs: capacity is never freed by the edit, and nothing beyond the request is
        reserved). None otherwise (an unverified pod that is not running never gets a GPU)."""
        if self.keys is None or not node:
            return None
        view = PodView.of(pod)
        if not view.admitted:
            return None
        gpu = self.config.resource_names.gpu
        for c in view.all_containers():
            if any(str(part.get(gpu, "0")).strip() not in ("", "0") for part in (c.limits, c.requests)):
                return PodAllocation(node, (), 0.0)
        return None

    def _reject(self, key: str, uid: str, node: str, rec: Rejected, booked: bool, extra: str) -> None:
        """Log (once per pod uid) and count a record that books nothing."""
        if uid in self._rejected:
            return
        if len(self._rejected) >= 100_000:  # bounded; forgetting one only means logging it again
            self._rejected.pop(next(iter(self._rejected)))
        self._rejected[uid] = rec.code
        why = f"{rec.reason}; {extra}" if extra else rec.reason
        if extra.startswith("the pod runs"):
            log.warning("pod allocation record not written by the vGPU system; booking the pod's own request",
                        extra={"pod": key, "node": node or None, "error": why})
        elif booked:
            log.warning("pod allocation record not written by the vGPU system; keeping the booking of its "
                        "verified record", extra={"pod": key, "node": node or None, "error": why})
        else:
            log.warning("pod allocation record not written by the vGPU system; nothing booked",
                        extra={"pod": key, "node": node or None, "error": why})
        if self.on_reject is not None:
            self.on_reject(rec.code)

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """Apply a Pod watch event (ADDED | MODIFIED | DELETED) or a list item (ADDED)."""
        view = PodView(pod)
        key, uid = view.key, view.uid
        rec = None if kind == "DELETED" else self.read_record(view)
        self._seen(kind, key, uid, view)
        if kind == "DELETED":
            self._rejected.pop(uid, None)
            self._forget(key, uid)
            return
        if not view.holds_gpus:  # finished: its containers stopped for good (terminating pods keep theirs)
            self._rejected.pop(uid, None)
            self._forget(key, uid)
            return
        old_uid = self.booked_uid.get(key)
        writing = self._writing(key)
        if old_uid is not None and old_uid != uid and not writing:
            # Same name, new pod: the old one is gone even if we missed its DELETED event.
            self._forget(key, old_uid)
        if writing:
            return  # our own bind is writing the record
        node_name = view.node_name
        bound = bool(node_name)
        if self._skip_record(uid, bound):
            return  # the annotation of a bind that failed; the pod will be re-bound
        prev = self.pods.get(key)
        b = self.state.bookings.get(key)
        booked = prev is not None and prev.uid == uid and b is not None and self.booked_uid.get(key) == uid
        if rec is None or isinstance(rec, Rejected):
            adopted: PodAllocation | None = None
            why = ""
            if rec is not None and not booked:
                adopted, why = self._adopt(key, pod, rec)
            if adopted is None and not booked:
                adopted = self._running(pod, node_name)
                if adopted is not None:
                    why = (f"the pod runs on {node_name} (kubelet admitted it): booking its own request on the "
                           f"node's first GPUs, the GPUs it uses are unknown")
            if rec is not None:
                self._reject(key, uid, node_name, rec, booked, why)
            elif adopted is not None:
                self._reject(key, uid, node_name, Rejected(MISSING, "allocation record missing"), booked, why)
            if adopted is None:
                if booked:  # a removed or edited record keeps the booking of the verified one
                    assert prev is not None
                    prev.bound = prev.bound or bound
                    prev.priority = pod_priority(view)
                return
            alloc = adopted
        else:
            alloc = rec.allocation
            if bound and self.on_resign is not None and self.stale_key(view, rec):
                self.on_resign(pod)  # key rotation: sign again with the active key
        if bound and alloc.node != node_name:
            log.warning("pod allocation annotation names another node than the pod is bound to; "
                        "booking the pod's request on its node",
                        extra={"pod": key, "node": node_name, "error": f"annotation node {alloc.node!r}"})
            alloc = PodAllocation(node_name, alloc.containers, alloc.time)
        kid = rec.kid if isinstance(rec, Record) else None
        if (prev is not None and prev.uid == uid and prev.allocation == alloc and b is not None
                and self.booked_uid.get(key) == uid):
            prev.bound = prev.bound or bound
            prev.priority = pod_priority(view)
            if kid is not None:
                prev.kid = kid
            return  # unchanged (e.g. our own bind's patch coming back)
        if prev is not None and prev.node != alloc.node:
            s = self.pods_by_node.get(prev.node)
            if s is not None:
                s.discard(key)
        info = PodInfo(uid, alloc.node, bound, alloc, self._request(key, pod), kid, pod_priority(view))
        self.pods[key] = info
        self.pods_by_node.setdefault(alloc.node, set()).add(key)
        if b is not None:
            if self.booked_uid.get(key) == uid and b.allocation == alloc:
                return
            self._release(key)
        self._book_record(key, info)

    def replace_pods(self, items: Iterable[dict[str, Any]], resource_version: str = "") -> None:
        """A relist: make the pod set equal to ``items``, the list taken at ``resource_version``
        (the list's ``metadata.resourceVersion``; "" if unknown). Every booking whose pod is absent
        is released, except those :meth:`_relist_keeps` names (the extender's binds in flight or
        not yet visible to a list, :class:`scheduler.bindstate.BindCache`)."""
        seen = set()
        for p in items:
            seen.add(pod_key(p))
            self.on_pod("ADDED", p)
        keep = self._relist_keeps(resource_version, seen)
        for key in [k for k in self._record_memo if k not in seen]:
            del self._record_memo[key]
        for key in list(self.pods):
            if key not in seen and key not in keep:
                self._forget(key, None)
        for key in list(self.state.bookings):
            if key not in seen and key not in keep:
                self._forget(key, None)

    # -- hooks for a cache that also binds (scheduler/bindstate.py); no-ops for a read-only view --
    def _seen(self, kind: str, key: str, uid: str, pod: PodView) -> None:
        """A pod event (``kind``) of ``key``/``uid`` arrived, before it is applied."""

    def _writing(self, key: str) -> bool:
        """Whether a bind of ``key`` is writing its record now (its booking is the bind's, not the
        annotation's: events of the pod do not change it). False here."""
        return False

    def _skip_record(self, uid: str, bound: bool) -> bool:
        """Whether the record of pod ``uid`` (``bound`` or not) is to be ignored (the unbound
        record of a failed bind). False here."""
        return False

    def _forgotten(self, key: str, uid: str | None) -> None:
        """Pod ``key`` (``uid``; None: whatever pod of that name) was forgotten."""

    def _relist_keeps(self, resource_version: str, seen: set[str]) -> set[str]:
        """Pod keys a relist at ``resource_version`` (pods ``seen``) must not release although
        absent. None here."""
        return set()

    # -- GPU quota per namespace (kube_vgpu/quota.py) ----------------------------------------
    def on_quota(self, kind: str, quota: dict[str, Any]) -> None:
        """A ResourceQuota watch event."""
        self.quotas.on_quota(kind, quota)

    def replace_quotas(self, items: Iterable[dict[str, Any]], resource_version: str = "") -> None:
        """A relist of ResourceQuotas."""
        self.quotas.replace(items)

    def namespace_usage(self, namespace: str, exclude: str = "") -> Amount:
        """GPU memory and compute booked or promised in ``namespace`` (pods ``ns/...``), leaving out
        the pod key ``exclude`` (the pod being placed: its own earlier promise or booking is
        replaced, not added)."""
        prefix = namespace + "/"
        total = Amount()
        bookings = self.state.bookings
        for key, b in bookings.items():
            if key.startswith(prefix) and key != exclude:
                total += self._held(b.node, b.usage, b.mig)
        for key, a in self.state.assumed.items():
            if key.startswith(prefix) and key != exclude and key not in bookings:
                total += self._held(a.node, a.usage, a.mig)
        return total

    def _held(self, node: str, usage: tuple[tuple[int, int, int, int], ...],
              mig: tuple[tuple[int, str, int], ...] = ()) -> Amount:
        """The quota Amount of per-GPU usage on ``node``: a GPU whose compute the pod books in full
        takes no other pod, so it counts its whole memory (a pod asking 1 MiB with gpucores: 100
        holds the card). A dynamic-MIG instance (``mig``) counts as its record does: the profile's
        MiB and the instance's compute (what :func:`allocation_amount` charges a new pod)."""
        ns = self.state.nodes.get(node)
        if mig and ns is not None:
            on_mig = {i for i, _, _ in mig}
            mib = cores = 0
            for i, profile, _start in mig:
                p = next((p for p in TABLES[ns.devices[i].mig].profiles if p.name == profile), None)
                if p is not None:
                    mib += p.memory_mib
                    cores += instance_cores(p, ns.devices[i].cores)
            return Amount(mib, cores) + self._held(node, tuple(u for u in usage if u[0] not in on_mig))
        amount = usage_of(usage)
        if ns is None:
            return amount
        extra = 0
        for i, mib, cores, _s in usage:
            if 0 <= i < len(ns.devices) and cores >= ns.devices[i].cores:
                extra += max(0, ns.devices[i].memory_mib - mib)
        return Amount(amount.mib + extra, amount.cores)

    def _whole_gpus(self, asked: Amount) -> Amount:
        """``asked`` with each GPU it books in full (``asked.whole``) charged its whole memory."""
        extra = 0
        for node, uuid, mib, cores in asked.whole:
            ns = self.state.nodes.get(node)
            dev = next((d for d in ns.devices if d.uuid == uuid), None) if ns is not None else None
            if dev is not None and cores >= dev.cores:
                extra += max(0, dev.memory_mib - mib)
        return Amount(asked.mib + extra, asked.cores)

    def quota_failure(self, pod: PodRequest, asked: Amount) -> FitFailure | None:
        """The failure when ``asked`` on top of what ``pod``'s namespace already holds goes over a
        GPU quota there (tightest first), else None. Cheap when the namespace has no GPU quota."""
        lims = self.quotas.limits(pod.namespace)
        if not lims:
            return None
        uncapped = uncapped_compute(pod.namespace, lims, pod.containers, self.quotas.names.gpucores)
        if uncapped is not None:
            return FitFailure(Code.QUOTA_EXCEEDED, detail=uncapped)
        over = exceeded(pod.namespace, lims, self.namespace_usage(pod.namespace, exclude=pod.key),
                        self._whole_gpus(asked))
        if over is None:
            return None
        return FitFailure(Code.QUOTA_EXCEEDED, need=over.asked, have=over.used, detail=over.text())

    def asked_on(self, pod: PodRequest, node: str) -> Amount | None:
        """What ``pod`` would book on ``node`` (its plan there: percentages resolved on the GPUs it
        would get), or None when it does not fit there."""
        plan = self.engine.plan_for(pod, node)
        if isinstance(plan, FitFailure):
            return None
        return allocation_amount(self.engine.allocation(pod, node, plan, now=0.0))

    def filter_quota(self, pod: PodRequest, ok: list[str], failed: dict[str, FitFailure]) -> list[str]:
        """Move the nodes of ``ok`` where ``pod`` would go over a GPU quota of its namespace into
        ``failed``; returns the nodes that stay. Plans once per distinct GPU-size layout (a
        percentage request books by the size of the GPUs it gets)."""
        if not self.quotas.limits(pod.namespace):
            return ok
        keep: list[str] = []
        seen: dict[tuple[int, ...], FitFailure | None] = {}
        for name in ok:
            ns = self.state.nodes.get(name)
            layout = tuple(d.memory_mib for d in ns.devices) if ns is not None else ()
            if layout not in seen:
                asked = self.asked_on(pod, name)
                seen[layout] = None if asked is None else self.quota_failure(pod, asked)
            f = seen[layout]
            if f is None:
                keep.append(name)
            else:
                failed[name] = f
        return keep

    # -- placement ----------------------------------------------------------------------------
    def evaluate(self, pod: PodRequest, names: Sequence[str], want_scores: bool = True
                 ) -> tuple[list[str], dict[str, FitFailure], dict[str, float]]:
        """Engine.evaluate over ``names`` minus unavailable nodes (with their failures added)."""
        un = self.unavailable
        if un:
            cand = [n for n in names if n not in un]
            pre = {n: un[n] for n in names if n in un}
        else:
            cand, pre = list(names), {}
        ok, failed, scores = self.engine.evaluate_names(pod, cand, want_scores)
        if pre:
            failed.update(pre)
        return ok, failed, scores

    def score_array(self, pod: PodRequest, names: Sequence[str], key: str | None = None) -> np.ndarray:
        """Policy score per name (float64), -inf where the pod does not fit or the node is not a
        candidate (unknown, stale, no allocatable). ``key``: ``names_key(names)`` if the caller
        has it (saves a join)."""
        sc = self.engine.score_array(pod, names, key)
        if self.unavailable:
            un = self.unavailable
            bad = [i for i, n in enumerate(names) if n in un]
            if bad:
                sc = sc.copy()
                sc[bad] = -np.inf
        return sc

