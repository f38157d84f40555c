"""Self-healing shared accounting: a damaged or truncated file, or a lock held by a stuck process, is
rebuilt and shared again instead of leaving each process with private accounting (which let a
container use n x its limit: 1.4 and 3.3 GiB under 1 GiB).

Each test runs two live processes of one container; a process that went private would get its own
allocation through where the shared accounting refuses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from libvgpu.region import read_region
from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, rc_usage

HEADER_BYTES = 344  # magic .. used[] (region.h)
RECOVERIES = 408  # offset of the recoveries counter (region.h)


def _env(tc: Toolchain, cache: Path) -> dict[str, str]:
    return tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                  LIBVGPU_CONTEXT_COST="0")


class Stepper:
    """A live process of the container that allocates on request (scenario ``steps``)."""

    def __init__(self, tc: Toolchain, cache: Path) -> None:
        self.p = subprocess.Popen([str(tc.prog), "direct", "steps"], env=_env(tc, cache), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.p.stdout is not None
        assert self.p.stdout.readline().strip() == "ready"

    def alloc(self, mib: int) -> tuple[int, int]:
        """Allocate ``mib`` MiB; returns (CUresult, container usage in bytes as this process sees it)."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(f"{mib}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, self.finish()
        return rc_usage(parse(line)["alloc"])

    def finish(self) -> str:
        """End the process; returns its stderr."""
        _, err = self.p.communicate("", timeout=60)
        return err


def _alloc(tc: Toolchain, cache: Path, mib: int) -> tuple[int, int]:
    proc = subprocess.run([str(tc.prog), "direct", "hold", str(mib), "0"], env=_env(tc, cache), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return rc_usage(parse(proc.stdout)["hold"])


@pytest.mark.parametrize("pattern", [b"\x00", b"\x5a", b"\xff"])
def test_overwritten_header_is_rebuilt_and_shared_again(tc: Toolchain, tmp_path: Path, pattern: bytes) -> None:
    cache = tmp_path / "vgpu.cache"
    a, b = Stepper(tc, cache), Stepper(tc, cache)
    try:
        assert a.alloc(600) == (0, 600 * MIB)
        assert b.alloc(300) == (0, 900 * MIB)
        with open(cache, "r+b") as f:
            f.write(pattern * HEADER_BYTES)
        # private accounting would give A 600 + 300 of its own; shared, B's 300 still counts
        assert a.alloc(300) == (2, 900 * MIB)
        assert b.alloc(100) == (0, 1000 * MIB)
        assert _alloc(tc, cache, 100) == (2, 1000 * MIB)  # a new process sees both
        region = read_region(cache)
        assert region.used[0] == 1000 * MIB and len(region.processes) == 2
    finally:
        err_a, _ = a.finish(), b.finish()
    assert "rebuilt it (keeping the usage of 2 live process(es)) and sharing it again" in err_a, err_a


@pytest.mark.parametrize(("new_size", "a_sees"), [(0, 610), (4096, 910)])
def test_truncated_file_is_rebuilt_and_shared_again(tc: Toolchain, tmp_path: Path, new_size: int,
                                                    a_sees: int) -> None:
    cache = tmp_path / "vgpu.cache"
    a, b = Stepper(tc, cache), Stepper(tc, cache)
    try:
        assert a.alloc(600) == (0, 600 * MIB)
        assert b.alloc(300) == (0, 900 * MIB)
        os.truncate(cache, new_size)  # 0: every slot is gone with the data; 4096: header and both slots survive
        assert a.alloc(10) == (0, a_sees * MIB)  # A remaps the file (rebuilding it if needed), its 600 count again
        assert b.alloc(10) == (0, 920 * MIB)  # B's 300 count again (re-registered when its slot was lost)
        assert a.alloc(200) == (2, 920 * MIB)  # shared again: private accounting would allow this
        assert _alloc(tc, cache, 200) == (2, 920 * MIB)
        assert read_region(cache).used[0] == 920 * MIB
    finally:
        err_a, err_b = a.finish(), b.finish()
    assert "sharing it again" in err_a, err_a
    if new_size == 0:
        assert "registering its usage again" in err_b, err_b
    assert "now private" not in err_a + err_b


def _stuck_holder(tc: Toolchain, cache: Path) -> subprocess.Popen[str]:
    """A live process that holds 100 MiB and the region lock, then stops (SIGSTOP)."""
    holder = subprocess.Popen([str(tc.prog), "direct", "hold_lock"], env=_env(tc, cache), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    assert holder.stdout is not None
    lines = []
    for line in holder.stdout:
        lines.append(line)
        if line.strip() == "locked":
            break
    assert "hold=0\n" in lines, lines
    holder.send_signal(signal.SIGSTOP)
    return holder


def test_stuck_lock_holder_is_reset_and_sharing_goes_on(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    holder = _stuck_holder(tc, cache)
    try:
        c = Stepper(tc, cache)  # waits out the stuck lock (2 s), resets it, stays shared
        try:
            assert c.alloc(900) == (0, 1000 * MIB)  # the stuck holder's 100 MiB still count
            assert _alloc(tc, cache, 100) == (2, 1000 * MIB)  # and a new process sees both
            assert int.from_bytes(cache.read_bytes()[RECOVERIES:RECOVERIES + 8], "little") == 1  # one reset
        finally:
            err = c.finish()
        assert "re-initialising it" in err and "now private" not in err, err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert _alloc(tc, cache, 1000) == (0, 1000 * MIB)  # the holder is dead: its 100 MiB are reclaimed
