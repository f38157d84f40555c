"""Shared accounting across processes: stress, KF-29 (dead lock holder), reclaim, mismatched limits."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from libvgpu.region import read_region
from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, parse, rc_usage, run


def _stress(tc: Toolchain, cache: Path, procs: int = 8, threads: int = 8, iters: int = 1500) -> list[dict[str, str]]:
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                 LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1")
    children = [subprocess.Popen([str(tc.prog), "direct", "stress", str(threads), str(iters), str(GIB)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(procs)]
    results = []
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err[-2000:]
        results.append(parse(out))
    return results


def test_stress_8_processes_x_8_threads(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    results = _stress(tc, cache)
    for r in results:
        assert r["over"] == "0"
        assert int(r["max"]) <= GIB
    assert sum(int(r["ooms"]) for r in results) > 0  # the limit was actually contended
    region = read_region(cache)
    assert region.limit[0] == GIB
    assert region.used[0] == 0
    assert region.processes == []


def test_kf29_killed_lock_holder_does_not_block(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    holder = subprocess.Popen([str(tc.prog), "direct", "hold_lock"], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = holder.stdout.readline()
        lines.append(line)
        if line.strip() == "locked" or not line:
            break
    assert "hold=0\n" in lines and "locked\n" in lines, lines
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    assert read_region(cache).used[0] == 100 * MIB  # the dead process's usage is still recorded

    t0 = time.monotonic()
    proc = run(tc, "direct", "hold", "200", "0", timeout=10, CUDA_DEVICE_MEMORY_LIMIT_0="1g",
               CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0
    # the lock was recovered and the dead holder's 100 MiB reclaimed: only our 200 MiB counts
    assert rc_usage(parse(proc.stdout)["hold"]) == (0, 200 * MIB)
    out = parse(run(tc, "direct", "kf20", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                    CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0").stdout)
    assert int(out["rc"]) == 2  # limits still enforced after recovery
    region = read_region(cache)
    assert region.used[0] == 0 and region.processes == []


def test_dead_process_usage_is_reclaimed(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    victim = subprocess.Popen([str(tc.prog), "direct", "hold", "700", "60"], env=env, stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None
    assert rc_usage(parse(victim.stdout.readline())["hold"]) == (0, 700 * MIB)
    # while it lives, its usage counts for the container
    out = parse(run(tc, "direct", "hold", "500", "0", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                    CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="0").stdout)
    assert rc_usage(out["hold"]) == (2, 700 * MIB)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    out = parse(run(tc, "direct", "hold", "500", "0", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                    CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["hold"]) == (0, 500 * MIB)


def test_file_with_other_limits_is_refused_then_reinitialised(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    first = subprocess.Popen([str(tc.prog), "direct", "hold", "100", "60"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None
        assert rc_usage(parse(first.stdout.readline())["hold"]) == (0, 100 * MIB)
        proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="2g",
                   CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
        assert "refusing to mix" in proc.stderr
        out = parse(proc.stdout)
        # its own limits, private accounting: the other process's 100 MiB is not mixed in
        assert int(out["total"]) == 2 * GIB
        assert rc_usage(out["alloc512"]) == (0, 512 * MIB)
        region = read_region(cache)
        assert region.limit[0] == GIB and region.used[0] == 100 * MIB
    finally:
        first.kill()
        first.wait(timeout=10)
    proc = run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="2g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
               LIBVGPU_CONTEXT_COST="0")
    assert "re-initialising" in proc.stderr
    assert read_region(cache).limit[0] == 2 * GIB


def test_garbage_file_is_reinitialised(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    cache.write_bytes(b"\xff" * 4096)
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                    CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["alloc768"])[0] == 2
    assert read_region(cache).limit[0] == GIB


def test_refusals_are_counted_in_the_shared_file_for_the_nodes_metrics(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = dict(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    out = parse(run(tc, "direct", "hold", "500", "0", **env).stdout)
    assert rc_usage(out["hold"]) == (0, 500 * MIB)
    assert read_region(cache).oom_refusals == 0  # an allocation under the limit is not a refusal
    out = parse(run(tc, "direct", "hold", "1500", "0", LIBVGPU_LOG_LEVEL="0", **env).stdout)
    assert rc_usage(out["hold"])[0] == 2
    assert read_region(cache).oom_refusals == 1
    run(tc, "direct", "hold", "1500", "0", LIBVGPU_LOG_LEVEL="0", **env)
    assert read_region(cache).oom_refusals == 2  # a counter over the container's processes
