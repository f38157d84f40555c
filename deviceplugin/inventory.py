"""From NVML's GPUs to what the node advertises: vGPU slots for kubelet, the inventory for the scheduler.

Per-node overrides (config ``nodes[]``, matched by node name) replace the ``devices`` defaults:
``splitCount`` (slots per GPU), ``memoryScaling`` (factor on NVML total memory), ``coreScaling``
(factor on 100 percent of compute) and ``excludeGPUs`` (uuids or NVML indexes never advertised).
MIG-enabled GPUs are skipped (logged by the caller).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kube_vgpu.config import Config
from kube_vgpu.model import GPUDevice, NodeInventory

from .nvml import PhysicalGPU
from .podmatch import slot_id


@dataclass(frozen=True, slots=True)
class DeviceSettings:
    """Effective device settings for one node: split (slots per GPU), memory/core scaling, exclusions."""

    split_count: int
    memory_scaling: float
    core_scaling: float
    exclude: frozenset[str]


def settings_for(cfg: Config, node: str) -> DeviceSettings:
    """The ``devices`` defaults with the node's override (if any) applied."""
    d = cfg.devices
    o = cfg.node_override(node)
    if o is None:
        return DeviceSettings(d.split_count, d.memory_scaling, d.core_scaling, frozenset())
    return DeviceSettings(
        split_count=o.split_count if o.split_count is not None else d.split_count,
        memory_scaling=o.memory_scaling if o.memory_scaling is not None else d.memory_scaling,
        core_scaling=o.core_scaling if o.core_scaling is not None else d.core_scaling,
        exclude=frozenset(o.exclude_gpus))


def select(gpus: Iterable[PhysicalGPU], s: DeviceSettings) -> tuple[list[PhysicalGPU], list[str]]:
    """Split NVML's GPUs into (advertised, skip reasons): excluded by config or in MIG mode."""
    keep: list[PhysicalGPU] = []
    skipped: list[str] = []
    for g in gpus:
        if g.uuid in s.exclude or str(g.index) in s.exclude:
            skipped.append(f"{g.uuid} (index {g.index}): excluded by config")
        elif g.mig:
            skipped.append(f"{g.uuid} (index {g.index}): MIG mode enabled, MIG is not supported yet")
        else:
            keep.append(g)
    return keep, skipped


def to_devices(gpus: Iterable[PhysicalGPU], s: DeviceSettings, health: Mapping[str, bool],
               links: list[list[int]] | None = None) -> tuple[GPUDevice, ...]:
    """Inventory devices: memory = NVML total MiB x memory scaling (rounded down), cores =
    100 x core scaling, split = slots per GPU, healthy from ``health`` (missing = healthy), links:
    interconnect ranks by position (:mod:`kube_vgpu.topology`; None or a wrong size: none)."""
    gpus = list(gpus)
    ok = links is not None and len(links) == len(gpus) and all(len(r) == len(gpus) for r in links)
    return tuple(GPUDevice(uuid=g.uuid, index=g.index, model=g.model, memory_mib=int(g.memory_mib * s.memory_scaling),
                           cores=int(round(100 * s.core_scaling)), split=s.split_count,
                           healthy=health.get(g.uuid, True), numa=g.numa,
                           links=tuple(links[i]) if ok and links is not None else ())
                 for i, g in enumerate(gpus))


def inventory(devices: tuple[GPUDevice, ...], now: float) -> NodeInventory:
    """The node inventory with heartbeat ``now`` (unix seconds)."""
    return NodeInventory(devices=devices, heartbeat=now)


@dataclass(frozen=True, slots=True)
class Slot:
    """One advertised kubelet device: id ``<uuid>::<k>``, health, NUMA node."""

    id: str
    uuid: str
    healthy: bool
    numa: int


def slots(devices: Iterable[GPUDevice]) -> list[Slot]:
    """``split`` slots per GPU, each with its GPU's health and NUMA node."""
    return [Slot(slot_id(d.uuid, k), d.uuid, d.healthy, d.numa) for d in devices for k in range(d.split)]
