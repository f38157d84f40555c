"""The device plugin daemon: gRPC service for kubelet, registration, health, inventory heartbeat.

Threads (all daemon threads, stopped by :meth:`DevicePlugin.stop`):

* gRPC server on ``<device-plugin-dir>/kube-vgpu.sock`` (``v1beta1.DevicePlugin``);
* supervisor: registers with kubelet (``v1beta1.Registration/Register`` on ``kubelet.sock``) and
  re-registers when kubelet.sock is recreated (inode or mtime changed: kubelet restarted) or our own
  socket vanished (kubelet removes plugin sockets when it starts); our socket is recreated first;
* health: NVML events + periodic probes (:func:`deviceplugin.gpuhealth.run_health_loop`, shared with
  the DRA plugin); a health change is pushed to every ListAndWatch stream and to the node inventory at once;
* heartbeat: writes the node inventory annotation every ``heartbeat_seconds`` and refreshes the pod
  list used by the metrics;
* pod watch (:class:`deviceplugin.podwatch.PodWatcher`): numbers pods in the order they become bound
  to this node, the order GetPreferredAllocation assumes kubelet admits them in (a preference only).

Allocation in two steps (registered with ``PreStartRequired``; docs/device-plugin.md):

* ``Allocate`` names only device IDs. The answer depends on nothing else: the GPUs behind the IDs,
  the shim/preload/cache mounts and a read-only limits directory keyed by the IDs holding a
  fail-closed placeholder (:func:`deviceplugin.response.allocate_spec`). No API call, no guess.
* kubelet records the result, then calls ``PreStartContainer`` (same IDs) before starting the
  container. Its PodResources API now names exactly the pod and container holding the IDs
  (:mod:`deviceplugin.podresources`); the plugin takes that pod's verified allocation for that
  container, checks the IDs are on exactly the booked GPUs, writes the limits file and records the
  progress. Anything else fails PreStart with a message naming the pod, and the container does not
  start. A restarted container calls PreStart again: the same file is written again.

Trust: only pods whose allocation record the scheduler extender signed for this node are served
(:func:`deviceplugin.podmatch.trusted_view`); what the plugin writes back (allocated-containers,
bind-phase) carries its own ``kube-vgpu.io/progress-signature`` and is also kept in memory. The
signing keys (``--signing-keys-dir``) are reloaded when their files change (checked at every
PreStartContainer, GetPreferredAllocation and heartbeat).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from kube_vgpu.codec import allocation_or_none, encode_inventory
from kube_vgpu.config import Config
from kube_vgpu.envcontract import VISIBLE_DEVICES
from kube_vgpu.mig import MigError, single_profile_error
from kube_vgpu.model import DeviceBooking, GPUDevice
from kube_vgpu.podlife import active
from kube_vgpu.resources import (
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_NODE_INVENTORY,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    BIND_SUCCESS,
    mig_resource,
)
from kube_vgpu.signing import KeyDir, KeyRing, KeySource, sign_progress
from kube_vgpu.views import PodView

from . import inventory as inv
from . import mig as dmig
from .api import API_VERSION, HEALTHY, KUBELET_SOCKET, UNHEALTHY, api_pb2, api_pb2_grpc
from .gpuhealth import run_health_loop
from .kube import KubeClient, PodWatchClient
from .migserver import MixedMig, by_resource, no_preference
from .nvml import NVML, GPUBackend, HealthTracker, MigDevice, NVMLError, PhysicalGPU
from .podmatch import (
    ANN_ALLOCATED_CONTAINERS,
    Arrival,
    MatchError,
    PendingContainer,
    Progress,
    allocated_names,
    check_assignment,
    identified,
    mig_slot_placement,
    pending_containers,
    preferred_allocation,
    slot_uuid,
    trusted_view,
    with_held,
)
from .podresources import DEFAULT_SOCKET, PodResourcesClient, PodResourcesError, holders_of
from .podwatch import ArrivalBook, PodWatcher
from .response import (
    ALLOC_PREFIX,
    CACHE_HOST_DIR,
    LIMITS_SUFFIX,
    OWNER_FILE,
    SHIM_HOST_PATH,
    ContainerSpec,
    alloc_dirs,
    alloc_key,
    allocate_spec,
    cache_dir_name,
    limits_dir,
    preload_contents,
    preload_host_path,
    prestart_files,
    read_owner,
)
from .shimcache import remove_tree, write_host_files

log = logging.getLogger("kube_vgpu.deviceplugin")

#: our socket in the device plugin directory
PLUGIN_SOCKET = "kube-vgpu.sock"


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """What both kubelet plugins of a node (this device plugin and ``kube-vgpu dra-plugin``) take alike:
    the node, where the shim and the containers' shared files live on the host (flags), and the timings
    of the GPU health watch (not flags; the tests shrink them). Paths on the node; times in seconds
    unless the name says ms."""

    node_name: str
    shim_host_path: str = SHIM_HOST_PATH
    cache_host_dir: str = CACHE_HOST_DIR
    #: how often the plugin's sockets (and kubelet's, for the device plugin) are checked
    watch_interval: float = 1.0
    #: the longest wait for one NVML event before the health loop goes round again (ms)
    health_poll_ms: int = 500
    #: every GPU is probed this often
    probe_interval: float = 5.0
    #: after a critical event a GPU is healthy again at the first successful probe this long later
    recovery_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class Options(NodeOptions):
    """Runtime options of the device plugin (flags in docs/CONTRACTS.md, plus test-only timings).

    Paths are on the node. Times in seconds unless the name says ms.
    """

    device_plugin_dir: str = "/var/lib/kubelet/device-plugins"
    heartbeat_seconds: float = 30.0
    #: a pod pending Allocate for longer than this (since first seen bound) is demoted: it is no
    #: longer the target of GetPreferredAllocation while a newer pod waits (0 or less: never)
    pending_stale_seconds: float = 300.0
    #: kubelet's PodResources socket (``--pod-resources-socket``)
    pod_resources_socket: str = DEFAULT_SOCKET
    #: an allocation directory no container was identified for (PreStartContainer never came) is
    #: removed this long after its Allocate (s)
    alloc_dir_grace_seconds: float = 3600.0
    # not flags: timings the tests shrink
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
    prestarts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    started: float = field(default_factory=time.time)


#: name prefix of a directory being removed: ``<prefix><8 hex>-<its name>``, in the same parent
TRASH_PREFIX = ".removing-"
_trash_lock = threading.Lock()  # one remover at a time (heartbeat, Unprepare calls)


def _discard_dir(path: str) -> bool:
    """Move the real directory ``path`` (never a symlink) out of its name at once, to a trash name in
    the same directory (:data:`TRASH_PREFIX`), for :func:`_empty_trash` to remove later, outside any
    lock: a tenant's directory may hold millions of files (seconds to minutes to remove), and no
    Allocate, PreStart or Prepare of another pod may wait for that. True when moved. Raises OSError
    when the rename fails."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    parent, name = os.path.split(path)
    os.rename(path, os.path.join(parent, f"{TRASH_PREFIX}{secrets.token_hex(4)}-{name}"))
    return True


