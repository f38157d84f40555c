"""Added cost of the libvgpu shim per ``cuLaunchKernel``, with and without an SM limit, on the fake driver.

Builds the fakes and the shim (``tests/fakes/build.py``) and ``benchmarks/libvgpu/bench.c``, then runs
``bench launch`` plain (no shim), under the shim without an SM limit, under the shim with a 50 % SM limit, and as a
low-priority process (``CUDA_TASK_PRIORITY=1``, limited only to give way to neighbours). Each run first
warms up with real launches of 1 ns of simulated device time (the limiter's first cost estimate is
1 us per block, so it throttles until its sampler has measured the real cost), then times loops of
launches the fake driver refuses at once (a NULL function, after its context check): the fake's own
bookkeeping (a process-shared lock per launch, ~250 ns, too noisy on a loaded machine) is left out,
so the difference to the plain run is the shim's own launch path, including the limiter's
accounting (every launch is charged). The limit is never reached: this is the *unthrottled* path.
Best of several timed loops; plain and shim processes alternate. Target: <= 50 ns added per launch with a limit. Prints one table; exit
status 1 if the target is missed. Not a unit test (run by hand, a few seconds):

    .venv/bin/python benchmarks/shim_launch_bench.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _shimbench  # noqa: E402

from tests.fakes import build as fakebuild  # noqa: E402

TARGET_NS = 50.0


def main() -> int:
    """Build, measure and print the table; returns 0, or 1 if the target is missed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=1_000_000, help="launches per timed loop")
    _shimbench.add_round_flags(ap)
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of launches before timing")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        built, bench = _shimbench.build(out)
        base = {"FAKE_CUDA_NS_PER_BLOCK": "1", "FAKE_GPU_STATE": str(out / "gpu.state"), "PATH": "/usr/bin:/bin",
                "LIBVGPU_CONTEXT_COST": "0", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(out / "vgpu.cache")}
        configs = {
            "fake driver, no shim": fakebuild.shim_env(built, base, preload=False),
            "shim, no SM limit": fakebuild.shim_env(built, base),
            "shim, SM limit 50 %": {**fakebuild.shim_env(built, base), "CUDA_DEVICE_SM_LIMIT": "50"},
            "shim, priority 1": {**fakebuild.shim_env(built, base), "CUDA_TASK_PRIORITY": "1"},
        }
        args = ["launch", str(opts.launches), str(opts.reps), str(opts.warmup)]
        best = {name: figures["launch_ns"] for name, figures in
                _shimbench.best_of_rounds(bench, configs, args, opts.rounds).items()}
    plain = best["fake driver, no shim"]
    print(f"{'cuLaunchKernel, unthrottled':<28}{'ns/launch':>10}{'added':>10}{'target':>10}")
    ok = True
    for name, ns in best.items():
        added = ns - plain
        limited = "limit 50" in name or "priority" in name
        target = f"{TARGET_NS:.0f}" if limited else "-"
        print(f"{name:<28}{ns:>10.1f}{added:>10.1f}{target:>10}")
        ok = ok and (not limited or added <= TARGET_NS)
    print("within target" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
