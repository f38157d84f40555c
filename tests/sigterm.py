"""SIGTERM a component's process and wait for it to exit (the shutdown tests of each component)."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import AnyStr

#: how long a process may take to exit after SIGTERM before the test fails: generous, not the 2 s
#: figure (a loaded machine must not fail the test); the measured time is printed instead
EXIT_BOUND = 60.0


def sigterm_and_wait(proc: subprocess.Popen[AnyStr], what: str, bound: float = EXIT_BOUND) -> tuple[AnyStr, float]:
    """Send SIGTERM to ``proc`` and wait for it to exit. Returns (its stderr, seconds from the signal
    to the exit). Raises AssertionError naming ``what`` when it still runs ``bound`` s later (it is
    then killed)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{what} still running {bound:.0f} s after SIGTERM") from None
    return err, time.monotonic() - t0
