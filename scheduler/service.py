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

Concurrency: every handler and every cache update runs on one asyncio loop; API calls run in a
thread pool.

The bind cycle (promise, check, reserve, write, settle unknown outcomes) is
:class:`scheduler.bindcycle.BindCycle`, owned by the service (:attr:`SchedulerService.binds`); its
bookkeeping on top of the cluster view is :class:`scheduler.bindstate.BindCache` (the service's
``cache``). ``scheduling.bindHandoverSeconds`` is accepted and has no effect.
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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kube_vgpu.cluster import Record, pod_key
from kube_vgpu.config import Config, load_config_text
from kube_vgpu.errors import ConfigError, RequestError
from kube_vgpu.kubeapi import AsyncReflector, Reflector, api_error_text
from kube_vgpu.model import PodAllocation
from kube_vgpu.placement.fastpath import names_key, normalise_array
from kube_vgpu.placement.liveshapes import shapes_from_state
from kube_vgpu.placement.render import detail, summaries, summary
from kube_vgpu.placement.status import Code, FitFailure
from kube_vgpu.podspec import parse_pod, pod_asks
from kube_vgpu.policyregistry import needs_shapes
from kube_vgpu.scrape import next_render_at
from kube_vgpu.signing import KeyDir, KeyRing, KeySource, resign_record
from kube_vgpu.views import NodeView, PodView

from .bindcycle import BindCycle
from .bindstate import BindCache
from .drascore import DraListWatch, DraScorer
from .hostpriority import HostPriorityEncoder
from .kube import KubeAPI
from .leader import LeaseElector, LeaseFollower
from .metrics import GpuRow, Metrics
from .preempt import Preemption, PreemptMetrics, check_preemption_args
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
    #: /filter answers only the node the policy ranks first (HAMi's behaviour: kube-scheduler then
    #: skips scoring, and /prioritize is not called); False: every feasible node
    filter_best_node: bool = True
    api_workers: int = 48
    #: first and longest wait (s) between read-backs of a pod whose bind outcome is unknown
    unknown_retry: tuple[float, float] = (0.2, 10.0)
    component: str = "kube-vgpu-scheduler"
    freeze_gc: bool = False  #: after the first sync, move the cache out of the GC's scans (p99)
    #: DRA scoring (``/dra-prioritize``, scheduler/drascore.py): watch ResourceSlices and
    #: ResourceClaims and rank the nodes of pods whose claims ask ``dra_classes`` (class -> model)
    dra_scoring: bool = False
    dra_classes: dict[str, str] = field(default_factory=dict)


def _names_of(args: Obj) -> tuple[list[str], Obj | None]:
    """Candidate node names of ExtenderArgs and the NodeList (when nodeCacheCapable is false)."""
    names = args.get("NodeNames")
    nodes = args.get("Nodes")
    if isinstance(names, list):
        return names, None
    if isinstance(nodes, dict):
        items = nodes.get("items") or []
        return [NodeView(n).name for n in items], nodes
    return [], None


