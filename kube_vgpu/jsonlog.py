"""JSON logs to stderr, shared by every component (one formatter, one setup).

One object per line: ``ts`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``msg``, every
field a call passes in ``extra`` (``pod`` as ``ns/name``, ``node``, ``gpu`` uuid, ``key``,
``error``, ...), and ``exc`` with the traceback when there is one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import Any

_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    """Formats a LogRecord as one JSON line (see module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in out and v is not None:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler on whatever ``sys.stderr`` is at each emit (like logging's last resort), so
    a stream swapped out and closed later (pytest's capture) is never written to."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr


#: the levels every command's ``--log-level`` takes
LEVELS = ("debug", "info", "warning", "error")


def setup(level: str = "info", quiet: Iterable[str] = ()) -> None:
    """Route the root logger to stderr as JSON at ``level`` (one of :data:`LEVELS`); loggers
    named in ``quiet`` log warnings and above only (e.g. ``aiohttp.access``)."""
    h = StderrHandler()
    h.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
