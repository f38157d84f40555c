"""A tenant against the device plugin through its own shared-cache directory.

The per-container cache directory (``<cache-host-dir>/<pod uid>_<container>``) is mounted read-write
into the tenant's container, and the device plugin reads the ``vgpu.cache`` file in it on the node
for its metrics. The tenant can replace that file with anything; the plugin must neither hang nor
read without bound, nor follow a symlink out of the directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deviceplugin.shimcache import CACHE_FILE, cache_dir_name, read_container
from kube_vgpu.shimregion import SIZE, RegionError, read_region

UID, CTR = "uid-tenant", "train"


@pytest.fixture
def cache_file(tmp_path: Path) -> Path:
    d = tmp_path / cache_dir_name(UID, CTR)
    d.mkdir()
    return d / CACHE_FILE


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom", "/proc/self/environ", "/etc/shadow"])
def test_symlink_out_of_the_directory_is_not_followed(cache_file: Path, target: str) -> None:
    cache_file.symlink_to(target)
    with pytest.raises(OSError):
        read_region(cache_file)
    assert read_container(str(cache_file.parent.parent), UID, CTR) is None


def test_fifo_does_not_block_the_reader(cache_file: Path) -> None:
    """Opening a FIFO for reading blocks until a writer comes; the reader opens non-blocking and
    refuses anything but a regular file (this test would hang, not fail, without that)."""
    os.mkfifo(cache_file)
    with pytest.raises(OSError):
        read_region(cache_file)
    assert read_container(str(cache_file.parent.parent), UID, CTR) is None


def test_huge_file_is_read_only_up_to_the_region_size(cache_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(cache_file, "wb") as f:
        f.truncate(64 << 30)  # sparse 64 GiB
    reads: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)
    monkeypatch.setattr(os, "read", counting_read)
    with pytest.raises(RegionError):  # zeros: not a region, and never more than SIZE bytes asked for
        read_region(cache_file)
    assert sum(reads) <= SIZE and max(reads) <= SIZE


def test_directory_in_place_of_the_file_is_refused(cache_file: Path) -> None:
    cache_file.mkdir()
    assert read_container(str(cache_file.parent.parent), UID, CTR) is None
