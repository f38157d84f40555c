"""Files the certs jobs write (TLS bundles, signing keys): written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` through a temporary file in the same directory
    (created with a random name, mode set before the data is written) renamed over ``path``: a
    reader sees the old file or the new one, never a torn one. Raises OSError (the temporary file
    is removed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
