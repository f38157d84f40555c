"""Liveness of the container's processes, as containers run them: zombies (a PID 1 that does not reap)
and nested PID namespaces (``unshare --pid --fork``, with the container's /proc or with its own).

Before: a zombie kept its memory charged (false OOM), and a process in a nested PID namespace judged
the others by ``kill(pid, 0)`` in its own namespace and "reclaimed" live processes' usage.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, rc_usage

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare (real PID namespaces)")


def _env(tc: Toolchain, cache: Path) -> dict[str, str]:
    return tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                  LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1")


def _hold(tc: Toolchain, cache: Path, mib: int, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    p = subprocess.Popen([*(prefix or []), str(tc.prog), "direct", "hold", str(mib), "60"], env=_env(tc, cache),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert rc_usage(parse(line)["hold"])[0] == 0, line
    return p


def _alloc(tc: Toolchain, cache: Path, mib: int, prefix: list[str] | None = None) -> tuple[int, int]:
    proc = subprocess.run([*(prefix or []), str(tc.prog), "direct", "hold", str(mib), "0"], env=_env(tc, cache),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return rc_usage(parse(proc.stdout)["hold"])


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def _stop(p: subprocess.Popen[str]) -> None:
    """Kills the program (for ``unshare --fork``: its child, which unshare then reaps) and waits."""
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children")
    kids = children.read_text().split() if children.exists() else []
    for k in kids:
        os.kill(int(k), 9)
    p.kill()
    p.wait(timeout=10)


def test_zombie_counts_as_dead(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    child = subprocess.Popen([str(tc.prog), "direct", "hold", "700", "0"], env=_env(tc, cache),
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert rc_usage(parse(child.stdout.readline())["hold"]) == (0, 700 * MIB)
    child.stdout.read()  # EOF: it has exited; nobody reaps it yet (as under a PID 1 that never waits)
    pid = child.pid
    while _state(pid) != "Z":  # exit -> zombie is one kernel step after EOF
        os.sched_yield()
    try:
        assert _alloc(tc, cache, 500) == (0, 500 * MIB)  # the zombie's 700 MiB were reclaimed
    finally:
        child.wait(timeout=10)


NESTED = ["unshare", "--pid", "--fork", "--"]
NESTED_OWN_PROC = ["unshare", "--pid", "--fork", "--mount-proc", "--"]


def test_nested_pid_namespace_never_reclaims_live_processes(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    outer = _hold(tc, cache, 700)
    try:
        # inside a nested namespace (same /proc): the outer process's 700 MiB stay counted
        assert _alloc(tc, cache, 500, NESTED) == (2, 700 * MIB)
        assert _alloc(tc, cache, 200, NESTED) == (0, 900 * MIB)
        inner = _hold(tc, cache, 200, NESTED)
        try:
            # and the outer view counts the nested process by the pid it sees
            assert _alloc(tc, cache, 200) == (2, 900 * MIB)
        finally:
            _stop(inner)
        assert _alloc(tc, cache, 300) == (0, 1000 * MIB)  # the nested one is gone, and reclaimed
    finally:
        _stop(outer)


def test_nested_namespace_with_its_own_proc(tc: Toolchain, tmp_path: Path) -> None:
    """A process that mounted its own /proc records pids no other process can look up: the slot's
    lock (dropped by the kernel at exit) decides, both ways."""
    cache = tmp_path / "vgpu.cache"
    outer = _hold(tc, cache, 400)
    try:
        inner = _hold(tc, cache, 300, NESTED_OWN_PROC)
        try:
            assert _alloc(tc, cache, 500) == (2, 700 * MIB)  # the inner 300 MiB count: alive by its lock
            assert _alloc(tc, cache, 500, NESTED_OWN_PROC) == (2, 700 * MIB)  # and the outer 400 from inside
        finally:
            _stop(inner)
        assert _alloc(tc, cache, 500) == (0, 900 * MIB)  # lock gone: reclaimed
    finally:
        _stop(outer)
