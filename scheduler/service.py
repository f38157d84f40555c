"""The extender service: HTTP handlers (kube-scheduler extender v1), cache feeding, bind, background
loops (availability, config reload, FGD shapes, events, leader election).

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
a later step fails.

Hand-over (``scheduling.bindHandoverSeconds``, 0 = off): kubelet's Allocate carries only device
IDs, so the device plugin must tell which pending container kubelet is admitting. A bind of pod B
to node N therefore waits, after reserving and before writing anything, while N has a pod bound
less than bindHandoverSeconds ago that is still ``allocating`` with a pending GPU container of one
of B's GPU counts, or an earlier bind in this process of such a count is still in progress. The
wait is event-driven (woken by the cache's pod updates and by finishing binds), holds no lock, and
lasts at most ``min(Options.handover_wait, bindHandoverSeconds)``; then the bind fails (reservation
released, nothing written) and kube-scheduler retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import time
from collections import OrderedDict
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

from kube_vgpu.cluster import ClusterCache, pod_key
from kube_vgpu.codec import encode_allocation
from kube_vgpu.config import Config, load_config_text
from kube_vgpu.errors import ConfigError, RequestError
from kube_vgpu.model import PodAllocation
from kube_vgpu.placement.fastpath import names_key, normalise_array
from kube_vgpu.placement.liveshapes import shapes_from_state
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

from .hostpriority import HostPriorityEncoder
from .kube import KubeAPI, Reflector, api_error_text, is_conflict, is_not_found
from .leader import LeaseElector, LeaseFollower
from .metrics import GpuRow, Metrics
from .reasons import aggregate, classify, split_unresolvable
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
    pod_selector: label selector of the pods watched (bound vGPU pods carry ``kube-vgpu.io/node``);
    sync_wait: how long /filter waits for the first list before answering an Error (s);
    shapes_interval: FGD shape refresh (s); event_dedupe: same message to the same pod at most
    once per this many seconds; api_workers: threads for blocking API calls; handover_wait: the
    longest one bind call waits for the hand-over (s; also capped by bindHandoverSeconds).
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
    pod_selector: str | None = LABEL_NODE
    sync_wait: float = 5.0
    shapes_interval: float = 300.0
    event_dedupe: float = 60.0
    api_workers: int = 16
    handover_wait: float = 5.0
    component: str = "kube-vgpu-scheduler"
    freeze_gc: bool = False  #: after the first sync, move the cache out of the GC's scans (p99)


class BindError(Exception):
    """A bind step failed; ``outcome`` is the metrics label."""

    def __init__(self, message: str, outcome: str):
        super().__init__(message)
        self.outcome = outcome


def write_bind(api: KubeAPI, ns: str, name: str, uid: str, rv: str, annotations: dict[str, str],
               labels: dict[str, str], node: str, attempts: int = 4) -> None:
    """The bind's API writes, in one worker thread (blocking): merge-patch the allocation
    annotations and label guarded by ``rv``; on 409 Conflict re-read the pod and retry while it is
    the same, live, unbound pod; then POST the Binding. Raises BindError or ApiException."""
    key = f"{ns}/{name}"
    for attempt in range(attempts):
        try:
            api.patch_pod_metadata(ns, name, rv, annotations, labels)
            break
        except Exception as e:  # noqa: BLE001
            if not is_conflict(e) or attempt == attempts - 1:
                raise
        fresh = api.get_pod(ns, name)
        fm = fresh.get("metadata") or {}
        if str(fm.get("uid") or "") != uid or fm.get("deletionTimestamp") or (fresh.get("spec") or {}).get("nodeName"):
            raise BindError(f"pod {key} changed while binding (deleted, recreated or already bound)", "conflict")
        rv = str(fm.get("resourceVersion") or "")
    api.create_binding(ns, name, uid, node)


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
        self._priorities = HostPriorityEncoder()
        self.metrics = Metrics()
        self._gpu_seen: dict[str, tuple[Any, int, tuple[GpuRow, ...]]] = {}
        self._executor = ThreadPoolExecutor(self.opts.api_workers, thread_name_prefix="kube-api")
        self._synced = {"nodes": False, "pods": False}
        self.synced = asyncio.Event()
        self._events: asyncio.Queue[tuple[Obj, dict[str, str], int]] = asyncio.Queue(maxsize=1000)
        self._event_sent: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._tasks: list[asyncio.Task[Any]] = []
        self._reflectors: list[Reflector] = []
        self._stop = asyncio.Event()
        self._config_sig: str | None = None
        self.elector: LeaseElector | LeaseFollower | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics.is_leader.set(0 if self.opts.leader_elect else 1)
        #: node -> pod key -> (sequence, GPU counts) of binds in progress here (reserved, not done)
        self._active_binds: dict[str, dict[str, tuple[int, frozenset[int]]]] = {}
        self._bind_seq = 0
        self.handover_waits = 0  #: binds that had to wait for a hand-over (tests, debugging)
        self._handover_wake = asyncio.Event()
        self.cache.on_handover_change = self._wake_handover
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
                Reflector(api, "nodes", marshal(self.cache.replace_nodes), marshal(self.cache.on_node),
                          marshal(partial(self.mark_synced, "nodes")), resync_seconds=self.opts.resync_seconds),
                Reflector(api, "pods", marshal(self.cache.replace_pods), marshal(self.cache.on_pod),
                          marshal(partial(self.mark_synced, "pods")), label_selector=self.opts.pod_selector,
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
            self._tasks.append(asyncio.create_task(self._every(self.opts.config_poll, self.keys.refresh)))

    async def stop(self) -> None:
        """Stop the background work (reflector threads are joined in a worker thread)."""
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
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
        self.cache.refresh_availability()
        self.metrics.nodes.set(len(self.cache.state.nodes))
        self.metrics.unavailable.set(len(self.cache.unavailable))
        self.metrics.bookings.set(len(self.cache.state.bookings))

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
            bad = {n: str(e) for n in names}
            self._queue_event(pod, bad, len(names))
            return filter_result(names, nodelist, [], {}, bad)
        ok, failed, _ = self.cache.evaluate(req, names, want_scores=False)
        resolvable, unresolvable = split_unresolvable(failed)
        if failed:
            self._queue_event(pod, failed, len(names) if not ok else -1)
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
        0..10, infeasible or non-vGPU: 0)."""
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
                raw = self.cache.score_array(req, names, key)
                feasible = raw > -np.inf
                scores[feasible] = normalise_array(raw[feasible])
        return self._priorities.encode(names, scores, key)

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

    async def _bind_pod(self, pod: Obj, node: str) -> list[str]:
        """Reserve, annotate (optimistic concurrency), bind; release at once on failure.
        Returns the GPU uuids. Raises BindError."""
        assert self.api is not None
        api = self.api
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        uid = str(meta.get("uid") or "")
        key = f"{ns}/{name}"
        if meta.get("deletionTimestamp"):
            raise BindError(f"pod {key} is being deleted", "not_found")
        try:
            req = parse_pod(pod, self.config)
        except RequestError as e:
            raise BindError(str(e), "invalid") from e
        if not req.has_gpu:
            try:
                await self.run_blocking(api.create_binding, ns, name, uid, node)
            except Exception as e:  # noqa: BLE001
                raise BindError(f"binding {key} to {node}: {api_error_text(e)}", "api_error") from e
            return []
        r = self.cache.reserve(req, uid, node)  # synchronous: no other bind interleaves
        if isinstance(r, str):
            raise BindError(f"cannot place {key} on {node}: {r}", "unschedulable")
        booking, alloc = r
        gpus = sorted({d.uuid for c in alloc.containers for d in c.devices})
        counts = frozenset(len(c.devices) for c in alloc.containers if c.devices)
        self.cache.inflight.add(key)
        self._bind_seq += 1
        seq = self._bind_seq
        self._active_binds.setdefault(node, {})[key] = (seq, counts)
        try:
            await self._handover(key, node, counts, seq)
            annotations = self.bind_annotations(uid, node, alloc)
            labels = {LABEL_NODE: node}
            rv = str(meta.get("resourceVersion") or "")
            await self.run_blocking(write_bind, api, ns, name, uid, rv, annotations, labels, node)
        except BaseException as e:
            self.cache.release_if(key, booking, failed_uid=uid)
            if isinstance(e, BindError) or not isinstance(e, Exception):
                raise
            outcome = "conflict" if is_conflict(e) else "not_found" if is_not_found(e) else "api_error"
            raise BindError(f"binding {key} to {node} failed: {api_error_text(e)}", outcome) from e
        finally:
            self.cache.inflight.discard(key)
            active = self._active_binds.get(node)
            if active is not None and active.get(key, (None,))[0] == seq:
                del active[key]
                if not active:
                    del self._active_binds[node]
            self._wake_handover()  # waiters run after record_bound below (no await in between)
        self.cache.record_bound(key, uid, booking, req)
        return gpus

    # -- signed records -----------------------------------------------------------------------
    def bind_annotations(self, uid: str, node: str, alloc: PodAllocation) -> dict[str, str]:
        """The annotations a bind writes: the allocation record, bind-phase ``allocating``, the
        bind time (whole unix seconds) and the allocation signature over uid, node, bind time and
        the record's exact text (active key)."""
        text = encode_allocation(alloc)
        bind_time = str(int(self.clock()))
        return {ANN_ALLOCATION: text, ANN_BIND_PHASE: BIND_ALLOCATING, ANN_BIND_TIME: bind_time,
                ANN_ALLOCATION_SIGNATURE: sign_allocation(self.keys.current(), uid, node, bind_time, text)}

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

    # -- bind hand-over -----------------------------------------------------------------------
    def _wake_handover(self) -> None:
        """Wake every bind waiting to hand over (they re-check; one Event per generation)."""
        ev = self._handover_wake
        self._handover_wake = asyncio.Event()
        ev.set()

    def _handover_blocker(self, key: str, node: str, counts: frozenset[int], seq: int,
                          limit: float) -> tuple[str, float] | None:
        """(pod key, seconds until it stops blocking by age, inf if not by age) this bind must wait
        for, or None: an earlier bind here to ``node`` of an overlapping GPU count, else a pod the
        cache knows bound to ``node`` and still allocating a container of such a count."""
        for k, (s, c) in self._active_binds.get(node, {}).items():
            if s < seq and c & counts and k != key:
                return k, float("inf")
        return self.cache.handover_blocker(node, key, counts, limit)

    async def _handover(self, key: str, node: str, counts: frozenset[int], seq: int) -> None:
        """Wait (event-driven, no lock) until no pod blocks this bind's hand-over on ``node``; at
        most min(handover_wait, bindHandoverSeconds). Raises BindError on timeout."""
        limit = self.config.scheduling.bind_handover_seconds
        if limit <= 0 or not counts:
            return
        deadline = time.monotonic() + min(self.opts.handover_wait, limit)
        waited = False
        while True:
            blocker = self._handover_blocker(key, node, counts, seq, limit)
            if blocker is None:
                return
            if not waited:
                waited = True
                self.handover_waits += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise BindError(f"node {node}: waiting for pod {blocker[0]} to finish device allocation "
                                "(hand-over); kube-scheduler will retry", "handover")
            ev = self._handover_wake
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), min(left, blocker[1] + 0.01))

    # -- events -------------------------------------------------------------------------------
    def _queue_event(self, pod: Obj, failed: dict[str, str], total: int) -> None:
        """Hand the rejection to the background worker (metrics; an Event when total >= 0, i.e.
        the pod fits nowhere). Never blocks: drops when the queue is full."""
        try:
            self._events.put_nowait((pod, failed, total))
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()

    async def _event_loop(self) -> None:
        while True:
            pod, failed, total = await self._events.get()
            try:
                await self._handle_rejection(pod, failed, total)
            except Exception:  # noqa: BLE001
                log.exception("event emission failed")

    async def _handle_rejection(self, pod: Obj, failed: dict[str, str], total: int) -> None:
        counts: dict[str, int] = {}
        for why in failed.values():
            c = classify(why)
            counts[c] = counts.get(c, 0) + 1
        for c, n in counts.items():
            self.metrics.filter_rejections.labels(reason=c).inc(n)
        if total < 0 or self.api is None:
            return
        meta = pod.get("metadata") or {}
        msg = aggregate(failed, total)
        k = (str(meta.get("uid") or pod_key(pod)), msg)
        now = time.monotonic()
        last = self._event_sent.get(k)
        if last is not None and now - last < self.opts.event_dedupe:
            return
        self._event_sent[k] = now
        self._event_sent.move_to_end(k)
        while len(self._event_sent) > 10_000:
            self._event_sent.popitem(last=False)
        await self.run_blocking(self.api.create_event, str(meta.get("namespace") or "default"),
                                self.event_body(pod, msg))

    def event_body(self, pod: Obj, message: str) -> Obj:
        """A core/v1 Event (Warning, reason FailedScheduling) on ``pod`` with ``message``."""
        meta = pod.get("metadata") or {}
        ns = str(meta.get("namespace") or "default")
        name = str(meta.get("name") or "")
        ts = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": ns},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name,
                               "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")},
            "reason": "FailedScheduling", "type": "Warning", "message": message[:1024],
            "source": {"component": self.opts.component},
            "reportingComponent": self.opts.component, "reportingInstance": self.opts.identity,
            "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
        }
