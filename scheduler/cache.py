"""The extender's cluster cache: nodes and vGPU pods as seen by list+watch, and the bookings.

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
  replicas' binds: booked with ``check=False``) or from :meth:`ClusterCache.reserve` (our bind).
* Pods deleted, or in phase Succeeded/Failed, release their booking at once; terminating pods
  (``deletionTimestamp`` set) keep it until the DELETED event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kube_vgpu.codec import decode_allocation, decode_inventory
from kube_vgpu.config import Config
from kube_vgpu.errors import CodecError, QuantityError
from kube_vgpu.model import PodAllocation, PodRequest
from kube_vgpu.placement import Booking, ClusterState, OvercommitError
from kube_vgpu.quantity import parse_quantity
from kube_vgpu.resources import ANN_ALLOCATION, ANN_NODE_INVENTORY

from .fastpath import NO_INVENTORY, ExtenderEngine
from .shapes import default_shapes

log = logging.getLogger("kube_vgpu.scheduler.cache")

@dataclass(slots=True)
class NodeInfo:
    """What the cache keeps of a Node: heartbeat (unix s), allocatable vGPU slots, inventory state."""

    heartbeat: float = 0.0
    allocatable: int = 0
    inventory_error: str | None = None
    has_inventory: bool = False


@dataclass(slots=True)
class PodInfo:
    """What the cache keeps of a vGPU pod with an allocation annotation."""

    uid: str
    node: str
    bound: bool
    allocation: PodAllocation


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def pod_key(pod: dict[str, Any]) -> str:
    """``namespace/name`` of a Pod dict."""
    m = _meta(pod)
    return f"{m.get('namespace') or 'default'}/{m.get('name') or ''}"


class ClusterCache:
    """Nodes, vGPU pods and bookings, kept from watch events; the engine on top.

    config: the domain config (resource names, stale threshold, policies); clock: unix seconds.
    """

    def __init__(self, config: Config, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.state = ClusterState()
        self.engine = ExtenderEngine(self.state, config.scheduling.node_policy, config.scheduling.gpu_policy,
                             shapes=default_shapes())
        self.nodes: dict[str, NodeInfo] = {}
        #: node name -> reason it is not a candidate (stale, no allocatable, bad inventory)
        self.unavailable: dict[str, str] = {}
        self.pods: dict[str, PodInfo] = {}
        self.pods_by_node: dict[str, set[str]] = {}
        #: pod key -> uid of the pod that owns the booking in ``state.bookings``
        self.booked_uid: dict[str, str] = {}
        #: pod keys whose bind is in progress (their booking is ours, not the annotation's)
        self.inflight: set[str] = set()
        #: uids whose bind failed: their (unbound) annotation is ignored until bound or re-bound
        self.failed_binds: set[str] = set()
        #: pod key -> clock() of our own successful bind: a relist whose snapshot predates the
        #: patch must not drop that booking (the watch delivers the patch right after)
        self.own_binds: dict[str, float] = {}
        self.own_bind_grace = 30.0
        self.on_change: Callable[[], None] | None = None

    # -- configuration ------------------------------------------------------------------------
    def apply_config(self, config: Config) -> None:
        """Switch to a new config (policies, stale threshold, resource names). Raises ValueError."""
        s = config.scheduling
        if (s.node_policy, s.gpu_policy) != (self.engine.node_policy, self.engine.gpu_policy):
            self.engine.configure(s.node_policy, s.gpu_policy)
        self.config = config
        self.refresh_availability()

    # -- nodes --------------------------------------------------------------------------------
    def _availability(self, name: str, info: NodeInfo, now: float) -> str | None:
        if info.inventory_error is not None:
            return f"vGPU inventory annotation is invalid: {info.inventory_error}"
        if not info.has_inventory:
            return NO_INVENTORY if name in self.state.nodes else None
        limit = self.config.scheduling.inventory_stale_seconds
        if now - info.heartbeat > limit:
            return f"vGPU inventory heartbeat is stale (older than {limit:g}s; device plugin down?)"
        if info.allocatable <= 0:
            return (f"node allocatable {self.config.resource_names.gpu} is 0 "
                    "(device plugin not registered with the kubelet)")
        return None

    def _set_available(self, name: str, now: float) -> None:
        info = self.nodes.get(name)
        why = None if info is None else self._availability(name, info, now)
        if why is None:
            self.unavailable.pop(name, None)
        else:
            self.unavailable[name] = why

    def refresh_availability(self) -> None:
        """Re-check every node's heartbeat age (call periodically, e.g. every second)."""
        now = self.clock()
        for name in self.nodes:
            self._set_available(name, now)

    def on_node(self, kind: str, node: dict[str, Any]) -> None:
        """Apply a Node watch event (kind ADDED | MODIFIED | DELETED) or a list item (ADDED)."""
        name = _meta(node).get("name") or ""
        if not name:
            return
        if kind == "DELETED":
            self.remove_node(name)
            return
        info = self.nodes.get(name) or NodeInfo()
        alloc_raw = ((node.get("status") or {}).get("allocatable") or {}).get(self.config.resource_names.gpu)
        try:
            info.allocatable = int(parse_quantity(alloc_raw)) if alloc_raw is not None else 0
        except QuantityError:
            info.allocatable = 0
        text = (_meta(node).get("annotations") or {}).get(ANN_NODE_INVENTORY)
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
                n = self.state.set_node(name, inv.devices, 0, 0, inv.heartbeat)
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
            seen.add(_meta(n).get("name"))
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
        try:
            self.state.book(key, info.allocation, check=False)
        except OvercommitError:
            return  # node not known yet; booked when it appears
        self.booked_uid[key] = info.uid
        self._changed()

    def _release(self, key: str) -> Booking | None:
        b = self.state.release(key)
        self.booked_uid.pop(key, None)
        if b is not None:
            self._changed()
        return b

    def _forget(self, key: str, uid: str | None) -> None:
        info = self.pods.get(key)
        if info is not None and (uid is None or info.uid == uid):
            self.pods.pop(key, None)
            s = self.pods_by_node.get(info.node)
            if s is not None:
                s.discard(key)
                if not s:
                    self.pods_by_node.pop(info.node, None)
        if uid is not None:
            self.failed_binds.discard(uid)
        self.own_binds.pop(key, None)
        if key in self.state.bookings and (uid is None or self.booked_uid.get(key) == uid):
            self._release(key)

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """Apply a Pod watch event (ADDED | MODIFIED | DELETED) or a list item (ADDED)."""
        m = _meta(pod)
        key = pod_key(pod)
        uid = str(m.get("uid") or "")
        if kind == "DELETED":
            self._forget(key, uid)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            self._forget(key, uid)
            return
        old_uid = self.booked_uid.get(key)
        if old_uid is not None and old_uid != uid and key not in self.inflight:
            # Same name, new pod: the old one is gone even if we missed its DELETED event.
            self._forget(key, old_uid)
        text = (m.get("annotations") or {}).get(ANN_ALLOCATION)
        if not text or key in self.inflight:
            return
        bound = bool((pod.get("spec") or {}).get("nodeName"))
        if not bound and uid in self.failed_binds:
            return  # the annotation of a bind that failed; the pod will be re-bound
        if bound:
            self.failed_binds.discard(uid)
        try:
            alloc = decode_allocation(text)
        except CodecError as e:
            log.warning("pod allocation annotation invalid", extra={"pod": key, "error": str(e)})
            return
        prev = self.pods.get(key)
        if prev is not None and prev.node != alloc.node:
            s = self.pods_by_node.get(prev.node)
            if s is not None:
                s.discard(key)
        info = PodInfo(uid, alloc.node, bound, alloc)
        self.pods[key] = info
        self.pods_by_node.setdefault(alloc.node, set()).add(key)
        b = self.state.bookings.get(key)
        if b is not None:
            if self.booked_uid.get(key) == uid and b.allocation == alloc:
                return
            self._release(key)
        self._book_record(key, info)

    def replace_pods(self, items: Iterable[dict[str, Any]]) -> None:
        """A relist: make the pod set equal to ``items``. In-flight binds, and our own binds of the
        last ``own_bind_grace`` seconds (the list may predate their patch), are kept."""
        seen = set()
        for p in items:
            seen.add(pod_key(p))
            self.on_pod("ADDED", p)
        now = self.clock()
        for key, t in list(self.own_binds.items()):
            if now - t > self.own_bind_grace:
                del self.own_binds[key]
        keep = self.inflight | set(self.own_binds)
        for key in list(self.pods):
            if key not in seen and key not in keep:
                self._forget(key, None)
        for key in list(self.state.bookings):
            if key not in seen and key not in keep:
                self._forget(key, None)

    def record_bound(self, key: str, uid: str, booking: Booking) -> None:
        """After a successful bind: remember the pod as bound (if its booking is still this one)."""
        if self.state.bookings.get(key) is not booking:
            return
        self.pods[key] = PodInfo(uid, booking.node, True, booking.allocation)
        self.pods_by_node.setdefault(booking.node, set()).add(key)
        self.own_binds[key] = self.clock()

    # -- placement ----------------------------------------------------------------------------
    def evaluate(self, pod: PodRequest, names: Sequence[str], want_scores: bool = True
                 ) -> tuple[list[str], dict[str, str], dict[str, float]]:
        """Engine.evaluate over ``names`` minus unavailable nodes (with their reasons added)."""
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

    def score_array(self, pod: PodRequest, names: Sequence[str]) -> np.ndarray:
        """Policy score per name (float64), -inf where the pod does not fit or the node is not a
        candidate (unknown, stale, no allocatable)."""
        sc = self.engine.score_array(pod, names)
        if self.unavailable:
            un = self.unavailable
            bad = [i for i, n in enumerate(names) if n in un]
            if bad:
                sc = sc.copy()
                sc[bad] = -np.inf
        return sc

    def reserve(self, pod: PodRequest, uid: str, node: str) -> tuple[Booking, PodAllocation] | str:
        """Choose the GPUs for ``pod`` on ``node`` and book them, atomically (no await inside).

        A previous booking of the same key is dropped first (new pod of that name, or a re-bind of
        an unbound pod). Returns (booking, allocation) or a human-readable reason nothing was booked.
        """
        key = pod.key
        why = self.unavailable.get(node)
        if why is not None:
            return why
        if node not in self.state.nodes:
            return NO_INVENTORY
        info = self.pods.get(key)
        if info is not None and info.uid == uid and info.bound:
            return f"pod {key} is already bound to {info.node}"
        if key in self.state.bookings:
            self._release(key)
        plan = self.engine.plan_for(pod, node)
        if isinstance(plan, str):
            return plan
        alloc = self.engine.allocation(pod, node, plan, now=self.clock())
        try:
            b = self.engine.book(pod, alloc)
        except OvercommitError as e:  # cannot happen after a fresh plan; kept as a guard
            return str(e)
        self.booked_uid[key] = uid
        self.failed_binds.discard(uid)
        self._changed()
        return b, alloc

    def release_if(self, key: str, booking: Booking, failed_uid: str | None = None) -> bool:
        """Release ``key`` only if its current booking is ``booking`` (the watch may have released
        or replaced it meanwhile). ``failed_uid``: remember that this pod's bind failed."""
        if failed_uid is not None:
            self.failed_binds.add(failed_uid)
        if self.state.bookings.get(key) is booking:
            self._release(key)
            return True
        return False
