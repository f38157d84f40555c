"""The device plugin daemon: gRPC service for kubelet, registration, health, inventory heartbeat.

Threads (all daemon threads, stopped by :meth:`DevicePlugin.stop`):

* gRPC server on ``<device-plugin-dir>/kube-vgpu.sock`` (``v1beta1.DevicePlugin``);
* supervisor: registers with kubelet (``v1beta1.Registration/Register`` on ``kubelet.sock``) and
  re-registers when kubelet.sock is recreated (inode or mtime changed: kubelet restarted) or our own
  socket vanished (kubelet removes plugin sockets when it starts); our socket is recreated first;
* health: NVML events + periodic probes (:class:`deviceplugin.nvml.HealthTracker`); a health change
  is pushed to every ListAndWatch stream and to the node inventory at once;
* heartbeat: writes the node inventory annotation every ``heartbeat_seconds`` and refreshes the pod
  list used by the metrics;
* pod watch (:class:`deviceplugin.podwatch.PodWatcher`): numbers pods in the order they become bound
  to this node, the order GetPreferredAllocation/Allocate assume kubelet admits them in.

Trust: Allocate serves only pods whose allocation record the scheduler extender signed for this node
(:func:`deviceplugin.podmatch.trusted_view`); what the plugin writes back (allocated-containers,
bind-phase) carries its own ``kube-vgpu.io/progress-signature`` and is also kept in memory. The
signing keys (``--signing-keys-dir``) are reloaded when their files change (checked at every
Allocate, GetPreferredAllocation and heartbeat).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from kube_vgpu.codec import decode_allocation, encode_inventory
from kube_vgpu.config import Config
from kube_vgpu.errors import CodecError
from kube_vgpu.model import GPUDevice
from kube_vgpu.resources import (
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_NODE_INVENTORY,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    BIND_SUCCESS,
)
from kube_vgpu.signing import KeyDir, KeyRing, KeySource, sign_progress

from . import inventory as inv
from .api import api_pb2, api_pb2_grpc
from .kube import KubeClient, PodWatchClient
from .nvml import NVML, HealthTracker, NVMLError, PhysicalGPU
from .podmatch import (
    ANN_ALLOCATED_CONTAINERS,
    Arrival,
    MatchError,
    PendingContainer,
    Progress,
    match,
    pending_containers,
    preferred_allocation,
    slot_uuid,
    trusted_view,
)
from .podwatch import ArrivalBook, PodWatcher
from .shimcache import write_host_files
from .response import (
    ContainerSpec,
    cache_dir_name,
    container_spec,
    preload_contents,
    preload_host_path,
    unlimited_devices,
)

log = logging.getLogger("kube_vgpu.deviceplugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
PLUGIN_SOCKET = "kube-vgpu.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Options:
    """Runtime options (flags in docs/CONTRACTS.md, plus test-only timings).

    Paths are on the node. Times in seconds unless the name says ms.
    """

    node_name: str
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    shim_host_path: str = "/usr/local/vgpu/libvgpu.so"
    cache_host_dir: str = "/var/lib/kube-vgpu/containers"
    heartbeat_seconds: float = 30.0
    #: a pod pending Allocate for longer than this (since first seen bound) is demoted: it is no
    #: longer the target of GetPreferredAllocation while a newer pod waits (0 or less: never)
    pending_stale_seconds: float = 300.0
    # not flags: timings the tests shrink
    watch_interval: float = 1.0
    health_poll_ms: int = 500
    probe_interval: float = 5.0
    recovery_seconds: float = 60.0
    preferred_ttl: float = 120.0
    register_timeout: float = 5.0
    pod_watch_timeout: int = 300


@dataclass
class Status:
    """What /readyz and /metrics report. Times are unix seconds (0 = never)."""

    registered: bool = False
    registrations: int = 0
    last_inventory_write: float = 0.0
    last_inventory_error: str = ""
    allocations: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    started: float = field(default_factory=time.time)


class DevicePlugin:
    """One plugin instance for one node. Construct, :meth:`start`, later :meth:`stop`.

    nvml: an initialised-or-not :class:`deviceplugin.nvml.NVML`; kube: a
    :class:`deviceplugin.kube.KubeClient`; keys: the signing key ring records must verify with (a
    :class:`~kube_vgpu.signing.KeyDir` is reloaded when its files change; None: a fresh random
    key, so no record verifies and no pod is served). Raises NVMLError from :meth:`start` when NVML
    cannot be initialised.
    """

    def __init__(self, cfg: Config, opts: Options, kube: KubeClient, nvml: NVML | None = None,
                 keys: KeySource | None = None) -> None:
        self.cfg = cfg
        self.opts = opts
        self.kube = kube
        self.keys: KeySource = keys if keys is not None else KeyRing.generate()
        #: pod uid -> what this plugin wrote on it (trusted over the pod's annotations)
        self._written: dict[str, Progress] = {}
        self.nvml = nvml or NVML()
        self.names = cfg.resource_names
        self.settings = inv.settings_for(cfg, opts.node_name)
        self.status = Status()
        self._gpus: list[PhysicalGPU] = []
        self._devices: tuple[GPUDevice, ...] = ()
        self._health = HealthTracker((), opts.recovery_seconds)
        self._cond = threading.Condition()
        self._version = 0
        self._stop = threading.Event()
        self._inventory_due = threading.Event()
        self._alloc_lock = threading.Lock()
        self._preferred: dict[frozenset[str], tuple[PendingContainer, float]] = {}
        self._pods: list[dict[str, Any]] = []
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._kubelet_id: tuple[int, int] | None = None
        self.arrivals = ArrivalBook(opts.node_name)
        self._watcher: PodWatcher | None = None
        if isinstance(kube, PodWatchClient):
            self._watcher = PodWatcher(kube, self.arrivals, watch_timeout=opts.pod_watch_timeout)

    # ------------------------------------------------------------------ paths

    @property
    def socket_path(self) -> str:
        return os.path.join(self.opts.device_plugin_dir, PLUGIN_SOCKET)

    @property
    def kubelet_socket(self) -> str:
        return os.path.join(self.opts.device_plugin_dir, KUBELET_SOCKET)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Discover GPUs, start serving, register, start the background threads."""
        self.nvml.init()
        self._discover()
        self._write_preload_file()
        os.makedirs(self.opts.cache_host_dir, exist_ok=True)
        if self._watcher is not None:
            self._watcher.start()
        self._serve()
        for name, fn in (("supervisor", self._supervise), ("health", self._health_loop),
                         ("heartbeat", self._heartbeat_loop)):
            t = threading.Thread(target=fn, name=f"deviceplugin-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop threads and the gRPC server, remove our socket, shut NVML down."""
        self._stop.set()
        self._inventory_due.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None
        if self._watcher is not None:
            self._watcher.stop()
        for t in self._threads:
            t.join(timeout=5)
        self._remove_socket()
        self.nvml.shutdown()

    def wait_pods_synced(self, timeout: float) -> bool:
        """Wait until the pod watch has listed the node's pods once (True at once without a watch)."""
        return self._watcher is None or self._watcher.synced.wait(timeout)

    def alive(self) -> bool:
        """True while every background thread runs (for /livez)."""
        return (not self._stop.is_set() and all(t.is_alive() for t in self._threads)
                and (self._watcher is None or self._watcher.alive()))

    def ready(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: registered with kubelet, inventory written recently, shim present."""
        if not self.status.registered:
            return False, "not registered with kubelet"
        if time.time() - self.status.last_inventory_write > 3 * self.opts.heartbeat_seconds + 5:
            return False, f"node inventory not written recently: {self.status.last_inventory_error or 'pending'}"
        if not os.path.exists(self.opts.shim_host_path):
            return False, f"shim not found at {self.opts.shim_host_path}"
        return True, "ok"

    # ------------------------------------------------------------------ devices

    def _discover(self) -> None:
        gpus, problems = self.nvml.discover()
        for p in problems:
            log.error("GPU not usable, not advertised: %s", p)
        keep, skipped = inv.select(gpus, self.settings)
        for s in skipped:
            log.warning("GPU skipped: %s", s)
        for g in keep:
            self._health.add(g.uuid)
            log.info("GPU %s index %d %s %d MiB numa %d: %d slots", g.uuid, g.index, g.model, g.memory_mib,
                     g.numa, self.settings.split_count)
        for p in self.nvml.watch_events([g.uuid for g in keep]):
            log.warning("%s (the GPU is still probed)", p)
        self._gpus = keep
        self._rebuild()

    def _rebuild(self) -> None:
        devices = inv.to_devices(self._gpus, self.settings, self._health.snapshot())
        with self._cond:
            self._devices = devices
            self._version += 1
            self._cond.notify_all()

    def devices(self) -> tuple[GPUDevice, ...]:
        """The current inventory devices (with health)."""
        with self._cond:
            return self._devices

    def list_response(self) -> api_pb2.ListAndWatchResponse:
        """The ListAndWatch message for the current devices: one Device per vGPU slot."""
        return api_pb2.ListAndWatchResponse(devices=[
            api_pb2.Device(ID=s.id, health=HEALTHY if s.healthy else UNHEALTHY,
                           topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=s.numa)]))
            for s in inv.slots(self.devices())])

    def watch(self, is_active: Any = lambda: True) -> Iterator[api_pb2.ListAndWatchResponse]:
        """Yield the device list now and after every change, until stop or ``is_active()`` is False."""
        seen = -1
        while not self._stop.is_set() and is_active():
            with self._cond:
                if self._version == seen:
                    self._cond.wait(timeout=0.5)
                    continue
                seen = self._version
            yield self.list_response()

    # ------------------------------------------------------------------ health

    def _health_loop(self) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            changed = False
            try:
                ev = self.nvml.wait_event(self.opts.health_poll_ms)
            except NVMLError as e:
                log.warning("NVML event wait failed: %s", e)
                self._stop.wait(self.opts.health_poll_ms / 1000)
                ev = None
            if ev is not None:
                uuid, etype, xid = ev
                if self._health.on_event(uuid, etype, xid):
                    changed = True
                    log.error("GPU %s unhealthy: %s", uuid, self._health.reason(uuid))
                else:
                    log.info("GPU %s event type 0x%x xid %d (no health change)", uuid, etype, xid)
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.opts.probe_interval
                for g in self._gpus:
                    err = self.nvml.probe(g.uuid)
                    if self._health.on_probe(g.uuid, err):
                        changed = True
                        if self._health.healthy(g.uuid):
                            log.info("GPU %s healthy again", g.uuid)
                        else:
                            log.error("GPU %s unhealthy: %s", g.uuid, self._health.reason(g.uuid))
            if changed:
                self._rebuild()
                self._inventory_due.set()

    # ------------------------------------------------------------------ inventory heartbeat

    def write_inventory(self) -> None:
        """Patch the node annotation with the current inventory (heartbeat = now). Raises on API errors."""
        text = encode_inventory(inv.inventory(self.devices(), time.time()))
        self.kube.patch_node_annotations(self.opts.node_name, {ANN_NODE_INVENTORY: text})
        self.status.last_inventory_write = time.time()
        self.status.last_inventory_error = ""

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.write_inventory()
            except Exception as e:  # noqa: BLE001 - any API failure is retried next beat
                self.status.last_inventory_error = str(e)
                log.warning("writing node inventory failed: %s", e)
            try:
                # under the Allocate lock: a cache directory created by an Allocate before this listing
                # belongs to a pod the listing holds (unless it was deleted), none is created during it
                with self._alloc_lock:
                    self._refresh_keys()
                    self._pods = self.kube.list_node_pods(self.opts.node_name)
                    self.clean_cache_dirs(self._pods)
                    live = {(p.get("metadata") or {}).get("uid") for p in self._pods}
                    for uid in [u for u in self._written if u not in live]:
                        del self._written[uid]
            except Exception as e:  # noqa: BLE001
                log.warning("listing pods (metrics, cache cleanup) failed: %s", e)
            self._inventory_due.wait(self.opts.heartbeat_seconds)
            self._inventory_due.clear()

    def clean_cache_dirs(self, pods: list[dict[str, Any]]) -> list[str]:
        """Remove per-container cache directories (``<cache-host-dir>/<pod uid>_<container>``) whose pod
        uid is not in ``pods`` (a complete listing of this node's pods) nor known to the pod watch.

        Only names of that form are touched; anything else in the directory is left alone. A directory
        that vanishes meanwhile is fine; one that cannot be removed is logged and tried again next
        time. Returns the removed paths. Call with the Allocate lock held (see the heartbeat).
        """
        live = {(p.get("metadata") or {}).get("uid") for p in pods} | set(self.arrivals.snapshot())
        live.discard(None)
        live.discard("")
        root = self.opts.cache_host_dir
        try:
            names = os.listdir(root)
        except OSError as e:
            log.warning("cannot list the cache directory %s: %s", root, e)
            return []
        removed = []
        for name in names:
            uid, sep, ctr = name.partition("_")
            if not sep or not uid or not ctr or uid in live or cache_dir_name(uid, ctr) != name:
                continue
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("cannot remove the cache directory %s of gone pod %s: %s", path, uid, e)
                continue
            removed.append(path)
            log.info("removed the cache directory %s (pod %s no longer on this node)", path, uid)
        return removed

    def allocated_by_gpu(self) -> dict[str, tuple[int, int, int]]:
        """Per GPU uuid: (MiB, cores percent, containers) booked by live pods on this node (last
        listing; verified records only)."""
        out: dict[str, list[int]] = {}
        views, _ = trusted_view(self._pods, self.opts.node_name, self.keys.current())
        for pod in views:
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            raw = (meta.get("annotations") or {}).get(ANN_ALLOCATION)
            if not raw:
                continue
            try:
                alloc = decode_allocation(raw)
            except CodecError:
                continue
            if alloc.node != self.opts.node_name:
                continue
            for uuid, (mem, cores, n) in alloc.usage().items():
                cur = out.setdefault(uuid, [0, 0, 0])
                cur[0] += mem
                cur[1] += cores
                cur[2] += n
        return {k: (v[0], v[1], v[2]) for k, v in out.items()}

    def pods_snapshot(self) -> list[dict[str, Any]]:
        return list(self._pods)

    def trusted_pods(self) -> list[dict[str, Any]]:
        """The last listing as far as it can be trusted (:func:`deviceplugin.podmatch.trusted_view`):
        only verified allocation records are left on the pods."""
        return trusted_view(self._pods, self.opts.node_name, self.keys.current(), self._written)[0]

    # ------------------------------------------------------------------ gRPC serving + registration

    def _remove_socket(self) -> None:
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.2).wait()
        self._remove_socket()
        os.makedirs(self.opts.device_plugin_dir, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="deviceplugin-grpc"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        log.info("serving v1beta1.DevicePlugin on %s", self.socket_path)

    def register(self) -> None:
        """Call kubelet's Registration.Register. Raises grpc.RpcError."""
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as ch:
            stub = api_pb2_grpc.RegistrationStub(ch)
            stub.Register(api_pb2.RegisterRequest(
                version=API_VERSION, endpoint=PLUGIN_SOCKET, resource_name=self.names.gpu,
                options=api_pb2.DevicePluginOptions(pre_start_required=False,
                                                    get_preferred_allocation_available=True)),
                timeout=self.opts.register_timeout)
        self.status.registered = True
        self.status.registrations += 1
        log.info("registered %s with kubelet at %s", self.names.gpu, self.kubelet_socket)

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.kubelet_socket)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            ident = self._kubelet_identity()
            ours = os.path.exists(self.socket_path)
            if ident is None:
                if self.status.registered:
                    log.warning("kubelet socket %s is gone; waiting for kubelet", self.kubelet_socket)
                self.status.registered = False
                self._kubelet_id = None
            elif ident != self._kubelet_id or not ours or not self.status.registered:
                if self._kubelet_id is not None and ident != self._kubelet_id:
                    log.warning("kubelet socket recreated (kubelet restarted); registering again")
                try:
                    if not ours or (self._kubelet_id is not None and ident != self._kubelet_id):
                        self._serve()
                    self.status.registered = False
                    self.register()
                    self._kubelet_id = ident
                except grpc.RpcError as e:
                    log.warning("registration with kubelet failed: %s", _rpc_text(e))
                except Exception as e:  # noqa: BLE001 - keep supervising
                    log.warning("restarting the plugin socket failed: %s", e)
            self._stop.wait(self.opts.watch_interval)

    # ------------------------------------------------------------------ preferred allocation / allocate

    def _check_ids(self, ids: list[str]) -> None:
        """Reject (ValueError -> INVALID_ARGUMENT) a container request whose IDs are not slots this plugin
        advertises now (``<uuid>::<k>`` exactly; a bare uuid or ``<uuid>::999`` is not one), name an ID
        twice, or name two slots of one GPU (a container gets distinct physical GPUs)."""
        advertised = {s.id for s in inv.slots(self.devices())}
        unknown = [i for i in ids if i not in advertised]
        if unknown:
            raise ValueError(f"unknown device IDs {', '.join(repr(i) for i in unknown)} "
                             f"(not advertised by this plugin)")
        dups = sorted({i for i in ids if ids.count(i) > 1})
        if dups:
            raise ValueError(f"device IDs requested more than once for one container: {', '.join(dups)}")
        by_gpu: dict[str, list[str]] = {}
        for i in ids:
            by_gpu.setdefault(slot_uuid(i), []).append(i)
        same = [f"{', '.join(v)} (GPU {u})" for u, v in by_gpu.items() if len(v) > 1]
        if same:
            raise ValueError(f"several slots of one GPU requested for one container: {'; '.join(same)}; "
                             f"a container gets distinct physical GPUs")

    def _refresh_keys(self) -> None:
        if isinstance(self.keys, KeyDir):
            self.keys.refresh()

    def _candidates(self, pods: list[dict[str, Any]]) -> list[PendingContainer]:
        """Pending containers in admission order (arrival order from the pod watch, demotions applied),
        from what can be trusted of ``pods`` (refused pods included, see :func:`trusted_view`)."""
        self.arrivals.saw(pods)  # a listing can be ahead of the watch
        arrivals: dict[str, Arrival] = self.arrivals.snapshot()
        stale = self.opts.pending_stale_seconds
        views, refused = trusted_view(pods, self.opts.node_name, self.keys.current(), self._written)
        return pending_containers(views, self.opts.node_name, self.names, arrivals=arrivals,
                                  now=self.arrivals.clock(), stale_after=stale if stale > 0 else None,
                                  refused=refused)

    def preferred(self, req: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
        """GetPreferredAllocation: slots on the GPUs booked for the first pending container of that size
        in admission order (see :func:`deviceplugin.podmatch.pending_containers`)."""
        with self._alloc_lock:
            return self._preferred_locked(req)

    def _preferred_locked(self, req: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
        self._refresh_keys()
        pods = self.kube.list_node_pods(self.opts.node_name)
        cands = self._candidates(pods)
        resp = api_pb2.PreferredAllocationResponse()
        now = time.monotonic()
        for creq in req.container_requests:
            ids, target = preferred_allocation(list(creq.available_deviceIDs), list(creq.must_include_deviceIDs),
                                               int(creq.allocation_size), cands)
            if target is not None and len(ids) == creq.allocation_size:
                self._preferred = {k: v for k, v in self._preferred.items() if now - v[1] < self.opts.preferred_ttl}
                self._preferred[frozenset(ids)] = (target, now)
                skipped = [c.key for c in cands if c.demoted and len(c.devices) == creq.allocation_size]
                log.info("preferred %s for %s%s", ",".join(ids), target.key,
                         f" (demoted, not admitted by kubelet in order: {', '.join(skipped)})" if skipped else "")
            resp.container_responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return resp

    def allocate(self, req: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """Allocate: match each container request to a pending container, record it, answer env + mounts.

        Raises MatchError (no or ambiguous match, no booking or 0 MiB booked, a pod without a trusted
        allocation record), ValueError (device IDs not advertised, repeated, or two on one GPU) or the
        API client's error (listing or patching pods).
        """
        with self._alloc_lock:
            self._refresh_keys()
            pods = self.kube.list_node_pods(self.opts.node_name)
            resp = api_pb2.AllocateResponse()
            for creq in req.container_requests:
                ids = list(creq.devices_ids)
                self._check_ids(ids)
                cands = self._candidates(pods)
                pref = self._preferred.pop(frozenset(ids), None)
                if pref is not None and time.monotonic() - pref[1] > self.opts.preferred_ttl:
                    pref = None
                pc = match(ids, cands, pref[0] if pref else None)
                spec = container_spec(pc, shim_host_path=self.opts.shim_host_path,
                                      cache_host_dir=self.opts.cache_host_dir)
                unlimited = unlimited_devices(spec)
                if unlimited:  # match() refuses 0 MiB bookings already; never let one through (KF-17)
                    raise MatchError(f"pod {pc.namespace}/{pc.pod} container {pc.container} GPU "
                                     f"{', '.join(unlimited)}: no positive memory limit (0 MiB booked or no "
                                     f"booking); refusing to hand out an unlimited limit")
                self._prepare_mounts(spec)
                self._record(pods, pc)
                log.info("allocated %s (kubelet ids %s): %s", pc.describe(), ",".join(ids),
                         " ".join(f"{k}={v}" for k, v in sorted(spec.envs.items())))
                resp.container_responses.append(_to_pb(spec))
            self._pods = pods
            return resp

    def _record(self, pods: list[dict[str, Any]], pc: PendingContainer) -> None:
        """Write (and remember) that ``pc`` was answered: allocated-containers, bind-phase and the
        progress signature over both, tied to the pod's verified allocation signature."""
        sig = ""
        for pod in pods:
            meta = pod.get("metadata") or {}
            if meta.get("uid") == pc.uid:
                sig = str((meta.get("annotations") or {}).get(ANN_ALLOCATION_SIGNATURE) or "")
        done = list(pc.allocated) + [pc.container]
        phase = BIND_SUCCESS if len(pc.remaining) <= 1 else BIND_ALLOCATING
        text = ",".join(done)
        ann: dict[str, str | None] = {
            ANN_ALLOCATED_CONTAINERS: text, ANN_BIND_PHASE: phase,
            ANN_PROGRESS_SIGNATURE: sign_progress(self.keys.current(), pc.uid, sig, phase, text)}
        self.kube.patch_pod_annotations(pc.namespace, pc.pod, ann)
        self._written[pc.uid] = Progress(sig, phase, tuple(done))
        for pod in pods:  # keep the in-memory list in step for further requests in the same call
            meta = pod.get("metadata") or {}
            if meta.get("uid") == pc.uid and meta.get("name") == pc.pod:
                meta["annotations"] = {**(meta.get("annotations") or {}),
                                       **{k: v for k, v in ann.items() if v is not None}}

    def _prepare_mounts(self, spec: ContainerSpec) -> None:
        """Create the container's shared-cache directory and write its read-only limits file.
        Raises OSError (the Allocate fails: a container must not start without its limits file)."""
        for m in spec.mounts:
            if not m.read_only and m.host_path.startswith(self.opts.cache_host_dir):
                os.makedirs(m.host_path, exist_ok=True)
                os.chmod(m.host_path, 0o777)  # the container may run as any user
        write_host_files(spec)

    def _write_preload_file(self) -> None:
        path = preload_host_path(self.opts.shim_host_path)
        want = preload_contents()
        try:
            with open(path) as f:
                if f.read() == want:
                    return
        except OSError:
            pass
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(want)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            log.info("wrote %s", path)
        except OSError as e:
            log.error("cannot write the preload file %s: %s; containers will not load the shim", path, e)


def _to_pb(spec: ContainerSpec) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=spec.envs,
        mounts=[api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for m in spec.mounts])


def _rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code}: {details}"


class Servicer(api_pb2_grpc.DevicePluginServicer):
    """gRPC glue: maps errors to status codes (FAILED_PRECONDITION for match errors,
    INVALID_ARGUMENT for unknown IDs, UNAVAILABLE for API server errors)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    def GetDevicePluginOptions(self, request: Any, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[api_pb2.ListAndWatchResponse]:
        yield from self.p.watch(context.is_active)

    def GetPreferredAllocation(self, request: Any, context: Any) -> api_pb2.PreferredAllocationResponse:
        try:
            return self.p.preferred(request)
        except Exception as e:  # noqa: BLE001 - a preference is optional; never fail kubelet here
            log.warning("GetPreferredAllocation failed, answering without preference: %s", e)
            resp = api_pb2.PreferredAllocationResponse()
            for creq in request.container_requests:
                ids = list(creq.must_include_deviceIDs)
                ids += [i for i in creq.available_deviceIDs if i not in ids][: max(0, creq.allocation_size - len(ids))]
                resp.container_responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
            return resp

    def Allocate(self, request: Any, context: Any) -> api_pb2.AllocateResponse:
        try:
            resp = self.p.allocate(request)
        except MatchError as e:
            self._fail(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - API server or filesystem trouble
            self._fail(context, grpc.StatusCode.UNAVAILABLE, f"allocate failed: {e}")
        self.p.status.allocations["ok"] += 1
        return resp

    def _fail(self, context: Any, code: grpc.StatusCode, msg: str) -> None:
        self.p.status.allocations["error"] += 1
        log.error("Allocate refused: %s", msg)
        context.abort(code, msg)

    def PreStartContainer(self, request: Any, context: Any) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
