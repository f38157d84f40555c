"""Make the repository root importable (for ``tests.fakeapi``) when pytest is run as a script, and
keep every test's background work inside the test: reflector threads joined, root logging
handlers restored (a handler left on a stream pytest has closed prints "Logging error")."""

import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _stream_closed(h: logging.Handler) -> bool:
    stream = getattr(h, "stream", None)
    return bool(getattr(stream, "closed", False))


@pytest.fixture(autouse=True)
def _contained_background_work() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    # a handler an earlier test left on a stream that is closed now would fail on every record
    root.handlers[:] = [h for h in handlers if not _stream_closed(h)]
    yield
    lingering = [t for t in threading.enumerate() if t.name.startswith("reflector-")]
    for t in lingering:  # services stop their reflectors on exit; wait for the last list to end
        t.join(10)
    root.handlers[:] = [h for h in handlers if not _stream_closed(h)]
    root.setLevel(level)
    alive = [t.name for t in lingering if t.is_alive()]
    assert not alive, f"reflector threads still running after the test: {alive}"
