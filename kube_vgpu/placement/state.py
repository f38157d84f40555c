"""Incremental cluster state: per-GPU free memory (MiB), cores (percent) and vGPU slots per node.

Booking and releasing a pod update the affected node in O(GPUs) and bump its ``version`` so that
cached placement decisions for that node are recomputed, and only for that node.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..mig import TABLES, Instance, instance_cores, instance_memory_share, layout_error
from ..model import ContainerAllocation, DeviceBooking, GPUDevice, PodAllocation


class OvercommitError(ValueError):
    """Booking an allocation would exceed a GPU's memory, cores or slots, or the node is unknown."""


@dataclass(frozen=True, slots=True)
class Booking:
    """What one pod holds: node, its allocation record, host CPU (millicores) and memory (MiB),
    and the per-GPU-index usage ``{index: (MiB, cores, slots)}`` applied to the node."""

    pod: str
    node: str
    allocation: PodAllocation
    cpu_milli: int
    memory_mib: int
    usage: tuple[tuple[int, int, int, int], ...]  # (gpu index in node.devices, MiB, cores, slots)
    #: the dynamic-MIG instances it holds: (gpu index, profile, first memory slice), each once
    mig: tuple[tuple[int, str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Assumption:
    """A promise, not a booking: ``pod`` (key; ``uid``) passed filter/prioritize and is on its way to
    bind on ``node`` with ``usage`` (as :attr:`Booking.usage`). It holds that capacity until it is
    turned into a booking, released, or ``expires`` (the caller's clock, seconds)."""

    pod: str
    uid: str
    node: str
    usage: tuple[tuple[int, int, int, int], ...]
    expires: float
    mig: tuple[tuple[int, str, int], ...] = ()  #: as :attr:`Booking.mig`


class NodeState:
    """One node's devices and what is free on each (lists indexed by position in ``devices``).

    cpu_total / memory_total: host capacity in millicores / MiB (0 = not modelled: always fits).
    mig_used: per GPU, the dynamic-MIG instances booked or promised on it ((profile, first memory
    slice), one entry per holding pod; empty lists on other GPUs); has_mig: the node has a GPU in
    dynamic-MIG mode.
    """

    __slots__ = ("name", "idx", "devices", "free_mem", "free_cores", "free_slots", "cpu_total",
                 "cpu_free", "memory_total", "memory_free", "heartbeat", "version", "pods", "by_uuid",
                 "model", "devclass", "mig_used", "has_mig")

    def __init__(self, name: str, idx: int, devices: tuple[GPUDevice, ...], cpu_milli: int = 0,
                 memory_mib: int = 0, heartbeat: float = 0.0):
        self.name = name
        self.idx = idx
        self.devices = devices
        self.by_uuid = {d.uuid: i for i, d in enumerate(devices)}
        self.model = devices[0].model if devices else ""
        #: what placement sees of the devices (no uuids): nodes alike in this and in their free
        #: resources get the same decision, so the engine can share it
        self.devclass = tuple((d.model, d.memory_mib, d.cores, d.split, d.healthy, d.links, d.mig, d.mig_profiles)
                              for d in devices)
        self.mig_used: list[list[tuple[str, int]]] = [[] for _ in devices]
        self.has_mig = any(d.mig for d in devices)
        self.free_mem = [d.memory_mib for d in devices]
        self.free_cores = [d.cores for d in devices]
        self.free_slots = [d.split for d in devices]
        self.cpu_total = cpu_milli
        self.cpu_free = cpu_milli
        self.memory_total = memory_mib
        self.memory_free = memory_mib
        self.heartbeat = heartbeat
        self.version = 0
        self.pods: dict[str, Booking] = {}

    def signature(self) -> tuple[object, ...]:
        """Everything a placement decision on this node depends on, without names or uuids."""
        return (self.devclass, tuple(self.free_mem), tuple(self.free_cores), tuple(self.free_slots),
                self.cpu_total, self.cpu_free, self.memory_total, self.memory_free,
                tuple(tuple(sorted(u)) for u in self.mig_used) if self.has_mig else ())

    def gpu_milli_free(self, i: int) -> int:
        """Usable share of GPU ``i`` in milli-GPU (0..1000): the tighter of memory and cores; 0 when
        the GPU is unhealthy or has no free slot."""
        d = self.devices[i]
        if not d.healthy or self.free_slots[i] <= 0 or d.cores <= 0 or d.memory_mib <= 0:
            return 0
        return min(self.free_cores[i] * 1000 // d.cores, self.free_mem[i] * 1000 // d.memory_mib)

    def used_fraction(self) -> float:
        """HAMi's node usage score: used/total slots + used/total cores + used/total memory (0..3)."""
        ts = sum(d.split for d in self.devices)
        tc = sum(d.cores for d in self.devices)
        tm = sum(d.memory_mib for d in self.devices)
        if not ts or not tc or not tm:
            return 0.0
        return ((ts - sum(self.free_slots)) / ts + (tc - sum(self.free_cores)) / tc
                + (tm - sum(self.free_mem)) / tm)


class GpuTable:
    """Every node's GPUs as numpy arrays, for the vectorised fit (:mod:`kube_vgpu.placement.vector`).

    Row = node index (position in ``ClusterState.node_list``), column = GPU position on the node,
    padded to the node with the most GPUs (``present`` is False in the padding, where every other
    value is 0). Per GPU: ``free_mem`` (MiB), ``free_cores`` (percent), ``free_slots``,
    ``mem_total``, ``cores_total``, ``split``, ``healthy``, ``model`` (an id into ``model_names``)
    and ``uuids``; per node: ``n_gpus``, host ``cpu_total`` / ``cpu_free`` (millicores),
    ``host_mem_total`` / ``host_mem_free`` (MiB), and two values the node scores read, computed
    by NodeState itself: ``used_fraction`` (:meth:`NodeState.used_fraction`) and ``milli_free``
    (the sum of :meth:`NodeState.gpu_milli_free` over the node's GPUs). Arrays have spare rows: only the first ``n`` are
    nodes. :class:`ClusterState` keeps it in step with its NodeStates, in O(GPUs of the node)
    per booking, release or promise.
    """

    _GPU_INT = ("free_mem", "free_cores", "free_slots", "mem_total", "cores_total", "split", "model")
    _NODE_INT = ("n_gpus", "cpu_total", "cpu_free", "host_mem_total", "host_mem_free", "milli_free", "mig")

    def __init__(self) -> None:
        self.n = 0
        self.width = 0
        self.model_names: list[str] = [""]  # id 0: the padding
        self._model_ids: dict[str, int] = {"": 0}
        self._alloc(16, 1)

    def _alloc(self, rows: int, width: int) -> None:
        old = dict(vars(self)) if hasattr(self, "free_mem") else None
        for k in self._GPU_INT:
            setattr(self, k, np.zeros((rows, width), dtype=np.int64))
        self.present = np.zeros((rows, width), dtype=bool)
        self.healthy = np.zeros((rows, width), dtype=bool)
        self.uuids = np.full((rows, width), "", dtype=object)
        for k in self._NODE_INT:
            setattr(self, k, np.zeros(rows, dtype=np.int64))
        self.used_fraction = np.zeros(rows, dtype=np.float64)
        if old is not None:
            n, w = self.n, self.width
            for k in (*self._GPU_INT, "present", "healthy", "uuids"):
                getattr(self, k)[:n, :w] = old[k][:n, :w]
            for k in (*self._NODE_INT, "used_fraction"):
                getattr(self, k)[:n] = old[k][:n]
        self.width = width

    # The per-array attributes are set by _alloc; declared here for type checkers.
    free_mem: np.ndarray
    free_cores: np.ndarray
    free_slots: np.ndarray
    mem_total: np.ndarray
    cores_total: np.ndarray
    split: np.ndarray
    model: np.ndarray
    present: np.ndarray
    healthy: np.ndarray
    uuids: np.ndarray
    n_gpus: np.ndarray
    cpu_total: np.ndarray
    cpu_free: np.ndarray
    host_mem_total: np.ndarray
    host_mem_free: np.ndarray
    milli_free: np.ndarray
    #: per node: how many of its GPUs are in dynamic-MIG mode (the vectorised fit skips such nodes)
    mig: np.ndarray
    used_fraction: np.ndarray

    def _model_id(self, name: str) -> int:
        i = self._model_ids.get(name)
        if i is None:
            i = self._model_ids[name] = len(self.model_names)
            self.model_names.append(name)
        return i

    def write(self, r: int, node: NodeState) -> None:
        """Row ``r`` becomes ``node`` (devices, capacities and what is free); grows the arrays
        when ``r`` is the next row or the node has more GPUs than any before."""
        k = len(node.devices)
        if r >= len(self.n_gpus) or k > self.width:
            self._alloc(max(len(self.n_gpus), 2 * (r + 1)), max(self.width, k))
        if r >= self.n:
            self.n = r + 1
        for a in (*self._GPU_INT, "present", "healthy"):
            getattr(self, a)[r] = 0
        self.uuids[r] = ""
        devs = node.devices
        self.mem_total[r, :k] = [d.memory_mib for d in devs]
        self.cores_total[r, :k] = [d.cores for d in devs]
        self.split[r, :k] = [d.split for d in devs]
        self.healthy[r, :k] = [d.healthy for d in devs]
        self.model[r, :k] = [self._model_id(d.model) for d in devs]
        self.uuids[r, :k] = [d.uuid for d in devs]
        self.present[r, :k] = True
        self.n_gpus[r] = k
        self.mig[r] = sum(1 for d in devs if d.mig)
        self.cpu_total[r] = node.cpu_total
        self.host_mem_total[r] = node.memory_total
        self.sync_free(r, node)

    def sync_free(self, r: int, node: NodeState) -> None:
        """Copy what is free on ``node`` (per GPU and host) into row ``r``."""
        k = len(node.devices)
        if k:
            self.free_mem[r, :k] = node.free_mem
            self.free_cores[r, :k] = node.free_cores
            self.free_slots[r, :k] = node.free_slots
        self.cpu_free[r] = node.cpu_free
        self.host_mem_free[r] = node.memory_free
        self.used_fraction[r] = node.used_fraction()
        self.milli_free[r] = sum(node.gpu_milli_free(i) for i in range(k))

    def delete(self, r: int) -> None:
        """Remove row ``r``; the rows after it move up by one."""
        n = self.n
        for a in (*self._GPU_INT, "present", "healthy", "uuids", *self._NODE_INT, "used_fraction"):
            arr = getattr(self, a)
            arr[r:n - 1] = arr[r + 1:n]
            arr[n - 1] = "" if a == "uuids" else 0
        self.n = n - 1


def _models_host(node: NodeState) -> int:
    return 1 if node.cpu_total or node.memory_total else 0


class ClusterState:
    """All nodes and bookings. Not thread-safe: callers serialise (the extender runs it on one loop)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.node_list: list[NodeState] = []
        self.bookings: dict[str, Booking] = {}
        #: pod key -> its promise (:meth:`assume`), oldest first
        self.assumed: OrderedDict[str, Assumption] = OrderedDict()
        #: the most promises held at once (a full book drops the oldest)
        self.max_assumed = 10_000
        self.generation = 0  #: bumped when nodes are added or removed (caches are rebuilt)
        #: node.version per node index, so caches find changed nodes with one vector compare
        self.versions = np.zeros(0, dtype=np.int64)
        #: how many nodes model host CPU or memory (``cpu_total`` or ``memory_total`` > 0)
        self.host_nodes = 0
        #: the same nodes as numpy arrays, row = node index (the vectorised fit reads them)
        self.table = GpuTable()

    @property
    def models_host(self) -> bool:
        """Whether any node models host CPU or memory (the replay); when none does (the live
        extender), no fit or score reads a pod's CPU or memory request."""
        return self.host_nodes > 0

    # -- nodes ---------------------------------------------------------------------------------
    def set_node(self, name: str, devices: tuple[GPUDevice, ...], cpu_milli: int = 0, memory_mib: int = 0,
                 heartbeat: float = 0.0) -> NodeState:
        """Add a node or replace its inventory, keeping the bookings already on it (re-applied by
        GPU uuid; bookings on GPUs that vanished are kept in ``bookings`` but hold nothing)."""
        old = self.nodes.get(name)
        if old is not None and old.devices == devices and old.cpu_total == cpu_milli \
                and old.memory_total == memory_mib:
            old.heartbeat = heartbeat
            return old
        if old is not None:  # promises were made on the old inventory: they end with it
            for a in [a for a in self.assumed.values() if a.node == name]:
                self.forget_assumed(a.pod)
        idx = old.idx if old is not None else len(self.node_list)
        node = NodeState(name, idx, devices, cpu_milli, memory_mib, heartbeat)
        if old is None:
            self.node_list.append(node)
            self.versions = np.append(self.versions, 0)
            self.generation += 1
            self.table.write(idx, node)
        else:
            self.node_list[idx] = node
            node.version = old.version + 1
            self.table.write(idx, node)
            for b in list(old.pods.values()):
                rebased = self._usage_for(node, b.allocation)
                b2 = Booking(b.pod, name, b.allocation, b.cpu_milli, b.memory_mib, rebased,
                             self.mig_of(node, b.allocation))
                self._apply(node, b2, +1)
                node.pods[b.pod] = b2
                self.bookings[b.pod] = b2
        self.nodes[name] = node
        self.versions[idx] = node.version
        self.host_nodes += _models_host(node) - (_models_host(old) if old is not None else 0)
        return node

    def remove_node(self, name: str) -> None:
        """Forget a node and every booking on it."""
        for a in [a for a in self.assumed.values() if a.node == name]:
            self.forget_assumed(a.pod)
        node = self.nodes.pop(name, None)
        if node is None:
            return
        for pod in list(node.pods):
            self.bookings.pop(pod, None)
        self.host_nodes -= _models_host(node)
        self.node_list.pop(node.idx)
        self.table.delete(node.idx)
        self.versions = np.delete(self.versions, node.idx)
        for i, n in enumerate(self.node_list):
            n.idx = i
        self.generation += 1

    # -- bookings ------------------------------------------------------------------------------
    @staticmethod
    def _accounted(node: NodeState, alloc: PodAllocation) -> PodAllocation:
        """``alloc`` as the node's per-GPU accounting counts it: a dynamic-MIG instance takes its
        share of the GPU (:func:`kube_vgpu.mig.instance_memory_share`, :func:`instance_cores`),
        not the profile's own MiB (whose sum over a layout can exceed the card)."""
        if not node.has_mig:
            return alloc
        conts = []
        for c in alloc.containers:
            devs = []
            for d in c.devices:
                i = node.by_uuid.get(d.uuid)
                dev = node.devices[i] if i is not None else None
                if d.profile and dev is not None and dev.mig:
                    p = next((p for p in TABLES[dev.mig].profiles if p.name == d.profile), None)
                    if p is not None:
                        d = DeviceBooking(d.uuid, instance_memory_share(p, dev.memory_mib),
                                          instance_cores(p, dev.cores), d.profile, d.start)
                devs.append(d)
            conts.append(ContainerAllocation(c.name, c.init, tuple(devs)))
        return PodAllocation(alloc.node, tuple(conts), alloc.time)

    @staticmethod
    def mig_of(node: NodeState, alloc: PodAllocation) -> tuple[tuple[int, str, int], ...]:
        """The dynamic-MIG instances ``alloc`` holds on ``node``: (GPU index, profile, first memory
        slice), each once (an init and an app container of one pod may use one instance in turn)."""
        if not node.has_mig:
            return ()
        out: set[tuple[int, str, int]] = set()
        for c in alloc.containers:
            for d in c.devices:
                i = node.by_uuid.get(d.uuid)
                if d.profile and i is not None and node.devices[i].mig:
                    out.add((i, d.profile, d.start))
        return tuple(sorted(out))

    @staticmethod
    def mig_error(node: NodeState, mig: tuple[tuple[int, str, int], ...]) -> str | None:
        """Why the instances ``mig`` cannot join what ``node``'s GPUs hold (an unknown profile, a bad
        start, a slice already taken, too many of a profile), or None."""
        for i in sorted({i for i, _, _ in mig}):
            d = node.devices[i]
            held = [Instance(p, s) for p, s in node.mig_used[i]]
            new = [Instance(p, s) for j, p, s in mig if j == i]
            bad = layout_error(TABLES[d.mig], held + new)
            if bad is not None:
                return f"GPU {d.uuid} on {node.name}: {bad}"
        return None

    @classmethod
    def usage_for(cls, node: NodeState, alloc: PodAllocation) -> tuple[tuple[int, int, int, int], ...]:
        """Per GPU index of ``node``: (MiB, cores, slots) ``alloc`` holds there, init containers
        collapsed (:meth:`PodAllocation.usage`), dynamic-MIG instances as their share of the GPU;
        GPUs not on the node are left out."""
        return cls._usage_for(node, alloc)

    @classmethod
    def _usage_for(cls, node: NodeState, alloc: PodAllocation) -> tuple[tuple[int, int, int, int], ...]:
        out = []
        for uuid, (mem, cores, slots) in sorted(cls._accounted(node, alloc).usage().items()):
            i = node.by_uuid.get(uuid)
            if i is not None:
                out.append((i, mem, cores, slots))
        return tuple(out)

    def _apply(self, node: NodeState, b: Booking | Assumption, sign: int) -> None:
        for i, mem, cores, slots in b.usage:
            node.free_mem[i] -= sign * mem
            node.free_cores[i] -= sign * cores
            node.free_slots[i] -= sign * slots
        for i, profile, start in b.mig:
            if sign > 0:
                node.mig_used[i].append((profile, start))
            else:
                node.mig_used[i].remove((profile, start))
        if isinstance(b, Booking):
            node.cpu_free -= sign * b.cpu_milli
            node.memory_free -= sign * b.memory_mib
        node.version += 1
        if node.idx < len(self.versions) and self.node_list[node.idx] is node:
            self.versions[node.idx] = node.version
            self.table.sync_free(node.idx, node)

    def book(self, pod: str, alloc: PodAllocation, cpu_milli: int = 0, memory_mib: int = 0,
             check: bool = True) -> Booking:
        """Record ``pod``'s allocation on ``alloc.node``, atomically.

        check: refuse (OvercommitError) if any GPU would go below zero memory, cores or slots.
        Restart recovery passes check=False so that a record the cluster already runs is never lost.
        The pod's own promise (:meth:`assume`) ends first: the booking replaces it.
        Raises: OvercommitError (nothing changed but the promise), also if the pod is already booked.
        """
        self.forget_assumed(pod)
        if pod in self.bookings:
            raise OvercommitError(f"pod {pod} is already booked on {self.bookings[pod].node}")
        node = self.nodes.get(alloc.node)
        if node is None:
            raise OvercommitError(f"node {alloc.node} is unknown")
        usage = self._usage_for(node, alloc)
        mig = self.mig_of(node, alloc)
        if check:
            bad = self.mig_error(node, mig)
            if bad is not None:
                raise OvercommitError(bad)
            for i, mem, cores, slots in usage:
                d = node.devices[i]
                if mem > node.free_mem[i] or cores > node.free_cores[i] or slots > node.free_slots[i]:
                    raise OvercommitError(
                        f"GPU {d.uuid} on {node.name}: needs {mem} MiB/{cores}% /{slots} slot(s), "
                        f"free {node.free_mem[i]} MiB/{node.free_cores[i]}%/{node.free_slots[i]} slot(s)")
        b = Booking(pod, node.name, alloc, cpu_milli, memory_mib, usage, mig)
        self._apply(node, b, +1)
        node.pods[pod] = b
        self.bookings[pod] = b
        return b

    def release(self, pod: str) -> Booking | None:
        """Free everything ``pod`` holds (its promise included); returns its booking, or None if it
        held none."""
        self.forget_assumed(pod)
        b = self.bookings.pop(pod, None)
        if b is None:
            return None
        node = self.nodes.get(b.node)
        if node is not None and node.pods.pop(pod, None) is not None:
            self._apply(node, b, -1)
        return b

    # -- promises ("assume") --------------------------------------------------------------------
    def assume(self, pod: str, uid: str, node: str, usage: tuple[tuple[int, int, int, int], ...],
               expires: float, mig: tuple[tuple[int, str, int], ...] = ()) -> Assumption | None:
        """Promise ``usage`` (per GPU index: MiB, cores, slots) on ``node`` to ``pod`` until
        ``expires``, like kube-scheduler's assumed pods: every later fit sees it as taken. A newer
        promise to the same pod replaces the old one. Refused (None, nothing changed) when the pod
        holds a booking, the node is unknown or the usage no longer fits (never overcommits).
        Holding :attr:`max_assumed` promises, the oldest is dropped. ``mig``: the dynamic-MIG
        instances promised (:attr:`Booking.mig`), refused too when they no longer fit the GPU's
        geometry."""
        self.forget_assumed(pod)
        n = self.nodes.get(node)
        if n is None or pod in self.bookings:
            return None
        for i, mem, cores, slots in usage:
            if not (0 <= i < len(n.devices)) or mem > n.free_mem[i] or cores > n.free_cores[i] \
                    or slots > n.free_slots[i]:
                return None
        if any(not (0 <= i < len(n.devices)) or not n.devices[i].mig for i, _, _ in mig) \
                or self.mig_error(n, mig) is not None:
            return None
        while len(self.assumed) >= self.max_assumed:
            self.forget_assumed(next(iter(self.assumed)))
        a = Assumption(pod, uid, node, usage, expires, mig)
        self._apply(n, a, +1)
        self.assumed[pod] = a
        return a

    def forget_assumed(self, pod: str) -> Assumption | None:
        """End ``pod``'s promise (its capacity is free again); returns it, or None if it had none."""
        a = self.assumed.pop(pod, None)
        if a is not None:
            n = self.nodes.get(a.node)
            if n is not None:
                self._apply(n, a, -1)
        return a

    def expire_assumed(self, now: float) -> int:
        """End every promise whose ``expires`` is at or before ``now``; returns how many. Cheap when
        none is due (promises are kept oldest first; a caller uses one TTL, so the first one
        that is not due ends the scan, and a later-added shorter one waits at most for those)."""
        n = 0
        while self.assumed:
            a = next(iter(self.assumed.values()))
            if a.expires > now:
                break
            self.forget_assumed(a.pod)
            n += 1
        return n
