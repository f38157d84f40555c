"""The extender's bind cycle (``POST /bind``), in small named steps:

* **promise** (:meth:`BindCycle.assume`): a pod that passed filter/prioritize holds its plan on the
  chosen node for ``Options.assume_seconds`` while kube-scheduler binds it asynchronously
  (docs/scheduler.md "Promises"); :meth:`BindCycle.expire_promises` ends the ones never bound.
* **check** (:meth:`BindCycle.fetch`, :meth:`BindCycle.check`): the pod as the API server has it
  (as the pod watch last showed it, else a GET; uid checked against ``PodUID``; never a pod spec
  some /filter body carried: those bodies are not authenticated), refused when it asks for no vGPU resource, names another
  ``schedulerName``, is bound, terminating or finished, or does not tolerate the node's taints.
* **reserve** (:meth:`BindCycle.reserve`): choose the GPUs and book them in memory (no ``await``
  between choosing and booking), so concurrent binds never overcommit.
* **write** (:meth:`BindCycle.write`: sent from the event loop, and :func:`write_binding` in an API
  worker thread after any failure): one Binding carrying the signed
  allocation record as its annotations, with the pod's uid and the checked resourceVersion as
  preconditions; the API server binds the pod and copies the annotations in one atomic update, so
  the pod the check passed is exactly the pod that is bound (a pod changed since: 409, re-read).
* **settle** (:meth:`BindCycle.settled`, :func:`settle`, :meth:`BindCycle.resolve`): a definite
  failure releases the reservation at once; a write whose outcome is unknown (timeout, 5xx, 429,
  lost connection) is settled by reading the pod back; while that read fails too, the reservation
  is kept (:attr:`scheduler.bindstate.BindCache.unresolved`) and the pod is read back in the
  background.

No bind waits for the device plugin: it identifies each container exactly at PreStartContainer
(kubelet's PodResources API names the pod holding the device IDs; docs/device-plugin.md), so binds
to one node run concurrently. The bind bookkeeping lives in :mod:`scheduler.bindstate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kube_vgpu.cluster import pod_key
from kube_vgpu.codec import allocation_text, encode_allocation
from kube_vgpu.errors import CodecError, RequestError
from kube_vgpu.kubeapi import api_error_text, is_conflict, is_not_found, outcome_unknown
from kube_vgpu.model import PodAllocation, PodRequest
from kube_vgpu.placement import Booking
from kube_vgpu.podspec import parse_pod, pod_asks
from kube_vgpu.resources import (
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    BIND_ALLOCATING,
    BIND_FAILED,
)
from kube_vgpu.signing import sign_allocation
from kube_vgpu.taints import untolerated
from kube_vgpu.views import PodView

from .kube import KubeAPI

if TYPE_CHECKING:
    from .service import SchedulerService

log = logging.getLogger("kube_vgpu.scheduler")

Obj = dict[str, Any]


class BindError(Exception):
    """A bind step failed; ``outcome`` is the metrics label."""

    def __init__(self, message: str, outcome: str):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class WriteResult:
    """What the bind's API writes came to (:func:`write_binding`, :func:`settle`).

    state: ``bound`` (the pod is bound to our node with our record; ``resource_version`` is the
    pod's once our write was on it), ``failed`` (nothing of this attempt holds: not bound, and our
    record is not on the pod or was taken off), ``lost`` (the pod was bound by someone else, or to
    our node without our record; ``pod`` is it as read back), ``unknown`` (the API did not tell:
    the booking must be kept until the pod is read back). ``error``: what went wrong (not for
    ``bound``); ``outcome``: the ``binds_total`` label; ``binding_posted``: whether the Binding
    was sent (so an unknown outcome may be a committed Binding).
    """

    state: str
    resource_version: str = ""
    pod: Obj | None = None
    error: str = ""
    outcome: str = ""
    binding_posted: bool = False


@dataclass(frozen=True)
class Pending:
    """A bind whose Binding has been sent: what settling it needs (pod key and uid, node, its
    booking and request, the annotations the Binding carries and its resourceVersion
    precondition)."""

    key: str
    uid: str
    node: str
    booking: Booking
    request: PodRequest
    annotations: dict[str, str]
    fence_rv: str


def _rv(pod: Obj | None) -> str:
    return PodView(pod).resource_version if pod is not None else ""


def _outcome_of(e: BaseException) -> str:
    if outcome_unknown(e):
        return "unknown"
    return "conflict" if is_conflict(e) else "not_found" if is_not_found(e) else "api_error"


def read_pod(api: KubeAPI, ns: str, name: str) -> Obj | None | Exception:
    """GET the pod (blocking): the pod, None when it does not exist (404), or the exception when
    the read itself failed."""
    try:
        pod = api.get_pod(ns, name)
    except Exception as e:  # noqa: BLE001
        return None if is_not_found(e) else e
    if not isinstance(pod, dict) or pod_key(pod) != f"{ns}/{name}":
        return ValueError(f"the API server answered another object for pod {ns}/{name}")
    return pod


def judge(pod: Obj | None, uid: str, node: str, allocation: str) -> str:
    """Where a bind attempt stands, from the pod as read back: ``gone`` (no pod, or another pod of
    that name), ``bound`` (bound to ``node`` and carrying our ``allocation`` annotation text),
    ``elsewhere`` (bound, but to another node or without our record), ``landed`` (not bound, our
    record on it), ``absent`` (not bound, our record not on it)."""
    if pod is None:
        return "gone"
    view = PodView(pod)
    if uid and view.uid != uid:
        return "gone"
    try:
        ours = bool(allocation) and allocation_text(pod) == allocation
    except CodecError:
        ours = False
    bound_to = view.node_name
    if bound_to:
        return "bound" if bound_to == node and ours else "elsewhere"
    return "landed" if ours else "absent"


def _verdict(v: str, pod: Obj | None, key: str, node: str, error: str, outcome: str,
             posted: bool) -> WriteResult:
    """The WriteResult of a read-back verdict other than ``landed``."""
    if v == "bound":
        return WriteResult("bound", resource_version=_rv(pod), binding_posted=posted)
    if v == "gone":
        return WriteResult("failed", error=f"{error}; pod {key} no longer exists (deleted or recreated)",
                           outcome="not_found", binding_posted=posted)
    if v == "elsewhere":
        to = PodView(pod).node_name if pod is not None else ""
        return WriteResult("lost", pod=pod, error=f"{error}; pod {key} is bound to node {to} without this "
                           f"bind's allocation (bound by someone else)", outcome="conflict", binding_posted=posted)
    return WriteResult("failed", error=error, outcome=outcome if outcome != "unknown" else "api_error",
                       binding_posted=posted)


def settle(api: KubeAPI, ns: str, name: str, uid: str, node: str, annotations: dict[str, str],
           fence_rv: str, error: str, outcome: str, posted: bool, attempts: int = 3) -> WriteResult:
    """Read the pod back after a Binding whose outcome is not known (blocking) and settle the
    attempt: bound to ``node`` with our record -> ``bound``; gone -> ``failed``; bound elsewhere
    (or without our record) -> ``lost``; not bound -> ``failed``, once no Binding of this attempt
    can still land. The Binding carried ``fence_rv`` as its resourceVersion precondition: a pod
    read back at another resourceVersion can never take it; a pod still at ``fence_rv`` is fenced
    first (a merge patch guarded by that resourceVersion marks it ``bind-phase: failed``, which
    moves its resourceVersion, so a Binding still in flight fails its precondition). A read or fence
    that fails without an answer -> ``unknown`` (the caller keeps the booking and asks again
    later). ``error`` / ``outcome``: what made the outcome unknown."""
    key = f"{ns}/{name}"
    allocation = annotations.get(ANN_ALLOCATION, "")
    failed = WriteResult("failed", error=error, outcome=outcome if outcome != "unknown" else "api_error",
                         binding_posted=posted)
    for _ in range(attempts):
        got = read_pod(api, ns, name)
        if isinstance(got, Exception):
            return WriteResult("unknown", error=f"{error}; reading the pod back failed too: {api_error_text(got)}",
                               outcome="unknown", binding_posted=posted)
        v = judge(got, uid, node, allocation)
        if v not in ("landed", "absent"):
            return _verdict(v, got, key, node, error, outcome, posted)
        rv = _rv(got)
        if not fence_rv and posted:
            return WriteResult("unknown", error=f"{error}; the Binding carried no resourceVersion precondition, "
                               "so it may still land", outcome="unknown", binding_posted=posted)
        if rv != fence_rv:
            return failed
        try:
            api.patch_pod_metadata(ns, name, rv, {ANN_BIND_PHASE: BIND_FAILED}, {})
        except Exception as e:  # noqa: BLE001
            if is_conflict(e):
                continue  # the pod changed since the read: read again
            if is_not_found(e):
                return _verdict("gone", None, key, node, error, outcome, posted)
            return WriteResult("unknown", error=f"{error}; fencing the unbound pod failed too: "
                               f"{api_error_text(e)}", outcome="unknown", binding_posted=posted)
        return failed
    return WriteResult("unknown", error=f"{error}; the pod kept changing while it was read back",
                       outcome="unknown", binding_posted=posted)


def write_binding(api: KubeAPI, ns: str, name: str, uid: str, rv: str, annotations: dict[str, str],
                  node: str, attempts: int = 4, first_error: Exception | None = None) -> WriteResult:
    """The bind's one API write, in a worker thread (blocking): POST the Binding carrying the
    signed allocation record as its annotations, with the pod's uid and ``rv`` as preconditions.
    The API server applies node name and annotations in one atomic update, so the pod is either
    bound with our record or untouched. 409 (the pod changed since ``rv``): re-read, and retry at
    the new resourceVersion while it is the same live, unbound pod. A definite failure writes
    nothing (``failed``); a Binding whose outcome is unknown (timeout, 5xx, 429, connection error)
    is settled by reading the pod back (:func:`settle`). Raises BindError when the re-read pod may
    not be bound any more. ``first_error``: the first Binding was already sent (from the event
    loop, :meth:`BindCycle.write`) and failed with this error; go on from there."""
    key = f"{ns}/{name}"
    for attempt in range(attempts):
        try:
            if attempt == 0 and first_error is not None:
                raise first_error
            api.create_binding(ns, name, uid, node, rv, annotations)
            return WriteResult("bound", binding_posted=True)
        except Exception as e:  # noqa: BLE001
            error = f"binding {key} to {node}: {api_error_text(e)}"
            if outcome_unknown(e):
                return settle(api, ns, name, uid, node, annotations, rv, error, "unknown", True)
            if not is_conflict(e) or attempt == attempts - 1:
                return WriteResult("failed", error=error, outcome=_outcome_of(e), binding_posted=True)
        got = read_pod(api, ns, name)
        if isinstance(got, Exception):
            return WriteResult("failed", error=f"binding {key} to {node}: the pod changed, and reading it again "
                               f"failed: {api_error_text(got)}", outcome="api_error", binding_posted=True)
        view = PodView(got) if got is not None else None
        if view is None or view.uid != uid or view.terminating or view.node_name:
            raise BindError(f"pod {key} changed while binding (deleted, recreated or already bound)", "conflict")
        rv = _rv(got)
    raise AssertionError("unreachable")  # the last attempt returns


def bind_plain(api: KubeAPI, ns: str, name: str, uid: str, node: str) -> WriteResult:
    """Bind a pod that books no GPU (blocking): POST the Binding; if that fails, read the pod
    back (bound to ``node`` -> bound; otherwise the error; unknown when the read fails too)."""
    try:
        api.create_binding(ns, name, uid, node)
    except Exception as e:  # noqa: BLE001
        error = f"binding {ns}/{name} to {node}: {api_error_text(e)}"
        got = read_pod(api, ns, name)
        if isinstance(got, Exception):
            return WriteResult("unknown", error=f"{error}; reading the pod back failed too: {api_error_text(got)}",
                               outcome="unknown", binding_posted=True)
        view = PodView(got) if got is not None else None
        if view is not None and view.uid == uid and view.node_name == node:
            return WriteResult("bound", resource_version=_rv(got), binding_posted=True)
        return WriteResult("failed", error=error, outcome=_outcome_of(e) if not outcome_unknown(e) else "api_error",
                           binding_posted=True)
    return WriteResult("bound", binding_posted=True)


class BindCycle:
    """The bind cycle of one :class:`~scheduler.service.SchedulerService` (which owns it and
    serves ``/bind`` with :meth:`bind`): its cache, API client, options, config, clock, keys and
    metrics are the service's (``self.svc``), read at each use (a config reload or a test's clock
    applies)."""

    def __init__(self, svc: SchedulerService):
        self.svc = svc
        self.unknown_retries = 0  #: read-backs of unknown bind outcomes that could not tell yet
        self.resolvers: set[asyncio.Task[None]] = set()  #: background read-backs (:meth:`resolve`)
        self._unresolved_by: dict[str, Pending] = {}  #: pod key -> the bind its unresolved mark is for

    # -- promises ("assume") ------------------------------------------------------------------
    def assume(self, req: PodRequest, pod: Obj, node: str) -> bool:
        """Promise ``req`` its plan on ``node`` for ``Options.assume_seconds`` (kube-scheduler binds
        asynchronously: the next pod's filter must not see this capacity as free). Only for a pod
        with a uid that books GPUs and holds no booking; a newer promise to the same pod replaces
        the old one; /bind turns it into the booking (see docs/scheduler.md "Promises"). Returns
        True if promised."""
        ttl = self.svc.opts.assume_seconds
        uid = PodView(pod).uid
        if ttl <= 0 or not uid or not req.has_gpu or req.key in self.svc.cache.state.bookings:
            return False
        return self.svc.cache.engine.assume_on(req, uid, node, self.svc.clock() + ttl) is not None

    def expire_promises(self) -> None:
        """End the promises whose time is up (pods that never came to bind)."""
        n = self.svc.cache.state.expire_assumed(self.svc.clock())
        if n:
            self.svc.metrics.assumptions_expired.inc(n)

    async def bind(self, args: Obj) -> str:
        """ExtenderBindingArgs -> error text ("" on success)."""
        ns = str(args.get("PodNamespace") or "default")
        name = str(args.get("PodName") or "")
        uid = str(args.get("PodUID") or "")
        node = str(args.get("Node") or "")
        key = f"{ns}/{name}"
        try:
            if not self.svc.is_leader:
                raise BindError("this kube-vgpu scheduler replica is not the leader; only the leader binds",
                                "not_leader")
            if self.svc.api is None:
                raise BindError("no API server connection", "api_error")
            pod = await self.fetch(ns, name, uid)
            self.check(pod, node)
            gpus = await self.bind_pod(pod, node)
        except BindError as e:
            self.svc.metrics.binds.labels(outcome=e.outcome).inc()
            log.warning("bind failed", extra={"pod": key, "node": node, "error": str(e), "outcome": e.outcome})
            return str(e)
        self.svc.metrics.binds.labels(outcome="success").inc()
        log.debug("bound", extra={"pod": key, "node": node, "gpu": ",".join(gpus)})
        return ""

    async def fetch(self, ns: str, name: str, uid: str) -> Obj:
        """The pod as the API server has it (never a pod spec a /filter body carried: that body
        is not authenticated, and the bind writes an allocation from it): as the watch last showed
        it when that is this uid, unbound and not terminating (its resourceVersion becomes the
        Binding's precondition, so a pod changed since is re-read before anything is written), else
        a GET. Checks name and uid."""
        assert self.svc.api is not None
        cached = self.svc.cache.pod_to_bind(f"{ns}/{name}", uid)
        if cached is not None:
            return cached
        try:
            pod = await self.svc.run_blocking(self.svc.api.get_pod, ns, name)
        except Exception as e:  # noqa: BLE001
            outcome = "not_found" if is_not_found(e) else "api_error"
            raise BindError(f"pod {ns}/{name}: {api_error_text(e)}", outcome) from e
        if not isinstance(pod, dict) or pod_key(pod) != f"{ns}/{name}":
            raise BindError(f"pod {ns}/{name}: the API server answered another object", "api_error")
        got = PodView(pod).uid
        if uid and got != uid:
            raise BindError(f"pod {ns}/{name} has uid {got}, bind asked for {uid} (pod was recreated)", "not_found")
        return pod

    def check(self, pod: Obj, node: str) -> None:
        """Refuse (BindError naming pod, field and value) a pod this extender must not bind to
        ``node``: one that asks for no vGPU resource, names another scheduler, is bound already,
        terminating or finished, or does not tolerate the node's NoSchedule/NoExecute taints (or
        its cordon). ``/bind`` has no caller authentication, so nothing here trusts the caller;
        fitting the node's GPUs is checked when booking."""
        view = PodView(pod)
        key = view.key
        cfg = self.svc.config
        if not pod_asks(pod, cfg.resource_names):
            raise BindError(f"pod {key} asks for no vGPU resource (none of {', '.join(cfg.resource_names.all())} "
                            f"in its containers' resources); kube-vgpu binds only vGPU pods", "refused")
        sched = view.scheduler_name
        if sched != cfg.scheduler_name:
            raise BindError(f"pod {key}: spec.schedulerName={sched!r}; this extender binds only pods of "
                            f"schedulerName {cfg.scheduler_name!r}", "refused")
        if view.node_name:
            raise BindError(f"pod {key} is already bound: spec.nodeName={view.node_name!r}", "refused")
        if view.terminating:
            raise BindError(f"pod {key} is being deleted: metadata.deletionTimestamp="
                            f"{view.deletion_timestamp!r}", "not_found")
        if view.finished:
            raise BindError(f"pod {key} has finished: status.phase={view.phase!r}", "refused")
        info = self.svc.cache.nodes.get(node)
        if info is None:
            raise BindError(f"cannot bind pod {key}: node {node!r} is not known to the kube-vgpu scheduler",
                            "unschedulable")
        taint = untolerated(view.spec.get("tolerations"), info.taints)
        if taint is not None:
            raise BindError(f"cannot bind pod {key} to node {node}: the pod does not tolerate the node's taint "
                            f"{taint} (no entry of spec.tolerations matches it)", "unschedulable")

    async def bind_pod(self, pod: Obj, node: str) -> list[str]:
        """Reserve, then bind with the record (one Binding, optimistic concurrency). A definite failure releases the
        booking at once; an unknown outcome keeps it until the pod is read back (see
        :meth:`settled`). Returns the GPU uuids. Raises BindError."""
        assert self.svc.api is not None
        api = self.svc.api
        view = PodView(pod)
        ns, name, uid, key = view.namespace, view.name, view.uid, view.key
        try:
            req = parse_pod(pod, self.svc.config)
        except RequestError as e:
            raise BindError(str(e), "invalid") from e
        if not req.has_gpu:  # asks for a vGPU resource but books no GPU (e.g. only the priority)
            res = await self.svc.run_blocking(bind_plain, api, ns, name, uid, node)
            if res.state != "bound":
                raise BindError(res.error, res.outcome)
            return []
        cache = self.svc.cache
        if key in cache.inflight or (uid and cache.unresolved.get(key) == uid):
            # a Binding of this pod may still land: booking again would drop its booking, and the
            # pod would run on GPUs nothing books (a replayed /bind, or kube-scheduler's retry)
            raise BindError(f"pod {key}: a bind of this pod is in progress (its Binding may still land); "
                            "try again once it has ended", "conflict")
        booking, alloc = self.reserve(req, uid, node)
        gpus = sorted({d.uuid for c in alloc.containers for d in c.devices})
        self.svc.cache.inflight.add(key)
        annotations: dict[str, str] = {}
        rv = view.resource_version
        writing: asyncio.Future[WriteResult] | None = None
        try:
            annotations = self.bind_annotations(uid, node, alloc)
            writing = asyncio.ensure_future(self.write(api, ns, name, uid, rv, annotations, node))
            result = await asyncio.shield(writing)
        except BaseException as e:
            if writing is not None and isinstance(e, asyncio.CancelledError):
                # cancelled while the writes go on in their thread: settle them when they end
                pending = Pending(key, uid, node, booking, req, annotations, rv)
                if writing.done():
                    self.writes_ended(pending, writing)
                else:
                    self.mark(pending)
                    writing.add_done_callback(partial(self.writes_ended, pending))
                raise
            self.svc.cache.release_if(key, booking, failed_uid=uid)
            if isinstance(e, BindError) or not isinstance(e, Exception):
                raise
            outcome = "conflict" if is_conflict(e) else "not_found" if is_not_found(e) else "api_error"
            raise BindError(f"binding {key} to {node} failed: {api_error_text(e)}", outcome) from e
        finally:
            self.svc.cache.inflight.discard(key)
        pending = Pending(key, uid, node, booking, req, annotations, rv)
        err = self.settled(pending, result)
        if err is not None:
            raise err
        return gpus

    async def write(self, api: KubeAPI, ns: str, name: str, uid: str, rv: str, annotations: dict[str, str],
                    node: str) -> WriteResult:
        """:func:`write_binding`, its first Binding sent from the event loop when the API client
        can (:attr:`KubeAPI.aio`): a bind that goes through makes no hop to a worker thread. Any
        failure of that Binding (a definite one, a conflict, an unknown outcome) is handed with its
        error to :func:`write_binding` in a worker thread, which goes on exactly as if it had sent
        it (re-read and retry, or settle by reading the pod back)."""
        if api.aio is None:
            return await self.svc.run_blocking(write_binding, api, ns, name, uid, rv, annotations, node)
        try:
            await api.create_binding_async(ns, name, uid, node, rv, annotations)
        except Exception as e:  # noqa: BLE001 - every error is judged by write_binding
            return await self.svc.run_blocking(partial(write_binding, api, ns, name, uid, rv, annotations, node,
                                                   first_error=e))
        return WriteResult("bound", binding_posted=True)

    def reserve(self, req: PodRequest, uid: str, node: str) -> tuple[Booking, PodAllocation]:
        """Choose ``req``'s GPUs on ``node`` and book them (synchronous: no other bind interleaves;
        a promise of the pod becomes this booking). Raises BindError (``unschedulable``) when
        nothing could be booked."""
        r = self.svc.cache.reserve(req, uid, node)
        if isinstance(r, str):
            raise BindError(f"cannot place {req.key} on {node}: {r}", "unschedulable")
        return r

    # -- unknown outcomes ---------------------------------------------------------------------
    def settled(self, p: Pending, result: WriteResult) -> BindError | None:
        """Apply a bind's WriteResult to the cache (on the loop): bound -> record the bind; failed
        -> release the booking (if still this bind's); lost -> release it and book what the pod
        says; unknown -> keep the booking, mark the pod unresolved and read it back in the
        background until the outcome is known. Returns the BindError to report (None: bound)."""
        self.unmark(p)
        if result.state == "bound":
            self.svc.cache.record_bound(p.key, p.uid, p.booking, p.request, result.resource_version, p.fence_rv)
            self.svc.cache.remember_written(p.key, p.uid, p.node, p.annotations, p.booking.allocation)
            return None
        if result.state == "unknown":
            if self.svc.cache.state.bookings.get(p.key) is not p.booking:
                return BindError(result.error, "unknown")  # released meanwhile (deleted): nothing to keep
            self.mark(p)
            log.warning("bind outcome unknown; keeping the booking until the pod is read back",
                        extra={"pod": p.key, "node": p.node, "error": result.error, "outcome": "unknown"})
            task = asyncio.get_running_loop().create_task(self.resolve(p, result.binding_posted))
            self.resolvers.add(task)
            task.add_done_callback(self.resolvers.discard)
            return BindError(f"{result.error}; the outcome is unknown, so the GPUs stay booked until the pod "
                             "has been read back", "unknown")
        self.svc.cache.release_if(p.key, p.booking, failed_uid=p.uid if result.state == "failed" else None)
        if result.state == "lost" and result.pod is not None:
            self.svc.cache.on_pod("MODIFIED", result.pod)  # book what the pod's own record says
        return BindError(result.error, result.outcome or "api_error")

    def writes_ended(self, p: Pending, fut: asyncio.Future[WriteResult]) -> None:
        """Done-callback of writes whose bind call was cancelled: settle their result."""
        if fut.cancelled() or fut.exception() is not None:
            self.unmark(p)
            self.svc.cache.release_if(p.key, p.booking, failed_uid=p.uid)
            return
        err = self.settled(p, fut.result())
        if err is not None:
            log.warning("bind failed", extra={"pod": p.key, "node": p.node, "error": str(err),
                                               "outcome": err.outcome})

    async def resolve(self, p: Pending, posted: bool) -> None:
        """Read a pod whose bind outcome is unknown back, with backoff (Options.unknown_retry),
        until :func:`settle` knows; then apply it. Stops early when the watch settled it (the
        booking is no longer this bind's: deleted, re-booked from the pod's record, or a newer
        bind; or the watch shows the pod bound to our node) or the service stops."""
        assert self.svc.api is not None
        delay, cap = self.svc.opts.unknown_retry
        ns, name = p.key.split("/", 1)
        while not self.svc.stop_event.is_set():
            if self.svc.cache.state.bookings.get(p.key) is not p.booking:
                self.unmark(p)
                log.info("bind outcome settled by the watch", extra={"pod": p.key, "node": p.node})
                return
            info = self.svc.cache.pods.get(p.key)
            if info is not None and info.uid == p.uid and info.bound and info.node == p.node:
                self.unmark(p)  # booked from the pod's own record from here on
                log.info("bind outcome settled by the watch: bound", extra={"pod": p.key, "node": p.node})
                return
            result = await self.svc.run_blocking(settle, self.svc.api, ns, name, p.uid, p.node, p.annotations,
                                             p.fence_rv, "the outcome of the bind was unknown", "api_error", posted)
            if result.state != "unknown":
                if self.svc.cache.state.bookings.get(p.key) is not p.booking:
                    continue  # the watch settled it while we read (the top of the loop says so)
                err = self.settled(p, result)
                log.info("bind outcome read back", extra={
                    "pod": p.key, "node": p.node, "outcome": result.state,
                    "error": str(err) if err is not None else None})
                return
            self.unknown_retries += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.svc.stop_event.wait(), delay)
            delay = min(cap, delay * 2)

    def mark(self, p: Pending) -> None:
        """Mark ``p``'s pod unresolved in the cache (relists keep its booking)."""
        self.svc.cache.unresolved[p.key] = p.uid
        self._unresolved_by[p.key] = p

    def unmark(self, p: Pending) -> None:
        """Drop the unresolved mark of ``p``'s pod, if it is ``p``'s (a newer bind of the same pod
        may have marked it since)."""
        if self._unresolved_by.get(p.key) is p:
            del self._unresolved_by[p.key]
            self.svc.cache.unresolved.pop(p.key, None)

    def bind_annotations(self, uid: str, node: str, alloc: PodAllocation) -> dict[str, str]:
        """The annotations a bind writes: the allocation record, bind-phase ``allocating``, the
        bind time (whole unix seconds) and the allocation signature over uid, node, bind time and
        the record's exact text (active key)."""
        text = encode_allocation(alloc)
        bind_time = str(int(self.svc.clock()))
        return {ANN_ALLOCATION: text, ANN_BIND_PHASE: BIND_ALLOCATING, ANN_BIND_TIME: bind_time,
                ANN_ALLOCATION_SIGNATURE: sign_allocation(self.svc.keys.current(), uid, node, bind_time, text)}

