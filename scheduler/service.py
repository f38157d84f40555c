"""The extender service: HTTP handlers (kube-scheduler extender v1), cache feeding, bind, background
loops (availability, config reload, FGD shapes, rejection counting, leader election).

Wire format - ``k8s.io/kube-scheduler/extender/v1``; the Go types have no JSON tags, so keys are
the Go field names (captured from kube-scheduler v1.36):

* ``POST /filter``: ``ExtenderArgs {Pod, Nodes: NodeList|null, NodeNames: [str]|null}`` ->
  ``ExtenderFilterResult {Nodes, NodeNames, FailedNodes: {name: reason},
  FailedAndUnresolvableNodes: {name: reason}, Error: str}``. With ``nodeCacheCapable: true`` the
  scheduler sends ``NodeNames`` and gets ``NodeNames`` back; otherwise ``Nodes`` in, ``Nodes`` out.
* ``POST /prioritize``: ExtenderArgs -> ``HostPriorityList [{Host, Score}]``, Score 0..10
  (``MaxExtenderPriority``).
* ``POST /bind``: ``ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}`` ->
  ``ExtenderBindingResult {Error}``.

Errors are answered with HTTP 200 and the ``Error`` field (what kube-scheduler reads), except a
body that is not JSON or not shaped like the type above (wrong JSON types, no ``Pod``, no
``PodName``/``Node``): HTTP 400 with an ``Error`` naming the field (``scheduler/wire.py``); no body
ever gets a 500. Pods that ask for no vGPU resource pass through untouched.

Bind plans from the pod as the API server has it (GET, uid checked against ``PodUID``), never from
a pod spec some /filter body carried: those bodies are not authenticated.

Concurrency: every handler and every cache update runs on one asyncio loop; API calls run in a
thread pool. A bind reserves its GPUs in memory (no ``await`` between choosing and booking) before
writing anything, so concurrent binds never overcommit, and releases the reservation at once when
a later step definitely fails. A write whose outcome is unknown (timeout, 5xx, 429, lost
connection) is settled by reading the pod back; while that read fails too, the reservation is kept
and the pod is read back in the background (``settle``, ``_resolve``).

Bind refuses (``_check_bindable``) a pod that asks for no vGPU resource, names another
``schedulerName``, is bound, terminating or finished, or does not tolerate the node's taints.

No bind waits for the device plugin: it identifies each container exactly at PreStartContainer
(kubelet's PodResources API names the pod holding the device IDs; docs/device-plugin.md), so binds
to one node run concurrently. ``scheduling.bindHandoverSeconds`` is accepted and has no effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kube_vgpu.cluster import ClusterCache, Record, pod_key
from kube_vgpu.codec import encode_allocation
from kube_vgpu.config import Config, load_config_text
from kube_vgpu.errors import ConfigError, RequestError
from kube_vgpu.model import PodAllocation, PodRequest
from kube_vgpu.placement import Booking
from kube_vgpu.placement.fastpath import names_key, normalise_array
from kube_vgpu.placement.liveshapes import shapes_from_state
from kube_vgpu.placement.render import detail, summaries, summary
from kube_vgpu.placement.status import Code, FitFailure
from kube_vgpu.podspec import parse_pod, pod_asks
from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    LABEL_NODE,
)
from kube_vgpu.signing import KeyDir, KeyRing, KeySource, sign_allocation, sign_progress, verify_progress
from kube_vgpu.taints import untolerated

from .hostpriority import HostPriorityEncoder
from .kube import KubeAPI, Reflector, api_error_text, is_conflict, is_not_found, outcome_unknown
from .leader import LeaseElector, LeaseFollower
from .metrics import GpuRow, Metrics
from .wire import check_binding_args, check_extender_args

log = logging.getLogger("kube_vgpu.scheduler")

T = TypeVar("T")
Obj = dict[str, Any]


@dataclass
class Options:
    """Service options (see ``kube-vgpu scheduler --help`` and docs/CONTRACTS.md).

    config_path: policy file polled every ``config_poll`` s (None = no reload); leader_elect,
    lease_name, lease_namespace, identity: Lease election; leader_mode: ``own`` (compete for our
    Lease) or ``follow`` (lead while kube-scheduler in this pod, hostname ``hostname``, holds its Lease); resync_seconds: full relist period;
    pod_field_selector: field selector of the pods watched; None = ``spec.schedulerName=<our
    scheduler name>`` (immutable after creation and written by the webhook, so a tenant cannot hide
    a running pod from the cache the way removing a label would; a change of the scheduler name
    needs a restart);
    sync_wait: how long /filter waits for the first list before answering an Error (s);
    shapes_interval: FGD shape refresh (s); assume_seconds: how long a pod that passed
    filter/prioritize holds its promise on the chosen node while kube-scheduler binds it (0 =
    no promises; see docs/scheduler.md "Promises"); api_workers: threads for blocking API calls (each bind holds one for its GET,
    PATCH and Binding; kube-scheduler binds many pods at once, and with 16 a burst of 200 binds
    queued ~1.5 s behind them; at most the client's connection pool size, 64);
    unknown_retry: first and longest wait (s) between read-backs of a pod whose bind outcome is
    unknown (doubling). ``leader_elect`` defaults to False here; the command line's default is True.
    """

    config_path: str | None = None
    config_poll: float = 2.0
    leader_elect: bool = False
    leader_mode: str = "own"
    hostname: str = ""
    lease_name: str = "kube-vgpu-scheduler"
    lease_namespace: str = "kube-system"
    identity: str = "kube-vgpu-scheduler"
    resync_seconds: float = 300.0
    pod_field_selector: str | None = None
    sync_wait: float = 5.0
    shapes_interval: float = 300.0
    assume_seconds: float = 30.0
    api_workers: int = 48
    #: first and longest wait (s) between read-backs of a pod whose bind outcome is unknown
    unknown_retry: tuple[float, float] = (0.2, 10.0)
    component: str = "kube-vgpu-scheduler"
    freeze_gc: bool = False  #: after the first sync, move the cache out of the GC's scans (p99)


class BindError(Exception):
    """A bind step failed; ``outcome`` is the metrics label."""

    def __init__(self, message: str, outcome: str):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class WriteResult:
    """What the bind's API writes came to (:func:`write_bind`, :func:`settle`).

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
class _Pending:
    """A bind whose writes have started: what settling it needs (pod key and uid, node, its
    booking and request, the annotations and labels it writes)."""

    key: str
    uid: str
    node: str
    booking: Booking
    request: PodRequest
    annotations: dict[str, str]
    labels: dict[str, str]


def _rv(pod: Obj | None) -> str:
    return str(((pod or {}).get("metadata") or {}).get("resourceVersion") or "")


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
    meta = pod.get("metadata") or {}
    if uid and str(meta.get("uid") or "") != uid:
        return "gone"
    ours = bool(allocation) and (meta.get("annotations") or {}).get(ANN_ALLOCATION) == allocation
    bound_to = str((pod.get("spec") or {}).get("nodeName") or "")
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
        to = str(((pod or {}).get("spec") or {}).get("nodeName") or "")
        return WriteResult("lost", pod=pod, error=f"{error}; pod {key} is bound to node {to} without this "
                           f"bind's allocation (bound by someone else)", outcome="conflict", binding_posted=posted)
    return WriteResult("failed", error=error, outcome=outcome if outcome != "unknown" else "api_error",
                       binding_posted=posted)


def settle(api: KubeAPI, ns: str, name: str, uid: str, node: str, annotations: dict[str, str],
           labels: dict[str, str], error: str, outcome: str, posted: bool, attempts: int = 3) -> WriteResult:
    """Read the pod back after a write whose outcome is not known (blocking) and settle the
    attempt: bound to ``node`` with our record -> ``bound``; gone -> ``failed``; bound elsewhere ->
    ``lost``; not bound and our record absent -> ``failed``; not bound with our record on it ->
    take the record off (merge patch guarded by the resourceVersion just read, so neither the
    record nor a Binding still in flight, whose resourceVersion precondition is then stale, can
    outlive the attempt), then ``failed``. A read or removal that fails without an answer ->
    ``unknown`` (the caller keeps the booking and asks again later). ``error`` / ``outcome``:
    what made the outcome unknown."""
    key = f"{ns}/{name}"
    allocation = annotations.get(ANN_ALLOCATION, "")
    for _ in range(attempts):
        got = read_pod(api, ns, name)
        if isinstance(got, Exception):
            return WriteResult("unknown", error=f"{error}; reading the pod back failed too: {api_error_text(got)}",
                               outcome="unknown", binding_posted=posted)
        v = judge(got, uid, node, allocation)
        if v != "landed":
            return _verdict(v, got, key, node, error, outcome, posted)
        try:
            api.remove_pod_metadata(ns, name, _rv(got), list(annotations), list(labels))
        except Exception as e:  # noqa: BLE001
            if is_conflict(e):
                continue  # the pod changed since the read: read again
            if outcome_unknown(e):
                return WriteResult("unknown", error=f"{error}; taking the allocation off the unbound pod failed "
                                   f"too: {api_error_text(e)}", outcome="unknown", binding_posted=posted)
            if is_not_found(e):
                return _verdict("gone", None, key, node, error, outcome, posted)
            # refused for good: the record stays on the unbound pod, which books nothing (the
            # cache ignores an unbound record of a failed bind) and a re-bind overwrites
            return WriteResult("failed", error=f"{error}; the allocation could not be taken off the unbound "
                               f"pod: {api_error_text(e)}", outcome=outcome if outcome != "unknown" else "api_error",
                               binding_posted=posted)
        return WriteResult("failed", error=error, outcome=outcome if outcome != "unknown" else "api_error",
                           binding_posted=posted)
    return WriteResult("unknown", error=f"{error}; the pod kept changing while it was read back",
                       outcome="unknown", binding_posted=posted)


def _write_record(api: KubeAPI, ns: str, name: str, uid: str, rv: str, annotations: dict[str, str],
                  labels: dict[str, str], node: str, attempts: int) -> str | WriteResult:
    """Merge-patch the record guarded by ``rv``; on 409 re-read and retry while it is the same,
    live, unbound pod. Returns the pod's resourceVersion with the record on it, or the settled
    WriteResult when the patch's outcome was unknown and the read-back shows it did not land (or
    cannot tell). Raises BindError or ApiException for a definite failure (nothing written)."""
    key = f"{ns}/{name}"
    for attempt in range(attempts):
        try:
            return _rv(api.patch_pod_metadata(ns, name, rv, annotations, labels)) or rv
        except Exception as e:  # noqa: BLE001
            if outcome_unknown(e):
                error = f"writing the allocation of {key}: {api_error_text(e)}"
                got = read_pod(api, ns, name)
                if isinstance(got, Exception):
                    return WriteResult("unknown", error=f"{error}; reading the pod back failed too: "
                                       f"{api_error_text(got)}", outcome="unknown")
                v = judge(got, uid, node, annotations.get(ANN_ALLOCATION, ""))
                if v == "landed":
                    return _rv(got)  # the patch did commit: go on to the Binding
                return _verdict(v, got, key, node, error, "api_error", False)
            if not is_conflict(e) or attempt == attempts - 1:
                raise
        fresh = api.get_pod(ns, name)
        fm = fresh.get("metadata") or {}
        if str(fm.get("uid") or "") != uid or fm.get("deletionTimestamp") or (fresh.get("spec") or {}).get("nodeName"):
            raise BindError(f"pod {key} changed while binding (deleted, recreated or already bound)", "conflict")
        rv = str(fm.get("resourceVersion") or "")
    raise AssertionError("unreachable")  # the last attempt returns or raises


def write_bind(api: KubeAPI, ns: str, name: str, uid: str, rv: str, annotations: dict[str, str],
               labels: dict[str, str], node: str, attempts: int = 4) -> WriteResult:
    """The bind's API writes, in one worker thread (blocking): merge-patch the allocation
    annotations and label guarded by ``rv`` (409: re-read and retry while it is the same, live,
    unbound pod), then POST the Binding with the pod's uid and the patched resourceVersion as
    preconditions. A write whose outcome is unknown (timeout, 5xx, 429, connection error) is
    settled by reading the pod back (:func:`settle`); a definite failure of the Binding is
    settled the same way (the record comes off the unbound pod). Raises BindError or
    ApiException for a definite failure before anything was written."""
    r = _write_record(api, ns, name, uid, rv, annotations, labels, node, attempts)
    if isinstance(r, WriteResult):
        return r
    try:
        api.create_binding(ns, name, uid, node, r)
    except Exception as e:  # noqa: BLE001
        return settle(api, ns, name, uid, node, annotations, labels,
                      f"binding {ns}/{name} to {node}: {api_error_text(e)}", _outcome_of(e), True)
    return WriteResult("bound", resource_version=r, binding_posted=True)


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
        if got is not None and str((got.get("metadata") or {}).get("uid") or "") == uid \
                and (got.get("spec") or {}).get("nodeName") == node:
            return WriteResult("bound", resource_version=_rv(got), binding_posted=True)
        return WriteResult("failed", error=error, outcome=_outcome_of(e) if not outcome_unknown(e) else "api_error",
                           binding_posted=True)
    return WriteResult("bound", binding_posted=True)


def _names_of(args: Obj) -> tuple[list[str], Obj | None]:
    """Candidate node names of ExtenderArgs and the NodeList (when nodeCacheCapable is false)."""
    names = args.get("NodeNames")
    nodes = args.get("Nodes")
    if isinstance(names, list):
        return names, None
    if isinstance(nodes, dict):
        items = nodes.get("items") or []
        return [str((n.get("metadata") or {}).get("name") or "") for n in items], nodes
    return [], None


def filter_result(names: Sequence[str], nodelist: Obj | None, ok: Sequence[str], failed: dict[str, str],
                  unresolvable: dict[str, str], error: str = "") -> Obj:
    """Build an ExtenderFilterResult in the shape the caller used (NodeNames or Nodes)."""
    if nodelist is not None:
        keep = set(ok)
        items = [n for n in nodelist.get("items") or [] if (n.get("metadata") or {}).get("name") in keep]
        out_nodes: Obj | None = dict(nodelist)
        assert out_nodes is not None
        out_nodes["items"] = items
        out_names: list[str] | None = None
    else:
        out_nodes = None
        out_names = list(ok)
    return {"Nodes": out_nodes, "NodeNames": out_names, "FailedNodes": failed,
            "FailedAndUnresolvableNodes": unresolvable, "Error": error}


class SchedulerService:
    """The extender. ``api`` None runs without a cluster (tests feed the cache directly and call
    :meth:`mark_synced`). ``keys``: the signing key ring (a :class:`~kube_vgpu.signing.KeyDir` is
    reloaded every ``config_poll`` s); None: a fresh random key, so only records this process signs
    verify (``kube-vgpu scheduler`` always passes ``--signing-keys-dir``)."""

    def __init__(self, config: Config, api: KubeAPI | None, options: Options | None = None,
                 clock: Callable[[], float] = time.time, keys: KeySource | None = None):
        self.config = config
        self.api = api
        self.opts = options or Options()
        self.clock = clock
        self.keys: KeySource = keys if keys is not None else KeyRing.generate()
        self.cache = ClusterCache(config, clock, keys=self.keys)
        self._resigning: dict[str, asyncio.Task[None]] = {}  #: pod uid -> its re-sign in progress
        self._sweep: asyncio.Task[None] | None = None  #: re-signing after a key rotation
        self._sweep_again = False
        self._priorities = HostPriorityEncoder()
        self.metrics = Metrics()
        self._gpu_seen: dict[str, tuple[Any, int, tuple[GpuRow, ...]]] = {}
        self._executor = ThreadPoolExecutor(self.opts.api_workers, thread_name_prefix="kube-api")
        self._synced = {"nodes": False, "pods": False}
        self.synced = asyncio.Event()
        self._events: asyncio.Queue[tuple[str, dict[str, FitFailure]]] = asyncio.Queue(maxsize=1000)
        self._tasks: list[asyncio.Task[Any]] = []
        self._reflectors: list[Reflector] = []
        self._stop = asyncio.Event()
        self._config_sig: str | None = None
        self.elector: LeaseElector | LeaseFollower | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics.is_leader.set(0 if self.opts.leader_elect else 1)
        self.unknown_retries = 0  #: read-backs of unknown bind outcomes that could not tell yet
        self._resolvers: set[asyncio.Task[None]] = set()
        self._unresolved_by: dict[str, _Pending] = {}  #: pod key -> the bind its unresolved mark is for
        self.cache.on_reject = lambda code: self.metrics.records_rejected.labels(reason=code).inc()
        self.cache.on_resign = self._resign_soon

    # -- plumbing -----------------------------------------------------------------------------
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (API request) in the service's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args))

    def app(self, serve_metrics: bool = True) -> web.Application:
        """The aiohttp application: the extender API, /livez, /readyz and (unless ``serve_metrics``
        is false, when :meth:`metrics_app` serves it on its own listener) /metrics. It starts and
        stops the service."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/filter", self.handle_filter)
        app.router.add_post("/prioritize", self.handle_prioritize)
        app.router.add_post("/bind", self.handle_bind)
        app.router.add_get("/livez", self.handle_livez)
        app.router.add_get("/healthz", self.handle_livez)
        app.router.add_get("/readyz", self.handle_readyz)
        if serve_metrics:
            app.router.add_get("/metrics", self.handle_metrics)
        app.on_startup.append(lambda _app: self.start())
        app.on_cleanup.append(lambda _app: self.stop())
        return app

    def metrics_app(self) -> web.Application:
        """Observability only (the ``--metrics-port`` listener): /metrics, /livez, /readyz; never
        filter, prioritize or bind, so it can be exposed to the pod network. It does not start the
        service (the main application does)."""
        app = web.Application(client_max_size=1 << 16)
        app.router.add_get("/livez", self.handle_livez)
        app.router.add_get("/healthz", self.handle_livez)
        app.router.add_get("/readyz", self.handle_readyz)
        app.router.add_get("/metrics", self.handle_metrics)
        return app

    @property
    def is_leader(self) -> bool:
        """True if this replica may bind (always, without --leader-elect)."""
        return self.elector is None or self.elector.is_leader

    def mark_synced(self, kind: str = "all") -> None:
        """Record that ``kind`` (nodes | pods | all) has been listed; ready once both are."""
        if kind == "all":
            self._synced = {"nodes": True, "pods": True}
        else:
            self._synced[kind] = True
        if all(self._synced.values()) and not self.synced.is_set():
            if self.opts.freeze_gc:
                gc.collect()
                gc.freeze()  # the long-lived cache is never garbage; full collections stop scanning it
            self.synced.set()
            self.metrics.synced.set(1)
            log.info("caches synced", extra={"outcome": f"{len(self.cache.state.nodes)} nodes, "
                                                         f"{len(self.cache.state.bookings)} bookings"})

    async def start(self) -> None:
        """Start list+watch, leader election and the background loops (idempotent)."""
        if self.loop is not None:
            return
        self.loop = loop = asyncio.get_running_loop()
        if self.api is not None:
            api = self.api

            def marshal(fn: Callable[..., Any]) -> Callable[..., None]:
                def call(*a: Any) -> None:
                    loop.call_soon_threadsafe(fn, *a)
                return call

            self._reflectors = [
                Reflector(api, "nodes", marshal(lambda items, _rv: self.cache.replace_nodes(items)),
                          marshal(self.cache.on_node),
                          marshal(partial(self.mark_synced, "nodes")), resync_seconds=self.opts.resync_seconds),
                Reflector(api, "pods", marshal(self.cache.replace_pods), marshal(self._on_pod_event),
                          marshal(partial(self.mark_synced, "pods")),
                          field_selector=self.opts.pod_field_selector
                          or f"spec.schedulerName={self.config.scheduler_name}",
                          resync_seconds=self.opts.resync_seconds),
            ]
            for r in self._reflectors:
                r.start()
            if self.opts.leader_elect:
                if self.opts.leader_mode == "follow":
                    self.elector = LeaseFollower(api, self.opts.lease_namespace, self.opts.lease_name,
                                                 self.opts.hostname or self.opts.identity.split("_")[0],
                                                 self.run_blocking)
                else:
                    self.elector = LeaseElector(api, self.opts.lease_namespace, self.opts.lease_name,
                                                self.opts.identity, self.run_blocking)
                self.elector.on_change = lambda lead: self.metrics.is_leader.set(1 if lead else 0)
                self._tasks.append(asyncio.create_task(self.elector.run(self._stop)))
        self._tasks.append(asyncio.create_task(self._event_loop()))
        self._tasks.append(asyncio.create_task(self._every(1.0, self._tick)))
        if self.opts.config_path:
            self._config_sig = self._file_sig(self.opts.config_path)
            self._tasks.append(asyncio.create_task(self._every(self.opts.config_poll, self.reload_config)))
        self._tasks.append(asyncio.create_task(self._every(self.opts.shapes_interval, self.refresh_shapes)))
        if isinstance(self.keys, KeyDir):
            self._tasks.append(asyncio.create_task(self._every(self.opts.config_poll, self.refresh_keys)))

    def _on_pod_event(self, kind: str, pod: Obj) -> None:
        """A pod watch event: into the cache; then our own bind of that pod needs no relist
        protection any more once the watch has shown it at or after our write."""
        self.cache.on_pod(kind, pod)
        meta = pod.get("metadata") or {}
        self.cache.own_bind_seen(pod_key(pod), str(meta.get("resourceVersion") or ""))

    async def stop(self) -> None:
        """Stop the background work (reflector threads are joined in a worker thread)."""
        self._stop.set()
        tasks = self._tasks + list(self._resolvers)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        loop = asyncio.get_running_loop()
        for r in self._reflectors:
            await loop.run_in_executor(None, r.stop)
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _every(self, period: float, fn: Callable[[], Any]) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), period)
                return
            except TimeoutError:
                pass
            try:
                r = fn()
                if asyncio.iscoroutine(r):
                    await r
            except Exception:  # noqa: BLE001 - a background loop must survive
                log.exception("background task failed")

    def _tick(self) -> None:
        self._expire_promises()
        self.cache.refresh_availability()
        self.metrics.nodes.set(len(self.cache.state.nodes))
        self.metrics.unavailable.set(len(self.cache.unavailable))
        self.metrics.bookings.set(len(self.cache.state.bookings))
        self.metrics.assumed.set(len(self.cache.state.assumed))

    # -- config and shapes --------------------------------------------------------------------
    @staticmethod
    def _file_sig(path: str) -> str | None:
        try:
            return hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return None

    def reload_config(self) -> bool:
        """Reload the policy file if its content changed. An invalid file keeps the last good
        config, logs the error with its key and counts it in ``config_reload_errors_total{key}``.
        Returns True when a new config was applied."""
        path = self.opts.config_path
        if not path:
            return False
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            if self._config_sig != "missing":
                self._config_sig = "missing"
                log.error("policy config unreadable; keeping the last good config",
                          extra={"key": "(file)", "error": str(e)})
                self.metrics.config_reload_errors.labels(key="(file)").inc()
                self.metrics.config_ok.set(0)
            return False
        sig = hashlib.sha256(raw).hexdigest()
        if sig == self._config_sig:
            return False
        self._config_sig = sig
        try:
            cfg = load_config_text(raw.decode("utf-8", "replace"))
            self.cache.apply_config(cfg)
        except ConfigError as e:
            log.error("invalid policy config; keeping the last good config", extra={"key": e.key, "error": str(e)})
            self.metrics.config_reload_errors.labels(key=e.key).inc()
            self.metrics.config_ok.set(0)
            return False
        except ValueError as e:
            log.error("invalid policy config; keeping the last good config",
                      extra={"key": "scheduling", "error": str(e)})
            self.metrics.config_reload_errors.labels(key="scheduling").inc()
            self.metrics.config_ok.set(0)
            return False
        self.config = cfg
        self.metrics.config_ok.set(1)
        log.info("policy config reloaded", extra={"policy": f"{cfg.scheduling.node_policy}/{cfg.scheduling.gpu_policy}"})
        return True

    def refresh_shapes(self) -> bool:
        """FGD only: rebuild the target workload's task shapes from the current bookings (default
        mix while few pods are known). Returns True if the engine was reconfigured."""
        eng = self.cache.engine
        if eng.node_policy != "fgd":
            return False
        shapes = shapes_from_state(self.cache.state)
        if shapes == eng.shapes:
            return False
        eng.configure(eng.node_policy, eng.gpu_policy, shapes)
        return True

    # -- metrics ------------------------------------------------------------------------------
    def gpu_rows(self) -> list[tuple[str, tuple[GpuRow, ...]]]:
        """Per node, per GPU: booked and capacity values (MiB, cores %, slots), from the engine
        state. Read on the event loop (a consistent snapshot; a node's rows are rebuilt only when
        its state object or version changed since the last call); rendered in a thread."""
        out: list[tuple[str, tuple[GpuRow, ...]]] = []
        seen = self._gpu_seen
        fresh: dict[str, tuple[Any, int, tuple[GpuRow, ...]]] = {}
        for n in self.cache.state.node_list:
            hit = seen.get(n.name)
            if hit is None or hit[0] is not n or hit[1] != n.version:
                fm, fc, fs = n.free_mem, n.free_cores, n.free_slots
                hit = (n, n.version, tuple(
                    (n.name, d.uuid, d.model, d.memory_mib - fm[i], d.cores - fc[i], d.split - fs[i],
                     d.memory_mib, d.cores, d.split) for i, d in enumerate(n.devices)))
            fresh[n.name] = hit
            out.append((n.name, hit[2]))
        self._gpu_seen = fresh
        return out

    def render_metrics(self, gpus: list[tuple[str, tuple[GpuRow, ...]]]) -> bytes:
        """The /metrics body: the registry, then the per-GPU gauges (blocking: run in a thread)."""
        return self.metrics.gpus.render(gpus, head=generate_latest(self.metrics.registry))

    # -- handlers -----------------------------------------------------------------------------
    async def handle_livez(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def handle_readyz(self, request: web.Request) -> web.Response:
        if not self.synced.is_set():
            return web.Response(status=503, text="caches not synced")
        # own Lease: a Service may route binds to the leader only. follow: kube-scheduler calls its
        # own sidecar, and a non-leader pod must stay Ready (or a rollout would stall).
        if self.opts.leader_elect and self.opts.leader_mode == "own" and not self.is_leader:
            return web.Response(status=503, text="not the leader")
        return web.Response(text="ok")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        gpus = self.gpu_rows()  # snapshot on the loop; render in a thread
        body = await asyncio.get_running_loop().run_in_executor(None, self.render_metrics, gpus)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @staticmethod
    async def _json(request: web.Request) -> tuple[Any, str]:
        """The decoded body and "" , or (None, why it is not JSON). Never raises for any body
        (deep nesting included: orjson refuses it, ``RecursionError`` is caught anyway)."""
        try:
            return orjson.loads(await request.read()), ""
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
            return None, f"request body is not JSON: {str(e)[:200]}"

    async def _wait_synced(self) -> bool:
        if self.synced.is_set():
            return True
        try:
            await asyncio.wait_for(self.synced.wait(), self.opts.sync_wait)
        except TimeoutError:
            return False
        return True

    @staticmethod
    def _bad_request(what: str, e: Exception) -> str:
        """Safety net behind the shape checks: a body they let through that still breaks a
        handler is the client's malformed input (400), never a 500."""
        log.warning("malformed request", extra={"error": f"{what}: {type(e).__name__}: {e}"[:500]})
        return f"malformed {what}: {type(e).__name__}: {str(e)[:200]}"

    async def _checked_args(self, request: web.Request, handler: Callable[[Obj], Awaitable[Any]]
                            ) -> tuple[Any, str]:
        """Read and shape-check ExtenderArgs, then run ``handler``: (result, "") or (None, error)."""
        args, err = await self._json(request)
        if not err:
            err = check_extender_args(args) or ""
        if err:
            return None, err
        try:
            return await handler(args), ""
        except Exception as e:  # noqa: BLE001 - see _bad_request
            return None, self._bad_request("ExtenderArgs", e)

    async def handle_filter(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        res, err = await self._checked_args(request, self.filter)
        if err:
            return web.json_response(filter_result([], None, [], {}, {}, f"invalid ExtenderArgs: {err}"),
                                     status=400)
        body = orjson.dumps(res)
        self.metrics.filter_seconds.observe(time.perf_counter() - t0)
        return web.Response(body=body, content_type="application/json")

    async def filter(self, args: Obj) -> Obj:
        """ExtenderArgs -> ExtenderFilterResult (see module docstring)."""
        pod = args.get("Pod") or {}
        names, nodelist = _names_of(args)
        cfg = self.config
        if not pod_asks(pod, cfg.resource_names):
            return filter_result(names, nodelist, names, {}, {})
        if not await self._wait_synced():
            return filter_result(names, nodelist, [], {}, {}, "kube-vgpu scheduler cache is not synced yet")
        try:
            req = parse_pod(pod, cfg)
        except RequestError as e:
            f = FitFailure(Code.INVALID_REQUEST, detail=str(e))
            bad = dict.fromkeys(names, f)
            self._queue_rejection(pod_key(pod), bad)
            return filter_result(names, nodelist, [], {}, dict.fromkeys(names, summary(f)))
        if self.cache.state.assumed:
            self._expire_promises()
            self.cache.state.forget_assumed(req.key)  # a new scheduling cycle ends the pod's promise
        ok, failed, _ = self.cache.evaluate(req, names, want_scores=False)
        own = self.cache.own_unbound_booking(req.key, str((pod.get("metadata") or {}).get("uid") or ""))
        if own is not None and own in failed and own not in self.cache.unavailable:
            del failed[own]  # the pod's own booking there is what it needs (see own_unbound_booking)
            ok.append(own)
        if not failed:
            resolvable: dict[str, str] = {}
            unresolvable: dict[str, str] = {}
        else:
            resolvable, unresolvable = summaries(failed)
            self._queue_rejection(req.key, failed)
        if len(ok) == 1:  # kube-scheduler does not prioritize a single feasible node: promise it now
            self._assume(req, pod, ok[0])
        return filter_result(names, nodelist, ok, resolvable, unresolvable)

    async def handle_prioritize(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        body, err = await self._checked_args(request, self.prioritize)
        if err:  # HostPriorityList has no Error field; kube-scheduler reads only the status
            return web.json_response({"Error": f"invalid ExtenderArgs: {err}"}, status=400)
        self.metrics.prioritize_seconds.observe(time.perf_counter() - t0)
        return web.Response(body=body, content_type="application/json")

    async def prioritize(self, args: Obj) -> bytes:
        """ExtenderArgs -> HostPriorityList JSON (UTF-8; one entry per name, input order; scores
        0..10, infeasible or non-vGPU: 0). The pod is promised (:meth:`_assume`) on its best node
        (the first of the best-scoring names), which alone keeps the top score: other nodes tied
        with it get one point less, so kube-scheduler, whose own scores usually tie on equal
        nodes, binds where the promise is."""
        pod = args.get("Pod") or {}
        names, _ = _names_of(args)
        cfg = self.config
        scores = np.zeros(len(names), dtype=np.int64)
        key = names_key(names)  # shared by the engine's and the encoder's per-list caches
        if names and pod_asks(pod, cfg.resource_names) and self.synced.is_set():
            try:
                req = parse_pod(pod, cfg)
            except RequestError:
                req = None
            if req is not None:
                if self.cache.state.assumed:
                    self._expire_promises()
                raw = self.cache.score_array(req, names, key)
                own = self.cache.own_unbound_booking(req.key, str((pod.get("metadata") or {}).get("uid") or ""))
                if own is not None and own not in self.cache.unavailable:
                    # its own booking: the best place for it (see own_unbound_booking); a copy,
                    # the engine may keep the array it returned
                    raw = raw.copy()
                    finite = raw[np.isfinite(raw)]
                    raw[[i for i, n in enumerate(names) if n == own]] = float(finite.max()) + 1.0 if finite.size else 0.0
                feasible = raw > -np.inf
                if feasible.any():
                    scores[feasible] = normalise_array(raw[feasible])
                    best = int(np.argmax(raw))
                    if self._assume(req, pod, names[best]):
                        top = scores[best]
                        tied = scores == top
                        if int(np.count_nonzero(tied)) > 1:
                            scores[tied] = top - 1
                            scores[best] = top
        return self._priorities.encode(names, scores, key)

    # -- promises ("assume") ------------------------------------------------------------------
    def _assume(self, req: PodRequest, pod: Obj, node: str) -> bool:
        """Promise ``req`` its plan on ``node`` for ``Options.assume_seconds`` (kube-scheduler binds
        asynchronously: the next pod's filter must not see this capacity as free). Only for a pod
        with a uid that books GPUs and holds no booking; a newer promise to the same pod replaces
        the old one; /bind turns it into the booking (see docs/scheduler.md "Promises"). Returns
        True if promised."""
        ttl = self.opts.assume_seconds
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if ttl <= 0 or not uid or not req.has_gpu or req.key in self.cache.state.bookings:
            return False
        return self.cache.engine.assume_on(req, uid, node, self.clock() + ttl) is not None

    def _expire_promises(self) -> None:
        """End the promises whose time is up (pods that never came to bind)."""
        n = self.cache.state.expire_assumed(self.clock())
        if n:
            self.metrics.assumptions_expired.inc(n)

    async def handle_bind(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        args, err = await self._json(request)
        if not err:
            err = check_binding_args(args) or ""
        if err:
            return web.json_response({"Error": f"invalid ExtenderBindingArgs: {err}"}, status=400)
        try:
            err = await self.bind(args)
        except Exception as e:  # noqa: BLE001 - see _bad_request
            return web.json_response({"Error": self._bad_request("ExtenderBindingArgs", e)}, status=400)
        self.metrics.bind_seconds.observe(time.perf_counter() - t0)
        return web.json_response({"Error": err})

    async def bind(self, args: Obj) -> str:
        """ExtenderBindingArgs -> error text ("" on success)."""
        ns = str(args.get("PodNamespace") or "default")
        name = str(args.get("PodName") or "")
        uid = str(args.get("PodUID") or "")
        node = str(args.get("Node") or "")
        key = f"{ns}/{name}"
        try:
            if not self.is_leader:
                raise BindError("this kube-vgpu scheduler replica is not the leader; only the leader binds",
                                "not_leader")
            if self.api is None:
                raise BindError("no API server connection", "api_error")
            pod = await self._pod_for_bind(ns, name, uid)
            self._check_bindable(pod, node)
            gpus = await self._bind_pod(pod, node)
        except BindError as e:
            self.metrics.binds.labels(outcome=e.outcome).inc()
            log.warning("bind failed", extra={"pod": key, "node": node, "error": str(e), "outcome": e.outcome})
            return str(e)
        self.metrics.binds.labels(outcome="success").inc()
        log.info("bound", extra={"pod": key, "node": node, "gpu": ",".join(gpus)})
        return ""

    async def _pod_for_bind(self, ns: str, name: str, uid: str) -> Obj:
        """The pod as the API server has it (never a pod spec a /filter body carried: that body
        is not authenticated, and the bind writes an allocation from it). Checks name and uid."""
        assert self.api is not None
        try:
            pod = await self.run_blocking(self.api.get_pod, ns, name)
        except Exception as e:  # noqa: BLE001
            outcome = "not_found" if is_not_found(e) else "api_error"
            raise BindError(f"pod {ns}/{name}: {api_error_text(e)}", outcome) from e
        if not isinstance(pod, dict) or pod_key(pod) != f"{ns}/{name}":
            raise BindError(f"pod {ns}/{name}: the API server answered another object", "api_error")
        got = str((pod.get("metadata") or {}).get("uid") or "")
        if uid and got != uid:
            raise BindError(f"pod {ns}/{name} has uid {got}, bind asked for {uid} (pod was recreated)", "not_found")
        return pod

    def _check_bindable(self, pod: Obj, node: str) -> None:
        """Refuse (BindError naming pod, field and value) a pod this extender must not bind to
        ``node``: one that asks for no vGPU resource, names another scheduler, is bound already,
        terminating or finished, or does not tolerate the node's NoSchedule/NoExecute taints (or
        its cordon). ``/bind`` has no caller authentication, so nothing here trusts the caller;
        fitting the node's GPUs is checked when booking."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        key = pod_key(pod)
        cfg = self.config
        if not pod_asks(pod, cfg.resource_names):
            raise BindError(f"pod {key} asks for no vGPU resource (none of {', '.join(cfg.resource_names.all())} "
                            f"in its containers' resources); kube-vgpu binds only vGPU pods", "refused")
        sched = spec.get("schedulerName")
        if sched != cfg.scheduler_name:
            raise BindError(f"pod {key}: spec.schedulerName={sched!r}; this extender binds only pods of "
                            f"schedulerName {cfg.scheduler_name!r}", "refused")
        if spec.get("nodeName"):
            raise BindError(f"pod {key} is already bound: spec.nodeName={spec['nodeName']!r}", "refused")
        if meta.get("deletionTimestamp"):
            raise BindError(f"pod {key} is being deleted: metadata.deletionTimestamp="
                            f"{meta['deletionTimestamp']!r}", "not_found")
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            raise BindError(f"pod {key} has finished: status.phase={phase!r}", "refused")
        info = self.cache.nodes.get(node)
        if info is None:
            raise BindError(f"cannot bind pod {key}: node {node!r} is not known to the kube-vgpu scheduler",
                            "unschedulable")
        taint = untolerated(spec.get("tolerations"), info.taints)
        if taint is not None:
            raise BindError(f"cannot bind pod {key} to node {node}: the pod does not tolerate the node's taint "
                            f"{taint} (no entry of spec.tolerations matches it)", "unschedulable")

    async def _bind_pod(self, pod: Obj, node: str) -> list[str]:
        """Reserve, annotate (optimistic concurrency), bind. A definite failure releases the
        booking at once; an unknown outcome keeps it until the pod is read back (see
        :meth:`_settled`). Returns the GPU uuids. Raises BindError."""
        assert self.api is not None
        api = self.api
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        uid = str(meta.get("uid") or "")
        key = f"{ns}/{name}"
        try:
            req = parse_pod(pod, self.config)
        except RequestError as e:
            raise BindError(str(e), "invalid") from e
        if not req.has_gpu:  # asks for a vGPU resource but books no GPU (e.g. only the priority)
            res = await self.run_blocking(bind_plain, api, ns, name, uid, node)
            if res.state != "bound":
                raise BindError(res.error, res.outcome)
            return []
        r = self.cache.reserve(req, uid, node)  # synchronous: no other bind interleaves
        if isinstance(r, str):
            raise BindError(f"cannot place {key} on {node}: {r}", "unschedulable")
        booking, alloc = r
        gpus = sorted({d.uuid for c in alloc.containers for d in c.devices})
        self.cache.inflight.add(key)
        annotations: dict[str, str] = {}
        labels: dict[str, str] = {}
        writing: asyncio.Future[WriteResult] | None = None
        try:
            annotations = self.bind_annotations(uid, node, alloc)
            labels = {LABEL_NODE: node}
            rv = str(meta.get("resourceVersion") or "")
            loop = asyncio.get_running_loop()
            writing = loop.run_in_executor(self._executor, partial(
                write_bind, api, ns, name, uid, rv, annotations, labels, node))
            result = await asyncio.shield(writing)
        except BaseException as e:
            if writing is not None and isinstance(e, asyncio.CancelledError):
                # cancelled while the writes go on in their thread: settle them when they end
                pending = _Pending(key, uid, node, booking, req, annotations, labels)
                if writing.done():
                    self._writes_ended(pending, writing)
                else:
                    self._mark(pending)
                    writing.add_done_callback(partial(self._writes_ended, pending))
                raise
            self.cache.release_if(key, booking, failed_uid=uid)
            if isinstance(e, BindError) or not isinstance(e, Exception):
                raise
            outcome = "conflict" if is_conflict(e) else "not_found" if is_not_found(e) else "api_error"
            raise BindError(f"binding {key} to {node} failed: {api_error_text(e)}", outcome) from e
        finally:
            self.cache.inflight.discard(key)
        pending = _Pending(key, uid, node, booking, req, annotations, labels)
        err = self._settled(pending, result)
        if err is not None:
            raise err
        return gpus

    # -- unknown outcomes ---------------------------------------------------------------------
    def _settled(self, p: _Pending, result: WriteResult) -> BindError | None:
        """Apply a bind's WriteResult to the cache (on the loop): bound -> record the bind; failed
        -> release the booking (if still this bind's); lost -> release it and book what the pod
        says; unknown -> keep the booking, mark the pod unresolved and read it back in the
        background until the outcome is known. Returns the BindError to report (None: bound)."""
        self._unmark(p)
        if result.state == "bound":
            self.cache.record_bound(p.key, p.uid, p.booking, p.request, result.resource_version)
            return None
        if result.state == "unknown":
            if self.cache.state.bookings.get(p.key) is not p.booking:
                return BindError(result.error, "unknown")  # released meanwhile (deleted): nothing to keep
            self._mark(p)
            log.warning("bind outcome unknown; keeping the booking until the pod is read back",
                        extra={"pod": p.key, "node": p.node, "error": result.error, "outcome": "unknown"})
            task = asyncio.get_running_loop().create_task(self._resolve(p, result.binding_posted))
            self._resolvers.add(task)
            task.add_done_callback(self._resolvers.discard)
            return BindError(f"{result.error}; the outcome is unknown, so the GPUs stay booked until the pod "
                             "has been read back", "unknown")
        self.cache.release_if(p.key, p.booking, failed_uid=p.uid if result.state == "failed" else None)
        if result.state == "lost" and result.pod is not None:
            self.cache.on_pod("MODIFIED", result.pod)  # book what the pod's own record says
        return BindError(result.error, result.outcome or "api_error")

    def _writes_ended(self, p: _Pending, fut: asyncio.Future[WriteResult]) -> None:
        """Done-callback of writes whose bind call was cancelled: settle their result."""
        if fut.cancelled() or fut.exception() is not None:
            self._unmark(p)
            self.cache.release_if(p.key, p.booking, failed_uid=p.uid)
            return
        err = self._settled(p, fut.result())
        if err is not None:
            log.warning("bind failed", extra={"pod": p.key, "node": p.node, "error": str(err),
                                               "outcome": err.outcome})

    async def _resolve(self, p: _Pending, posted: bool) -> None:
        """Read a pod whose bind outcome is unknown back, with backoff (Options.unknown_retry),
        until :func:`settle` knows; then apply it. Stops early when the watch settled it (the
        booking is no longer this bind's: deleted, re-booked from the pod's record, or a newer
        bind; or the watch shows the pod bound to our node) or the service stops."""
        assert self.api is not None
        delay, cap = self.opts.unknown_retry
        ns, name = p.key.split("/", 1)
        while not self._stop.is_set():
            if self.cache.state.bookings.get(p.key) is not p.booking:
                self._unmark(p)
                log.info("bind outcome settled by the watch", extra={"pod": p.key, "node": p.node})
                return
            info = self.cache.pods.get(p.key)
            if info is not None and info.uid == p.uid and info.bound and info.node == p.node:
                self._unmark(p)  # booked from the pod's own record from here on
                log.info("bind outcome settled by the watch: bound", extra={"pod": p.key, "node": p.node})
                return
            result = await self.run_blocking(settle, self.api, ns, name, p.uid, p.node, p.annotations,
                                             p.labels, "the outcome of the bind was unknown", "api_error", posted)
            if result.state != "unknown":
                if self.cache.state.bookings.get(p.key) is not p.booking:
                    continue  # the watch settled it while we read (the top of the loop says so)
                err = self._settled(p, result)
                log.info("bind outcome read back", extra={
                    "pod": p.key, "node": p.node, "outcome": result.state,
                    "error": str(err) if err is not None else None})
                return
            self.unknown_retries += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            delay = min(cap, delay * 2)

    def _mark(self, p: _Pending) -> None:
        """Mark ``p``'s pod unresolved in the cache (relists keep its booking)."""
        self.cache.unresolved[p.key] = p.uid
        self._unresolved_by[p.key] = p

    def _unmark(self, p: _Pending) -> None:
        """Drop the unresolved mark of ``p``'s pod, if it is ``p``'s (a newer bind of the same pod
        may have marked it since)."""
        if self._unresolved_by.get(p.key) is p:
            del self._unresolved_by[p.key]
            self.cache.unresolved.pop(p.key, None)

    # -- signed records -----------------------------------------------------------------------
    def bind_annotations(self, uid: str, node: str, alloc: PodAllocation) -> dict[str, str]:
        """The annotations a bind writes: the allocation record, bind-phase ``allocating``, the
        bind time (whole unix seconds) and the allocation signature over uid, node, bind time and
        the record's exact text (active key)."""
        text = encode_allocation(alloc)
        bind_time = str(int(self.clock()))
        return {ANN_ALLOCATION: text, ANN_BIND_PHASE: BIND_ALLOCATING, ANN_BIND_TIME: bind_time,
                ANN_ALLOCATION_SIGNATURE: sign_allocation(self.keys.current(), uid, node, bind_time, text)}

    def refresh_keys(self) -> bool:
        """Reload the signing keys if their files changed (a :class:`KeyDir`); after a change, read
        back and sign again every bound pod whose record a retired key signed. Returns True when
        a new key ring was taken."""
        if not isinstance(self.keys, KeyDir) or not self.keys.refresh():
            return False
        if self.api is not None and self.is_leader and self.loop is not None:
            if self._sweep is not None and not self._sweep.done():
                self._sweep_again = True
            else:
                self._sweep = asyncio.ensure_future(self._resign_stale(), loop=self.loop)
        return True

    async def _resign_stale(self) -> None:
        """Read back each bound pod booked from a record of a retired key and sign it again."""
        assert self.api is not None
        while True:
            self._sweep_again = False
            for key in self.cache.stale_keys():
                ns, _, name = key.partition("/")
                try:
                    pod = await self.run_blocking(self.api.get_pod, ns, name)
                except Exception as e:  # noqa: BLE001 - gone or API trouble: its next event decides
                    log.info("reading a pod back to sign it again failed", extra={"pod": key, "error": api_error_text(e)})
                    continue
                rec = self.cache.read_record(pod)
                uid = str((pod.get("metadata") or {}).get("uid") or "")
                info = self.cache.pods.get(key)
                if isinstance(rec, Record) and info is not None and info.uid == uid:
                    info.kid = rec.kid  # known now: not read again at the next rotation
                if isinstance(rec, Record) and self.cache.stale_key(pod, rec) and uid not in self._resigning:
                    await self._resign(pod)
            if not self._sweep_again:
                return

    def _resign_soon(self, pod: Obj) -> None:
        """The cache asks to sign a booked record again (adopted unsigned record, or signed with a
        key no longer active): one patch per pod at a time, by the leader only."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if self.api is None or not self.is_leader or not uid or uid in self._resigning or self.loop is None:
            return
        t = asyncio.ensure_future(self._resign(pod), loop=self.loop)
        self._resigning[uid] = t
        t.add_done_callback(lambda _t: self._resigning.pop(uid, None))

    async def _resign(self, pod: Obj) -> None:
        """Patch the active key's allocation signature onto ``pod`` (and a fresh progress signature
        when the old one verifies), guarded by the pod's resourceVersion: what is signed is exactly
        what the cache booked. A conflict or error is logged; the pod's next event asks again."""
        assert self.api is not None
        m = pod.get("metadata") or {}
        ann = m.get("annotations") or {}
        ns, name, uid = str(m.get("namespace") or "default"), str(m.get("name") or ""), str(m.get("uid") or "")
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        ring = self.keys.current()
        sig = sign_allocation(ring, uid, node, str(ann.get(ANN_BIND_TIME) or ""), str(ann.get(ANN_ALLOCATION) or ""))
        patch = {ANN_ALLOCATION_SIGNATURE: sig}
        old = ann.get(ANN_ALLOCATION_SIGNATURE)
        phase, done = ann.get(ANN_BIND_PHASE), ann.get(ANN_ALLOCATED_CONTAINERS)
        if old and verify_progress(ring, ann.get(ANN_PROGRESS_SIGNATURE), uid, old, phase, done):
            patch[ANN_PROGRESS_SIGNATURE] = sign_progress(ring, uid, sig, str(phase or ""), str(done or ""))
        try:
            await self.run_blocking(self.api.patch_pod_metadata, ns, name, str(m.get("resourceVersion") or ""),
                                    patch, {})
        except Exception as e:  # noqa: BLE001 - changed meanwhile (409) or API trouble: next event retries
            log.warning("signing a booked allocation record failed; retried on the pod's next event",
                        extra={"pod": f"{ns}/{name}", "node": node, "error": api_error_text(e)})
            return
        log.info("allocation record signed with the active key", extra={"pod": f"{ns}/{name}", "node": node,
                                                                         "key": ring.active})

    # -- rejections ---------------------------------------------------------------------------
    # kube-scheduler posts the one FailedScheduling event per attempt, with the reasons /filter
    # answered; the extender posts none. It counts rejections by code and logs the details.
    def _queue_rejection(self, key: str, failed: dict[str, FitFailure]) -> None:
        """Hand a filter's failures to the background worker (metrics by code, debug log of the
        details). Never blocks: drops when the queue is full (``events_dropped_total``)."""
        try:
            self._events.put_nowait((key, failed))
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()

    async def _event_loop(self) -> None:
        while True:
            key, failed = await self._events.get()
            try:
                self._handle_rejection(key, failed)
            except Exception:  # noqa: BLE001
                log.exception("counting rejections failed")

    #: the most per-node detail lines one filter call writes to the debug log
    DETAIL_LINES = 50

    def _handle_rejection(self, key: str, failed: dict[str, FitFailure]) -> None:
        """Count rejected (pod, node) pairs by code; at debug level, log each node's detail (the
        numbers behind the code and the GPU they were measured on), up to DETAIL_LINES nodes."""
        counts: dict[Code, int] = {}
        for f in failed.values():
            counts[f.code] = counts.get(f.code, 0) + 1
        for c, n in counts.items():
            self.metrics.filter_rejections.labels(reason=c.value).inc(n)
        if not log.isEnabledFor(logging.DEBUG):
            return
        nodes = self.cache.state.nodes
        for k, (name, f) in enumerate(failed.items()):
            if k == self.DETAIL_LINES:
                log.debug("node rejected", extra={"pod": key, "error": f"... and {len(failed) - k} more nodes"})
                break
            log.debug("node rejected", extra={"pod": key, "node": name, "outcome": f.code.value,
                                              "error": detail(f, nodes.get(name))})