def _empty_trash(root: str) -> list[str]:
    """Remove every directory :func:`_discard_dir` moved aside in ``root``; returns the paths they were
    discarded from. A failure is logged and the directory kept for the next call."""
    removed = []
    with _trash_lock:  # listed under the lock: another caller may have removed what it listed
        try:
            names = [n for n in os.listdir(root) if n.startswith(TRASH_PREFIX)]
        except OSError as e:
            log.warning("cannot list the cache directory", extra={"path": root, "error": str(e)})
            return []
        for name in sorted(names):
            if _remove_dir(os.path.join(root, name), None):
                removed.append(os.path.join(root, name[len(TRASH_PREFIX):].partition("-")[2]))
    return removed


def run_trash_loop(root: str, due: threading.Event, stop: threading.Event, period: float) -> None:
    """Remove the directories moved aside in ``root`` (:func:`_empty_trash`) at once, then whenever
    ``due`` is set and at least every ``period`` seconds (what failed is retried), until ``stop`` is set
    (set ``due`` too, to wake it). Meant for a thread of its own: a tenant's millions of files must
    delay no kubelet call (Allocate, PreStart, NodePrepare/UnprepareResources) and no heartbeat.
    Never raises (a failure is logged, the thread lives on)."""
    while not stop.is_set():
        due.clear()  # before listing: a directory moved aside after this is seen now or at the next wake-up
        try:
            _empty_trash(root)
        except Exception as e:  # noqa: BLE001 - tried again next period; the thread must live
            log.warning("removing cache directories failed", extra={"error": str(e)})
        due.wait(period)


