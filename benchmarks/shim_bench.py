"""Added cost of the libvgpu shim per hooked call, against the fake driver called directly.

Builds the fakes, the shim and ``benchmarks/libvgpu/bench.c`` with gcc, then runs the bench
plain and under the shim (memory limit on, shared accounting file, no SM limit) and prints
ns per ``cuLaunchKernel`` and per ``cuMemAlloc_v2``+``cuMemFree_v2`` pair. Targets: <= 50 ns added
per launch with no SM limit, <= 1 us added per alloc/free pair. Not a unit test; run by hand:

    .venv/bin/python benchmarks/shim_bench.py
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

LAUNCH_TARGET_NS = 50.0
PAIR_TARGET_NS = 1000.0


def _run(binary: Path, env: dict[str, str], args: list[str]) -> dict[str, float]:
    out = subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in (tok.split("=") for tok in out.split())}


def main() -> int:
    """Build, measure and print the comparison; returns 0, or 1 if a target is missed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2_000_000)
    ap.add_argument("--allocs", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=5, help="best of this many runs per process")
    ap.add_argument("--rounds", type=int, default=3, help="alternate plain/shim processes this many times")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        built = fakebuild.build_all(out)
        bench = fakebuild.build_prog(ROOT / "benchmarks" / "libvgpu" / "bench.c", out / "bench", out)
        base = {"FAKE_CUDA_NS_PER_BLOCK": "0", "PATH": "/usr/bin:/bin"}
        plain_env = fakebuild.shim_env(built, base, preload=False)
        shim_env = fakebuild.shim_env(built, base, preload=True)
        shim_env.update(CUDA_DEVICE_MEMORY_LIMIT_0="64g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(out / "vgpu.cache"),
                        LIBVGPU_CONTEXT_COST="0")
        args = [str(opts.launches), str(opts.allocs), str(opts.reps)]
        plain: dict[str, float] = {}
        shim: dict[str, float] = {}
        for _ in range(opts.rounds):
            for store, env in ((plain, plain_env), (shim, shim_env)):
                for k, v in _run(bench, env, args).items():
                    store[k] = min(v, store.get(k, v))
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
