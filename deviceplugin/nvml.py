"""GPU discovery, health and usage through NVML (``pynvml`` from nvidia-ml-py).

pynvml loads ``libnvidia-ml.so.1`` with ``ctypes.CDLL`` on ``nvmlInit``; on a node that is the
driver's library (mounted into the device plugin's pod by the NVIDIA container toolkit), in tests a
fake built from ``tests/fakes/fakenvml.c``.

Health rules (:class:`HealthTracker`, pure and clock-injected so it is testable):

* an NVML event of type XID-critical or double-bit ECC marks the GPU unhealthy, except the
  application-caused XIDs in :data:`IGNORED_XIDS` (the same list the NVIDIA/HAMi device plugins use);
* a failed NVML query on the GPU (e.g. ``NVML_ERROR_GPU_IS_LOST``) marks it unhealthy;
* it is healthy again once queries succeed and no critical event arrived for ``recovery_seconds``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

log = logging.getLogger("kube_vgpu.deviceplugin.nvml")

#: XIDs caused by applications (illegal address, page fault in a kernel, ...), not by the GPU
IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: NVML event types that are watched: XID critical error (0x8) and double-bit ECC (0x2)
WATCHED_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError

NVMLError = pynvml.NVMLError


@dataclass(frozen=True, slots=True)
class PhysicalGPU:
    """One GPU as NVML reports it. memory_mib: total device memory (MiB, unscaled); numa: NUMA node
    (0 when NVML cannot tell); mig: MIG mode currently enabled."""

    uuid: str
    index: int
    model: str
    memory_mib: int
    numa: int
    mig: bool


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device (a compute instance) as NVML reports it: its ``MIG-...`` uuid, the parent GPU's
    uuid and NVML index, the GPU instance's profile name (``1g.18gb``), memory (MiB), GPU and compute
    instance ids, the first memory slice of the GPU instance, and the processes running on it."""

    uuid: str
    parent: str
    parent_index: int
    profile: str
    memory_mib: int
    gi: int
    ci: int
    start: int
    processes: int


