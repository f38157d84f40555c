"""Robustness of the shim against a damaged shared file, bad limit values and the opt-out switch.

Each test here failed before the fix it covers: a truncated cache file crashed the process with
SIGBUS, an overwritten header lifted the limit, lax parsing turned bad values into "no limit",
a garbage file was re-initialised silently, and the fake driver accepted cuMemAlloc(SIZE_MAX).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from libvgpu.region import read_region
from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, parse, rc_usage, run

HEADER_BYTES = 344  # magic .. used[]: everything before the mutex (region.h)
SLOTS_OFFSET = 472


def _start_holder(tc: Toolchain, cache: Path, first_mib: int, *steps: int,
                  **env: str) -> subprocess.Popen[str]:
    e = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
               LIBVGPU_CONTEXT_COST="0", **env)
    proc = subprocess.Popen([str(tc.prog), "direct", "hold_then", str(first_mib), *map(str, steps)], env=e,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = parse(proc.stdout.readline())
    assert rc_usage(first["first"]) == (0, first_mib * MIB)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _finish(proc: subprocess.Popen[str]) -> tuple[dict[str, str], str]:
    out, err = proc.communicate("go\n", timeout=30)
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 = SIGBUS)\n{out}\n{err}"
    return parse(out), err


# ------------------------------------------------------------------ 1: truncated file, no SIGBUS
@pytest.mark.parametrize("new_size", [0, 4096])
def test_truncated_cache_file_does_not_crash(tc: Toolchain, tmp_path: Path, new_size: int) -> None:
    cache = tmp_path / "vgpu.cache"
    proc = _start_holder(tc, cache, 600, 600, 300)
    os.truncate(cache, new_size)
    out, err = _finish(proc)
    # the process keeps its own 600 MiB against its own 1 GiB limit: 600 more is refused, 300 fits
    assert rc_usage(out["step0"]) == (2, 600 * MIB)
    assert rc_usage(out["step1"]) == (0, 900 * MIB)
    assert (int(out["meminfo_rc"]), int(out["total"]), int(out["free"])) == (0, GIB, GIB - 600 * MIB)
    assert rc_usage(out["free0"]) == (0, 0)
    warns = [ln for ln in err.splitlines() if "was truncated under this process" in ln]
    assert len(warns) == 1 and "WARN" in warns[0], err


def test_truncated_cache_file_is_reinitialised_for_new_processes(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    proc = _start_holder(tc, cache, 600, 100)
    os.truncate(cache, 0)
    out, _ = _finish(proc)
    assert rc_usage(out["step0"]) == (0, 700 * MIB)
    later = run(tc, "direct", "hold", "900", "0", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    assert rc_usage(parse(later.stdout)["hold"]) == (0, 900 * MIB)
    assert read_region(cache).limit[0] == GIB


# ------------------------------------------------------------------ 2: overwritten header, fail closed
@pytest.mark.parametrize("pattern", [b"\x00", b"\x5a", b"\xff"])
def test_overwritten_header_keeps_the_limit(tc: Toolchain, tmp_path: Path, pattern: bytes) -> None:
    cache = tmp_path / "vgpu.cache"
    proc = _start_holder(tc, cache, 600, 600, 300)
    with open(cache, "r+b") as f:
        f.write(pattern * HEADER_BYTES)
    out, err = _finish(proc)
    assert rc_usage(out["step0"]) == (2, 600 * MIB)  # never "unlimited"
    assert rc_usage(out["step1"]) == (0, 900 * MIB)
    assert int(out["total"]) == GIB
    warns = [ln for ln in err.splitlines() if "no longer has the header this process joined" in ln]
    assert len(warns) == 1 and "WARN" in warns[0], err


def test_header_rewritten_with_other_limits_keeps_own_limit(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    proc = _start_holder(tc, cache, 600, 600)
    with open(cache, "r+b") as f:
        f.seek(24)
        f.write((64 * GIB).to_bytes(8, "little"))  # limit[0] raised in the file
    out, err = _finish(proc)
    assert rc_usage(out["step0"]) == (2, 600 * MIB)
    # no other live process uses the file: it is rebuilt with this process's limits and shared again
    assert "rebuilt it (keeping the usage of 1 live process(es)) and sharing it again" in err, err
    assert read_region(cache).limit[0] == GIB


def test_zeroed_mutex_and_header_do_not_hang(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    proc = _start_holder(tc, cache, 600, 600)
    with open(cache, "r+b") as f:
        f.write(b"\x00" * SLOTS_OFFSET)
    out, _ = _finish(proc)
    assert rc_usage(out["step0"]) == (2, 600 * MIB)


# ------------------------------------------------------------------ 3: strict limit parsing
@pytest.mark.parametrize("value", ["-1", "99999999999999999999g", "17179869185g", "17179869184g", "1.5g", "abc", "0", "0m", "",
                                   " 1g", "+1g", "1gb", "1g1", "18446744073709551616"])
def test_invalid_or_zero_limit_fails_closed(tc: Toolchain, value: str) -> None:
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0=value, LIBVGPU_CONTEXT_COST="0")
    out = parse(proc.stdout)
    assert rc_usage(out["alloc512"]) == (2, 0)  # every allocation refused
    assert (int(out["total"]), int(out["free"])) == (0, 0)
    warns = [ln for ln in proc.stderr.splitlines() if "CUDA_DEVICE_MEMORY_LIMIT_0" in ln]
    assert len(warns) == 1 and "WARN" in warns[0] and f'"{value}"' in warns[0], proc.stderr


@pytest.mark.parametrize(("value", "expected"), [
    ("1073741824", GIB), ("1048576k", GIB), ("1024m", GIB), ("1024M", GIB), ("1g", GIB), ("1G", GIB),
    ("17179869183g", 17179869183 * GIB),  # 2^64 - 2^30: the largest g value that fits in 64 bits
])
def test_valid_limits(tc: Toolchain, value: str, expected: int) -> None:
    proc = run(tc, "direct", "alloc_bytes", str(512 * MIB), CUDA_DEVICE_MEMORY_LIMIT_0=value,
               LIBVGPU_CONTEXT_COST="0")
    out = parse(proc.stdout)
    assert rc_usage(out["alloc"]) == (0, 512 * MIB)
    physical = 143771 * MIB
    assert int(out["total"]) == min(expected, physical)
    assert "WARN" not in proc.stderr


def test_invalid_device_limit_does_not_fall_back_to_global(tc: Toolchain) -> None:
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT="8g", CUDA_DEVICE_MEMORY_LIMIT_0="8gb",
               LIBVGPU_CONTEXT_COST="0")
    assert rc_usage(parse(proc.stdout)["alloc512"]) == (2, 0)


def test_invalid_global_limit_fails_closed(tc: Toolchain) -> None:
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT="-1", LIBVGPU_CONTEXT_COST="0")
    assert rc_usage(parse(proc.stdout)["alloc512"]) == (2, 0)
    assert 'invalid CUDA_DEVICE_MEMORY_LIMIT="-1"' in proc.stderr


def test_absent_limit_is_no_limit(tc: Toolchain) -> None:
    proc = run(tc, "direct", "alloc_bytes", str(100 * GIB), LIBVGPU_CONTEXT_COST="0")
    assert rc_usage(parse(proc.stdout)["alloc"]) == (0, 100 * GIB)
    assert "WARN" not in proc.stderr


# ------------------------------------------------------------------ 4: re-initialisation is logged
@pytest.mark.parametrize("content", [b"\xff" * 4096, b"\x00" * 100, None], ids=["garbage", "short", "zeroed-header"])
def test_damaged_file_reinitialisation_is_logged(tc: Toolchain, tmp_path: Path, content: bytes | None) -> None:
    cache = tmp_path / "vgpu.cache"
    if content is None:  # full size, header zeroed
        run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
            LIBVGPU_CONTEXT_COST="0")
        with open(cache, "r+b") as f:
            f.write(b"\x00" * HEADER_BYTES)
    else:
        cache.write_bytes(content)
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
               LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="2")
    lines = [ln for ln in proc.stderr.splitlines() if "unknown layout" in ln and "re-initialised" in ln]
    assert len(lines) == 1 and "WARN" in lines[0], proc.stderr
    assert read_region(cache).limit[0] == GIB


def test_empty_file_is_initialised_silently(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    cache.write_bytes(b"")
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
               LIBVGPU_CONTEXT_COST="0")
    assert "unknown layout" not in proc.stderr


def test_bad_header_with_live_process_keeps_its_usage(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    holder = _start_holder(tc, cache, 600, 100)
    try:
        with open(cache, "r+b") as f:
            f.write(b"\x00" * HEADER_BYTES)
        proc = run(tc, "direct", "hold", "500", "0", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                   CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
        assert "keeping the usage of 1 live process(es)" in proc.stderr
        assert rc_usage(parse(proc.stdout)["hold"]) == (2, 600 * MIB)  # the live 600 MiB still counts
    finally:
        _finish(holder)


# ------------------------------------------------------------------ 5: CUDA_DISABLE_CONTROL
@pytest.mark.parametrize(("value", "disabled"), [
    ("true", True), ("TRUE", True), ("True", True), ("1", True), ("false", False), ("0", False), ("yes", False),
])
def test_disable_control_values(tc: Toolchain, value: str, disabled: bool) -> None:
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DISABLE_CONTROL=value,
                    LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["alloc768"])[0] == (0 if disabled else 2)


# ------------------------------------------------------------------ 6: fake driver refuses what it cannot hold
@pytest.mark.parametrize("size", ["max", str(143771 * MIB + 1)])
def test_fake_refuses_allocations_larger_than_the_device(tc: Toolchain, size: str) -> None:
    proc = run(tc, "direct", "alloc_bytes", size, LIBVGPU_CONTEXT_COST="0")
    out = parse(proc.stdout)
    assert int(out["alloc"].split(":")[0]) == 2
    assert int(out["free"]) > 0  # the driver's counter did not wrap
    bare = subprocess.run([str(tc.prog), "direct", "alloc_bytes", size], env=tc.env(False),
                          capture_output=True, text=True, timeout=30)  # the fake alone, no shim
    assert bare.returncode == 0, bare.stderr
    out = parse(bare.stdout)
    assert int(out["alloc"].split(":")[0]) == 2
    assert int(out["free"]) == int(out["total"]) - 300 * MIB  # only the context's 300 MiB is used
