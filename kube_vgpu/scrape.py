"""How often a component renders its ``/metrics`` body: the one rule the extender (asyncio) and the
device and DRA plugins (threads) share.

Their metrics ports are reachable from the pod network, and a render costs CPU that the
component's own work (the extender's filter and bind on its event loop, the plugins' Allocate and
PreStartContainer) then waits for under the interpreter lock. A flood of scrapes rendering at once
slowed that work down by as many renders as were running. So:

* one render runs at a time, and every scrape waiting for it gets its body: a scrape is answered
  by a render that started after it arrived (it sees the state as of its arrival or later);
* the next render starts at least :data:`SPACING` seconds, and :data:`SPACING_FACTOR` times the
  last render's length, after the last one ended (:func:`next_render_at`): rendering takes at
  most a sixth of the time, however many scrape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
