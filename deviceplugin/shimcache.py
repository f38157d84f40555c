"""Per-container GPU memory use, read from the shim's shared accounting files on the node.

Each GPU container gets ``<cache-host-dir>/alloc-<hash of its device IDs>/`` mounted at
``envcontract.CACHE_CONTAINER_DIR``; the shim keeps its shared region in ``vgpu.cache`` there
(``CUDA_DEVICE_MEMORY_SHARED_CACHE``). The region's binary layout belongs to libvgpu
(``libvgpu/src/region.h``); it is parsed by ``kube_vgpu.shimregion.read_region``, the one reader
of that format. Nothing here raises: a missing, short or foreign file means "no data".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .response import CACHE_FILE, ContainerSpec, cache_dir_name

log = logging.getLogger("kube_vgpu.deviceplugin.shimcache")


def _reader() -> Callable[[str], Any] | None:
    from kube_vgpu.shimregion import read_region

    return read_region


def cache_path(cache_host_dir: str, pod_uid: str, container: str, dir_name: str | None = None) -> str:
    """Host path of a container's shared cache file: in ``dir_name`` (the allocation's directory,
    ``alloc-...``) when given, else in the ``<pod uid>_<container>`` directory."""
    return os.path.join(cache_host_dir, dir_name or cache_dir_name(pod_uid, container), CACHE_FILE)


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """What one container's shim reports: ``used`` bytes per visible device index, and
    ``oom_refusals``, the allocations it refused past the limit since the file was created.
    The file is the container's: a tenant can forge both (figures for dashboards, never for booking)."""

    used: dict[int, int]
    oom_refusals: int


def read_container(cache_host_dir: str, pod_uid: str, container: str,
                   dir_name: str | None = None) -> ContainerUsage | None:
    """The usage of one container (its cache directory as in :func:`cache_path`), or None when
    there is no data."""
    if not pod_uid:
        return None
    path = cache_path(cache_host_dir, pod_uid, container, dir_name)
    if not os.path.lexists(path):
        return None
    read = _reader()  # reads a regular file only, no symlink, bounded (the directory is the tenant's)
    if read is None:
        return None
    try:
        region = read(path)
    except (OSError, ValueError) as e:  # RegionError is a ValueError
        log.debug("cache file not readable", extra={"path": str(path), "error": str(e)})
        return None
    return ContainerUsage({i: int(u) for i, u in enumerate(region.used)}, int(region.oom_refusals))


def atomic_write(path: str, text: str, mode: int, sync_dir: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory (opened with
    O_NOFOLLOW): fsync, chmod to ``mode``, rename over ``path``, and with ``sync_dir`` an fsync of the
    directory (so a crash leaves the old or the new file, never a torn one). Raises OSError (the
    temporary file is removed)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if not sync_dir:
        return
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


#: name prefix of the subdirectories :func:`remove_tree` moves up to the top directory while removing it
_HOIST_PREFIX = ".kube-vgpu-rm-"


def remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything in it, never following a symlink, without
    recursion, with at most four file descriptors open and without holding a directory's listing in
    memory, however deep or wide the tree (it is a tenant's: a container can nest directories
    thousands of levels deep, which made ``shutil.rmtree`` fail with ``RecursionError`` or ``EMFILE``,
    or put millions of names in one directory, whose listing would not fit in the plugin's memory).
    Every subdirectory is moved up to ``path`` itself (``renameat`` within ``path``), emptied there and
    removed; each directory is read again until it is empty (entries are removed while it is read).
    A symlink at ``path`` itself is refused (``ELOOP``/``ENOTDIR``).

    Raises OSError when something cannot be removed (what was removed stays removed)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(path, flags)
    n = 0

    def hoist(name: str, dfd: int) -> None:
        nonlocal n
        while True:  # a name free in ``path``: the tenant may have used ours
            n += 1
            hoisted = f"{_HOIST_PREFIX}{n}"
            try:
                os.lstat(hoisted, dir_fd=top)
            except FileNotFoundError:
                break
        os.rename(name, hoisted, src_dir_fd=dfd, dst_dir_fd=top)

    def empty(dfd: int) -> None:
        """Unlink what is not a directory in ``dfd``, move its directories up to ``top``."""
        while True:
            seen = False
            with os.scandir(dfd) as it:
                for e in it:
                    seen = True
                    if e.is_dir(follow_symlinks=False):
                        hoist(e.name, dfd)
                    else:
                        os.unlink(e.name, dir_fd=dfd)
            if not seen:
                return

    try:
        while True:
            seen = False
            with os.scandir(top) as it:
                for e in it:
                    seen = True
                    if not e.is_dir(follow_symlinks=False):
                        os.unlink(e.name, dir_fd=top)
                        continue
                    dfd = os.open(e.name, flags, dir_fd=top)
                    try:
                        empty(dfd)
                    finally:
                        os.close(dfd)
                    os.rmdir(e.name, dir_fd=top)
            if not seen:
                break
    finally:
        os.close(top)
    os.rmdir(path)


def write_host_files(spec: ContainerSpec) -> list[str]:
    """Write ``spec.files`` (the container's limits file) on the host, each atomically (temporary file,
    fsync, rename) with its mode; parent directories are created with mode 0755 (readable by any
    container user, writable by root only, mounted read-only). Returns the paths written.

    Raises OSError when a file cannot be written: the container must not start without its limits.
    """
    written = []
    for f in spec.files:
        d = os.path.dirname(f.host_path)
        os.makedirs(d, mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
        atomic_write(f.host_path, f.contents, f.mode, sync_dir=False)
        written.append(f.host_path)
    return written
