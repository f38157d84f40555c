"""Per-container GPU memory use, read from the shim's shared accounting files on the node.

Each GPU container gets ``<cache-host-dir>/<pod uid>_<container>/`` mounted at
``envcontract.CACHE_CONTAINER_DIR``; the shim keeps its shared region in ``vgpu.cache`` there
(``CUDA_DEVICE_MEMORY_SHARED_CACHE``). The region's binary layout belongs to libvgpu
(``libvgpu/src/region.h``); it is parsed by ``kube_vgpu.shimregion.read_region``, the one reader
of that format. Nothing here raises: a missing, short or foreign file means "no data".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from .response import CACHE_FILE, cache_dir_name

log = logging.getLogger("kube_vgpu.deviceplugin.shimcache")


def _reader() -> Callable[[str], Any] | None:
    from kube_vgpu.shimregion import read_region

    return read_region


def cache_path(cache_host_dir: str, pod_uid: str, container: str) -> str:
    """Host path of a container's shared cache file."""
    return os.path.join(cache_host_dir, cache_dir_name(pod_uid, container), CACHE_FILE)


def read_container(cache_host_dir: str, pod_uid: str, container: str) -> dict[int, int] | None:
    """Bytes in use per visible device index of one container, or None when there is no data."""
    if not pod_uid:
        return None
    path = cache_path(cache_host_dir, pod_uid, container)
    if not os.path.exists(path):
        return None
    read = _reader()
    if read is None:
        return None
    try:
        region = read(path)
    except (OSError, ValueError) as e:  # RegionError is a ValueError
        log.debug("cache file %s not readable: %s", path, e)
        return None
    return {i: int(u) for i, u in enumerate(region.used)}