def filter_result(names: Sequence[str], nodelist: Obj | None, ok: Sequence[str], failed: dict[str, str],
                  unresolvable: dict[str, str], error: str = "") -> Obj:
    """Build an ExtenderFilterResult in the shape the caller used (NodeNames or Nodes)."""
    if nodelist is not None:
        keep = set(ok)
        items = [n for n in nodelist.get("items") or [] if NodeView(n).name in keep]
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
        self.cache = BindCache(config, clock, keys=self.keys)
        self._resigning: dict[str, asyncio.Task[None]] = {}  #: pod uid -> its re-sign in progress
        self._sweep: asyncio.Task[None] | None = None  #: re-signing after a key rotation
        self._sweep_again = False
        self._priorities = HostPriorityEncoder()
        self.metrics = Metrics()
        self._gpu_seen: dict[str, tuple[Any, int, tuple[GpuRow, ...]]] = {}
        #: /metrics renders (:meth:`_next_render`): the one scrapes now join, one at a time, not before
        self._metrics_next: asyncio.Future[bytes] | None = None
        self._metrics_lock = asyncio.Lock()
        self._metrics_after = 0.0
        self._metrics_tasks: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(self.opts.api_workers, thread_name_prefix="kube-api")
        self._synced = {"nodes": False, "pods": False, "resourcequotas": False}
        self.synced = asyncio.Event()
        self._events: asyncio.Queue[tuple[str, dict[str, FitFailure]]] = asyncio.Queue(maxsize=1000)
        self._tasks: list[asyncio.Task[Any]] = []
        self._reflectors: list[Reflector] = []
        self._stop = asyncio.Event()
        self._config_sig: str | None = None
        self.elector: LeaseElector | LeaseFollower | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics.is_leader.set(0 if self.opts.leader_elect else 1)
        self.binds = BindCycle(self)  #: the bind cycle (scheduler/bindcycle.py)
        #: the preempt verb (scheduler/preempt.py): advice only, never changes the cache
        self.preemption = Preemption(self.cache, PreemptMetrics(self.metrics.registry))
        self.cache.on_reject = lambda code: self.metrics.records_rejected.labels(reason=code).inc()
        self.cache.on_resign = self._resign_soon
        #: the DRA path's view and scores (with ``dra_scoring``), else None: /dra-prioritize answers 0s
        self.dra: DraScorer | None = DraScorer(self.opts.dra_classes) if self.opts.dra_scoring else None

    # -- plumbing -----------------------------------------------------------------------------
    @property
    def executor(self) -> ThreadPoolExecutor:
        """The thread pool of blocking API calls."""
        return self._executor

    @property
    def stop_event(self) -> asyncio.Event:
        """Set when the service stops."""
        return self._stop

    @property
    def unknown_retries(self) -> int:
        """Read-backs of unknown bind outcomes that could not tell yet."""
        return self.binds.unknown_retries

    async def bind(self, args: Obj) -> str:
        """ExtenderBindingArgs -> error text ("" on success); see :meth:`BindCycle.bind`."""
        return await self.binds.bind(args)

    def bind_annotations(self, uid: str, node: str, alloc: PodAllocation) -> dict[str, str]:
        """The annotations a bind writes (:meth:`BindCycle.bind_annotations`)."""
        return self.binds.bind_annotations(uid, node, alloc)

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
        app.router.add_post("/preempt", self.handle_preempt)
        app.router.add_post("/dra-prioritize", self.handle_dra_prioritize)
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
        """Record that ``kind`` (nodes | pods | resourcequotas | all) has been listed; ready once
        all are."""
        if kind == "all":
            self._synced = dict.fromkeys(self._synced, True)
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

            def reflector(kind: str, on_replace: Callable[[list[Obj], str], None],
                          on_event: Callable[[str, Obj], None], **kw: Any) -> Reflector:
                """On the event loop when the client streams there (callbacks called directly),
                else in a thread (callbacks marshalled onto the loop; on_list_start is not)."""
                synced = partial(self.mark_synced, kind)
                if api.aio is not None:
                    return AsyncReflector(api, kind, on_replace, on_event, synced,
                                          resync_seconds=self.opts.resync_seconds, **kw)
                return Reflector(api, kind, marshal(on_replace), marshal(on_event), marshal(synced),
                                 resync_seconds=self.opts.resync_seconds, **kw)

            self._reflectors = [
                reflector("nodes", lambda items, _rv: self.cache.replace_nodes(items), self.cache.on_node),
                reflector("pods", self.cache.replace_pods, self._on_pod_event,
                          field_selector=self.opts.pod_field_selector
                          or f"spec.schedulerName={self.config.scheduler_name}", on_list_start=self.cache.listing),
                reflector("resourcequotas", self.cache.replace_quotas, self.cache.on_quota),
            ]
            if self.dra is not None:
                dra, lw = self.dra, DraListWatch(api.api_client, api.timeout)
                for kind in ("resourceslices", "resourceclaims"):
                    self._reflectors.append(Reflector(
                        lw, kind, marshal(partial(dra.replace, kind)), marshal(partial(dra.event, kind)),
                        resync_seconds=self.opts.resync_seconds))
            for r in self._reflectors:
                r.start()
            if self.opts.leader_elect:
                if self.opts.leader_mode == "follow":
                    self.elector = LeaseFollower(api, self.opts.lease_namespace, self.opts.lease_name,
                                                 self.opts.hostname or self.opts.identity.split("_")[0],
                                                 run_blocking=self.run_blocking)
                else:
                    self.elector = LeaseElector(api, self.opts.lease_namespace, self.opts.lease_name,
                                                self.opts.identity, run_blocking=self.run_blocking)
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
        view = PodView(pod)
        self.cache.own_bind_seen(view.key, view.resource_version)

    async def stop(self) -> None:
        """Stop the background work (reflector threads are joined in a worker thread)."""
        self._stop.set()
        tasks = self._tasks + list(self.binds.resolvers)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        loop = asyncio.get_running_loop()
        for r in self._reflectors:
            if isinstance(r, AsyncReflector):
                await r.astop()
            else:
                await loop.run_in_executor(None, r.stop)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.api is not None:
            await self.api.aclose()

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
        self.binds.expire_promises()
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
        """For a node policy that needs the workload's task shapes (the registry's
        ``needs_shapes``: fgd, fgd-bestfit): rebuild them from the current bookings (default mix
        while few pods are known). Returns True if the engine was reconfigured."""
        eng = self.cache.engine
        if not needs_shapes(eng.node_policy):
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
        if self.dra is not None and not self.dra.ready:  # (the vGPU path does not wait for these)
            return web.Response(status=503, text="DRA caches (resourceslices, resourceclaims) not synced")
        # own Lease: a Service may route binds to the leader only. follow: kube-scheduler calls its
        # own sidecar, and a non-leader pod must stay Ready (or a rollout would stall).
        if self.opts.leader_elect and self.opts.leader_mode == "own" and not self.is_leader:
            return web.Response(status=503, text="not the leader")
        return web.Response(text="ok")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.shield(self._next_render())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _next_render(self) -> asyncio.Future[bytes]:
        """The /metrics body of the next render to start: every scrape waiting for it shares it, so
        it shows the state as of the scrape's arrival or later. One render at a time, spaced by
        :func:`kube_vgpu.scrape.next_render_at` (the metrics port is reachable from the pod network,
        and a flood of scrapes rendering at once kept the event loop that answers filter and bind
        waiting for the GIL)."""
        fut = self._metrics_next
        if fut is None:
            fut = self._metrics_next = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._render_into(fut))
            self._metrics_tasks.add(task)
            task.add_done_callback(self._metrics_tasks.discard)
        return fut

    async def _render_into(self, fut: asyncio.Future[bytes]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self._metrics_lock:
                wait = self._metrics_after - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self._metrics_next is fut:
                    self._metrics_next = None  # scrapes arriving from now on wait for a later render
                start = loop.time()
                try:
                    gpus = self.gpu_rows()  # snapshot on the loop; render in a thread
                    body = await loop.run_in_executor(None, self.render_metrics, gpus)
                except Exception as e:  # noqa: BLE001 - every waiting scrape gets the error (500)
                    fut.set_exception(e)
                    fut.exception()  # retrieved: no warning when every scrape has gone meanwhile
                else:
                    fut.set_result(body)
                finally:
                    end = loop.time()
                    self._metrics_after = next_render_at(start, end)
        finally:  # cancelled (shutdown): its scrapes end, later ones start a render of their own
            if self._metrics_next is fut:
                self._metrics_next = None
            if not fut.done():
                fut.cancel()

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
            self.binds.expire_promises()
            self.cache.state.forget_assumed(req.key)  # a new scheduling cycle ends the pod's promise
        best_only = self.opts.filter_best_node
        ok, failed, scores = self.cache.evaluate(req, names, want_scores=best_only)
        own = self.cache.own_unbound_booking(req.key, PodView(pod).uid)
        if own is not None and own in failed and own not in self.cache.unavailable:
            del failed[own]  # the pod's own booking there is what it needs (see own_unbound_booking)
            ok.append(own)
        ok = self.cache.filter_quota(req, ok, failed)  # GPU quota of the pod's namespace
        if best_only and len(ok) > 1:
            # only the node prioritize would rank first (its own booking, else the first of the
            # best-scoring names in request order): kube-scheduler skips scoring for one feasible node
            if own is not None and own in ok:
                ok = [own]
            else:  # ok keeps the request's order: the first of the best scores
                sget, low = scores.get, float("-inf")
                vals = [sget(n, low) for n in ok]
                ok = [ok[vals.index(max(vals))]]
        if not failed:
            resolvable: dict[str, str] = {}
            unresolvable: dict[str, str] = {}
        else:
            resolvable, unresolvable = summaries(failed)
            self._queue_rejection(req.key, failed)
        if len(ok) == 1:  # kube-scheduler does not prioritize a single feasible node: promise it now
            self.binds.assume(req, pod, ok[0])
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
        0..10, infeasible or non-vGPU: 0). The pod is promised (:meth:`BindCycle.assume`) on its best node
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
                    self.binds.expire_promises()
                raw = self.cache.score_array(req, names, key)
                own = self.cache.own_unbound_booking(req.key, PodView(pod).uid)
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
                    if self.binds.assume(req, pod, names[best]):
                        top = scores[best]
                        tied = scores == top
                        if int(np.count_nonzero(tied)) > 1:
                            scores[tied] = top - 1
                            scores[best] = top
        return self._priorities.encode(names, scores, key)

    async def handle_dra_prioritize(self, request: web.Request) -> web.Response:
        """``/dra-prioritize`` (the second extender entry, ``dra.extenderScoring``): ExtenderArgs ->
        HostPriorityList ranking the nodes of a pod whose claims ask our DeviceClasses
        (scheduler/drascore.py); 0 for every node otherwise. A malformed body: HTTP 400."""
        body, err = await self._checked_args(request, self.dra_prioritize)
        if err:
            return web.json_response({"Error": f"invalid ExtenderArgs: {err}"}, status=400)
        return web.Response(body=body, content_type="application/json")

    async def dra_prioritize(self, args: Obj) -> bytes:
        """ExtenderArgs -> HostPriorityList JSON (scores 0..10 in input order; see handle_dra_prioritize).
        Nothing is promised or booked: kube-scheduler's DynamicResources plugin allocates."""
        pod = args.get("Pod") or {}
        names, _ = _names_of(args)
        scores = np.zeros(len(names), dtype=np.int64)
        if self.dra is not None and names:
            eng = self.cache.engine
            scores = self.dra.scores(pod, names, eng.node_policy, eng.shapes)
        return self._priorities.encode(names, scores, names_key(names))

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
        return web.Response(body=orjson.dumps({"Error": err}), content_type="application/json")

    async def handle_preempt(self, request: web.Request) -> web.Response:
        """``preemptVerb``: ExtenderPreemptionArgs -> ExtenderPreemptionResult (scheduler/preempt.py).
        A malformed body: HTTP 400 naming the field. Before the first sync no node is kept."""
        args, err = await self._json(request)
        if not err:
            err = check_preemption_args(args) or ""
        if err:
            return web.json_response({"Error": f"invalid ExtenderPreemptionArgs: {err}"}, status=400)
        if not await self._wait_synced():
            return web.json_response({"NodeNameToMetaVictims": {}})
        try:
            res = self.preemption.handle(args)
        except Exception as e:  # noqa: BLE001 - see _bad_request
            return web.json_response({"Error": self._bad_request("ExtenderPreemptionArgs", e)}, status=400)
        return web.Response(body=orjson.dumps(res), content_type="application/json")

    # -- signed records -----------------------------------------------------------------------
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
                view = PodView(pod)
                rec = self.cache.read_record(view)
                uid = view.uid
                info = self.cache.pods.get(key)
                if isinstance(rec, Record) and info is not None and info.uid == uid:
                    info.kid = rec.kid  # known now: not read again at the next rotation
                if isinstance(rec, Record) and self.cache.stale_key(view, rec) and uid not in self._resigning:
                    await self._resign(pod)
            if not self._sweep_again:
                return

    def _resign_soon(self, pod: Obj) -> None:
        """The cache asks to sign a booked record again (adopted unsigned record, or signed with a
        key no longer active): one patch per pod at a time, by the leader only."""
        uid = PodView(pod).uid
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
        view = PodView(pod)
        ns, name, uid, node = view.namespace, view.name, view.uid, view.node_name
        ring = self.keys.current()
        patch = resign_record(ring, view.annotations, uid, node)
        try:
            await self.run_blocking(self.api.patch_pod_metadata, ns, name, view.resource_version,
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
