"""One connection of an aiohttp server, wrapped so that its listener can bound it: the webhook's
HTTPS listener (``webhook/server.py``: a cap, a timeout per connection state) and the metrics
listeners (:class:`kube_vgpu.scrape.BoundedListener`: a cap that evicts the longest-idle one, one
timeout) each subclass :class:`GuardedProtocol` with their own rules, and tell it when a request is
in its handler through :func:`request_middleware`.

aiohttp's own protocol (``inner``) gets every event; the wrapper adds a timer that aborts the
connection when it fires, and hooks for the subclass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection (``inner``), with a timer: :meth:`arm` starts it (a new
    one replaces the last), :meth:`disarm` stops it, and when it fires :meth:`expired` runs (by
    default: abort the connection). Subclasses decide when, in :meth:`connection_made` (call
    :meth:`pass_connection` to hand the connection to ``inner``), :meth:`request_started`,
    :meth:`request_finished` and :meth:`closed` (the connection is gone; before ``inner`` hears
    of it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._passed = False  #: inner has the connection

    def arm(self, seconds: float) -> None:
        self.disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._fire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self.expired()

    def expired(self) -> None:
        """The timer fired: abort the connection."""
        self.abort()

    def abort(self) -> None:
        self.disarm()
        if self.transport is not None:
            self.transport.abort()

    def pass_connection(self, transport: asyncio.Transport) -> None:
        """Hand the connection to ``inner`` (aiohttp starts reading requests)."""
        self._passed = True
        self.inner.connection_made(transport)

    # -- hooks --------------------------------------------------------------------------------
    def request_started(self) -> None:
        """A request is in the application's handler."""

    def request_finished(self) -> None:
        """The handler returned (the answer is written or being written)."""

    def closed(self) -> None:
        """The connection is gone (timer stopped already)."""

    # -- asyncio.Protocol: every event passed on ----------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.closed()
        if self._passed:
            self.inner.connection_lost(exc)


def request_middleware(guards: Mapping[asyncio.BaseTransport, GuardedProtocol]) -> Any:
    """aiohttp middleware telling the request's connection guard (found in ``guards`` by transport)
    when the request enters and leaves the handler."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        g = guards.get(request.transport) if request.transport is not None else None
        if g is not None:
            g.request_started()
        try:
            return await handler(request)
        finally:
            if g is not None:
                g.request_finished()

    return guard
