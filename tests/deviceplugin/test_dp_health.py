"""HealthTracker rules (pure, fake clock), the health loop and the readiness rule both node plugins use."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pynvml

from deviceplugin.gpuhealth import run_health_loop
from deviceplugin.nvml import HealthTracker, NVMLError
from deviceplugin.server import node_readiness
from deviceplugin.simgpu import SimulatedGPUs

XID = pynvml.nvmlEventTypeXidCriticalError


def test_xid_then_recovery_after_quiet_period() -> None:
    t = [0.0]
    h = HealthTracker(["a", "b"], recovery_seconds=10, now=lambda: t[0])
    assert not h.on_event("a", XID, 13)  # application XID ignored
    assert h.healthy("a")
    assert h.on_event("a", XID, 79)
    assert not h.healthy("a") and h.reason("a") == "XID 79" and h.healthy("b")
    t[0] = 5
    assert not h.on_probe("a", None)  # too soon
    t[0] = 10.5
    assert h.on_probe("a", None) and h.healthy("a") and h.reason("a") == ""


def test_failed_query_and_ecc() -> None:
    h = HealthTracker(["a"], recovery_seconds=0, now=lambda: 0.0)
    assert h.on_probe("a", "GPU is lost")
    assert "GPU is lost" in h.reason("a")
    assert not h.on_probe("a", "GPU is lost")
    assert h.on_probe("a", None) and h.healthy("a")
    assert h.on_event("a", pynvml.nvmlEventTypeDoubleBitEccError, 0)
    assert not h.on_event("zzz", XID, 79) and not h.healthy("zzz")


class _StopAfterWaits(threading.Event):
    """A stop event that records each timeout the loop waits with and is set after ``n`` waits."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.waited: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.append(timeout)
        if len(self.waited) >= self.n:
            self.set()
        return self.is_set()


class _Backend(SimulatedGPUs):
    """Simulated GPUs with scripted NVML events and probe errors; waiting is bounded so a loop that
    spins fails instead of hanging."""

    def __init__(self, events: list[tuple[str, int, int] | BaseException], probe_errors: dict[str, str]) -> None:
        super().__init__("2x1000", "n1")
        self.events = events
        self.probe_errors = probe_errors
        self.waits = 0

    def wait_event(self, timeout_ms: int) -> tuple[str, int, int] | None:
        self.waits += 1
        assert self.waits <= 5, "the health loop spins"
        if not self.events:
            return None
        ev = self.events.pop(0)
        if isinstance(ev, BaseException):
            raise ev
        return ev

    def probe(self, uuid: str) -> str | None:
        return self.probe_errors.get(uuid)


def _run(nvml: _Backend, stop: _StopAfterWaits, health: HealthTracker) -> list[int]:
    changes: list[int] = []
    run_health_loop(nvml, health, stop, poll_ms=60_000, probe_interval=0,
                    uuids=lambda: [g.uuid for g in nvml.gpus], on_change=lambda: changes.append(nvml.waits),
                    logger=logging.getLogger("test"))
    return changes


def test_health_loop_event_and_probe_flip_once_per_round() -> None:
    """An XID on one GPU and a failed probe on the other in the same round call on_change once; a
    quiet round changes nothing and waits the poll period out."""
    nvml = _Backend([], {})
    a, b = (g.uuid for g in nvml.gpus)
    nvml.events.append((a, XID, 79))
    nvml.probe_errors[b] = "GPU is lost"
    health = HealthTracker([a, b])
    stop = _StopAfterWaits(1)
    assert _run(nvml, stop, health) == [1]
    assert not health.healthy(a) and health.reason(a) == "XID 79"
    assert not health.healthy(b) and "GPU is lost" in health.reason(b)
    assert nvml.waits == 2 and len(stop.waited) == 1


def test_health_loop_without_events_waits_each_round() -> None:
    """Simulated GPUs answer the event wait at once: each round still waits about ``poll_ms`` instead
    of spinning (the loop's backend asserts it is not asked more than a few times)."""
    nvml = _Backend([], {})
    stop = _StopAfterWaits(3)
    assert _run(nvml, stop, HealthTracker(g.uuid for g in nvml.gpus)) == []
    assert nvml.waits == 3
    assert all(w is not None and 0 < w <= 60 for w in stop.waited)


def test_health_loop_failed_event_wait_is_logged_and_waits() -> None:
    """A failed NVML event wait waits ``poll_ms`` (or until stopped) and the loop goes on probing."""
    nvml = _Backend([NVMLError(pynvml.NVML_ERROR_UNKNOWN)], {})
    a, b = (g.uuid for g in nvml.gpus)
    nvml.probe_errors[a] = "GPU is lost"
    stop = _StopAfterWaits(1)
    health = HealthTracker([a, b])
    assert _run(nvml, stop, health) == [1]
    assert stop.waited[0] == 60 and not health.healthy(a) and health.healthy(b)


def test_node_readiness_names_the_first_missing_step(tmp_path: Path) -> None:
    """/readyz of both node plugins: registration, then publication, then the shim on the host."""
    shim = tmp_path / "libvgpu.so"
    assert node_readiness(False, "", None, str(shim)) == (False, "not registered with kubelet")
    assert node_readiness(False, "connection refused", "x", str(shim)) == \
        (False, "not registered with kubelet: connection refused")
    assert node_readiness(True, "", "ResourceSlices not published: pending", str(shim)) == \
        (False, "ResourceSlices not published: pending")
    assert node_readiness(True, "", None, str(shim)) == (False, f"shim not found at {shim}")
    shim.write_bytes(b"")
    assert node_readiness(True, "", None, str(shim)) == (True, "ok")
