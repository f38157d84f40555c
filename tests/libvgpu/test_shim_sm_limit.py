"""SM limit on the simulated GPU: accuracy per limit, 10 vs 90 sharing, KF-26 graphs, no-limit pass-through.

The fake driver charges FAKE_CUDA_NS_PER_BLOCK of device time per block and reports it through the
fake NVML (shared FAKE_GPU_STATE file), so the shim's sampler sees the container's own busy time.
Kernels cost 2.5 us/block here, not the shim's initial 1 us guess, so the feedback loop must work.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import Toolchain, parse

NS_PER_BLOCK = "2500"


def _windows(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"window util=([0-9.]+)", text)]


def _spawn(tc: Toolchain, mode: str, args: list[str], **env: str) -> subprocess.Popen[str]:
    e = tc.env(FAKE_CUDA_NS_PER_BLOCK=NS_PER_BLOCK, LIBVGPU_SM_PERIOD_MS="50", **env)
    return subprocess.Popen([str(tc.prog), mode, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(p: subprocess.Popen[str]) -> str:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return out


def test_sm_limit_accuracy_10_30_50_90(tc: Toolchain, tmp_path: Path) -> None:
    # the four limits run at once, each on its own simulated GPU; launch APIs and lookup paths vary
    cases = [(10, "direct", []), (30, "dlsym", []), (50, "procaddr", ["ex"]), (90, "direct", ["ex"])]
    procs = [
        (limit, _spawn(tc, mode, ["sm", "3.1", "100", "1.0", *extra], CUDA_DEVICE_SM_LIMIT=str(limit),
                       FAKE_GPU_STATE=str(tmp_path / f"gpu{limit}.state")))
        for limit, mode, extra in cases
    ]
    for limit, p in procs:
        windows = _windows(_finish(p))
        assert len(windows) >= 3, windows
        assert abs(windows[0] - limit) <= 10, (limit, windows)  # first second includes convergence
        for w in windows[1:3]:
            assert abs(w - limit) <= 5, (limit, windows)


def test_sm_10_vs_90_share_one_gpu(tc: Toolchain, tmp_path: Path) -> None:
    state = str(tmp_path / "gpu.state")
    # two containers (separate accounting files) on one simulated GPU
    low = _spawn(tc, "direct", ["sm", "3", "100", "1.0"], CUDA_DEVICE_SM_LIMIT="10", FAKE_GPU_STATE=state,
                 CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "a.cache"))
    high = _spawn(tc, "direct", ["sm", "3", "100", "1.0"], CUDA_DEVICE_SM_LIMIT="90", FAKE_GPU_STATE=state,
                  CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "b.cache"))
    n_low = int(parse(_finish(low))["total_kernels"])
    n_high = int(parse(_finish(high))["total_kernels"])
    ratio = n_low / n_high
    assert abs(ratio - 1 / 9) <= 0.2 / 9, (n_low, n_high, ratio)


def test_kf26_graph_launches_are_throttled(tc: Toolchain, tmp_path: Path) -> None:
    # 1000 kernels captured into a graph; cuGraphLaunch in a loop
    limited = _spawn(tc, "direct", ["graph", "2", "1000", "4"], CUDA_DEVICE_SM_LIMIT="20",
                     FAKE_GPU_STATE=str(tmp_path / "a.state"))
    free = _spawn(tc, "direct", ["graph", "1", "1000", "4"], FAKE_GPU_STATE=str(tmp_path / "b.state"))
    out_l, out_f = parse(_finish(limited)), parse(_finish(free))
    assert out_l["instantiate"].startswith("0:")
    assert abs(float(out_l["util"]) - 20) <= 5, out_l
    assert float(out_f["util"]) >= 90, out_f


@pytest.mark.parametrize("value", ["", "0", "100"])
def test_no_sm_limit_is_not_throttled(tc: Toolchain, tmp_path: Path, value: str) -> None:
    p = _spawn(tc, "dlsym", ["sm", "1.2", "100", "1.0"], CUDA_DEVICE_SM_LIMIT=value,
               FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
    windows = _windows(_finish(p))
    assert windows and windows[0] >= 80, windows  # unthrottled (a limit would hold it near 10-30); margin for a loaded machine


def test_core_policy_disable_turns_sm_limit_off(tc: Toolchain, tmp_path: Path) -> None:
    p = _spawn(tc, "direct", ["sm", "1.2", "100", "1.0"], CUDA_DEVICE_SM_LIMIT="10",
               GPU_CORE_UTILIZATION_POLICY="disable", FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
    windows = _windows(_finish(p))
    assert windows and windows[0] >= 80, windows  # unthrottled (a limit would hold it near 10-30); margin for a loaded machine
