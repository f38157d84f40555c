"""The metrics listeners' rules (the extender's ``--metrics-port``, the device and DRA plugins'
``/livez``, ``/readyz``, ``/metrics``): how often a ``/metrics`` body is rendered, and how many
connections a listener keeps and for how long. The extender (asyncio) and the plugins (threads)
share them.

Connections: the ports are reachable from the pod network, and a connection that never finished
its request was kept for ever (a thread each in the plugins, about 5 KiB each in the extender), so a
tenant's idle connections outgrew the component's memory limit. So at most :data:`MAX_CONNECTIONS`
are open; a new one beyond that closes the open one that has waited longest without a request in
its handler (a probe's or a scrape's request arrives within milliseconds, so idle connections evict
each other, not kubelet's probes), or itself when all are being answered; and a connection must
send each request, and read each answer, within :data:`CONNECTION_TIMEOUT` seconds.

Renders: a render costs CPU that the component's own work (the extender's filter and bind on its
event loop, the plugins' Allocate and PreStartContainer) then waits for under the interpreter
lock, and a flood of scrapes rendering at once slowed that work down by as many renders as were
running. So:

* one render runs at a time, and every scrape waiting for it gets its body: a scrape is answered
  by a render that started after it arrived (it sees the state as of its arrival or later);
* the next render starts at least :data:`SPACING` seconds, and :data:`SPACING_FACTOR` times the
  last render's length, after the last one ended (:func:`next_render_at`): rendering takes at
  most a sixth of the time, however many scrape.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .connguard import GuardedProtocol, request_middleware

#: open connections of a metrics listener
MAX_CONNECTIONS = 64
#: seconds a connection of a metrics listener may take to send a request, or to read an answer
CONNECTION_TIMEOUT = 10.0

#: a render starts at least this many seconds after the last one ended ...
SPACING = 0.05
#: ... and at least this many times the last render's length
SPACING_FACTOR = 5.0


def next_render_at(start: float, end: float) -> float:
    """When the next render may start, the last one having run from ``start`` to ``end`` (one clock)."""
    return end + max(SPACING, SPACING_FACTOR * (end - start))


class SharedRender:
    """Threads asking for a body (:meth:`get`) share renders of ``render`` by the module's rule.
    ``render``'s exceptions reach every caller that waited for that render."""

    def __init__(self, render: Callable[[], bytes], clock: Callable[[], float] = time.monotonic) -> None:
        self._render = render
        self._clock = clock
        self._cond = threading.Condition()
        self._started = 0  #: renders started so far
        self._done = 0  #: the last render that ended
        self._running = False
        self._result: tuple[bytes | None, BaseException | None] = (None, None)
        self._after = 0.0

    def get(self) -> bytes:
        """A body rendered after this call began. Raises what that render raised."""
        with self._cond:
            want = self._started + 1  # a render that has not started yet
            while self._done < want:
                if self._running:
                    self._cond.wait()
                    continue
                wait = self._after - self._clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._running = True
                self._started += 1
                mine = self._started
                break
            else:
                return self._answer()
        start = self._clock()
        result: tuple[bytes | None, BaseException | None]
        try:
            result = (self._render(), None)
        except Exception as e:  # noqa: BLE001 - handed to every caller of this render
            result = (None, e)
        end = self._clock()
        with self._cond:
            self._result = result
            self._done = mine
            self._running = False
            self._after = next_render_at(start, end)
            self._cond.notify_all()
            return self._answer()

    def _answer(self) -> bytes:
        body, err = self._result
        if err is not None:
            raise err
        assert body is not None
        return body


class BoundedListener:
    """Serves an aiohttp ``runner`` (set up, its application given :meth:`middleware` before the
    setup) on ``host:port`` under the module's connection rules. :meth:`start`, then :meth:`close`."""

    def __init__(self, runner: web.AppRunner, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = CONNECTION_TIMEOUT) -> None:
        self.runner = runner
        self.max_connections = max_connections
        self.timeout = timeout
        #: open connections, oldest first: transport -> its guard
        self.open: dict[asyncio.BaseTransport, _Guard] = {}
        self._server: asyncio.base_events.Server | None = None

    def middleware(self) -> Any:
        """Tells a connection's guard when a request is in its handler (never evicted, no timer)."""
        return request_middleware(self.open)

    async def start(self, host: str, port: int) -> int:
        """Listen; the port (``port`` 0 picks one). Raises OSError."""
        server = self.runner.server
        assert server is not None, "runner not set up"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Guard(self, server()), host, port, backlog=128)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for g in list(self.open.values()):
                g.abort()
            await self._server.wait_closed()

    def admit(self, g: _Guard) -> bool:
        if len(self.open) >= self.max_connections:
            idle = next((o for o in self.open.values() if not o.busy), None)
            if idle is None:
                return False
            idle.abort()
            if idle.transport is not None:
                self.open.pop(idle.transport, None)
        assert g.transport is not None
        self.open[g.transport] = g
        return True


class _Guard(GuardedProtocol):
    """aiohttp's protocol for one connection, wrapped: admitted under the cap, aborted when it has
    no request in its handler for the listener's timeout."""

    def __init__(self, owner: BoundedListener, inner: Any) -> None:
        super().__init__(inner)
        self.owner = owner
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.owner.admit(self):
            transport.abort()
            return
        self.arm(self.owner.timeout)
        self.pass_connection(transport)

    def request_started(self) -> None:
        self.busy = True
        self.disarm()

    def request_finished(self) -> None:
        self.busy = False
        self.arm(self.owner.timeout)

    def closed(self) -> None:
        if self.transport is not None and self.owner.open.get(self.transport) is self:
            del self.owner.open[self.transport]
