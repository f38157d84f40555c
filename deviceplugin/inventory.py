"""From NVML's GPUs to what the node advertises: vGPU slots for kubelet, the inventory for the scheduler.

Per-node overrides (config ``nodes[]``, matched by node name) replace the ``devices`` defaults:
``splitCount`` (slots per GPU), ``memoryScaling`` (factor on NVML total memory), ``coreScaling``
(factor on 100 percent of compute), ``excludeGPUs`` (uuids or NVML indexes never advertised) and
``migStrategy``. GPUs in MIG mode are never advertised as vGPU slots: with ``migStrategy: none`` they
are skipped (logged by the caller); with ``single`` their MIG devices join the inventory as whole GPUs
(:func:`mig_to_devices`); with ``mixed`` they are advertised per profile (:mod:`deviceplugin.migserver`);
with ``dynamic`` each joins the inventory as one GPU with its MIG profile table
(:func:`dynamic_devices`) and kubelet sees one device ID per allowed placement (:func:`slots`);
see docs/mig.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kube_vgpu.config import Config
from kube_vgpu.mig import COMPUTE_SLICES, TABLES, allowed_profiles, table_for
from kube_vgpu.model import GPUDevice, NodeInventory

from .nvml import MigDevice, PhysicalGPU
from .podmatch import mig_slot_id, slot_id


@dataclass(frozen=True, slots=True)
class DeviceSettings:
    """Effective device settings for one node: split (slots per GPU), memory/core scaling, exclusions,
    the MIG strategy (:data:`kube_vgpu.mig.MIG_STRATEGIES`) and the dynamic-MIG profile allowlist."""

    split_count: int
    memory_scaling: float
    core_scaling: float
    exclude: frozenset[str]
    mig_strategy: str = "none"
    mig_profiles: tuple[str, ...] = ()


def settings_for(cfg: Config, node: str) -> DeviceSettings:
    """The ``devices`` defaults with the node's override (if any) applied."""
    d = cfg.devices
    o = cfg.node_override(node)
    if o is None:
        return DeviceSettings(d.split_count, d.memory_scaling, d.core_scaling, frozenset(), d.mig_strategy,
                              d.mig_profiles)
    return DeviceSettings(
        split_count=o.split_count if o.split_count is not None else d.split_count,
        memory_scaling=o.memory_scaling if o.memory_scaling is not None else d.memory_scaling,
        core_scaling=o.core_scaling if o.core_scaling is not None else d.core_scaling,
        exclude=frozenset(o.exclude_gpus),
        mig_strategy=o.mig_strategy if o.mig_strategy is not None else d.mig_strategy,
        mig_profiles=d.mig_profiles)


def select(gpus: Iterable[PhysicalGPU], s: DeviceSettings) -> tuple[list[PhysicalGPU], list[str]]:
    """Split NVML's GPUs into (advertised as vGPU slots, skip reasons): excluded by config or in MIG
    mode (:func:`mig_parents` says which of those serve MIG devices)."""
    keep: list[PhysicalGPU] = []
    skipped: list[str] = []
    for g in gpus:
        if g.uuid in s.exclude or str(g.index) in s.exclude:
            skipped.append(f"{g.uuid} (index {g.index}): excluded by config")
        elif g.mig and s.mig_strategy == "none":
            skipped.append(f"{g.uuid} (index {g.index}): MIG mode enabled and devices.migStrategy is none")
        elif g.mig:
            skipped.append(f"{g.uuid} (index {g.index}): MIG mode enabled; its MIG devices are advertised "
                           f"(migStrategy {s.mig_strategy}), not vGPU slots")
        else:
            keep.append(g)
    return keep, skipped


def mig_parents(gpus: Iterable[PhysicalGPU], s: DeviceSettings) -> list[PhysicalGPU]:
    """The GPUs in MIG mode whose MIG devices this node advertises (none with ``migStrategy: none``;
    excluded GPUs never)."""
    if s.mig_strategy == "none":
        return []
    return [g for g in gpus if g.mig and g.uuid not in s.exclude and str(g.index) not in s.exclude]


def mig_to_devices(migs: Iterable[MigDevice], parents: Iterable[PhysicalGPU],
                   health: Mapping[str, bool]) -> tuple[GPUDevice, ...]:
    """``migStrategy: single``: each MIG device as one whole GPU of the inventory: its ``MIG-`` uuid,
    the parent's NVML index (cordoning the GPU's index cordons its MIG devices), model
    ``<parent model> MIG <profile>``, the instance's memory (MiB, never scaled: it is hardware),
    100 percent compute, one slot (one container: MIG devices are not shared), the parent's health
    and NUMA node."""
    by_uuid = {g.uuid: g for g in parents}
    out = []
    for m in migs:
        p = by_uuid.get(m.parent)
        if p is None:
            continue
        out.append(GPUDevice(uuid=m.uuid, index=m.parent_index, model=f"{p.model} MIG {m.profile}",
                             memory_mib=m.memory_mib, cores=100, split=1, healthy=health.get(p.uuid, True),
                             numa=p.numa))
    return tuple(out)


def dynamic_refusal(g: PhysicalGPU, s: DeviceSettings) -> str | None:
    """Why GPU ``g`` (in MIG mode, ``migStrategy: dynamic``) cannot be served by dynamic MIG (no
    profile table for its model; an allowlist naming none of its profiles), or None."""
    table = table_for(g.model, g.memory_mib)
    if table is None:
        return f"{g.uuid} (index {g.index}, {g.model}): no MIG profile table is known for this model"
    if s.mig_profiles and not allowed_profiles(table, s.mig_profiles):
        return (f"{g.uuid} (index {g.index}, {g.model}): devices.migProfiles names none of the profiles of "
                f"{table.key} ({', '.join(p.name for p in table.profiles)})")
    return None


def dynamic_devices(parents: Iterable[PhysicalGPU], s: DeviceSettings,
                    health: Mapping[str, bool]) -> tuple[GPUDevice, ...]:
    """``migStrategy: dynamic``: each GPU in MIG mode that :func:`dynamic_refusal` accepts as one
    inventory GPU: its uuid, index and model, NVML total memory (MiB, never scaled: MIG instances
    are hardware), 100 percent compute, one slot per compute slice (an instance per container),
    ``mig`` its profile table and ``mig_profiles`` the admin's allowlist restricted to that table."""
    out = []
    for g in parents:
        table = table_for(g.model, g.memory_mib)
        if table is None or dynamic_refusal(g, s) is not None:
            continue
        names = {p.name for p in table.profiles}
        out.append(GPUDevice(uuid=g.uuid, index=g.index, model=g.model, memory_mib=g.memory_mib, cores=100,
                             split=COMPUTE_SLICES, healthy=health.get(g.uuid, True), numa=g.numa, mig=table.key,
                             mig_profiles=tuple(p for p in s.mig_profiles if p in names)))
    return tuple(out)


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
    """``split`` slots per GPU, each with its GPU's health and NUMA node; a dynamic-MIG GPU has one
    per allowed placement instead (:func:`deviceplugin.podmatch.mig_slot_id`: every start of every
    allowed profile), so that the device ID kubelet hands over names the instance to create."""
    out = []
    for d in devices:
        if d.mig:
            out += [Slot(mig_slot_id(d.uuid, p.name, st), d.uuid, d.healthy, d.numa)
                    for p in allowed_profiles(TABLES[d.mig], d.mig_profiles) for st in p.starts]
        else:
            out += [Slot(slot_id(d.uuid, k), d.uuid, d.healthy, d.numa) for k in range(d.split)]
    return out
