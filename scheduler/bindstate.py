"""The extender's bind bookkeeping on top of the shared read model of the cluster
(:class:`kube_vgpu.cluster.ClusterCache`): which binds are writing their record, which failed,
which succeeded but may not be visible to a relist yet, and which have an unknown outcome; and
the bind's reserve step (choose GPUs and book them, atomically on the event loop).

:class:`BindCache` is a :class:`~kube_vgpu.cluster.ClusterCache` that fills in the cache's hooks
(``_seen``, ``_writing``, ``_skip_record``, ``_forgotten``, ``_relist_keeps``), so the domain package
never imports the scheduler and a read-only view (``kubectl vgpu simulate``) carries no bind state.
The bind cycle that drives it is :mod:`scheduler.bindcycle`.

Relist rules: every booking whose pod is absent from a list is released, except binds in flight
(:attr:`BindCache.inflight`), binds whose outcome is unknown (:attr:`BindCache.unresolved`), and our
own binds whose write the list may predate (the pod is not visible yet): a list at or before the
resourceVersion the Binding was conditioned on predates it; a list requested after the Binding was
acknowledged includes it (a list without resourceVersion is a consistent read), so an own bind
absent from it was deleted and is released. When neither tells (versions not integers, or a list
already under way when the Binding was acknowledged), an own bind is kept for ``own_bind_grace``
seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from kube_vgpu.cluster import ClusterCache, PodInfo, allocation_amount
from kube_vgpu.config import Config
from kube_vgpu.model import PodAllocation, PodRequest
from kube_vgpu.placement import Booking, OvercommitError
from kube_vgpu.placement.fastpath import NO_INVENTORY
from kube_vgpu.placement.render import detail
from kube_vgpu.placement.status import FitFailure
from kube_vgpu.signing import KeySource
from kube_vgpu.views import PodView


@dataclass(frozen=True, slots=True)
class OwnBind:
    """A bind this process completed: ``resource_version`` is the pod's resourceVersion once our
    write was on it (a read-back; "" if unknown), ``after`` the resourceVersion our Binding was
    conditioned on (the write is the pod's next change after it; "" if unknown), ``at`` the
    clock() and ``acked`` the time.monotonic() when the write was acknowledged."""

    uid: str
    resource_version: str
    at: float
    after: str = ""
    acked: float = 0.0


def compare_resource_versions(a: str, b: str) -> int | None:
    """-1, 0 or 1 as resourceVersion ``a`` is older than, equal to or newer than ``b``; None when
    they cannot be compared. resourceVersions are opaque in general; etcd-backed API servers issue
    integers (etcd revisions), which order changes, so two decimal integers are compared as such."""
    if not (a.isdigit() and b.isdigit() and a.isascii() and b.isascii()):
        return None
    x, y = int(a), int(b)
    return (x > y) - (x < y)


class BindCache(ClusterCache):
    """The extender's cluster cache: :class:`~kube_vgpu.cluster.ClusterCache` plus the bind state
    (see the module docstring). Same arguments."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.time, keys: KeySource | None = None):
        super().__init__(config, clock, keys)
        #: pod keys whose bind is in progress (their booking is ours, not the annotation's)
        self.inflight: set[str] = set()
        #: uids whose bind failed: their (unbound) annotation is ignored until bound or re-bound
        self.failed_binds: set[str] = set()
        #: pod key -> our own successful bind (with the pod's resourceVersion once our write was on
        #: it): a relist whose list predates that write must not drop the booking, a later one must
        self.own_binds: dict[str, OwnBind] = {}
        #: seconds an own bind is kept by relists when resourceVersions cannot be compared (not integers)
        self.own_bind_grace = 30.0
        #: pod key -> uid of a bind whose outcome is unknown (the API did not answer): its booking is
        #: kept, relists included, until the pod has been read back (the bind cycle does that)
        self.unresolved: dict[str, str] = {}
        self._bound_seen: dict[str, str] = {}  #: pod key -> uid, once a watch event showed it bound
        #: pod key -> the pod as the watch (or a list) last showed it, while it is unbound and not
        #: terminating: what a bind checks and binds (its resourceVersion is the Binding's
        #: precondition, so a pod changed since is re-read, never bound on stale content)
        self.unbound: dict[str, dict[str, Any]] = {}
        #: time.monotonic() when the latest pod list was requested (:meth:`listing`)
        self.list_started = float("-inf")

    # -- hooks of ClusterCache ----------------------------------------------------------------
    def _seen(self, kind: str, key: str, uid: str, pod: PodView) -> None:
        """Remember which pods a watch event has shown bound (``_bound_seen``: an own bind needs no
        relist protection once the watch has shown the pod bound)."""
        if kind == "DELETED":
            if self._bound_seen.get(key) == uid:
                del self._bound_seen[key]
            self.unbound.pop(key, None)
        elif pod.node_name:
            self._bound_seen[key] = uid
            self.unbound.pop(key, None)
        elif not pod.active:
            self.unbound.pop(key, None)
        else:
            self.unbound[key] = cast(dict[str, Any], pod.raw)  # on_pod's pod: a dict

    def _writing(self, key: str) -> bool:
        return key in self.inflight

    def _skip_record(self, uid: str, bound: bool) -> bool:
        if not bound:
            return uid in self.failed_binds
        self.failed_binds.discard(uid)
        return False

    def _forgotten(self, key: str, uid: str | None) -> None:
        if uid is not None:
            self.failed_binds.discard(uid)
        if uid is None or self._bound_seen.get(key) == uid:
            self._bound_seen.pop(key, None)
        self.own_binds.pop(key, None)

    def _relist_keeps(self, resource_version: str, seen: set[str]) -> set[str]:
        for key in [k for k in self.unbound if k not in seen]:
            del self.unbound[key]  # gone from the list: deleted while the watch was down
        now = self.clock()
        keep = self.inflight | set(self.unresolved)
        for key, ob in list(self.own_binds.items()):
            predates = self._predates(resource_version, ob, now)
            if not predates:
                del self.own_binds[key]  # this list speaks for the pod from now on
            elif key not in seen:
                keep.add(key)
        return keep

    def _predates(self, list_rv: str, ob: OwnBind, now: float) -> bool:
        """Whether a list at ``list_rv`` may predate own bind ``ob``'s write (then an absent pod is
        not yet visible, not deleted). Known write version: compare. Else: a list at or before the
        Binding's precondition predates it; a list requested after the write was acknowledged
        includes it (consistent read); otherwise keep it for ``own_bind_grace`` seconds."""
        if ob.resource_version:
            c = compare_resource_versions(list_rv, ob.resource_version)
            if c is not None:
                return c < 0
        elif ob.after:
            c = compare_resource_versions(list_rv, ob.after)
            if c is not None and c <= 0:
                return True
            if ob.acked < self.list_started:
                return False
        return now - ob.at <= self.own_bind_grace

    def listing(self) -> None:
        """A pod list is about to be requested (called from the reflector's thread)."""
        self.list_started = time.monotonic()

    # -- bind bookkeeping ---------------------------------------------------------------------
    def pod_to_bind(self, key: str, uid: str) -> dict[str, Any] | None:
        """The pod ``key`` as the watch last showed it, if that is the pod ``uid`` (any pod when
        ``uid`` is empty) and it was unbound and not terminating then; None otherwise (the bind
        reads it from the API server)."""
        pod = self.unbound.get(key)
        if pod is None or (uid and PodView(pod).uid != uid):
            return None
        return pod

    def own_bind_seen(self, key: str, resource_version: str) -> None:
        """The watch showed pod ``key`` at ``resource_version``: once that is at or after our own
        bind's write, every later list includes the pod while it exists, so the own-bind entry
        (which only protects against lists that predate the write) is dropped."""
        ob = self.own_binds.get(key)
        if ob is None:
            return
        if ob.resource_version:
            c = compare_resource_versions(resource_version, ob.resource_version)
            if c is not None and c >= 0:
                del self.own_binds[key]
        elif ob.after:  # our write is the pod's first change after ``after``: any later version has it
            c = compare_resource_versions(resource_version, ob.after)
            if c is not None and c > 0:
                del self.own_binds[key]

    def record_bound(self, key: str, uid: str, booking: Booking, request: PodRequest | None = None,
                     resource_version: str = "", after: str = "") -> None:
        """After a successful bind: remember the pod as bound (if its booking is still this one).
        ``resource_version``: the pod's resourceVersion once our write was on it; ``after``: the
        resourceVersion the Binding was conditioned on (see the module docstring and OwnBind)."""
        seen = self.unbound.get(key)
        if seen is not None and PodView(seen).uid == uid:
            del self.unbound[key]  # bound now, whatever the watch has shown so far
        if self.state.bookings.get(key) is not booking:
            return
        self.pods[key] = PodInfo(uid, booking.node, True, booking.allocation, request)
        self.pods_by_node.setdefault(booking.node, set()).add(key)
        if self._bound_seen.get(key) != uid:  # the watch has not shown it bound yet: lists may predate it
            self.own_binds[key] = OwnBind(uid, resource_version, self.clock(), after, time.monotonic())

    def own_unbound_booking(self, key: str, uid: str) -> str | None:
        """The node where the pod ``key`` (this ``uid``) holds a booking although it is not bound and
        no bind of it is in flight or unresolved here: a signed record whose Binding never came (an
        extender stopped between writing the record and posting the Binding). That booking is the
        pod's own capacity: the pod still fits there (a bind re-plans after dropping it), so a
        filter must not count it against the pod itself. None otherwise."""
        b = self.state.bookings.get(key)
        if b is None or self.booked_uid.get(key) != uid or key in self.inflight or key in self.unresolved:
            return None
        info = self.pods.get(key)
        if info is not None and info.bound:
            return None
        return b.node

    def reserve(self, pod: PodRequest, uid: str, node: str) -> tuple[Booking, PodAllocation] | str:
        """Choose the GPUs for ``pod`` on ``node`` and book them, atomically (no await inside).

        A previous booking of the same key is dropped first (new pod of that name, or a re-bind of
        an unbound pod). Returns (booking, allocation) or a human-readable reason nothing was booked.
        """
        key = pod.key
        why = self.unavailable.get(node)
        if why is not None:
            return detail(why)
        if node not in self.state.nodes:
            return detail(NO_INVENTORY)
        info = self.pods.get(key)
        if info is not None and info.uid == uid and info.bound:
            return f"pod {key} is already bound to {info.node}"
        if key in self.state.bookings:
            self._release(key)
        plan = self.engine.plan_for(pod, node)
        if isinstance(plan, FitFailure):
            return detail(plan, self.state.nodes[node])
        alloc = self.engine.allocation(pod, node, plan, now=self.clock())
        over = self.quota_failure(pod, allocation_amount(alloc))
        if over is not None:
            return detail(over)
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
