"""What the two certs Jobs (``kube-vgpu certs``, ``kube-vgpu certs signing-keys``) share: files written
whole or not at all (TLS bundles, signing keys), and how a run ends (a JSON summary, or exit 1)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def run_job(run: Callable[[Any], dict[str, Any]], args: Any, logger: logging.Logger, failed: str) -> int:
    """Run ``run(args)`` and end the Job: its summary printed as one JSON line, exit status 0; any
    exception (API, file, config errors) logged as ``failed`` with its type and text, exit status 1
    (the Job retries)."""
    try:
        summary = run(args)
    except Exception as e:  # noqa: BLE001 - report, exit 1 (the Job retries)
        logger.error(failed, extra={"error": f"{type(e).__name__}: {e}"})
        return 1
    print(json.dumps(summary))
    return 0
