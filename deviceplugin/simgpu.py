"""Simulated GPUs for a GPU-less trial (``kube-vgpu device-plugin --simulate-gpus 4x24576``).

:class:`SimulatedGPUs` stands beside :class:`deviceplugin.nvml.NVML` with the same methods, so the
device plugin advertises, books and answers ``Allocate`` / ``PreStartContainer`` exactly as on a
GPU node, and the whole system (webhook, scheduler, device plugin, inventory, ``kubectl vgpu``) can
be tried on a laptop cluster (kind, minikube). There is no GPU, so nothing is isolated: the
containers get the env contract and the limits file, and no process is limited by anything. The
device plugin says so at start and in every GPU's model name.

Spec: comma-separated groups ``COUNTxMIB[:MODEL]``, e.g. ``4x24576`` or
``2x81920:H100-sim,1x16384``. UUIDs are derived from the node name and the GPU index, so they stay
the same across restarts (bookings recorded against them stay valid).
"""

from __future__ import annotations

import logging
import re
import uuid as uuidlib
from collections.abc import Iterable

from .nvml import GPUUsage, PhysicalGPU

log = logging.getLogger("kube_vgpu.deviceplugin.simgpu")

#: model name of simulated GPUs when a group names none (shown by the inventory and kubectl vgpu)
DEFAULT_MODEL = "Simulated GPU (no isolation)"
#: the most simulated GPUs on one node, and the largest simulated memory (MiB)
MAX_GPUS = 64
MAX_MIB = 1_048_576
_GROUP = re.compile(r"^(\d{1,3})x(\d{1,8})(?::([A-Za-z0-9][A-Za-z0-9 ._()-]{0,63}))?$")
_NAMESPACE = uuidlib.UUID("6f1d3c8e-3b5a-4c61-9a8e-2d4b7c0e5f11")


class SimulateSpecError(ValueError):
    """``--simulate-gpus`` is not a valid spec; the message names the flag, the value and the form."""


def parse_spec(spec: str) -> list[tuple[int, int, str]]:
    """``COUNTxMIB[:MODEL]`` groups -> [(count, MiB, model)]. Raises SimulateSpecError."""
    allowed = (f"comma-separated COUNTxMIB[:MODEL] groups, e.g. 4x24576 or 2x81920:H100-sim,1x16384; "
               f"1..{MAX_GPUS} GPUs in all, 1..{MAX_MIB} MiB each")
    groups: list[tuple[int, int, str]] = []
    for part in spec.split(","):
        m = _GROUP.match(part.strip())
        if m is None:
            raise SimulateSpecError(f"--simulate-gpus={spec!r}: group {part.strip()!r} is not valid; allowed: {allowed}")
        count, mib = int(m.group(1)), int(m.group(2))
        if count < 1 or not 1 <= mib <= MAX_MIB:
            raise SimulateSpecError(f"--simulate-gpus={spec!r}: group {part.strip()!r} is out of range; "
                                    f"allowed: {allowed}")
        groups.append((count, mib, m.group(3) or DEFAULT_MODEL))
    if sum(g[0] for g in groups) > MAX_GPUS:
        raise SimulateSpecError(f"--simulate-gpus={spec!r}: {sum(g[0] for g in groups)} GPUs; allowed: {allowed}")
    return groups


class SimulatedGPUs:
    """The :class:`deviceplugin.nvml.NVML` interface over GPUs that do not exist: discovery
    returns the spec's GPUs, every probe succeeds, no health events, usage 0."""

    def __init__(self, spec: str, node: str):
        self.gpus: list[PhysicalGPU] = []
        for count, mib, model in parse_spec(spec):
            for _ in range(count):
                i = len(self.gpus)
                uid = uuidlib.uuid5(_NAMESPACE, f"{node}/{i}")
                self.gpus.append(PhysicalGPU(uuid=f"GPU-{uid}", index=i, model=model, memory_mib=mib, numa=0,
                                             mig=False))

    def init(self) -> None:
        """Nothing to load."""

    def shutdown(self) -> None:
        """Nothing to free."""

    def driver_version(self) -> str:
        return "simulated"

    def discover(self) -> tuple[list[PhysicalGPU], list[str]]:
        return list(self.gpus), []

    def probe(self, uuid: str) -> str | None:
        return None

    def usage(self, uuid: str) -> GPUUsage | None:
        return GPUUsage(0, 0) if any(g.uuid == uuid for g in self.gpus) else None

    def watch_events(self, uuids: Iterable[str]) -> list[str]:
        return []

    def wait_event(self, timeout_ms: int) -> tuple[str, int, int] | None:
        return None

    def topology(self, uuids: list[str]) -> list[list[int]]:
        return []  # simulated GPUs have no interconnect to report


def from_flag(spec: str, node: str) -> SimulatedGPUs:
    """The GPUs of ``--simulate-gpus SPEC`` on ``node`` (both node components), announced with the
    loud warning that nothing is isolated. Raises SimulateSpecError for a bad spec."""
    gpus = SimulatedGPUs(spec, node)
    log.warning("SIMULATED GPUs: this node has no GPU and NOTHING IS ISOLATED; for trying kube-vgpu only, "
                "never for workloads", extra={"gpu": f"{len(gpus.gpus)} x {spec}", "node": node})
    return gpus
