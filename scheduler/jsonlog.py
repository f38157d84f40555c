"""JSON logs to stderr: one object per line with ``ts``, ``level``, ``logger``, ``msg`` and the
context fields ``pod`` (``ns/name``), ``node``, ``gpu`` (uuid), ``key`` (config key), ``error``
(and ``address``/``port`` for listen errors) when a call passes them in ``extra``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = ("pod", "node", "gpu", "key", "error", "reason", "outcome", "policy", "address", "port")


class JSONFormatter(logging.Formatter):
    """Formats a LogRecord as one JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for f in _FIELDS:
            v = record.__dict__.get(f)
            if v is not None:
                out[f] = v
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


def setup(level: str = "info") -> None:
    """Route the root logger to stderr as JSON at ``level`` (debug|info|warning|error)."""
    h = StderrHandler()
    h.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level.upper())
