"""The shim and the fakes built with AddressSanitizer: stress, KF scenarios and lookup paths run clean.

ASan must be first in LD_PRELOAD (``$(gcc -print-file-name=libasan.so) libvgpu.so``); leak checking is
off because the processes exit with device state held on purpose (KF-29).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from libvgpu.region import read_region
from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, parse, rc_usage, run


def _clean(proc: subprocess.CompletedProcess[str]) -> None:
    assert "ERROR: AddressSanitizer" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["direct", "dlsym", "procaddr"])
def test_asan_kf20_kf22_kf23_kf24(tc_asan: Toolchain, mode: str) -> None:
    common = {"LIBVGPU_CONTEXT_COST": "0"}
    p = run(tc_asan, mode, "kf20", CUDA_DEVICE_MEMORY_LIMIT_0="1g", **common)
    _clean(p)
    assert int(parse(p.stdout)["rc"]) == 2
    p = run(tc_asan, mode, "kf22", CUDA_DEVICE_MEMORY_LIMIT_0="24g", **common)
    _clean(p)
    out = parse(p.stdout)
    assert rc_usage(out["again"]) == (0, GIB) and rc_usage(out["end"]) == (0, 0)
    p = run(tc_asan, mode, "kf23", CUDA_DEVICE_MEMORY_LIMIT_0="1g", **common)
    _clean(p)
    out = parse(p.stdout)
    assert out["ooms"] == "0" and int(out["end"]) == 0
    p = run(tc_asan, mode, "kf24", CUDA_DEVICE_MEMORY_LIMIT_0="1g", **common)
    _clean(p)
    assert rc_usage(parse(p.stdout)["big"]) == (2, 0)
    p = run(tc_asan, mode, "paths", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_LOG_LEVEL="0", **common)
    _clean(p)
    assert rc_usage(parse(p.stdout)["async_oom"]) == (2, 0)


def test_asan_stress_8_processes_x_8_threads(tc_asan: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc_asan.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                      LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1")
    children = [subprocess.Popen([str(tc_asan.prog), "direct", "stress", "8", "400", str(GIB)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    for c in children:
        out, err = c.communicate(timeout=180)
        assert c.returncode == 0 and "AddressSanitizer" not in err, err[-3000:]
        r = parse(out)
        assert r["over"] == "0" and int(r["max"]) <= GIB
    region = read_region(cache)
    assert region.used[0] == 0 and region.processes == []


def test_asan_kf29(tc_asan: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc_asan.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                      LIBVGPU_CONTEXT_COST="0")
    holder = subprocess.Popen([str(tc_asan.prog), "direct", "hold_lock"], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and holder.stdout.readline().strip() not in ("locked", ""):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    t0 = time.monotonic()
    p = run(tc_asan, "direct", "hold", "200", "0", timeout=20, CUDA_DEVICE_MEMORY_LIMIT_0="1g",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    assert time.monotonic() - t0 < 3.0  # ASan start-up is slower; the lock itself is not waited on
    _clean(p)
    assert rc_usage(parse(p.stdout)["hold"]) == (0, 200 * MIB)


def test_asan_sm_limit_and_graphs(tc_asan: Toolchain, tmp_path: Path) -> None:
    p = run(tc_asan, "procaddr", "graph", "1.5", "1000", "4", CUDA_DEVICE_SM_LIMIT="20", LIBVGPU_SM_PERIOD_MS="50",
            FAKE_CUDA_NS_PER_BLOCK="2500", FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
    _clean(p)
    assert abs(float(parse(p.stdout)["util"]) - 20) <= 7
    p = run(tc_asan, "dlsym", "sm", "1.2", "100", "1.0", "ex", CUDA_DEVICE_SM_LIMIT="30", LIBVGPU_SM_PERIOD_MS="50",
            FAKE_CUDA_NS_PER_BLOCK="2500", FAKE_GPU_STATE=str(tmp_path / "gpu2.state"))
    _clean(p)


@pytest.mark.parametrize("damage", ["truncate", "zero-header"])
def test_asan_damaged_cache_file(tc_asan: Toolchain, tmp_path: Path, damage: str) -> None:
    """The SIGBUS guard and the private fallback run clean under ASan (ASan's own SIGBUS handler is chained)."""
    cache = tmp_path / "vgpu.cache"
    env = tc_asan.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                      LIBVGPU_CONTEXT_COST="0")
    proc = subprocess.Popen([str(tc_asan.prog), "direct", "hold_then", "600", "600", "300"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert rc_usage(parse(proc.stdout.readline())["first"]) == (0, 600 * MIB)
    assert proc.stdout.readline().strip() == "ready"
    if damage == "truncate":
        cache.write_bytes(b"")
    else:
        with open(cache, "r+b") as f:
            f.write(b"\x00" * 344)
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "ERROR: AddressSanitizer" not in err, err[-3000:]
    res = parse(out)
    assert rc_usage(res["step0"]) == (2, 600 * MIB)
    assert rc_usage(res["step1"]) == (0, 900 * MIB)
    assert rc_usage(res["free0"]) == (0, 0)


def test_asan_stuck_lock_holder_is_reset(tc_asan: Toolchain, tmp_path: Path) -> None:
    """The forced reset of a lock held by a stopped process (self-healing) runs clean under ASan."""
    cache = tmp_path / "vgpu.cache"
    env = tc_asan.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                      LIBVGPU_CONTEXT_COST="0")
    holder = subprocess.Popen([str(tc_asan.prog), "direct", "hold_lock"], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    for line in holder.stdout:
        if line.strip() == "locked":
            break
    holder.send_signal(signal.SIGSTOP)
    try:
        p = run(tc_asan, "direct", "hold", "200", "0", timeout=60, CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
        _clean(p)
        assert rc_usage(parse(p.stdout)["hold"]) == (0, 300 * MIB)  # shared: the stopped holder's 100 MiB count
        assert "re-initialising it" in p.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


def test_asan_vmm_devices_and_liveness_paths(tc_asan: Toolchain, tmp_path: Path) -> None:
    """The VMM bookkeeping, the UUID device mapping (2 GPUs, CUDA_VISIBLE_DEVICES), the rate-limited OOM
    log and the liveness checks (shared file, slot locks) run clean under ASan."""
    p = run(tc_asan, "procaddr", "vmm", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0",
            LIBVGPU_LOG_LEVEL="1")
    _clean(p)
    assert rc_usage(parse(p.stdout)["unmap_both"]) == (0, 0)
    cfg = tmp_path / "nvml.conf"
    cfg.write_text("gpu index=0\ngpu index=1\n")
    cache = tmp_path / "vgpu.cache"
    p = run(tc_asan, "direct", "hold_on", "0", "300", "0", CUDA_VISIBLE_DEVICES="1", FAKE_NVML_CONFIG=str(cfg),
            CUDA_DEVICE_MEMORY_LIMIT_1="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    _clean(p)
    assert parse(p.stdout)["used1"] == str(300 * MIB)
    p = run(tc_asan, "direct", "oomloop", "2000", CUDA_DEVICE_MEMORY_LIMIT_0="1g",
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    _clean(p)
    assert parse(p.stdout)["ooms"] == "2000"
