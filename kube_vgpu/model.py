"""Domain dataclasses: GPUs, nodes, per-container requests, constraints and allocations.

Units: memory in MiB, compute ("cores") in percent of one GPU (100 = the whole card), time in
unix seconds. A container's ``count`` is the number of *physical* GPUs it gets (HAMi semantics:
``nvidia.com/gpu`` counts GPUs, not vGPU slots).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GPUDevice:
    """One physical GPU as advertised in a node's inventory.

    uuid: NVML UUID (``GPU-...``); index: NVML index on the node; model: NVML name
    (e.g. ``NVIDIA H200``); memory_mib: schedulable memory (NVML total x memory scaling);
    cores: schedulable compute in percent (100 x core scaling); split: vGPU slots (max containers
    sharing it); healthy: False when NVML reports an XID/failure; numa: NUMA node (0 if unknown);
    links: interconnect rank to each GPU of the node, by position in the inventory
    (:mod:`kube_vgpu.topology`; empty when not published).
    mig: for a GPU in dynamic-MIG mode (``migStrategy: dynamic``), its MIG profile table
    (a :data:`kube_vgpu.mig.TABLES` key, e.g. ``H200-141GB``); empty for any other GPU.
    mig_profiles: the profiles a dynamic-MIG GPU may serve requests with (the admin's
    ``devices.migProfiles``; empty = every profile without media extensions).
    """

    uuid: str
    index: int
    model: str
    memory_mib: int
    cores: int = 100
    split: int = 10
    healthy: bool = True
    numa: int = 0
    links: tuple[int, ...] = ()
    mig: str = ""
    mig_profiles: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """A node's GPUs as the device plugin publishes them (annotation ``kube-vgpu.io/node-inventory``).

    heartbeat: unix seconds of the last write; the scheduler ignores stale inventories.
    """

    devices: tuple[GPUDevice, ...]
    heartbeat: float = 0.0


class UuidList(tuple[str, ...]):
    """A uuid list from a tenant's annotation (``use-gpuuuid`` / ``nouse-gpuuuid``) whose ``in`` is one
    set lookup. A tuple in every other way (order, equality and hash with a plain tuple), so the fit
    asks ``uuid in listed`` per GPU at the same cost whatever the list's length (up to
    :data:`kube_vgpu.podspec.MAX_SELECTOR_ITEMS`; a list is tenant-written)."""

    _set: frozenset[str]

    def __new__(cls, items: Iterable[str] = ()) -> UuidList:
        self = super().__new__(cls, items)
        self._set = frozenset(self)
        return self

    def __contains__(self, item: object) -> bool:
        try:
            return item in self._set
        except TypeError:  # an unhashable probe: no uuid
            return False


@dataclass(frozen=True, slots=True)
class Constraints:
    """GPU selection constraints from pod annotations (HAMi keys).

    use_types / nouse_types: case-insensitive substrings of the GPU model (any / none must match).
    use_uuids / nouse_uuids: exact UUID allow / deny lists (kept as :class:`UuidList`: a membership
    test is one set lookup).
    min_link: the interconnect rank every pair of a multi-GPU container's GPUs must reach
    (:data:`kube_vgpu.topology.LINK_CLASSES`; 0: no requirement). Not a per-GPU rule: the fit
    applies it to the set (:mod:`kube_vgpu.placement.fit`).
    """

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: tuple[str, ...] = ()
    nouse_uuids: tuple[str, ...] = ()
    min_link: int = 0

    def __post_init__(self) -> None:
        for name in ("use_uuids", "nouse_uuids"):
            listed = getattr(self, name)
            if listed and not isinstance(listed, UuidList):
                object.__setattr__(self, name, UuidList(listed))

    def allows(self, dev: GPUDevice) -> bool:
        """True if ``dev`` satisfies every constraint."""
        model = dev.model.upper()
        if self.use_types and not any(t.upper() in model for t in self.use_types):
            return False
        if any(t.upper() in model for t in self.nouse_types):
            return False
        if self.use_uuids and dev.uuid not in self.use_uuids:
            return False
        return dev.uuid not in self.nouse_uuids

    def why_not(self, dev: GPUDevice) -> str | None:
        """A short reason ``dev`` is excluded, or None if allowed."""
        model = dev.model.upper()
        if self.use_types and not any(t.upper() in model for t in self.use_types):
            return f"model {dev.model} not in use-gputype {','.join(self.use_types)}"
        if any(t.upper() in model for t in self.nouse_types):
            return f"model {dev.model} excluded by nouse-gputype"
        if self.use_uuids and dev.uuid not in self.use_uuids:
            return "uuid not in use-gpuuuid"
        if dev.uuid in self.nouse_uuids:
            return "uuid excluded by nouse-gpuuuid"
        return None

    @property
    def empty(self) -> bool:
        """True when no per-GPU selector is set (``min_link`` is a rule on the set, not per GPU)."""
        return not (self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids)


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's vGPU request after defaulting.

    name: container name; init: True for an init container; count: physical GPUs (>= 1);
    memory_mib: MiB per GPU (0 when given as a percentage); memory_percent: percent of each GPU's
    memory (0 when given in MiB); cores: percent of each GPU's compute (0-100; 0 = no reservation);
    priority: ``nvidia.com/priority`` or None.
    """

    name: str
    init: bool
    count: int
    memory_mib: int = 0
    memory_percent: int = 0
    cores: int = 0
    priority: int | None = None

    def memory_on(self, dev: GPUDevice) -> int:
        """MiB this request books on ``dev`` (percentages rounded down, at least 1 MiB)."""
        if self.memory_mib:
            return self.memory_mib
        return max(1, dev.memory_mib * self.memory_percent // 100)

    def cores_on(self, dev: GPUDevice) -> int:
        """Percent of compute booked on ``dev`` (scaled to the device's core capacity)."""
        return dev.cores if self.cores >= 100 else self.cores

    @property
    def exclusive(self) -> bool:
        """True when the request takes whole cards (cores 100 or memory 100%)."""
        return self.cores >= 100 or self.memory_percent >= 100


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod's vGPU request: init and app containers kept apart (init run one at a time).

    cpu_milli / memory_mib: the pod's host CPU (millicores) and host memory (MiB) requests, used by
    the replay's node fit (0 when unknown).
    node_policy / gpu_policy: per-pod overrides from annotations, or None.
    """

    namespace: str
    name: str
    uid: str = ""
    init: tuple[ContainerRequest, ...] = ()
    app: tuple[ContainerRequest, ...] = ()
    constraints: Constraints = field(default_factory=Constraints)
    cpu_milli: int = 0
    memory_mib: int = 0
    node_policy: str | None = None
    gpu_policy: str | None = None
    gpu_spec: tuple[str, ...] = ()  # exact GPU model allow-list (trace gpu_spec); empty = any

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    @property
    def has_gpu(self) -> bool:
        return bool(self.init or self.app)

    @property
    def containers(self) -> tuple[ContainerRequest, ...]:
        """Init containers first, then app containers."""
        return self.init + self.app


@dataclass(frozen=True, slots=True)
class DeviceBooking:
    """What one container holds on one GPU: memory in MiB, cores in percent.

    On a dynamic-MIG GPU (:attr:`GPUDevice.mig`) the container holds one MIG instance:
    ``profile`` (e.g. ``1g.18gb``) at first memory slice ``start``; ``memory_mib`` is then the
    profile's memory (what the container gets) and ``cores`` the whole instance's compute as
    percent of the GPU (:func:`kube_vgpu.mig.instance_cores`). ``profile`` is empty for any other
    booking.
    """

    uuid: str
    memory_mib: int
    cores: int
    profile: str = ""
    start: int = 0


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """The GPUs booked for one container, in the order they become visible devices 0..n-1."""

    name: str
    init: bool
    devices: tuple[DeviceBooking, ...]


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """A pod's allocation record (annotation ``kube-vgpu.io/allocation``).

    node: node name; containers: one entry per GPU container (init first); time: unix seconds.
    """

    node: str
    containers: tuple[ContainerAllocation, ...]
    time: float = 0.0

    def container(self, name: str, init: bool = False) -> ContainerAllocation | None:
        """The allocation of the container named ``name`` (init or app), or None."""
        for c in self.containers:
            if c.name == name and c.init == init:
                return c
        return None

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """Per GPU uuid: (MiB, cores, slots) the pod holds, init containers collapsed.

        Init containers run one at a time before the app containers, so per GPU the pod holds
        ``max(peak of any init container, sum of app containers)`` for memory and cores, and
        ``max(1 if any init, number of app containers)`` slots.
        """
        app: dict[str, list[int]] = {}
        init: dict[str, list[int]] = {}
        for c in self.containers:
            for d in c.devices:
                if c.init:
                    cur = init.setdefault(d.uuid, [0, 0, 0])
                    cur[0] = max(cur[0], d.memory_mib)
                    cur[1] = max(cur[1], d.cores)
                    cur[2] = 1
                else:
                    cur = app.setdefault(d.uuid, [0, 0, 0])
                    cur[0] += d.memory_mib
                    cur[1] += d.cores
                    cur[2] += 1
        out: dict[str, tuple[int, int, int]] = {}
        for uuid in set(app) | set(init):
            a = app.get(uuid, [0, 0, 0])
            i = init.get(uuid, [0, 0, 0])
            out[uuid] = (max(a[0], i[0]), max(a[1], i[1]), max(a[2], i[2]))
        return out
