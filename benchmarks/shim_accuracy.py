"""SM-limit accuracy of the shim for tenants in separate containers, against the fake driver.

Each tenant runs in its own PID and mount namespace with its own accounting file (a container
without hostPID): the fake NVML reports host pids, as the real driver does in a container. All
tenants share one simulated GPU and launch as fast as they can under their ``nvidia.com/gpucores``
limit. Prints, per tenant mix (10/90, 30/70, 30/30, 50/50, a lone 30), each tenant's busy % of the
GPU in its steady 1 s windows (mean) and its lowest window, beside its limit. Needs root and
``unshare``; prints one skip line otherwise. Not a unit test (tests/libvgpu/test_shim_hostpid.py
asserts the bounds); run by hand:

    .venv/bin/python benchmarks/shim_accuracy.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIXES = [(10, 90), (30, 70), (30, 30), (50, 50), (30,)]


def main() -> int:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("shim_accuracy: skipped (needs root and unshare for PID namespaces)")
        return 0
    from tests.libvgpu.shim_helpers import make_toolchain
    from tests.libvgpu.test_shim_hostpid import _result, _started

    with tempfile.TemporaryDirectory(prefix="kv-shim-acc-") as d:
        tmp = Path(d)
        tc = make_toolchain(tmp / "build")
        print(f"{'mix':<8} {'limit %':>8} {'steady busy %':>14} {'lowest window %':>16} {'error':>7}")
        worst = 0.0
        for k, mix in enumerate(MIXES):
            run = tmp / f"mix{k}"
            run.mkdir()
            procs = [_started(tc, run, f"t{i}", lim, run / "gpu.state") for i, lim in enumerate(mix)]
            for lim, (windows, _) in zip(mix, [_result(p) for p in procs], strict=True):
                steady = sum(windows[1:]) / max(1, len(windows) - 1)
                worst = max(worst, abs(steady - lim))
                label = "/".join(map(str, mix)) if len(mix) > 1 else f"alone {mix[0]}"
                print(f"{label:<8} {lim:>8} {steady:>14.1f} {min(windows):>16.1f} {steady - lim:>+7.1f}")
        print(f"largest steady error: {worst:.1f} points (target: within 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
