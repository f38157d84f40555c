"""The SM limiter's model: real GPU time is charged, a change of kernel shape does not starve a tenant,
and the admin's work-conserving mode (limits file ``core_sharing=work_conserving``) against strict.

The fake driver keeps its GPU busy for ``FAKE_CUDA_NS_PER_LAUNCH + blocks * FAKE_CUDA_NS_PER_BLOCK`` per
kernel; with a fixed cost per launch a 1-block kernel costs ~90x more per block than a 1024-block one,
as on a real GPU, so a cost per block learnt on one shape is wrong for the other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_vgpu import envcontract
from kube_vgpu.model import DeviceBooking
from tests.libvgpu.shim_helpers import Toolchain, limits_path

UUID0 = "GPU-00000000-0000-4000-8000-000000000000"


def _spawn(tc: Toolchain, args: list[str], **env: str) -> subprocess.Popen[str]:
    e = tc.env(LIBVGPU_SM_PERIOD_MS="50", **env)
    return subprocess.Popen([str(tc.prog), "direct", *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _out(p: subprocess.Popen[str]) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out


def _windows(out: str) -> list[float]:
    return [float(w) for w in re.findall(r"window util=([0-9.]+)", out)]


def test_long_kernels_are_charged_for_their_real_duration(tc: Toolchain, tmp_path: Path) -> None:
    # 200 ms kernels under a 30 % limit (each spans four sampling periods; they ran at 56-77 % when only
    # the launches' estimates were charged); the second 4 s window is steady state. A window closes
    # after the launch that crosses it (a throttled launch waits), so the run is long enough for two
    # windows however late the second closes on a loaded machine
    p = _spawn(tc, ["sm", "12", "80000", "4.0"], FAKE_CUDA_NS_PER_BLOCK="2500", CUDA_DEVICE_SM_LIMIT="30",
               FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
    windows = _windows(_out(p))
    assert len(windows) >= 2, windows
    # one kernel is ~5 points of a 4 s window (measured 26-29); only the launches' estimates: 56-77.
    # Steady state is every window after the first, together: on a loaded machine a first window's
    # overrun (up to 44) is repaid in the next (down to 17), which is the limiter working
    steady = windows[1:]
    assert abs(sum(steady) / len(steady) - 30) <= 10, windows


@pytest.mark.parametrize("shape", [("1", "1024"), ("1024", "1")], ids=["1-to-1024-blocks", "1024-to-1-blocks"])
def test_kernel_shape_change_does_not_starve(tc: Toolchain, tmp_path: Path, shape: tuple[str, str]) -> None:
    # 1.5 s of one shape, then 1.5 s of the other, at 30 %; busy share per 20 ms bin after the change
    p = _spawn(tc, ["shape", "1.5", "1.5", *shape, "0.02"], FAKE_CUDA_NS_PER_BLOCK="1000",
               FAKE_CUDA_NS_PER_LAUNCH="100000", CUDA_DEVICE_SM_LIMIT="30", FAKE_GPU_STATE=str(tmp_path / "g.state"))
    out = _out(p)
    before = float(re.search(r"before util=([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    after = float(re.search(r"after util=([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    bins = [float(v) for v in re.findall(r"bin t=\d+ util=([0-9.]+)", out)]
    assert abs(before - 30) <= 5 and abs(after - 30) <= 5, (before, after)
    # never starved (it was 0.1-0.6 % for 3-4 s when the cost per block had to be re-learnt): from
    # 120 ms after the change on, the share since the change never falls below half the limit, and
    # every 240 ms (12 bins) averages at least 10 %. (After 1024 -> 1 blocks the tenant may overrun for a few bins until the new
    # cost is learnt and then repays it: 120 ms windows of that repayment can dip below 15 % on a
    # machine whose scheduling is noisy, without any starvation.)
    since = [sum(bins[:i + 1]) / (i + 1) for i in range(len(bins))]
    windows = [sum(bins[i:i + 12]) / 12 for i in range(len(bins) - 11)]
    assert min(since[5:]) >= 15 and min(windows) >= 10, [round(b) for b in bins]


@pytest.fixture
def limits_30(tc_limits: Toolchain, tmp_path: Path) -> Iterator[Path]:
    """Path of the limits file (removed afterwards); tests write it with the core sharing they need."""
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    yield path
    path.unlink(missing_ok=True)


def _write(path: Path, cache: Path, sharing: str) -> None:
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 4096, 30)], str(cache), core_sharing=sharing))


def test_strict_and_work_conserving_lone_tenant(tc_limits: Toolchain, limits_30: Path, tmp_path: Path) -> None:
    sm = ["sm", "3.1", "100", "1.0"]
    env = {"FAKE_CUDA_NS_PER_BLOCK": "2500"}
    _write(limits_30, tmp_path / "a.cache", "strict")  # the default: 30 % even on an idle GPU
    strict = _windows(_out(_spawn(tc_limits, sm, FAKE_GPU_STATE=str(tmp_path / "a.state"), **env)))
    _write(limits_30, tmp_path / "b.cache", "work_conserving")  # the admin's choice: a lone tenant bursts
    burst = _windows(_out(_spawn(tc_limits, sm, FAKE_GPU_STATE=str(tmp_path / "b.state"),
                                 CUDA_DEVICE_SM_LIMIT="30", **env)))
    assert abs(sum(strict[1:3]) / 2 - 30) <= 5, strict
    assert sum(burst[1:3]) / 2 >= 80, burst  # 90 % target (10 % left for newcomers to show)


def test_work_conserving_tenant_gives_way_to_a_neighbour(tc: Toolchain, tc_limits: Toolchain, limits_30: Path,
                                                         tmp_path: Path) -> None:
    # a work-conserving 30 % container next to a strict 60 % one (another container, its env limit)
    _write(limits_30, tmp_path / "wc.cache", "work_conserving")
    state = str(tmp_path / "gpu.state")
    sm = ["sm", "3.1", "100", "1.0"]
    wc = _spawn(tc_limits, sm, FAKE_GPU_STATE=state, FAKE_CUDA_NS_PER_BLOCK="2500")
    other = _spawn(tc, sm, FAKE_GPU_STATE=state, FAKE_CUDA_NS_PER_BLOCK="2500", CUDA_DEVICE_SM_LIMIT="60",
                   CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "other.cache"))
    w, o = _windows(_out(wc)), _windows(_out(other))
    u_wc, u_other = sum(w[1:3]) / 2, sum(o[1:3]) / 2
    assert u_other >= 55, (u_wc, u_other)  # the neighbour gets its limit
    assert 25 <= u_wc <= 45, (u_wc, u_other)  # the bursting tenant keeps its own 30 % and takes what is idle


IN_CONTAINER = ("mkdir -p \"$FAKE_HOST_PROC\" && mount --bind /proc \"$FAKE_HOST_PROC\" && "
                "mount -t proc proc /proc && exec \"$@\"")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare (PID and mount namespaces)")
def test_shape_change_next_to_a_neighbour_in_pid_namespaces(tc: Toolchain, tmp_path: Path) -> None:
    # two containers without hostPID on one GPU, started together (their contexts are created at the
    # same moment, so at least one sees both appear and must tell its own pid apart: before it could,
    # it fell back to device-wide utilisation, and CI runs saw the switcher at 0 % for 100-280 ms):
    # a 30 % tenant switches from 1-block to 1024-block kernels while a 60 % tenant runs steadily;
    # neither drops below half its limit for over 200 ms (four 50 ms periods: the switcher re-learns
    # its cost per block within two)
    state = tmp_path / "gpu.state"
    procs = []
    for name, lim, args in (("a", "30", ["shape", "2", "2", "1", "1024", "0.02"]),
                            ("b", "60", ["shape", "2", "2", "1024", "1024", "0.02"])):
        env = tc.env(LIBVGPU_SM_PERIOD_MS="50", FAKE_CUDA_NS_PER_BLOCK="1000", FAKE_CUDA_NS_PER_LAUNCH="100000",
                     CUDA_DEVICE_SM_LIMIT=lim, FAKE_GPU_STATE=str(state), FAKE_CUDA_CTX_RENDEZVOUS="2",
                     LIBVGPU_LOG_LEVEL="3",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / f"{name}.cache"),
                     FAKE_HOST_PROC=str(tmp_path / f"{name}-proc"))
        cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--",
               "sh", "-c", IN_CONTAINER, "sh", str(tc.prog), "direct", *args]
        procs.append((int(lim), subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True)))
    for limit, p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "NVML reports this process as pid" in err, err  # per-process utilisation, not the device's
        bins = [float(v) for v in re.findall(r"bin t=\d+ util=([0-9.]+)", out)]
        after = float(re.search(r"after util=([0-9.]+)", out).group(1))  # type: ignore[union-attr]
        # never below half its limit over 200 ms (10 bins of 20 ms): the switcher while it
        # re-learns, its steady neighbour while it shares the simulated device's queue with the
        # switcher's overrun period and with this machine's CPU scheduling
        span = 10
        means = [sum(bins[i:i + span]) / span for i in range(len(bins) - span + 1)]
        assert min(means) >= limit / 2, (limit, [round(b) for b in bins])
        # the saturated pair loses a few points to the simulated device's queueing on a loaded machine
        assert abs(after - limit) <= (10 if limit > 50 else 5), (limit, after)
