"""Where a pod is in its life, as far as GPUs go: the one rule every component reads.

* :func:`finished`: ``status.phase`` is ``Succeeded`` or ``Failed``: every container has stopped
  for good; the pod holds no GPUs any more (its booking is released at once).
* :func:`terminating`: ``metadata.deletionTimestamp`` is set: the pod is going away, but its
  containers may still run (until kubelet stops them) and so still hold their GPUs.
* :func:`holds_gpus`: not finished (a terminating pod still holds its GPUs; the scheduler keeps
  its booking until the DELETED event).
* :func:`active`: neither finished nor terminating: the pod may still be bound, allocated, started
  or counted as a live user of its GPUs (bind, Allocate, PreStartContainer, device-plugin metrics).

Pod JSON objects as the API server serves them, or :class:`kube_vgpu.views.PodView` (where the rule
lives); a malformed object reads as not finished and not terminating (its other checks refuse it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ShapeError
from .views import FINISHED_PHASES, PodView


def _view(pod: Mapping[str, Any] | PodView) -> PodView | None:
    try:
        return PodView.of(pod)
    except ShapeError:
        return None


def finished(pod: Mapping[str, Any] | PodView) -> bool:
    """``status.phase`` is Succeeded or Failed (see module docstring). Never raises."""
    v = _view(pod)
    return v is not None and v.finished


def terminating(pod: Mapping[str, Any] | PodView) -> bool:
    """``metadata.deletionTimestamp`` is set. Never raises."""
    v = _view(pod)
    return v is not None and v.terminating


def holds_gpus(pod: Mapping[str, Any] | PodView) -> bool:
    """The pod still holds the GPUs it was given: it has not finished. Never raises."""
    return not finished(pod)


def active(pod: Mapping[str, Any] | PodView) -> bool:
    """Neither finished nor being deleted: new work (a bind, an Allocate) may still go to it. Never raises."""
    v = _view(pod)
    return v is None or v.active


__all__ = ["FINISHED_PHASES", "active", "finished", "holds_gpus", "terminating"]
