"""Per-GPU cordon: an admin marks single GPUs of a node unschedulable without draining the node.

Node annotations (admins write Nodes; tenants cannot):

* ``kube-vgpu.io/gpu-cordon: "GPU-<uuid>,3"``: GPU uuids or NVML indexes, comma-separated;
* ``hami.io/device-cordon: "GPU-<uuid>,..."``: HAMi's form (uuids), read as well.

A cordoned GPU takes no new pod: placement treats it as unusable (like an unhealthy GPU). Pods
already on it keep running and keep their bookings. ``kubectl vgpu cordon|uncordon NODE GPU``
edits the annotation; ``kubectl vgpu inspect`` marks cordoned GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .model import GPUDevice
from .resources import ANN_GPU_CORDON, ANN_HAMI_DEVICE_CORDON


def _tokens(text: Any) -> set[str]:
    if not isinstance(text, str):
        return set()
    return {t.strip() for t in text.split(",") if t.strip()}


def cordoned_tokens(annotations: Mapping[str, Any] | None) -> frozenset[str]:
    """Every GPU token (uuid or index) either annotation names."""
    ann = annotations or {}
    return frozenset(_tokens(ann.get(ANN_GPU_CORDON)) | _tokens(ann.get(ANN_HAMI_DEVICE_CORDON)))


def is_cordoned(dev: GPUDevice, tokens: frozenset[str]) -> bool:
    """``dev`` is named by uuid or by its NVML index."""
    return bool(tokens) and (dev.uuid in tokens or str(dev.index) in tokens)


def apply_cordon(devices: Iterable[GPUDevice], tokens: frozenset[str]) -> tuple[GPUDevice, ...]:
    """The devices as placement sees them: a cordoned GPU is not usable (``healthy=False``)."""
    return tuple(replace(d, healthy=False) if d.healthy and is_cordoned(d, tokens) else d for d in devices)


def edit(annotation: str | None, gpu: str, cordon: bool) -> str:
    """The ``kube-vgpu.io/gpu-cordon`` value with ``gpu`` (a uuid or an index) added or removed,
    order kept."""
    cur = [t.strip() for t in (annotation or "").split(",") if t.strip()]
    if cordon:
        return ",".join(cur if gpu in cur else [*cur, gpu])
    return ",".join(t for t in cur if t != gpu)
