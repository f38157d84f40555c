"""Applying MIG decisions to a GPU through NVML (thin: every rule is in :mod:`kube_vgpu.mig`).

* :func:`repartition`: replace a GPU's whole MIG layout, only while none of its MIG devices has a
  process (:func:`kube_vgpu.mig.repartition_refusal`); the driver's own ``In use`` answer is kept as
  a second guard (a process that starts between the check and the destroy stops the repartition).
* :func:`ensure`: the MIG device of one placement (profile at a first memory slice), created when it
  does not exist; an instance in the way is removed only when it is idle and not booked, never one in
  use.

Errors: :class:`kube_vgpu.mig.MigError` (the message names the GPU, the layout and why), or the
NVML wrapper's NVMLError for a driver failure.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kube_vgpu.mig import Instance, MigError, Table, layout_error, repartition_refusal, table_for

from .nvml import NVML, MigDevice, NVMLError, PhysicalGPU


def _table_of(gpu: PhysicalGPU) -> Table:
    table = table_for(gpu.model, gpu.memory_mib)
    if table is None:
        raise MigError(f"GPU {gpu.uuid} ({gpu.model}): no MIG profile table is known for this model")
    return table


def repartition(nvml: NVML, gpu: PhysicalGPU, layout: Sequence[Instance]) -> list[MigDevice]:
    """Give GPU ``gpu`` (in MIG mode) exactly ``layout``: every MIG device destroyed, then one per
    instance created. Refused (MigError, nothing changed) when ``layout`` is not valid for the GPU's
    model or any MIG device has a running process. Returns the new MIG devices."""
    table = _table_of(gpu)
    bad = layout_error(table, list(layout))
    if bad is not None:
        raise MigError(f"GPU {gpu.uuid}: layout not valid: {bad}")
    current = nvml.mig_devices(gpu.uuid)
    why = repartition_refusal(gpu.uuid, {m.uuid: m.processes for m in current})
    if why is not None:
        raise MigError(why)
    for m in current:
        try:
            nvml.mig_destroy(gpu.uuid, m.uuid)
        except NVMLError as e:
            raise MigError(f"GPU {gpu.uuid} is not repartitioned: destroying {m.uuid} failed: {e}") from e
    return [nvml.mig_create(gpu.uuid, i.profile, i.start) for i in layout]


def ensure(nvml: NVML, gpu: PhysicalGPU, profile: str, start: int, booked: Collection[str] = ()) -> MigDevice:
    """The MIG device of ``profile`` at memory slice ``start`` on ``gpu``: the existing one, or a new
    one. MIG devices whose slices overlap it are destroyed first when idle and not in ``booked``
    (uuids other pods hold); one that is busy or booked refuses (MigError naming it)."""
    table = _table_of(gpu)
    want = table.profile(profile)
    slices = set(want.slices_at(start))
    for m in nvml.mig_devices(gpu.uuid):
        if m.profile == profile and m.start == start:
            return m
    for m in nvml.mig_devices(gpu.uuid):
        if not slices & set(table.profile(m.profile).slices_at(m.start)):
            continue
        if m.processes or m.uuid in booked:
            what = "has running processes" if m.processes else "is booked by another pod"
            raise MigError(f"GPU {gpu.uuid}: {profile}@{start} overlaps MIG device {m.uuid} ({m.profile}@{m.start}), "
                           f"which {what}; it is not destroyed")
        try:
            nvml.mig_destroy(gpu.uuid, m.uuid)
        except NVMLError as e:
            raise MigError(f"GPU {gpu.uuid}: MIG device {m.uuid} in the way could not be destroyed: {e}") from e
    return nvml.mig_create(gpu.uuid, profile, start)
