"""Read the shim's shared accounting file (``CUDA_DEVICE_MEMORY_SHARED_CACHE``), layout version 2.

The layout is defined in ``libvgpu/src/region.h``; this reader is for monitors and tests. It
reads without taking the lock, so figures are a consistent-enough snapshot, not a transaction.
"""

from __future__ import annotations

__all__ = ["MAGIC", "NDEV", "NSLOTS", "SIZE", "VERSION", "Process", "Region", "RegionError", "read_region"]

import errno
import os
import stat
import struct
from dataclasses import dataclass, field

MAGIC = 0x55504756
VERSION = 2
NDEV = 16
NSLOTS = 1024
_HEADER = struct.Struct("<IIQII16Q16I16Q")  # magic .. used[16]
_OOM_REFUSALS = struct.Struct("<Q")  # at 416, after the lock and the recoveries counter
_OOM_REFUSALS_OFFSET = 416
_SLOTS_OFFSET = 472
_SLOT = struct.Struct("<iiQ16Q4Q")
SIZE = _SLOTS_OFFSET + NSLOTS * _SLOT.size


class RegionError(ValueError):
    """The file is not a version-2 libvgpu region (wrong magic, version or size)."""


@dataclass
class Process:
    """One process slot: ``pid`` and bytes ``used`` per device index."""

    pid: int
    used: list[int]


@dataclass
class Region:
    """Snapshot of a region: per-device ``limit``/``used`` in bytes, ``sm_limit`` in percent;
    ``oom_refusals``: allocations (and context limits) the shim refused past the limit, all devices,
    since the file was created (a counter: it only grows while the file lives)."""

    limit: list[int]
    sm_limit: list[int]
    used: list[int]
    processes: list[Process] = field(default_factory=list)
    oom_refusals: int = 0


def _read_regular(path: str | os.PathLike[str], size: int) -> bytes:
    """At most ``size`` bytes of the regular file at ``path``, read without following a symlink in
    its last component and without blocking. The file lives in a directory the container (a
    tenant) can write: it may be swapped for a symlink to ``/dev/zero``, a FIFO or a huge file, and
    the reader (the device plugin, on the node) must neither hang nor read without bound.

    The file is first opened with ``O_PATH`` (which opens nothing: no driver is called) and checked to
    be a regular file; only that same inode is then opened for reading (through ``/proc/self/fd``). A
    device node the tenant created there (``mknod`` is in a container's default capabilities) is
    never opened: on the node, outside the container's device rules, opening one can start a
    watchdog (the node reboots), rewind a tape or take a terminal as the reader's controlling one.

    Raises OSError (also for a symlink, FIFO, device or directory: ``ELOOP`` / ``EINVAL``)."""
    pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(pfd)
    try:
        st2 = os.fstat(fd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(errno.EINVAL, "not the regular file checked", str(path))
        chunks: list[bytes] = []
        left = size
        while left > 0:
            b = os.read(fd, left)
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_region(path: str | os.PathLike[str]) -> Region:
    """Parse the region file at ``path`` (read as :func:`_read_regular` does: a regular file only,
    no symlink, at most ``SIZE`` bytes).

    Raises:
        OSError: the file cannot be read, or is not a regular file.
        RegionError: the content is not a version-2 region.
    """
    data = _read_regular(path, SIZE)
    if len(data) < SIZE:
        raise RegionError(f"{path}: {len(data)} bytes, expected {SIZE}")
    fields = _HEADER.unpack_from(data, 0)
    magic, version, size, ndev, nslots = fields[:5]
    if magic != MAGIC or version != VERSION or size != SIZE or ndev != NDEV or nslots != NSLOTS:
        raise RegionError(f"{path}: not a libvgpu v{VERSION} region (magic {magic:#x}, version {version})")
    limit = list(fields[5 : 5 + NDEV])
    sm_limit = list(fields[5 + NDEV : 5 + 2 * NDEV])
    used = list(fields[5 + 2 * NDEV : 5 + 3 * NDEV])
    procs = []
    for i in range(NSLOTS):
        slot = _SLOT.unpack_from(data, _SLOTS_OFFSET + i * _SLOT.size)
        if slot[0]:
            procs.append(Process(pid=slot[0], used=list(slot[3 : 3 + NDEV])))
    (refusals,) = _OOM_REFUSALS.unpack_from(data, _OOM_REFUSALS_OFFSET)
    return Region(limit=limit, sm_limit=sm_limit, used=used, processes=procs, oom_refusals=refusals)
