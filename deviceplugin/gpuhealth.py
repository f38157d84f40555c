"""The GPU health loop both node plugins run (the device plugin and the DRA plugin).

It feeds a :class:`deviceplugin.nvml.HealthTracker` from two sources: NVML events (an XID-critical or
double-bit ECC event marks the GPU unhealthy at once) and a probe of every watched GPU every
``probe_interval`` seconds (a failed query marks it unhealthy, a good one after the recovery time
marks it healthy again). When a GPU's health flips, the plugin's ``on_change`` callback runs (it
rebuilds the devices and pushes them: ListAndWatch and the node inventory, or the ResourceSlices).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from .nvml import GPUBackend, HealthTracker, NVMLError


def run_health_loop(nvml: GPUBackend, health: HealthTracker, stop: threading.Event, *, poll_ms: int,
                    probe_interval: float, uuids: Callable[[], Iterable[str]],
                    on_change: Callable[[], None], logger: logging.Logger) -> None:
    """Run until ``stop`` is set: wait up to ``poll_ms`` milliseconds for an NVML event, probe the GPUs
    ``uuids()`` names every ``probe_interval`` seconds, and call ``on_change()`` after a round in which
    a GPU's health flipped. A round without an event lasts ``poll_ms`` even when the backend answers
    at once (simulated GPUs have no events; a failed wait is logged). Changes are logged on ``logger``.
    Raises what ``on_change`` raises."""
    next_probe = 0.0
    while not stop.is_set():
        changed = False
        t0 = time.monotonic()
        ev = _wait_event(nvml, stop, poll_ms, logger)
        if ev is not None:
            uuid, etype, xid = ev
            if health.on_event(uuid, etype, xid):
                changed = True
                logger.error("GPU unhealthy", extra={"gpu": uuid, "reason": health.reason(uuid)})
            else:
                logger.info("GPU event, no health change", extra={"gpu": uuid, "event_type": hex(etype), "xid": xid})
        if time.monotonic() >= next_probe:
            next_probe = time.monotonic() + probe_interval
            for uuid in uuids():
                if health.on_probe(uuid, nvml.probe(uuid)):
                    changed = True
                    if health.healthy(uuid):
                        logger.info("GPU healthy again", extra={"gpu": uuid})
                    else:
                        logger.error("GPU unhealthy", extra={"gpu": uuid, "reason": health.reason(uuid)})
        if changed:
            on_change()
        left = poll_ms / 1000 - (time.monotonic() - t0)
        if ev is None and left > 0:
            stop.wait(left)


def _wait_event(nvml: GPUBackend, stop: threading.Event, poll_ms: int,
                logger: logging.Logger) -> tuple[str, int, int] | None:
    """The next NVML event (GPU uuid, event type, XID), waiting up to ``poll_ms`` milliseconds; None
    when none came. A failed wait is logged and waits ``poll_ms`` (or until ``stop``) before
    answering None."""
    try:
        return nvml.wait_event(poll_ms)
    except NVMLError as e:
        logger.warning("NVML event wait failed", extra={"error": str(e)})
        stop.wait(poll_ms / 1000)
        return None