@dataclass(frozen=True, slots=True)
class GPUUsage:
    """Live usage of one GPU: used_mib (MiB), util_percent (0-100, GPU busy over NVML's window)."""

    used_mib: int
    util_percent: int


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _addr(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class GPUBackend(Protocol):
    """What the device plugin asks of the GPUs: :class:`NVML` (the driver) or
    :class:`deviceplugin.simgpu.SimulatedGPUs` (a GPU-less trial)."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def discover(self) -> tuple[list[PhysicalGPU], list[str]]: ...
    def probe(self, uuid: str) -> str | None: ...
    def usage(self, uuid: str) -> GPUUsage | None: ...
    def watch_events(self, uuids: Iterable[str]) -> list[str]: ...
    def wait_event(self, timeout_ms: int) -> tuple[str, int, int] | None: ...
    def topology(self, uuids: list[str]) -> list[list[int]]: ...


class NVML:
    """A thin, thread-safe wrapper over pynvml for what the device plugin needs.

    Every method may raise ``pynvml.NVMLError`` (e.g. library not found, GPU lost) unless stated.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._handles: dict[str, Any] = {}
        self._events: Any = None
        self._inited = False

    def init(self) -> None:
        """``nvmlInit``; raises NVMLError (``NVML_ERROR_LIBRARY_NOT_FOUND`` without a driver)."""
        with self._lock:
            if not self._inited:
                pynvml.nvmlInit()
                self._inited = True

    def shutdown(self) -> None:
        """Free the event set and ``nvmlShutdown``; never raises."""
        with self._lock:
            if not self._inited:
                return
            try:
                if self._events is not None:
                    pynvml.nvmlEventSetFree(self._events)
                pynvml.nvmlShutdown()
            except NVMLError as e:
                log.warning("NVML shutdown failed", extra={"error": str(e)})
            self._events = None
            self._inited = False

    def driver_version(self) -> str:
        return _str(pynvml.nvmlSystemGetDriverVersion())

    def discover(self) -> tuple[list[PhysicalGPU], list[str]]:
        """All GPUs NVML lists. Returns (gpus in NVML index order, problems: one line per GPU that
        could not be read, e.g. ``"index 2: GPU is lost"``). MIG-enabled GPUs are included with
        ``mig=True``; the caller decides what to do with them."""
        gpus: list[PhysicalGPU] = []
        problems: list[str] = []
        with self._lock:
            n = pynvml.nvmlDeviceGetCount()
            for i in range(n):
                try:
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = _str(pynvml.nvmlDeviceGetUUID(h))
                    name = _str(pynvml.nvmlDeviceGetName(h))
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                except NVMLError as e:
                    problems.append(f"index {i}: {e}")
                    continue
                numa = 0
                try:
                    numa = int(pynvml.nvmlDeviceGetNumaNodeId(h))
                except (NVMLError, AttributeError):
                    pass
                mig = False
                try:
                    mig = bool(pynvml.nvmlDeviceGetMigMode(h)[0])
                except NVMLError:
                    pass
                self._handles[uuid] = h
                gpus.append(PhysicalGPU(uuid=uuid, index=i, model=name, memory_mib=int(mem.total) // (1024 * 1024),
                                        numa=max(0, numa), mig=mig))
        return gpus, problems

    # ------------------------------------------------------------------ MIG (docs/mig.md)

    def _mig_parent(self, parent: str) -> tuple[Any, int]:
        h = self._handles.get(parent)
        if h is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return h, int(pynvml.nvmlDeviceGetIndex(h))

    def _gi_profiles(self, h: Any) -> dict[int, tuple[int, str]]:
        """profile id -> (NVML profile index, name without "MIG ") of the GPU's GPU-instance profiles."""
        out: dict[int, tuple[int, str]] = {}
        for idx in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            except NVMLError:
                continue
            out[int(info.id)] = (idx, _str(info.name).removeprefix("MIG "))
        return out

    def mig_devices(self, parent: str) -> list[MigDevice]:
        """The MIG devices of GPU ``parent`` (a uuid :meth:`discover` returned), in NVML's order; []
        when it has none. Raises NVMLError (e.g. the GPU is not in MIG mode: ``Not Supported``)."""
        with self._lock:
            h, index = self._mig_parent(parent)
            names = self._gi_profiles(h)
            out: list[MigDevice] = []
            for i in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(h))):
                try:
                    m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                except NVMLError as e:
                    if e.value == pynvml.NVML_ERROR_NOT_FOUND:
                        continue
                    raise
                gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(m))
                info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(h, gi_id))
                out.append(MigDevice(
                    uuid=_str(pynvml.nvmlDeviceGetUUID(m)), parent=parent, parent_index=index,
                    profile=names.get(int(info.profileId), (0, f"profile-{int(info.profileId)}"))[1],
                    memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(m).total) // (1024 * 1024), gi=gi_id,
                    ci=int(pynvml.nvmlDeviceGetComputeInstanceId(m)), start=int(info.placement.start),
                    processes=len(pynvml.nvmlDeviceGetComputeRunningProcesses(m))))
            return out

    def mig_create(self, parent: str, profile: str, start: int) -> MigDevice:
        """Create a GPU instance of ``profile`` at memory slice ``start`` on GPU ``parent`` and one
        compute instance spanning it; returns the new MIG device. A failed compute instance destroys
        the GPU instance again. Raises NVMLError (``Insufficient resources`` when the placement is
        taken, ``Invalid Argument`` for a start the profile does not allow) or KeyError (no such
        profile on this GPU)."""
        with self._lock:
            h, _ = self._mig_parent(parent)
            by_name = {name: (idx, pid) for pid, (idx, name) in self._gi_profiles(h).items()}
            if profile not in by_name:
                raise KeyError(f"MIG profile {profile!r} is not offered by GPU {parent}; "
                               f"it offers {', '.join(sorted(by_name))}")
            idx, pid = by_name[profile]
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, idx)
            pl = pynvml.c_nvmlGpuInstancePlacement_t()
            pl.start = start
            cnt = ctypes.c_uint(0)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, ctypes.byref(cnt))
            sizes = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, cnt.value))()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, sizes, ctypes.byref(cnt))
            pl.size = next((p.size for p in sizes[: cnt.value] if p.start == start), 0)
            gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, ctypes.byref(pl))
            try:
                ci_idx = next(k for k in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
                              if _ci_slices(gi, k) == int(info.sliceCount))
                pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_idx)
            except (NVMLError, StopIteration):
                pynvml.nvmlGpuInstanceDestroy(gi)
                raise
            gi_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).id)
        return next(m for m in self.mig_devices(parent) if m.gi == gi_id)

    def mig_destroy(self, parent: str, uuid: str) -> None:
        """Destroy MIG device ``uuid`` of GPU ``parent``: its compute instance, then its GPU instance
        once it holds no other. Raises NVMLError (``In use`` while a process runs on it) or KeyError
        (no such MIG device)."""
        with self._lock:
            h, _ = self._mig_parent(parent)
            dev = next((m for m in self.mig_devices(parent) if m.uuid == uuid), None)
            if dev is None:
                raise KeyError(f"GPU {parent} has no MIG device {uuid}")
            gi = pynvml.nvmlDeviceGetGpuInstanceById(h, dev.gi)
            for k in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    cis = (pynvml.c_nvmlComputeInstance_t * 8)()
                    n = ctypes.c_uint(8)
                    pynvml.nvmlGpuInstanceGetComputeInstances(gi, k, cis, ctypes.byref(n))
                except NVMLError:
                    continue
                for ci in cis[: n.value]:
                    if int(pynvml.nvmlComputeInstanceGetInfo(ci).id) == dev.ci:
                        pynvml.nvmlComputeInstanceDestroy(ci)
            if not any(m.gi == dev.gi for m in self.mig_devices(parent)):
                pynvml.nvmlGpuInstanceDestroy(gi)

    def probe(self, uuid: str) -> str | None:
        """Query the GPU once (memory info). Returns None when fine, else the NVML error text."""
        with self._lock:
            h = self._handles.get(uuid)
            if h is None:
                return "unknown to NVML"
            try:
                pynvml.nvmlDeviceGetMemoryInfo(h)
            except NVMLError as e:
                return str(e)
        return None

    def topology(self, uuids: list[str]) -> list[list[int]]:
        """Interconnect rank between every two of ``uuids`` (:func:`kube_vgpu.topology.rank_of`, by
        position), from NVML's common ancestor and NVLink links; [] when NVML cannot tell (a query
        that fails makes that pair :data:`~kube_vgpu.topology.UNKNOWN`). Never raises."""
        from kube_vgpu.topology import UNKNOWN, rank_of

        n = len(uuids)
        if n < 2:
            return []
        with self._lock:
            handles = [self._handles.get(u) for u in uuids]
            if any(h is None for h in handles):
                return []
            bus = []
            for h in handles:
                try:
                    bus.append(_str(pynvml.nvmlDeviceGetPciInfo(h).busId).lower())
                except NVMLError:
                    bus.append("")
            nvlinks = [[0] * n for _ in range(n)]
            for i, h in enumerate(handles):
                for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                    try:
                        if not pynvml.nvmlDeviceGetNvLinkState(h, link):
                            continue
                        peer = _str(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
                    except NVMLError:
                        break  # no (more) NVLink on this GPU
                    if peer in bus:
                        nvlinks[i][bus.index(peer)] += 1
            out = [[UNKNOWN] * n for _ in range(n)]
            for i in range(n):
                for j in range(n):
                    if i == j:
                        continue
                    try:
                        level: int | None = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
                    except NVMLError:
                        level = None
                    out[i][j] = rank_of(level, max(nvlinks[i][j], nvlinks[j][i]))
        return out if any(any(r) for r in out) else []

    def usage(self, uuid: str) -> GPUUsage | None:
        """Used memory and utilisation, or None when NVML cannot tell."""
        with self._lock:
            h = self._handles.get(uuid)
            if h is None:
                return None
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                util = pynvml.nvmlDeviceGetUtilizationRates(h)
            except NVMLError:
                return None
        return GPUUsage(used_mib=int(mem.used) // (1024 * 1024), util_percent=int(util.gpu))

    def watch_events(self, uuids: Iterable[str]) -> list[str]:
        """Create the event set and register :data:`WATCHED_EVENTS` for each GPU. Returns problems
        (one line per GPU whose registration failed; those GPUs are only probed)."""
        problems = []
        with self._lock:
            if self._events is None:
                self._events = pynvml.nvmlEventSetCreate()
            for uuid in uuids:
                h = self._handles.get(uuid)
                if h is None:
                    continue
                try:
                    supported = pynvml.nvmlDeviceGetSupportedEventTypes(h)
                    pynvml.nvmlDeviceRegisterEvents(h, WATCHED_EVENTS & supported, self._events)
                except NVMLError as e:
                    problems.append(f"{uuid}: event registration failed: {e}")
        return problems

    def wait_event(self, timeout_ms: int) -> tuple[str, int, int] | None:
        """Wait up to ``timeout_ms`` for one event. Returns (uuid, event type, xid) or None on timeout.
        Not under the lock (NVML's wait is thread-safe and may block)."""
        ev = self._events
        if ev is None:
            time.sleep(timeout_ms / 1000)
            return None
        try:
            data = pynvml.nvmlEventSetWait_v2(ev, timeout_ms)
        except NVMLError as e:
            if e.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise
        addr = _addr(data.device)
        with self._lock:
            for uuid, h in self._handles.items():
                if addr is not None and _addr(h) == addr:
                    return uuid, int(data.eventType), int(data.eventData)
        try:
            return _str(pynvml.nvmlDeviceGetUUID(data.device)), int(data.eventType), int(data.eventData)
        except NVMLError:
            return None


def _ci_slices(gi: Any, profile: int) -> int:
    """Compute slices of compute-instance profile ``profile`` in GPU instance ``gi`` (0: not offered)."""
    try:
        return int(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, profile, 0).sliceCount)
    except NVMLError:
        return 0


class HealthTracker:
    """Per-GPU health from events and probes (no I/O; ``now`` is injected).

    ``on_event`` / ``on_probe`` return True when the GPU's health flipped. ``reason(uuid)`` says why a
    GPU is unhealthy.
    """

    def __init__(self, uuids: Iterable[str], recovery_seconds: float = 60.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.recovery_seconds = recovery_seconds
        self._now = now
        self._healthy = {u: True for u in uuids}
        self._last_event: dict[str, float] = {}
        self._reason: dict[str, str] = {}

    def add(self, uuid: str) -> None:
        self._healthy.setdefault(uuid, True)

    def healthy(self, uuid: str) -> bool:
        return self._healthy.get(uuid, False)

    def reason(self, uuid: str) -> str:
        return self._reason.get(uuid, "")

    def snapshot(self) -> dict[str, bool]:
        return dict(self._healthy)

    def _set(self, uuid: str, ok: bool, why: str) -> bool:
        was = self._healthy.get(uuid)
        self._healthy[uuid] = ok
        if ok:
            self._reason.pop(uuid, None)
        else:
            self._reason[uuid] = why
        return was != ok

    def on_event(self, uuid: str, event_type: int, xid: int) -> bool:
        """An NVML event arrived. Application XIDs are ignored."""
        if uuid not in self._healthy:
            return False
        if event_type == pynvml.nvmlEventTypeXidCriticalError and xid in IGNORED_XIDS:
            return False
        self._last_event[uuid] = self._now()
        what = f"XID {xid}" if event_type == pynvml.nvmlEventTypeXidCriticalError else f"event 0x{event_type:x}"
        return self._set(uuid, False, what)

    def on_probe(self, uuid: str, error: str | None) -> bool:
        """A probe finished: error is None when the query succeeded."""
        if uuid not in self._healthy:
            return False
        if error is not None:
            return self._set(uuid, False, f"NVML query failed: {error}")
        last = self._last_event.get(uuid)
        if last is not None and self._now() - last < self.recovery_seconds:
            return False
        return self._set(uuid, True, "")
