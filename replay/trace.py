"""Read the Alibaba GPU-sharing trace v2023 ("openb" CSVs) into domain objects.

Source format (alibaba/clusterdata ``cluster-trace-gpu-v2023/csv``):

* node list ``sn,cpu_milli,memory_mib,gpu,model`` (CPU in millicores, host memory in MiB).
* pod list ``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,...`` (multigpu lists have only
  the first five columns). ``gpu_milli`` is per GPU, 1000 = a whole GPU.

Mapping to the vGPU model (our assumption, documented in docs/placement.md): a pod asking
``gpu_milli`` of ``num_gpu`` GPUs becomes one container with ``count = num_gpu``,
``cores = gpu_milli / 10`` percent and memory ``gpu_milli / 1000`` of the GPU's memory (expressed as
a percentage of each GPU's memory, so it scales with the node's model); ``gpu_milli == 1000`` is an
exclusive whole card. ``gpu_spec`` (``A|B``) is an exact GPU-model allow-list.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from kube_vgpu.model import ContainerRequest, GPUDevice, PodRequest

#: GPU memory per trace model, MiB (public specs; G1-G3 are undisclosed: the FGD artifact's
#: placeholders). Memory shares scale with it, so placement does not depend on the exact values.
MODEL_MEMORY_MIB = {"T4": 15109, "P100": 16280, "V100M16": 16160, "V100M32": 32510, "A10": 22731,
                    "G1": 10000, "G2": 20000, "G3": 30000}
#: vGPU slots per GPU in the replay: large enough never to bind (the trace has no slot limit).
REPLAY_SPLIT = 100


@dataclass(frozen=True, slots=True)
class TraceNode:
    """One trace node: name, CPU millicores, host MiB, GPUs."""

    name: str
    cpu_milli: int
    memory_mib: int
    devices: tuple[GPUDevice, ...]


@dataclass(frozen=True, slots=True)
class TracePod:
    """One trace pod: the raw fields the replay and FGD need, plus its PodRequest."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    request: PodRequest

    @property
    def total_milli(self) -> int:
        """GPU demand in milli-GPU (num_gpu x gpu_milli)."""
        return self.num_gpu * self.gpu_milli


def _int(row: dict[str, str], key: str, path: Path, line: int, lo: int = 0, hi: int = 10**9) -> int:
    try:
        v = int(row[key])
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"{path}:{line}: column {key!r} = {row.get(key)!r} is not an integer") from None
    if not lo <= v <= hi:
        raise ValueError(f"{path}:{line}: column {key!r} = {v} is out of range; allowed {lo}..{hi}")
    return v


def make_devices(node: str, n: int, model: str, split: int = REPLAY_SPLIT) -> tuple[GPUDevice, ...]:
    """``n`` GPUs of ``model`` with deterministic uuids ``GPU-<node>-<i>``."""
    mem = MODEL_MEMORY_MIB.get(model, 16384)
    return tuple(GPUDevice(uuid=f"GPU-{node}-{i}", index=i, model=model, memory_mib=mem, cores=100,
                           split=split) for i in range(n))


def load_nodes(path: str | Path) -> list[TraceNode]:
    """Read a node list CSV. Raises ValueError naming file, line and column on bad rows."""
    p = Path(path)
    out = []
    with p.open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            n = _int(row, "gpu", p, line, 0, 64)
            model = (row.get("model") or "").strip()
            out.append(TraceNode(row["sn"], _int(row, "cpu_milli", p, line), _int(row, "memory_mib", p, line),
                                 make_devices(row["sn"], n, model) if n else ()))
    return out


def make_request(name: str, cpu_milli: int, memory_mib: int, num_gpu: int, gpu_milli: int,
                 gpu_spec: tuple[str, ...]) -> PodRequest:
    """The PodRequest of a trace pod (see module docstring for the mapping).

    Raises: ValueError if gpu_milli is outside 0..1000 or inconsistent with num_gpu.
    """
    if not 0 <= gpu_milli <= 1000 or (num_gpu == 0) != (gpu_milli == 0) or num_gpu < 0:
        raise ValueError(f"pod {name}: num_gpu={num_gpu}, gpu_milli={gpu_milli} is not a valid trace request")
    app: tuple[ContainerRequest, ...] = ()
    if num_gpu:
        pct = gpu_milli // 10
        app = (ContainerRequest(name="main", init=False, count=num_gpu, memory_percent=pct, cores=pct),)
    return PodRequest(namespace="trace", name=name, app=app, cpu_milli=cpu_milli, memory_mib=memory_mib,
                      gpu_spec=gpu_spec)


def load_pods(path: str | Path) -> list[TracePod]:
    """Read a pod list CSV (11-column or 5-column multigpu form), in file order."""
    p = Path(path)
    out = []
    with p.open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            spec = tuple(s for s in (row.get("gpu_spec") or "").split("|") if s)
            cpu, mem = _int(row, "cpu_milli", p, line), _int(row, "memory_mib", p, line)
            num, milli = _int(row, "num_gpu", p, line, 0, 64), _int(row, "gpu_milli", p, line, 0, 1000)
            out.append(TracePod(row["name"], cpu, mem, num, milli, spec,
                                make_request(row["name"], cpu, mem, num, milli, spec)))
    return out
