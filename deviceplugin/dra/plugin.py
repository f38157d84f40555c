"""The kubelet DRA plugin of the kube-vgpu driver: NodePrepareResources / NodeUnprepareResources.

kubelet calls :meth:`DRAPlugin.prepare` with (namespace, uid, name) for each ResourceClaim of a pod
that names our driver. For each claim the plugin:

1. reads the claim from the API server; when the checkpoint already holds it (a repeat after a
   kubelet or plugin restart) with the same allocation, or the API server cannot be asked, it gives
   the checkpoint's answer and rewrites the claim's files from it; a claim allocated anew since
   (same uid, another allocation) is prepared again;
2. refuses a claim unless its ``metadata.uid`` is the
   uid kubelet named (a claim deleted and recreated under the same name is another claim), it is
   allocated and reserved for a consumer, and each of our results is in this node's pool
   (the node's name) on a GPU this plugin advertises, within that GPU's memory and cores;
3. reads the grants from the claim's **status** (:func:`kube_vgpu.dra.claims.read_claim`; the spec
   is the tenant's wish, never read), sums them per GPU into bookings (memory MiB, cores percent;
   a device allocated whole gets all its memory and ``min(100, cores)``);
4. writes the same files the device plugin writes for a container: the allocation directory
   ``<cache-host-dir>/dra-<claim uid>`` (the shim's shared accounting file, read-write) and its
   read-only limits directory ``dra-<claim uid>.limits`` holding
   :func:`kube_vgpu.envcontract.limits_file` of the bookings, then a CDI spec file
   (:mod:`deviceplugin.dra.cdi`) injecting the env contract, the shim, ``/etc/ld.so.preload``, those
   two directories and the GPUs' device nodes; then records the claim in the checkpoint
   (:mod:`deviceplugin.dra.checkpoint`);
5. answers one device per result with its CDI device id ``kube-vgpu.io/vgpu=<claim uid>-gpu-<i>`` and
   its request's base name (``<request>`` of ``<request>/<subrequest>``, which kubelet matches a
   container's request against).

Every container that uses the claim mounts the same allocation directory, so the shim accounts them
together: the claim's memory is the limit of all of them at once.

Errors of one claim go in that claim's ``error`` field (kubelet retries it), never fail the call.
:meth:`DRAPlugin.unprepare` removes the claim's CDI spec and directories (by uid, so it also cleans
up after a lost checkpoint) and forgets it; unpreparing an unknown claim succeeds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kube_vgpu import envcontract
from kube_vgpu.config import Config
from kube_vgpu.dra import DRIVER_NAME, device_name
from kube_vgpu.dra.claims import Grant, read_claim
from kube_vgpu.kubeapi import api_error_text, is_not_found
from kube_vgpu.model import DeviceBooking, GPUDevice
from kube_vgpu.views import ObjectView

from .. import inventory as inv
from ..gpuhealth import run_health_loop
from ..nvml import NVML, GPUBackend, HealthTracker, NVMLError, PhysicalGPU
from ..response import ContainerSpec, HostFile, alloc_dirs, alloc_mounts
from ..server import (
    NodeOptions,
    _discard_dir,
    discover_gpus,
    node_readiness,
    run_trash_loop,
    write_preload_file,
)
from ..shimcache import write_host_files
from ..simgpu import SimulatedGPUs
from . import cdi
from .api import dra_pb2
from .checkpoint import Checkpoint, PreparedClaim, PreparedDevice

log = logging.getLogger("kube_vgpu.deviceplugin.dra")

#: prefix of a claim's allocation directory under ``--cache-host-dir`` (``dra-<claim uid>``)
DRA_PREFIX = "dra-"
#: the most GPUs one claim may hold through this driver (the limits file's bound)
MAX_GPUS_PER_CLAIM = 16
#: cores written for a device allocated whole (and the most one booking may hold)
MAX_CORES = 100


class PrepareError(Exception):
    """A claim cannot be prepared; the message names the claim and why (goes to kubelet as the
    claim's error)."""


class ClaimSource(Protocol):
    """What the plugin needs from the API server."""

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim ``namespace/name`` (API JSON). Raises the client's ApiException (404
        when absent) or a connection error."""
        ...


class SlicePublisherLike(Protocol):
    """What the plugin asks of :class:`deviceplugin.dra_publish.SlicePublisher`."""

    #: the NVIDIA driver version published as an attribute (the plugin sets it from NVML at start)
    driver_version: str

    def publish(self, devices: Sequence[GPUDevice]) -> int: ...


@dataclass(frozen=True, slots=True)
class Options(NodeOptions):
    """Runtime options (flags of ``kube-vgpu dra-plugin``; docs/dra-node.md), beyond those both node
    plugins take (:class:`deviceplugin.server.NodeOptions`). Paths are on the node, times in seconds
    unless the name says ms."""

    #: the plugin's own directory; its service socket ``dra.sock`` and (default) checkpoint are there
    plugin_dir: str = f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    #: kubelet's plugin registration directory (kubelet watches it for ``*.sock``)
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    #: where checkpoint.json lives ("" = plugin_dir)
    state_dir: str = ""
    #: the host's /dev (device nodes named in CDI specs)
    dev_root: str = "/dev"
    # not flags: timings the tests shrink
    publish_retry_seconds: float = 10.0
    #: the ResourceSlices are compared with the GPUs (and rewritten when they differ) at least this often
    resync_seconds: float = 60.0

    @property
    def checkpoint_dir(self) -> str:
        return self.state_dir or self.plugin_dir


@dataclass
class Status:
    """What the health endpoint and logs report."""

    registered: bool = False
    registration_error: str = ""
    prepared: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    unprepared: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    last_publish: float = 0.0
    last_publish_error: str = ""


def nvml_minor(uuid: str) -> int | None:
    """The device minor of GPU ``uuid`` (``/dev/nvidia<minor>``) from NVML (initialised by the
    backend). Raises NVMLError when NVML cannot tell."""
    import pynvml

    return int(pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByUUID(uuid)))


def allocation_fingerprint(claim: dict[str, Any]) -> str:
    """SHA-256 (hex) of the claim's ``status.allocation`` (keys sorted): the same allocation gives the
    same value, a new allocation of the same claim (new share ids, timestamp) another. Raises
    ShapeError when ``status`` is not an object."""
    allocation = ObjectView(claim).status.get("allocation")
    return hashlib.sha256(json.dumps(allocation, sort_keys=True, default=str).encode()).hexdigest()


def alloc_dir_name(claim_uid: str) -> str:
    """The allocation directory name of claim ``claim_uid`` (``dra-<uid>``; its limits directory is
    the same name + ``.limits``). Raises ValueError for a uid unsafe in a path."""
    return DRA_PREFIX + cdi.check_uid(claim_uid)


class DRAPlugin:
    """One plugin for one node. Construct, :meth:`start` (discovery, checkpoint, health loop and
    slice publishing), serve it with :mod:`deviceplugin.dra.grpcserver`, later :meth:`stop`.

    claims: reads ResourceClaims; nvml: the GPUs (NVML, or simulated GPUs); publisher: publishes the
    ResourceSlices (None: not published, for tests of the node side alone); minor_of: uuid -> device
    minor (default: NVML's; None for simulated GPUs: no GPU device node is injected).

    Raises NVMLError from :meth:`start` when NVML cannot be initialised, and
    :class:`deviceplugin.dra.checkpoint.CheckpointError` when the checkpoint is unreadable.
    """

    def __init__(self, cfg: Config, opts: Options, claims: ClaimSource, nvml: GPUBackend | None = None,
                 publisher: SlicePublisherLike | None = None,
                 minor_of: Callable[[str], int | None] | None = None) -> None:
        self.cfg = cfg
        self.opts = opts
        self.claims = claims
        self.nvml: GPUBackend = nvml if nvml is not None else NVML()
        self.publisher = publisher
        if minor_of is None:
            minor_of = nvml_minor if isinstance(self.nvml, NVML) else (lambda _u: None)
        self.minor_of = minor_of
        self.settings = inv.settings_for(cfg, opts.node_name)
        self.checkpoint = Checkpoint(opts.checkpoint_dir, opts.node_name)
        self.status = Status()
        self._lock = threading.Lock()
        self._gpus: list[PhysicalGPU] = []
        self._devices: tuple[GPUDevice, ...] = ()
        self._health = HealthTracker((), opts.recovery_seconds)
        self._stop = threading.Event()
        self._publish_due = threading.Event()
        self._trash_due = threading.Event()  # claim directories moved aside: remove them (own thread)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Load the checkpoint, discover the GPUs, write the preload file, start the health and
        publish threads. Raises CheckpointError or NVMLError."""
        self.checkpoint.load()
        self.nvml.init()
        if self.publisher is not None and not isinstance(self.nvml, SimulatedGPUs):
            try:
                self.publisher.driver_version = self.nvml.driver_version()
            except NVMLError as e:
                log.warning("NVIDIA driver version unknown; not published", extra={"error": str(e)})
        self._discover()
        write_preload_file(self.opts.shim_host_path)
        os.makedirs(self.opts.cache_host_dir, exist_ok=True)
        for name, fn in (("health", self._health_loop), ("publish", self._publish_loop),
                         ("trash", self._trash_loop)):
            t = threading.Thread(target=fn, name=f"dra-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._publish_due.set()
        log.info("DRA plugin started", extra={"node": self.opts.node_name, "gpu": len(self._devices),
                                               "claims": len(self.checkpoint.claims)})

    def stop(self) -> None:
        """Stop the threads and shut NVML down (ResourceSlices are left for the next start to adopt;
        the Node's deletion removes them)."""
        self._stop.set()
        self._publish_due.set()
        self._trash_due.set()
        for t in self._threads:
            t.join(timeout=5)
        self.nvml.shutdown()

    def alive(self) -> bool:
        """True while every background thread runs."""
        return not self._stop.is_set() and all(t.is_alive() for t in self._threads)

    def ready(self) -> tuple[bool, str]:
        """(ready, reason) for /readyz: kubelet accepted the registration, the ResourceSlices were
        published (when a publisher is wired) and the shim is present."""
        unpublished = None
        if self.publisher is not None and not self.status.last_publish:
            unpublished = f"ResourceSlices not published: {self.status.last_publish_error or 'pending'}"
        return node_readiness(self.status.registered, self.status.registration_error, unpublished,
                              self.opts.shim_host_path)

    # ------------------------------------------------------------------ devices

    def _discover(self) -> None:
        _, keep = discover_gpus(self.nvml, self.settings, log, "GPU not usable, not published")
        for g in keep:
            self._health.add(g.uuid)
        for p in self.nvml.watch_events([g.uuid for g in keep]):
            log.warning("no NVML events for a GPU; it is still probed", extra={"problem": str(p)})
        self._gpus = keep
        self._rebuild()

    def _rebuild(self) -> None:
        self._devices = inv.to_devices(self._gpus, self.settings, self._health.snapshot())

    def devices(self) -> tuple[GPUDevice, ...]:
        """The node's GPUs as published (with health)."""
        return self._devices

    def _trash_loop(self) -> None:
        """Remove the claim directories Unprepare moved aside, on a thread of its own: a tenant's
        millions of files must not hold an Unprepare call (kubelet times it out) nor, through the
        server's threads, any other claim's Prepare or Unprepare. Also every resync period (a
        removal that failed is retried; what a previous run left is removed at start)."""
        run_trash_loop(self.opts.cache_host_dir, self._trash_due, self._stop, self.opts.resync_seconds)

    def _health_loop(self) -> None:
        run_health_loop(self.nvml, self._health, self._stop, poll_ms=self.opts.health_poll_ms,
                        probe_interval=self.opts.probe_interval, uuids=lambda: [g.uuid for g in self._gpus],
                        on_change=self._health_changed, logger=log)

    def _health_changed(self) -> None:
        self._rebuild()
        self._publish_due.set()

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            # also every resync period: slices someone deleted or edited are put back (one list when unchanged)
            self._publish_due.wait(self.opts.resync_seconds)
            if self._stop.is_set():
                return
            self._publish_due.clear()
            if self.publisher is None:
                continue
            try:
                gen = self.publisher.publish(self._devices)
                self.status.last_publish = time.time()
                self.status.last_publish_error = ""
                log.info("ResourceSlices published", extra={"gpu": len(self._devices), "generation": gen})
            except Exception as e:  # noqa: BLE001 - API errors: retry later
                self.status.last_publish_error = api_error_text(e)
                log.warning("publishing ResourceSlices failed; retrying", extra={"error": api_error_text(e)})
                if self._stop.wait(self.opts.publish_retry_seconds):
                    return
                self._publish_due.set()

    # ------------------------------------------------------------------ prepare / unprepare

    def prepare(self, req: dra_pb2.NodePrepareResourcesRequest) -> dra_pb2.NodePrepareResourcesResponse:
        """NodePrepareResources: one entry per claim of the request (keyed by claim uid), with its
        devices or its error. Never raises for one claim's trouble."""
        resp = dra_pb2.NodePrepareResourcesResponse()
        for c in req.claims:
            if c.uid in resp.claims:  # named twice in one call: answered once
                continue
            entry = resp.claims[c.uid]
            try:
                with self._lock:
                    prepared = self._prepare_one(c.namespace, c.uid, c.name)
            except Exception as e:  # noqa: BLE001 - PrepareError, ClaimError, OSError, NVMLError, ...: per claim
                self.status.prepared["error"] += 1
                if isinstance(e, PrepareError):
                    msg = str(e)
                else:  # ClaimError and ValueError name field and value; others need their type
                    detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                    msg = f"claim {c.namespace}/{c.name} ({c.uid}): {detail}"
                log.error("claim not prepared", extra={"claim": f"{c.namespace}/{c.name}", "uid": c.uid,
                                                       "error": msg})
                entry.error = msg
                continue
            self.status.prepared["ok"] += 1
            for d in prepared.devices:
                pd = entry.devices.add(request_names=list(d.requests), pool_name=d.pool, device_name=d.device,
                                       cdi_device_ids=list(d.cdi_ids))
                if d.share_id is not None:
                    pd.share_id = d.share_id
        return resp

    def unprepare(self, req: dra_pb2.NodeUnprepareResourcesRequest) -> dra_pb2.NodeUnprepareResourcesResponse:
        """NodeUnprepareResources: one entry per claim (keyed by claim uid); an unknown claim
        succeeds (its files, if any, are removed all the same)."""
        resp = dra_pb2.NodeUnprepareResourcesResponse()
        for c in req.claims:
            entry = resp.claims[c.uid]
            try:
                with self._lock:
                    self._unprepare_one(c.uid)
            except Exception as e:  # noqa: BLE001 - ValueError (uid), OSError: per claim
                self.status.unprepared["error"] += 1
                entry.error = f"claim {c.namespace}/{c.name} ({c.uid}): not unprepared: {e}"
                log.error("claim not unprepared", extra={"uid": c.uid, "error": entry.error})
                continue
            self.status.unprepared["ok"] += 1
        self._trash_due.set()  # the directories moved aside: removed on the trash thread, not in this call
        return resp

    def _prepare_one(self, namespace: str, uid: str, name: str) -> PreparedClaim:
        who = f"claim {namespace}/{name} ({uid})"
        key = alloc_dir_name(uid)  # refuses a uid unsafe in a path before anything else
        done = self.checkpoint.claims.get(uid)
        if done is not None and (done.namespace, done.name) != (namespace, name):
            raise PrepareError(f"{who}: this uid was prepared as {done.namespace}/{done.name}; refused")
        try:
            obj = self.claims.get_claim(namespace, name)
        except Exception as e:  # noqa: BLE001 - ApiException or a connection error
            if done is not None:  # prepared before (a restart): the checkpoint is the truth we have
                return self._again(done, key, f"the API server cannot be asked ({api_error_text(e)})")
            if is_not_found(e):
                raise PrepareError(f"{who}: not found in the API server") from None
            raise PrepareError(f"{who}: cannot be read from the API server: {api_error_text(e)}") from None
        got_uid = ObjectView(obj).uid
        if got_uid != uid:
            if done is not None:  # the prepared claim is being deleted; its pod may still be stopping
                return self._again(done, key, f"the API server now holds uid {got_uid!r} under this name")
            raise PrepareError(f"{who}: the API server's {namespace}/{name} has uid {got_uid!r}, not the uid "
                               f"kubelet named (deleted and recreated?); refused")
        fingerprint = allocation_fingerprint(obj)
        if done is not None:
            if done.allocation == fingerprint:
                return self._again(done, key, "")
            log.warning("claim allocated anew since it was prepared; preparing the new allocation",
                        extra={"claim": who})
        grants = read_claim(obj, default_cores=MAX_CORES)
        if not grants.reserved_for:
            raise PrepareError(f"{who}: status.reservedFor is empty (the claim is not reserved for any pod); refused")
        prepared = replace(self._plan(namespace, name, uid, grants.grants), allocation=fingerprint)
        try:
            self._write_files(prepared, key)
            self.checkpoint.put(prepared)
        except Exception:
            try:  # not prepared: leave nothing behind (kubelet retries the whole claim)
                self._remove_files(uid)
            except OSError as e:
                log.warning("cannot remove the files of a claim that failed to prepare",
                            extra={"uid": uid, "error": str(e)})
            raise
        log.info("claim prepared", extra={"claim": who, "gpu": ",".join(b.uuid for b in prepared.bookings),
                                          "memory_mib": ",".join(str(b.memory_mib) for b in prepared.bookings),
                                          "cores": ",".join(str(b.cores) for b in prepared.bookings)})
        return prepared

    def _again(self, done: PreparedClaim, key: str, why: str) -> PreparedClaim:
        """A repeat prepare of the same allocation: the files rewritten from the checkpoint, the same answer."""
        self._write_files(done, key)
        log.info("claim already prepared; files rewritten from the checkpoint",
                 extra={"claim": f"{done.namespace}/{done.name}", "uid": done.uid, "reason": why or None})
        return done

    def _plan(self, namespace: str, name: str, uid: str, grants: Sequence[Grant]) -> PreparedClaim:
        """Bookings per GPU (grants summed in status order), CDI devices and device nodes. Raises
        PrepareError naming the result that is not ours to serve."""
        who = f"claim {namespace}/{name} ({uid})"
        by_name = {device_name(d.index): d for d in self._devices}
        order: list[str] = []
        mem: dict[str, int] = {}
        cores: dict[str, int] = {}
        for i, g in enumerate(grants):
            if g.pool != self.opts.node_name:
                raise PrepareError(f"{who}: result {i} ({g.request}) is in pool {g.pool!r}, not this node's pool "
                                   f"{self.opts.node_name!r}; refused")
            dev = by_name.get(g.device)
            if dev is None:
                raise PrepareError(f"{who}: result {i} ({g.request}) names device {g.device!r}, which this node does "
                                   f"not publish (devices: {', '.join(sorted(by_name)) or 'none'}); refused")
            if g.device not in order:
                order.append(g.device)
            m = dev.memory_mib if g.whole else g.memory_mib
            c = min(MAX_CORES, dev.cores) if g.whole else g.cores
            assert m is not None
            mem[g.device] = mem.get(g.device, 0) + m
            cores[g.device] = cores.get(g.device, 0) + c
        if len(order) > MAX_GPUS_PER_CLAIM:
            raise PrepareError(f"{who}: {len(order)} GPUs; allowed: at most {MAX_GPUS_PER_CLAIM} per claim")
        bookings: list[DeviceBooking] = []
        nodes: list[tuple[str, tuple[tuple[str, str], ...]]] = []
        for d in order:
            dev = by_name[d]
            if mem[d] > dev.memory_mib:
                raise PrepareError(f"{who}: {mem[d]} MiB on {d}, more than its {dev.memory_mib} MiB; refused")
            if cores[d] > dev.cores:
                raise PrepareError(f"{who}: {cores[d]} cores on {d}, more than its {dev.cores}; refused")
            bookings.append(DeviceBooking(dev.uuid, mem[d], min(MAX_CORES, cores[d])))
            minor = self.minor_of(dev.uuid)
            nodes.append((d, tuple((n.path, n.host_path) for n in cdi.device_nodes(self.opts.dev_root, minor))))
        # kubelet matches a container's request by its base name: "<request>/<subrequest>" answers "<request>"
        devices = tuple(PreparedDevice((g.request.split("/", 1)[0],), g.pool, g.device,
                                       (cdi.device_id(uid, g.device),), g.share_id) for g in grants)
        return PreparedClaim(namespace, name, uid, devices, tuple(bookings), tuple(nodes))

    def _write_files(self, c: PreparedClaim, key: str) -> None:
        """The claim's allocation directory, limits file and CDI spec. Raises OSError or ValueError."""
        if not c.bookings:  # another driver's results only: nothing of ours to inject
            return
        root = self.opts.cache_host_dir
        cache, limits_dir = alloc_dirs(root, key)
        os.makedirs(cache, exist_ok=True)
        os.chmod(cache, 0o777)  # the container may run as any user
        mounts = alloc_mounts(key, shim_host_path=self.opts.shim_host_path, cache_host_dir=root)
        text = envcontract.limits_file(c.bookings, envcontract.CACHE_CONTAINER_PATH,
                                       core_policy=self.cfg.devices.core_policy,
                                       core_sharing=self.cfg.devices.core_sharing,
                                       graph_memory=self.cfg.devices.graph_memory_bound)
        limits = HostFile(os.path.join(limits_dir, envcontract.LIMITS_FILE_NAME), text)
        write_host_files(ContainerSpec(envs={}, mounts=(), files=(limits,)))
        envs = envcontract.container_env(c.bookings, envcontract.CACHE_CONTAINER_PATH)
        devs = [(d, [cdi.DeviceNode(p, h) for p, h in pairs]) for d, pairs in c.nodes]
        cdi.write_spec(self.opts.cdi_dir, c.uid, cdi.claim_spec(c.uid, envs, mounts, devs))

    def _unprepare_one(self, uid: str) -> None:
        removed = self._remove_files(uid)
        known = uid in self.checkpoint.claims
        self.checkpoint.drop(uid)
        log.info("claim unprepared" if known or removed else "unprepare of a claim never prepared here: nothing to do",
                 extra={"uid": uid})

    def _remove_files(self, uid: str) -> bool:
        """Remove the claim's CDI spec and directories (moved aside at once: their removal, which may take
        long for a tenant's millions of files, is left to the trash thread, outside the lock and the
        call); True when a spec was there. Raises OSError when something stays, ValueError for a uid
        unsafe in a path."""
        key = alloc_dir_name(uid)
        removed = cdi.remove_spec(self.opts.cdi_dir, uid)
        for path in alloc_dirs(self.opts.cache_host_dir, key):
            if os.path.islink(path):  # never ours: drop the link itself, never what it points to
                os.unlink(path)
            elif os.path.lexists(path):
                _discard_dir(path)
            if os.path.lexists(path):
                raise OSError(f"{path} could not be removed")
        return removed