def _remove_dir(path: str, uid: str | None) -> bool:
    """Remove the real directory ``path`` (never through a symlink; a tenant can write inside it).
    True when removed; a failure is logged with ``uid`` and the error, and False returned."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        remove_tree(path)  # not shutil.rmtree: a tenant's tree thousands of levels deep made it raise
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("cannot remove the cache directory of a gone pod or allocation", extra={"path": path, "uid": uid, "error": str(e)})
        return False
    return True


class DevicePlugin:
    """One plugin instance for one node. Construct, :meth:`start`, later :meth:`stop`.

    nvml: an initialised-or-not :class:`deviceplugin.nvml.NVML`, or simulated GPUs
    (:class:`deviceplugin.simgpu.SimulatedGPUs`); kube: a
    :class:`deviceplugin.kube.KubeClient`; keys: the signing key ring records must verify with (a
    :class:`~kube_vgpu.signing.KeyDir` is reloaded when its files change; None: a fresh random
    key, so no record verifies and no pod is served). Raises NVMLError from :meth:`start` when NVML
    cannot be initialised.
    """

    def __init__(self, cfg: Config, opts: Options, kube: KubeClient, nvml: GPUBackend | None = None,
                 keys: KeySource | None = None) -> None:
        self.cfg = cfg
        self.opts = opts
        self.kube = kube
        self.keys: KeySource = keys if keys is not None else KeyRing.generate()
        #: pod uid -> what this plugin wrote on it (trusted over the pod's annotations)
        self._written: dict[str, Progress] = {}
        self.nvml: GPUBackend = nvml or NVML()
        self.names = cfg.resource_names
        self.settings = inv.settings_for(cfg, opts.node_name)
        self.status = Status()
        self._gpus: list[PhysicalGPU] = []
        #: GPUs in MIG mode whose MIG devices are advertised (migStrategy single / mixed) and those devices
        self._mig_parents: list[PhysicalGPU] = []
        self._migs: list[MigDevice] = []
        #: GPUs in MIG mode served by dynamic MIG (migStrategy dynamic; docs/mig.md)
        self._dynamic: list[PhysicalGPU] = []
        self._mixed_mig = MixedMig(opts.device_plugin_dir, opts.register_timeout)
        self._links: list[list[int]] = []
        self._devices: tuple[GPUDevice, ...] = ()
        self._health = HealthTracker((), opts.recovery_seconds)
        self._cond = threading.Condition()
        self._version = 0
        self._stop = threading.Event()
        self._inventory_due = threading.Event()
        self._trash_due = threading.Event()  # directories moved aside: remove them (own thread)
        self._alloc_lock = threading.Lock()
        self.podresources = PodResourcesClient(opts.pod_resources_socket)
        #: (pod uid, container) -> its allocation directory name (``alloc-...``), from PreStart and
        #: the owner files (for the per-container metrics)
        self._owners: dict[tuple[str, str], str] = {}
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
                         ("heartbeat", self._heartbeat_loop), ("trash", self._trash_loop)):
            t = threading.Thread(target=fn, name=f"deviceplugin-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop threads and the gRPC server, remove our socket, shut NVML down."""
        self._stop.set()
        self._inventory_due.set()
        self._trash_due.set()
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
        self._mixed_mig.stop()
        self.podresources.close()
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
        unpublished = None
        if time.time() - self.status.last_inventory_write > 3 * self.opts.heartbeat_seconds + 5:
            unpublished = f"node inventory not written recently: {self.status.last_inventory_error or 'pending'}"
        return node_readiness(self.status.registered, "", unpublished, self.opts.shim_host_path)

    # ------------------------------------------------------------------ devices

    def _discover(self) -> None:
        gpus, keep = discover_gpus(self.nvml, self.settings, log, "GPU not usable, not advertised")
        self._mig_parents = inv.mig_parents(gpus, self.settings)
        self._migs = self._discover_mig(self._mig_parents)
        for g in self._mig_parents:
            self._health.add(g.uuid)
        for g in keep:
            self._health.add(g.uuid)
            log.info("GPU advertised", extra={"gpu": g.uuid, "index": g.index, "model": g.model,
                                              "memory_mib": g.memory_mib, "numa": g.numa,
                                              "slots": self.settings.split_count})
        for p in self.nvml.watch_events([g.uuid for g in [*keep, *self._mig_parents]]):
            log.warning("no NVML events for a GPU; it is still probed", extra={"problem": str(p)})
        self._gpus = keep
        self._links = self.nvml.topology([g.uuid for g in keep])  # fixed for the node's life
        if self._links:
            log.info("GPU interconnect published", extra={"gpu": ",".join(g.uuid for g in keep)})
        self._rebuild()

    def _discover_mig(self, parents: list[PhysicalGPU]) -> list[MigDevice]:
        """The MIG devices of ``parents`` the MIG strategy advertises (docs/mig.md): with ``single``
        none unless they all have one profile; a GPU whose MIG devices cannot be read is not advertised."""
        lister = getattr(self.nvml, "mig_devices", None)
        self._dynamic = []
        if parents and self.settings.mig_strategy == "dynamic":
            for g in parents:
                why = inv.dynamic_refusal(g, self.settings) if isinstance(self.nvml, NVML) else \
                    f"{g.uuid}: the GPU backend cannot create MIG devices"
                if why is not None:
                    log.error("GPU in MIG mode not served by dynamic MIG, not advertised", extra={"reason": why})
                    continue
                log.info("GPU advertised for dynamic MIG", extra={"gpu": g.uuid, "index": g.index, "model": g.model})
                self._dynamic.append(g)
            return []
        if not parents or lister is None or self.settings.mig_strategy not in ("single", "mixed"):
            if parents:
                log.warning("MIG devices not advertised", extra={"strategy": self.settings.mig_strategy,
                                                                 "gpu": ",".join(g.uuid for g in parents)})
            return []
        migs: list[MigDevice] = []
        for g in parents:
            try:
                found = list(lister(g.uuid))
            except (NVMLError, KeyError) as e:
                log.error("MIG devices of a GPU not readable, not advertised", extra={"gpu": g.uuid, "error": str(e)})
                continue
            for m in found:
                log.info("MIG device advertised", extra={"gpu": m.uuid, "parent": g.uuid, "profile": m.profile,
                                                         "memory_mib": m.memory_mib,
                                                         "strategy": self.settings.mig_strategy})
            migs += found
        if self.settings.mig_strategy == "single":
            err = single_profile_error({m.uuid: m.profile for m in migs})
            if err is not None:
                log.error("MIG devices not advertised", extra={"reason": err})
                return []
        return migs

    def _rebuild(self) -> None:
        health = self._health.snapshot()
        devices = inv.to_devices(self._gpus, self.settings, health, self._links)
        if self._migs and self.settings.mig_strategy == "single":
            # MIG devices have no interconnect ranks: a node that has them publishes none
            devices = tuple(replace(d, links=()) for d in devices) + inv.mig_to_devices(
                self._migs, self._mig_parents, health)
        elif self._dynamic:
            # MIG devices have no interconnect ranks: a node that has them publishes none
            devices = tuple(replace(d, links=()) for d in devices) + inv.dynamic_devices(
                self._dynamic, self.settings, health)
        elif self._migs and self.settings.mig_strategy == "mixed":
            numa = {g.uuid: g.numa for g in self._mig_parents}
            self._mixed_mig.set(by_resource(self.names.gpu, self._migs, health, numa),
                                {mig_resource(self.names.gpu, m.profile): m.profile for m in self._migs})
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
        run_health_loop(self.nvml, self._health, self._stop, poll_ms=self.opts.health_poll_ms,
                        probe_interval=self.opts.probe_interval,
                        uuids=lambda: [g.uuid for g in [*self._gpus, *self._mig_parents]],
                        on_change=self._health_changed, logger=log)

    def _health_changed(self) -> None:
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
                log.warning("writing node inventory failed", extra={"error": str(e)})
            try:
                # under the Allocate lock: a cache directory created by an Allocate before this listing
                # belongs to a pod the listing holds (unless it was deleted), none is created during it
                with self._alloc_lock:
                    self._refresh_keys()
                    self._pods = self.kube.list_node_pods(self.opts.node_name)
                    self._discard_gone_dirs(self._pods)
                    live = {PodView(p).uid for p in self._pods}
                    for uid in [u for u in self._written if u not in live]:
                        del self._written[uid]
                self._trash_due.set()  # the slow part: its own thread, without the Allocate lock
            except Exception as e:  # noqa: BLE001
                log.warning("listing pods (metrics, cache cleanup) failed", extra={"error": str(e)})
            self._inventory_due.wait(self.opts.heartbeat_seconds)
            self._inventory_due.clear()

    def _trash_loop(self) -> None:
        """Remove the directories moved aside (:func:`_empty_trash`), when told and every heartbeat
        period: on a thread of its own, so that a tenant's millions of files delay neither an
        Allocate nor the node inventory's heartbeat (a stale inventory takes the node out of
        scheduling)."""
        run_trash_loop(self.opts.cache_host_dir, self._trash_due, self._stop, self.opts.heartbeat_seconds)

    def clean_cache_dirs(self, pods: list[dict[str, Any]]) -> list[str]:
        """:meth:`_discard_gone_dirs`, then remove what it moved aside (and what earlier calls could not
        remove). Returns the paths whose directories were removed. The heartbeat does the two steps
        apart: only the first under the Allocate lock."""
        self._discard_gone_dirs(pods)
        return _empty_trash(self.opts.cache_host_dir)

    def _discard_gone_dirs(self, pods: list[dict[str, Any]]) -> list[str]:
        """Move aside (:func:`_discard_dir`) the cache and limits directories of containers that are gone.

        Allocation directories (``alloc-<16 hex>`` and ``alloc-<16 hex>.limits``): removed when their
        owner file names a pod uid that is neither in ``pods`` (a complete listing of this node's
        pods) nor known to the pod watch, or, without an owner file (PreStartContainer never
        identified a container), when the limits directory is older than
        ``alloc_dir_grace_seconds``. Older per-container directories (``<pod uid>_<container>``, and
        its ``.limits``): removed when the uid is not live. The owner files also refresh the
        (pod uid, container) -> directory map the metrics read.

        Only names of those forms are touched; anything else in the directory is left alone. A
        directory that vanishes meanwhile is fine; one that cannot be removed is logged and tried
        again next time. Returns the paths moved aside. Call with the Allocate lock held (see the heartbeat).
        """
        live = {PodView(p).uid for p in pods} | set(self.arrivals.snapshot())
        live.discard("")
        root = self.opts.cache_host_dir
        try:
            names = os.listdir(root)
        except OSError as e:
            log.warning("cannot list the cache directory", extra={"path": root, "error": str(e)})
            return []
        removed = self._clean_alloc_dirs(names, live)
        for name in names:
            if name.startswith((ALLOC_PREFIX, TRASH_PREFIX)):
                continue
            uid, sep, ctr = name.partition("_")
            if not sep or not uid or not ctr or uid in live or cache_dir_name(uid, ctr) != name:
                continue
            path = os.path.join(root, name)
            if self._discard(path, uid):
                removed.append(path)
                log.info("removing the cache directory of a pod no longer on this node", extra={"path": path, "uid": uid})
        return removed

    def _clean_alloc_dirs(self, names: list[str], live: set[Any]) -> list[str]:
        root = self.opts.cache_host_dir
        keys = {n[: -len(LIMITS_SUFFIX)] if n.endswith(LIMITS_SUFFIX) else n
                for n in names if n.startswith(ALLOC_PREFIX)}
        removed: list[str] = []
        owners: dict[tuple[str, str], str] = {}
        now = time.time()
        for key in sorted(keys):
            if len(key) != len(ALLOC_PREFIX) + 16 or any(c not in "0123456789abcdef" for c in key[len(ALLOC_PREFIX):]):
                continue
            owner = read_owner(root, key)
            if owner is not None and owner[0] in live:
                owners[owner] = key
                continue
            if owner is None:
                try:
                    age = now - os.stat(limits_dir(root, key)).st_mtime
                except OSError:
                    age = float("inf")  # a cache directory without its limits directory
                if age < self.opts.alloc_dir_grace_seconds:
                    continue
            for path in alloc_dirs(root, key):
                if not self._discard(path, owner[0] if owner else None):
                    continue
                removed.append(path)
                log.info("removing the allocation directory", extra={
                    "path": path, "reason": "pod no longer on this node" if owner else "no container was identified for it",
                    "uid": owner[0] if owner else None})
        self._owners = owners
        return removed

    @staticmethod
    def _discard(path: str, uid: str | None) -> bool:
        try:
            return _discard_dir(path)
        except OSError as e:
            log.warning("cannot remove the cache directory of a gone pod or allocation",
                        extra={"path": path, "uid": uid, "error": str(e)})
            return False

    def cache_dir_for(self, uid: str, container: str) -> str | None:
        """The allocation directory name (``alloc-...``) of a pod's container, if known."""
        return self._owners.get((uid, container))

    def allocated_by_gpu(self) -> dict[str, tuple[int, int, int]]:
        """Per GPU uuid: (MiB, cores percent, containers) booked by live pods on this node (last
        listing; verified records only)."""
        out: dict[str, list[int]] = {}
        views, _ = trusted_view(self._pods, self.opts.node_name, self.keys.current())
        for pod in views:
            if not active(pod):
                continue
            alloc = allocation_or_none(pod)
            if alloc is None or alloc.node != self.opts.node_name:
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
        self._mixed_mig.serve()  # migStrategy mixed: one server per MIG profile resource
        log.info("serving v1beta1.DevicePlugin", extra={"socket": self.socket_path})

    def register(self) -> None:
        """Call kubelet's Registration.Register. Raises grpc.RpcError."""
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as ch:
            stub = api_pb2_grpc.RegistrationStub(ch)
            stub.Register(api_pb2.RegisterRequest(
                version=API_VERSION, endpoint=PLUGIN_SOCKET, resource_name=self.names.gpu,
                options=plugin_options()),
                timeout=self.opts.register_timeout)
        self._mixed_mig.register(self.kubelet_socket)
        self.status.registered = True
        self.status.registrations += 1
        log.info("registered with kubelet", extra={"resource": self.names.gpu, "socket": self.kubelet_socket})

    def _kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.kubelet_socket)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def _supervise(self) -> None:
        while not self._stop.is_set():
            ident = self._kubelet_identity()
            ours = os.path.exists(self.socket_path) and self._mixed_mig.sockets_present()
            if ident is None:
                if self.status.registered:
                    log.warning("kubelet socket is gone; waiting for kubelet", extra={"socket": self.kubelet_socket})
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
                    log.warning("registration with kubelet failed", extra={"error": _rpc_text(e)})
                except Exception as e:  # noqa: BLE001 - keep supervising
                    log.warning("restarting the plugin socket failed", extra={"error": str(e)})
            self._stop.wait(self.opts.watch_interval)

    # ------------------------------------------------------------------ preferred allocation / allocate

    def _mig_nvml(self) -> NVML:
        if not isinstance(self.nvml, NVML):
            raise ValueError("dynamic MIG needs NVML (the GPU backend cannot create MIG devices)")
        return self.nvml

    def _dynamic_gpu(self, uuid: str) -> PhysicalGPU:
        g = next((g for g in self._dynamic if g.uuid == uuid), None)
        if g is None:
            raise ValueError(f"GPU {uuid} is not served by dynamic MIG on this node")
        return g

    def _ensure_mig(self, gpu: str, profile: str, start: int) -> MigDevice:
        """The MIG device of placement ``profile@start`` on dynamic-MIG GPU ``gpu``, created when it
        does not exist (:func:`deviceplugin.mig.ensure`). An instance in its way is destroyed only
        when idle and not at a placement a verified booking on this node holds (read from the API
        server: an instance booked by a pod whose container has not started yet is kept).

        Raises MigError (a busy or booked instance in the way; the placement not valid), NVMLError
        (the driver refused), or the API client's error (the bookings cannot be read: nothing is
        destroyed on a guess)."""
        g = self._dynamic_gpu(gpu)
        self._refresh_keys()
        pods = self.kube.list_node_pods(self.opts.node_name)
        views, _ = trusted_view(pods, self.opts.node_name, self.keys.current(), self._written)
        held: set[tuple[str, int]] = set()
        for v in views:
            pv = PodView(v)
            if not active(pv):
                continue
            alloc = allocation_or_none(pv)
            if alloc is None or alloc.node != self.opts.node_name:
                continue
            held |= {(d.profile, d.start) for c in alloc.containers for d in c.devices if d.uuid == gpu and d.profile}
        held.discard((profile, start))
        nvml = self._mig_nvml()
        booked = {m.uuid for m in nvml.mig_devices(gpu) if (m.profile, m.start) in held}
        m = dmig.ensure(nvml, g, profile, start, booked)
        log.info("MIG device ready for a dynamic-MIG placement", extra={"gpu": gpu, "profile": profile,
                                                                       "start": start, "mig": m.uuid})
        return m

    def _mig_limits(self, d: DeviceBooking) -> DeviceBooking:
        """A container's booking as its limits file names it: a dynamic-MIG instance by its MIG uuid
        (what the container sees), its profile's memory and no SM limit inside the instance.
        Raises MatchError when the booked instance does not exist (Allocate did not create it)."""
        if not d.profile:
            return d
        m = next((m for m in self._mig_nvml().mig_devices(d.uuid) if (m.profile, m.start) == (d.profile, d.start)), None)
        if m is None:
            raise MatchError(f"GPU {d.uuid}: the booked MIG instance {d.profile}@{d.start} does not exist")
        return DeviceBooking(m.uuid, d.memory_mib, 100)

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

    def _candidates(self, pods: list[dict[str, Any]], held: dict[tuple[str, str], list[str]] | None = None
                    ) -> list[PendingContainer]:
        """Pending containers in admission order (arrival order from the pod watch, demotions applied),
        from what can be trusted of ``pods`` (refused pods included, see :func:`trusted_view`);
        containers kubelet already holds devices for (``held``, from PodResources) are not pending."""
        self.arrivals.saw(pods)  # a listing can be ahead of the watch
        arrivals: dict[str, Arrival] = self.arrivals.snapshot()
        stale = self.opts.pending_stale_seconds
        views, refused = trusted_view(pods, self.opts.node_name, self.keys.current(), self._written)
        if held:
            views = with_held(views, held)
        return pending_containers(views, self.opts.node_name, self.names, arrivals=arrivals,
                                  now=self.arrivals.clock(), stale_after=stale if stale > 0 else None,
                                  refused=refused)

    def _held(self) -> dict[tuple[str, str], list[str]]:
        """(namespace, pod) -> containers kubelet holds our devices for (PodResources); empty when
        kubelet cannot be asked (the preference is only a preference)."""
        try:  # short: kubelet is waiting for this answer
            listing = self.podresources.list(self.names.gpu, timeout=1.0)
        except PodResourcesError as e:
            log.debug("GetPreferredAllocation without PodResources", extra={"error": str(e)})
            return {}
        out: dict[tuple[str, str], list[str]] = {}
        for h in listing:
            out.setdefault((h.namespace, h.pod), []).append(h.container)
        return out

    def preferred(self, req: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
        """GetPreferredAllocation: slots on the GPUs booked for the first pending container of that size
        in admission order (see :func:`deviceplugin.podmatch.pending_containers`); containers kubelet
        already holds devices for (PodResources) are skipped. Only a preference: PreStartContainer
        checks what kubelet really chose."""
        with self._alloc_lock:
            return self._preferred_locked(req)

    def _preferred_locked(self, req: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
        self._refresh_keys()
        pods = self.kube.list_node_pods(self.opts.node_name)
        cands = self._candidates(pods, self._held())
        resp = api_pb2.PreferredAllocationResponse()
        for creq in req.container_requests:
            ids, target = preferred_allocation(list(creq.available_deviceIDs), list(creq.must_include_deviceIDs),
                                               int(creq.allocation_size), cands)
            if target is not None and len(ids) == creq.allocation_size:
                skipped = [c.key for c in cands if c.demoted and len(c.devices) == creq.allocation_size]
                log.info("preferred devices", extra={"ids": ",".join(ids), "container": target.key,
                                                    "demoted": ",".join(skipped) if skipped else None})
            resp.container_responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return resp

    def allocate(self, req: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """Allocate: for each container request, the GPUs behind its device IDs, the shim, preload and
        cache mounts, and the allocation's read-only limits directory holding the fail-closed
        placeholder (:func:`deviceplugin.response.allocate_spec`). No API call and no guess about the
        pod: its limits are written by :meth:`prestart`.

        Raises ValueError (device IDs not advertised, repeated, or two on one GPU) or OSError (the
        directories or the placeholder cannot be written: the container must not start without them).
        """
        with self._alloc_lock:
            resp = api_pb2.AllocateResponse()
            for creq in req.container_requests:
                ids = list(creq.devices_ids)
                self._check_ids(ids)
                spec = allocate_spec(ids, shim_host_path=self.opts.shim_host_path,
                                     cache_host_dir=self.opts.cache_host_dir)
                placements = [(i, p) for i in ids if (p := mig_slot_placement(i)) is not None]
                if placements:
                    if len(ids) != 1:
                        raise ValueError(f"device IDs {', '.join(ids)}: a dynamic-MIG placement is one "
                                         f"container's only device")
                    mig = self._ensure_mig(slot_uuid(ids[0]), *placements[0][1])
                    spec = replace(spec, envs={**spec.envs, VISIBLE_DEVICES: mig.uuid})
                self._prepare_mounts(spec)
                log.info("allocated (limits pending until PreStartContainer)", extra={"ids": ",".join(ids),
                                                                                        "key": alloc_key(ids)})
                resp.container_responses.append(_to_pb(spec))
            return resp

    def prestart(self, req: api_pb2.PreStartContainerRequest) -> api_pb2.PreStartContainerResponse:
        """PreStartContainer: identify the container holding ``req.devices_ids`` through kubelet's
        PodResources API, check it against its pod's verified booking, write its limits file and record
        the progress. Idempotent (a restarted container calls it again).

        Raises MatchError (no or several holders, the pod not on this node or without a trusted record,
        the container without a booking, GPUs other than the booked ones, 0 MiB), ValueError (device IDs
        not advertised, repeated, two on one GPU; a booking the limits file cannot hold),
        PodResourcesError (kubelet cannot be asked), OSError (files) or the API client's error.
        """
        ids = list(req.devices_ids)
        with self._alloc_lock:
            self._refresh_keys()
            self._check_ids(ids)
            found = holders_of(self.podresources.list(self.names.gpu), ids)
            if len(found) != 1:
                who = "no container" if not found else f"{len(found)} containers ({', '.join(h.key for h in found)})"
                raise MatchError(f"kubelet's PodResources lists {who} holding exactly the device IDs "
                                 f"{', '.join(sorted(ids))}; cannot tell which pod this container belongs to, "
                                 f"so no limits are written and it does not start")
            h = found[0]
            pods = self.kube.list_node_pods(self.opts.node_name)
            views, refused = trusted_view(pods, self.opts.node_name, self.keys.current(), self._written)
            view = next((v for v in map(PodView, views) if v.namespace == h.namespace and v.name == h.pod), None)
            if view is None:
                raise MatchError(f"pod {h.namespace}/{h.pod} (container {h.container}, device IDs "
                                 f"{', '.join(sorted(ids))}) is not bound to this node in the API server")
            uid = view.uid
            if uid not in refused:
                # progress as recorded (signed or remembered), not "all done" because kubelet already
                # reports container statuses (it does once the pod's first container exists)
                raw = next(p for p in pods if PodView(p).uid == uid)
                view = PodView(trusted_view([{**raw, "status": {}}], self.opts.node_name, self.keys.current(),
                                            self._written)[0][0])
            pc = identified(view, h.container, self.opts.node_name, self.names, refused=refused.get(uid, ""))
            check_assignment(pc, ids)
            if any(d.profile for d in pc.devices):
                pc = replace(pc, devices=tuple(self._mig_limits(d) for d in pc.devices))
            key = alloc_key(ids)
            root = self.opts.cache_host_dir
            cache = os.path.join(root, key)
            os.makedirs(cache, exist_ok=True)
            os.chmod(cache, 0o777)  # the container may run as any user
            write_host_files(ContainerSpec(envs={}, mounts=(), files=prestart_files(
                pc, ids, cache_host_dir=root, core_policy=self.cfg.devices.core_policy,
                core_sharing=self.cfg.devices.core_sharing,
                graph_memory=self.cfg.devices.graph_memory_bound)))
            self._owners[(uid, pc.container)] = key
            first = pc.container not in allocated_names(view)
            if first:
                self._record(pods, pc)
            log.info("pre-started" if first else "pre-started again (container restart)",
                     extra={"container": pc.describe(), "ids": ",".join(ids), "key": key})
            self._pods = pods
            return api_pb2.PreStartContainerResponse()

    def _record(self, pods: list[dict[str, Any]], pc: PendingContainer) -> None:
        """Write (and remember) that ``pc`` was started: allocated-containers, bind-phase and the
        progress signature over both, tied to the pod's verified allocation signature."""
        sig = ""
        for pod in pods:
            pv = PodView(pod)
            if pv.uid == pc.uid:
                sig = str(pv.annotations.get(ANN_ALLOCATION_SIGNATURE) or "")
        done = list(pc.allocated) + [pc.container]
        phase = BIND_SUCCESS if all(n in done for n in pc.remaining) else BIND_ALLOCATING
        text = ",".join(done)
        ann: dict[str, str | None] = {
            ANN_ALLOCATED_CONTAINERS: text, ANN_BIND_PHASE: phase,
            ANN_PROGRESS_SIGNATURE: sign_progress(self.keys.current(), pc.uid, sig, phase, text)}
        self.kube.patch_pod_annotations(pc.namespace, pc.pod, ann)
        self._written[pc.uid] = Progress(sig, phase, tuple(done))
        for pod in pods:  # keep the in-memory list in step
            pv = PodView(pod)
            if pv.uid == pc.uid and pv.name == pc.pod:
                pod["metadata"] = {**pv.meta, "annotations": {
                    **pv.annotations, **{k: v for k, v in ann.items() if v is not None}}}

    def _prepare_mounts(self, spec: ContainerSpec) -> None:
        """Create the allocation's shared-cache directory empty (a previous holder of the same device IDs
        left its files there: its accounting file, or anything it wrote, must not reach the next
        tenant), drop a previous holder's owner file and write the placeholder limits file. Raises
        OSError (the Allocate fails: a container must not start without its limits directory, nor in
        a directory still holding another's files)."""
        for m in spec.mounts:
            if not m.read_only and m.host_path.startswith(self.opts.cache_host_dir):
                if os.path.islink(m.host_path):  # never ours: drop the link, never what it points to
                    os.unlink(m.host_path)
                elif os.path.lexists(m.host_path):
                    _discard_dir(m.host_path)  # removed by the trash thread, outside the lock
                    self._trash_due.set()
                if os.path.lexists(m.host_path):
                    raise OSError(f"{m.host_path}: the previous holder's cache directory could not be removed")
                os.makedirs(m.host_path, exist_ok=True)
                os.chmod(m.host_path, 0o777)  # the container may run as any user
        for f in spec.files:
            try:
                os.unlink(os.path.join(os.path.dirname(f.host_path), OWNER_FILE))
            except FileNotFoundError:
                pass
        write_host_files(spec)

    def _write_preload_file(self) -> None:
        write_preload_file(self.opts.shim_host_path)


def discover_gpus(nvml: GPUBackend, settings: inv.DeviceSettings, logger: logging.Logger,
                  unusable: str) -> tuple[list[PhysicalGPU], list[PhysicalGPU]]:
    """NVML's GPUs and those to offer (:func:`deviceplugin.inventory.select`), logging each GPU NVML
    could not use (``unusable``: the message) and each one skipped. Used by the device plugin and
    the DRA plugin. Raises NVMLError when NVML cannot list the GPUs."""
    gpus, problems = nvml.discover()
    for p in problems:
        logger.error(unusable, extra={"problem": str(p)})
    keep, skipped = inv.select(gpus, settings)
    for s in skipped:
        logger.warning("GPU skipped", extra={"reason": str(s)})
    return gpus, keep


def node_readiness(registered: bool, registration_error: str, unpublished: str | None,
                   shim_host_path: str) -> tuple[bool, str]:
    """(ready, reason) of a node plugin for /readyz, the first failing of: kubelet accepted the
    registration (``registration_error``: why not, when known), the node's GPUs were published
    (``unpublished``: why not, None when they were) and the shim exists at ``shim_host_path``.
    Used by the device plugin and the DRA plugin."""
    if not registered:
        return False, f"not registered with kubelet{': ' + registration_error if registration_error else ''}"
    if unpublished is not None:
        return False, unpublished
    if not os.path.exists(shim_host_path):
        return False, f"shim not found at {shim_host_path}"
    return True, "ok"


def write_preload_file(shim_host_path: str) -> None:
    """Write ``ld.so.preload`` next to the shim (:func:`deviceplugin.response.preload_host_path`)
    unless it already holds :func:`deviceplugin.response.preload_contents`; a failure is logged
    (containers then do not load the shim). Used by the device plugin and the DRA plugin."""
    path = preload_host_path(shim_host_path)
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
        log.info("wrote the preload file", extra={"path": path})
    except OSError as e:
        log.error("cannot write the preload file; containers will not load the shim",
                  extra={"path": path, "error": str(e)})


def plugin_options() -> api_pb2.DevicePluginOptions:
    """The options registered with kubelet and answered by GetDevicePluginOptions: PreStartContainer
    required (the limits are written there) and GetPreferredAllocation available."""
    return api_pb2.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


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
    """gRPC glue: maps errors to status codes (FAILED_PRECONDITION for match errors and a dynamic-MIG
    instance that cannot be created, INVALID_ARGUMENT for unknown IDs, UNAVAILABLE for API server, PodResources or file errors)."""

    def __init__(self, plugin: DevicePlugin) -> None:
        self.p = plugin

    def GetDevicePluginOptions(self, request: Any, context: Any) -> api_pb2.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[api_pb2.ListAndWatchResponse]:
        yield from self.p.watch(context.is_active)

    def GetPreferredAllocation(self, request: Any, context: Any) -> api_pb2.PreferredAllocationResponse:
        try:
            return self.p.preferred(request)
        except Exception as e:  # noqa: BLE001 - a preference is optional; never fail kubelet here
            log.warning("GetPreferredAllocation failed, answering without preference", extra={"error": str(e)})
            return no_preference(request)

    def Allocate(self, request: Any, context: Any) -> api_pb2.AllocateResponse:
        try:
            resp = self.p.allocate(request)
        except MigError as e:  # a busy or booked MIG instance in the way: nothing destroyed
            self._fail(context, "Allocate", grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            self._fail(context, "Allocate", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - filesystem trouble
            self._fail(context, "Allocate", grpc.StatusCode.UNAVAILABLE, f"allocate failed: {e}")
        self.p.status.allocations["ok"] += 1
        return resp

    def PreStartContainer(self, request: Any, context: Any) -> api_pb2.PreStartContainerResponse:
        try:
            resp = self.p.prestart(request)
        except MatchError as e:
            self._fail(context, "PreStartContainer", grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            self._fail(context, "PreStartContainer", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - PodResources, API server or filesystem trouble
            self._fail(context, "PreStartContainer", grpc.StatusCode.UNAVAILABLE, f"pre-start failed: {e}")
        self.p.status.prestarts["ok"] += 1
        return resp

    def _fail(self, context: Any, call: str, code: grpc.StatusCode, msg: str) -> None:
        (self.p.status.allocations if call == "Allocate" else self.p.status.prestarts)["error"] += 1
        log.error("request refused", extra={"call": call, "error": msg})
        context.abort(code, msg)
