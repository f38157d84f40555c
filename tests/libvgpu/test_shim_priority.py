"""Task priority (``nvidia.com/priority``, ``priority=`` in the limits file, else ``CUDA_TASK_PRIORITY``).

On one simulated GPU a priority-0 (high) and a priority-1 (low) tenant both launch back to back. The
low tenant's limiter sees, through NVML's per-process utilisation, how busy the GPU is with processes
that are not low-priority processes of its own container, and gives way: the high tenant gets the GPU,
the low one keeps a floor. Without priorities the same pair splits the GPU about evenly (the control
that makes the test able to fail). Each tenant is a separate container (its own accounting file)
unless the test says otherwise.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_vgpu import envcontract
from kube_vgpu.model import DeviceBooking
from libvgpu.region import RegionError, read_region
from tests.libvgpu.shim_helpers import Toolchain, limits_path

NS_PER_BLOCK = "2500"
UUID0 = "GPU-00000000-0000-4000-8000-000000000000"
SM_ARGS = ["sm", "3.1", "100", "1.0"]  # 3.1 s of 100-block kernels, one line per 1 s window


def _tenant(tc: Toolchain, state: Path, cache: Path, **env: str) -> subprocess.Popen[str]:
    e = tc.env(FAKE_CUDA_NS_PER_BLOCK=NS_PER_BLOCK, LIBVGPU_SM_PERIOD_MS="50", FAKE_GPU_STATE=str(state),
               CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), **env)
    return subprocess.Popen([str(tc.prog), "direct", *SM_ARGS], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _steady(p: subprocess.Popen[str]) -> tuple[float, str]:
    """Mean busy % of the 2nd and 3rd 1 s windows (the first includes convergence), and stderr. A
    window closes at the first launch after its second is up, so a throttled tenant on a loaded machine
    may close only two in its 3.1 s: then the 2nd alone."""
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    windows = [float(w) for w in re.findall(r"window util=([0-9.]+)", out)]
    assert len(windows) >= 2, out
    steady = windows[1:3]
    return sum(steady) / len(steady), err


def test_low_priority_tenant_gives_way_to_high_priority_tenant(tc: Toolchain, tmp_path: Path) -> None:
    # GPU 1: priority 0 next to priority 1, neither has an SM limit. GPU 2: the same pair without priorities.
    hi = _tenant(tc, tmp_path / "gpu1.state", tmp_path / "hi.cache", CUDA_TASK_PRIORITY="0")
    lo = _tenant(tc, tmp_path / "gpu1.state", tmp_path / "lo.cache", CUDA_TASK_PRIORITY="1")
    a = _tenant(tc, tmp_path / "gpu2.state", tmp_path / "a.cache")
    b = _tenant(tc, tmp_path / "gpu2.state", tmp_path / "b.cache")
    (u_hi, _), (u_lo, _), (u_a, _), (u_b, _) = (_steady(p) for p in (hi, lo, a, b))
    assert u_hi >= 80 and u_lo <= 15, (u_hi, u_lo)  # measured 98 / 2
    assert min(u_a, u_b) >= 30, (u_a, u_b)  # without priorities neither gives way (measured ~50 / 50)


def test_low_priority_keeps_its_limit_while_the_gpu_has_room(tc: Toolchain, tmp_path: Path) -> None:
    # 40 % + 40 % leaves room: the low tenant is not pushed below its own limit
    state = tmp_path / "gpu.state"
    hi = _tenant(tc, state, tmp_path / "hi.cache", CUDA_TASK_PRIORITY="0", CUDA_DEVICE_SM_LIMIT="40")
    lo = _tenant(tc, state, tmp_path / "lo.cache", CUDA_TASK_PRIORITY="1", CUDA_DEVICE_SM_LIMIT="40")
    (u_hi, _), (u_lo, _) = _steady(hi), _steady(lo)
    assert abs(u_hi - 40) <= 5 and abs(u_lo - 40) <= 5, (u_hi, u_lo)


def test_low_priority_alone_is_not_throttled(tc: Toolchain, tmp_path: Path) -> None:
    u, _ = _steady(_tenant(tc, tmp_path / "gpu.state", tmp_path / "lo.cache", CUDA_TASK_PRIORITY="1"))
    assert u >= 80, u  # nothing to give way to (a loaded test machine costs a few points)


def test_priority_between_processes_of_one_container(tc: Toolchain, tmp_path: Path) -> None:
    # one accounting file: the low process gives way to its container's high-priority process
    state, cache = tmp_path / "gpu.state", tmp_path / "one.cache"
    hi = _tenant(tc, state, cache, CUDA_TASK_PRIORITY="0")
    lo = _tenant(tc, state, cache, CUDA_TASK_PRIORITY="1")
    (u_hi, _), (u_lo, _) = _steady(hi), _steady(lo)
    assert u_hi >= 80 and u_lo <= 15, (u_hi, u_lo)


def _slot_priorities(cache: Path) -> list[int]:
    """reserved[2] (priority + 1, 0 unset) of every used slot of a region file (libvgpu/src/region.h)."""
    data, out = cache.read_bytes(), []
    slot = struct.Struct("<iiQ16Q4Q")
    for i in range(1024):
        fields = slot.unpack_from(data, 472 + i * slot.size)
        if fields[0]:
            out.append(fields[3 + 16 + 2])
    return out


@pytest.fixture
def low_priority_file(tc_limits: Toolchain, tmp_path: Path) -> Iterator[Path]:
    """A limits file booking GPU 0 without an SM limit at priority 1 (the device plugin's writer)."""
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "file.cache"
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 4096, 0)], str(cache), priority=1))
    yield cache
    path.unlink(missing_ok=True)


