"""The event loop the HTTP services run on: uvloop's (libuv, its transports and TLS in compiled
code) where it is installed, else asyncio's own.

On the extender's hot path (two HTTP requests per scheduling decision, the pod watch's wake-ups,
the Binding's round trip) uvloop takes about a tenth off the event loop's CPU
(``benchmarks/extender_bench.py``). ``kube-vgpu scheduler`` runs on this one; its in-process tests run on
asyncio's loop, and ``tests/scheduler/test_extender_shutdown.py`` runs the command on both. (The
webhook stays on asyncio's: with uvloop, a client stuck in its TLS handshake holds the webhook's
shutdown for the handshake timeout.)
"""

from __future__ import annotations

import asyncio
import os

#: set to ``asyncio`` to run on asyncio's own loop even where uvloop is installed
ENV_LOOP = "KUBE_VGPU_EVENT_LOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's unless it is not installed or ``KUBE_VGPU_EVENT_LOOP=asyncio``."""
    if os.environ.get(ENV_LOOP, "") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop ``loop`` is (for the startup log line)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
