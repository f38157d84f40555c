"""Where a pod is in its life, as far as GPUs go: the one rule every component reads.

* :func:`finished`: ``status.phase`` is ``Succeeded`` or ``Failed``: every container has stopped
  for good; the pod holds no GPUs any more (its booking is released at once).
* :func:`terminating`: ``metadata.deletionTimestamp`` is set: the pod is going away, but its
  containers may still run (until kubelet stops them) and so still hold their GPUs.
* :func:`holds_gpus`: not finished (a terminating pod still holds its GPUs; the scheduler keeps
  its booking until the DELETED event).
* :func:`active`: neither finished nor terminating: the pod may still be bound, allocated, started
  or counted as a live user of its GPUs (bind, Allocate, PreStartContainer, device-plugin metrics).

Pod JSON objects as the API server serves them; a malformed object reads as not finished and not
terminating (its other checks refuse it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: pod phases after which no container of the pod runs again
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def _part(pod: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    v = pod.get(name)
    return v if isinstance(v, Mapping) else {}


def finished(pod: Mapping[str, Any]) -> bool:
    """``status.phase`` is Succeeded or Failed (see module docstring). Never raises."""
    return _part(pod, "status").get("phase") in FINISHED_PHASES


def terminating(pod: Mapping[str, Any]) -> bool:
    """``metadata.deletionTimestamp`` is set. Never raises."""
    return bool(_part(pod, "metadata").get("deletionTimestamp"))


def holds_gpus(pod: Mapping[str, Any]) -> bool:
    """The pod still holds the GPUs it was given: it has not finished. Never raises."""
    return not finished(pod)


def active(pod: Mapping[str, Any]) -> bool:
    """Neither finished nor being deleted: new work (a bind, an Allocate) may still go to it. Never raises."""
    return not finished(pod) and not terminating(pod)


__all__ = ["FINISHED_PHASES", "active", "finished", "holds_gpus", "terminating"]