def test_limits_file_priority_wins_over_env(tc: Toolchain, tc_limits: Toolchain, low_priority_file: Path,
                                            tmp_path: Path) -> None:
    # a tenant of a priority-1 container asks for priority 0 in its env: it still runs at priority 1
    state = tmp_path / "gpu.state"
    hi = _tenant(tc, state, tmp_path / "hi.cache", CUDA_TASK_PRIORITY="0")
    lo = _tenant(tc_limits, state, tmp_path / "ignored.cache", CUDA_TASK_PRIORITY="0")
    (u_hi, _), (u_lo, err) = _steady(hi), _steady(lo)
    assert u_hi >= 80 and u_lo <= 15, (u_hi, u_lo)
    assert "CUDA_TASK_PRIORITY=0" in err and "differs from the container's limits file" in err, err


def test_priority_is_recorded_in_the_process_slot(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "c.cache"
    e = tc.env(CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache))
    procs = [subprocess.Popen([str(tc.prog), "direct", "hold", "1", "30"], env={**e, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in ({"CUDA_TASK_PRIORITY": "0"}, {"CUDA_TASK_PRIORITY": "1"}, {})]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().startswith("hold=0:")
        assert sorted(_slot_priorities(cache)) == [0, 1, 2]  # unset, high + 1, low + 1
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def _forge_slot(cache: Path, host_pid: int) -> None:
    """Plays a tenant of the low-priority container: it writes a slot into its own (writable) accounting
    file that is alive by every check (this process: its pid, start time and /proc) and claims the
    neighbour's host pid, as a low-priority process of the container."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    slot = struct.Struct("<iiQ16Q4Q")
    data = slot.pack(os.getpid(), 0, start, *([0] * 16), os.stat("/proc/self").st_dev + 1, host_pid, 2, 0)
    with open(cache, "r+b") as f:
        f.seek(472 + 1023 * slot.size)  # the last slot: the shim fills slots from the first
        f.write(data)


def _joined(path: Path) -> bool:
    """The shim created, initialised and joined its region (it is created before it is initialised)."""
    try:
        return path.exists() and bool(read_region(path).processes)
    except RegionError:
        return False  # created, header not written yet


def test_forged_slot_does_not_stop_a_low_priority_tenant_from_giving_way(
        tc: Toolchain, tc_limits: Toolchain, low_priority_file: Path, tmp_path: Path) -> None:
    state = tmp_path / "gpu.state"
    hi = _tenant(tc, state, tmp_path / "hi.cache", CUDA_TASK_PRIORITY="0")
    lo = _tenant(tc_limits, state, tmp_path / "ignored.cache")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _joined(low_priority_file):
        time.sleep(0.01)  # until the low tenant has joined its file (a condition, not a timed assertion)
    _forge_slot(low_priority_file, hi.pid)  # without PID namespaces NVML reports the pid itself
    assert any(p.pid == os.getpid() for p in read_region(low_priority_file).processes)
    (u_hi, _), (u_lo, _) = _steady(hi), _steady(lo)
    assert u_hi >= 80 and u_lo <= 15, (u_hi, u_lo)  # it still gives way (trusting the file: 62 / 35)
