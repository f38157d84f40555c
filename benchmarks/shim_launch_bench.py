"""Added cost of the libvgpu shim per ``cuLaunchKernel``, with and without an SM limit, on the fake driver.

Builds the fakes and the shim (``tests/fakes/build.py``) and a small launch loop (below), then runs the
loop plain (no shim), under the shim without an SM limit, under the shim with a 50 % SM limit, and as a
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
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes import build as fakebuild  # noqa: E402

TARGET_NS = 50.0

LOOP_C = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "cuda_abi.h"
CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}
int main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    long n = atol(argv[1]);
    int reps = atoi(argv[2]);
    double warm = atof(argv[3]) * 1e9;
    CUcontext c;
    CUmodule m;
    CUfunction f;
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c) || cuModuleLoadData(&m, "x") ||
        cuModuleGetFunction(&f, m, "k"))
        return 1;
    for (double t0 = now(); now() - t0 < warm;)
        for (int i = 0; i < 10000; i++)
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    double best = 1e30;
    CUfunction none = NULL; /* timed launches: refused by the fake at once, so the shim's path dominates */
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        for (long i = 0; i < n; i++)
            cuLaunchKernel(none, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        double per = (now() - t0) / (double)n;
        if (per < best)
            best = per;
    }
    printf("%.2f\n", best);
    return 0;
}
"""


def main() -> int:
    """Build, measure and print the table; returns 0, or 1 if the target is missed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=1_000_000, help="launches per timed loop")
    ap.add_argument("--reps", type=int, default=5, help="timed loops per process (best is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per configuration (best is kept)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of launches before timing")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        built = fakebuild.build_all(out)
        src = out / "launch_loop.c"
        src.write_text(LOOP_C)
        loop = fakebuild.build_prog(src, out / "launch_loop", out)
        base = {"FAKE_CUDA_NS_PER_BLOCK": "1", "FAKE_GPU_STATE": str(out / "gpu.state"), "PATH": "/usr/bin:/bin",
                "LIBVGPU_CONTEXT_COST": "0", "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(out / "vgpu.cache")}
        configs = {
            "fake driver, no shim": fakebuild.shim_env(built, base, preload=False),
            "shim, no SM limit": fakebuild.shim_env(built, base),
            "shim, SM limit 50 %": {**fakebuild.shim_env(built, base), "CUDA_DEVICE_SM_LIMIT": "50"},
            "shim, priority 1": {**fakebuild.shim_env(built, base), "CUDA_TASK_PRIORITY": "1"},
        }
        best: dict[str, float] = {}
        args = [str(opts.launches), str(opts.reps), str(opts.warmup)]
        for _ in range(opts.rounds):
            for name, env in configs.items():
                ns = float(subprocess.run([str(loop), *args], env=env, capture_output=True, text=True,
                                          check=True).stdout)
                best[name] = min(ns, best.get(name, ns))
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
