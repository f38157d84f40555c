"""HealthTracker rules (pure, fake clock)."""

from __future__ import annotations

import pynvml

from deviceplugin.nvml import HealthTracker

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
