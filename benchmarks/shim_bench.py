"""Added cost of the libvgpu shim per hooked call, against the fake driver called directly.

Builds the fakes, the shim and ``benchmarks/libvgpu/bench.c`` with gcc, then runs ``bench calls``
plain and under the shim (memory limit on, shared accounting file, no SM limit) and prints
ns per ``cuLaunchKernel`` and per ``cuMemAlloc_v2``+``cuMemFree_v2`` pair. Targets: <= 50 ns added
per launch with no SM limit, <= 1 us added per alloc/free pair. Not a unit test; run by hand:

    .venv/bin/python benchmarks/shim_bench.py
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

LAUNCH_TARGET_NS = 50.0
PAIR_TARGET_NS = 1000.0


def main() -> int:
    """Build, measure and print the comparison; returns 0, or 1 if a target is missed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2_000_000)
    ap.add_argument("--allocs", type=int, default=200_000)
    _shimbench.add_round_flags(ap)
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        built, bench = _shimbench.build(out)
        base = {"FAKE_CUDA_NS_PER_BLOCK": "0", "PATH": "/usr/bin:/bin"}
        shim_env = fakebuild.shim_env(built, base, preload=True)
        shim_env.update(CUDA_DEVICE_MEMORY_LIMIT_0="64g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(out / "vgpu.cache"),
                        LIBVGPU_CONTEXT_COST="0")
        envs = {"plain": fakebuild.shim_env(built, base, preload=False), "shim": shim_env}
        args = ["calls", str(opts.launches), str(opts.allocs), str(opts.reps)]
        best = _shimbench.best_of_rounds(bench, envs, args, opts.rounds)
    plain, shim = best["plain"], best["shim"]
    d_launch = shim["launch_ns"] - plain["launch_ns"]
    d_pair = shim["alloc_free_ns"] - plain["alloc_free_ns"]
    print(f"{'call':<28}{'fake driver':>14}{'with shim':>12}{'added':>10}{'target':>10}")
    print(f"{'cuLaunchKernel (no SM lim.)':<28}{plain['launch_ns']:>11.1f} ns{shim['launch_ns']:>9.1f} ns"
          f"{d_launch:>7.1f} ns{LAUNCH_TARGET_NS:>7.0f} ns")
    print(f"{'cuMemAlloc+cuMemFree pair':<28}{plain['alloc_free_ns']:>11.1f} ns{shim['alloc_free_ns']:>9.1f} ns"
          f"{d_pair:>7.1f} ns{PAIR_TARGET_NS:>7.0f} ns")
    ok = d_launch <= LAUNCH_TARGET_NS and d_pair <= PAIR_TARGET_NS
    print("within targets" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
