"""Per-container GPU memory use, read from the shim's shared accounting files on the node.

Each GPU container gets ``<cache-host-dir>/<pod uid>_<container>/`` mounted at
``envcontract.CACHE_CONTAINER_DIR``; the shim keeps its shared region in ``vgpu.cache`` there
(``CUDA_DEVICE_MEMORY_SHARED_CACHE``). The region's binary layout is owned by libvgpu and described
in docs/shim.md; until that layout is pinned here, :func:`parse` recognises no format and the
per-container metric is simply absent. Nothing here ever raises: a missing, short or foreign file
means "no data".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from .response import CACHE_FILE, cache_dir_name

log = logging.getLogger("kube_vgpu.deviceplugin.shimcache")

#: parsers tried in order: bytes of the cache file -> {visible device index: used bytes} or None
PARSERS: list[Callable[[bytes], dict[int, int] | None]] = []

#: read at most this many bytes of a cache file
MAX_READ = 4 * 1024 * 1024


def parse(data: bytes) -> dict[int, int] | None:
    """Per visible device index, bytes in use; None when no known parser accepts ``data``."""
    for p in PARSERS:
        try:
            out = p(data)
        except (ValueError, IndexError, OverflowError):
            out = None
        if out is not None:
            return out
    return None


def read_container(cache_host_dir: str, pod_uid: str, container: str) -> dict[int, int] | None:
    """Usage of one container from its cache file, or None when absent or unreadable."""
    if not pod_uid:
        return None
    path = os.path.join(cache_host_dir, cache_dir_name(pod_uid, container), CACHE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_READ)
    except OSError:
        return None
    out = parse(data)
    if out is None:
        log.debug("cache file %s: format not recognised", path)
    return out
