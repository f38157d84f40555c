"""What the shim benchmarks (shim_bench.py, shim_launch_bench.py) share: building the fakes, the shim
and ``benchmarks/libvgpu/bench.c``, and running ``bench`` under several environments in alternating
rounds, keeping the best (lowest) figure of each. Not run by ``run_all.py`` (its name starts with ``_``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes import build as fakebuild  # noqa: E402

BENCH_C = ROOT / "benchmarks" / "libvgpu" / "bench.c"


def add_round_flags(ap: argparse.ArgumentParser) -> None:
    """``--reps`` (timed loops per process) and ``--rounds`` (processes per environment); the best is kept."""
    ap.add_argument("--reps", type=int, default=5, help="timed loops per process (best is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per environment, alternating (best is kept)")


def build(out: Path) -> tuple[fakebuild.Built, Path]:
    """The fakes and the shim built into ``out``, and the ``bench`` program linked against the fake
    libcuda. Raises fakebuild.BuildError."""
    built = fakebuild.build_all(out)
    return built, fakebuild.build_prog(BENCH_C, out / "bench", out)


def best_of_rounds(bench: Path, envs: Mapping[str, Mapping[str, str]], args: list[str],
                   rounds: int) -> dict[str, dict[str, float]]:
    """Run ``bench args`` once per environment, ``rounds`` times over (environments alternate, so a
    change in the machine's load hits them alike); environment name -> figure (``launch_ns``, ...)
    -> its lowest value in ns. Raises subprocess.CalledProcessError when bench fails."""
    best: dict[str, dict[str, float]] = {name: {} for name in envs}
    for _ in range(rounds):
        for name, env in envs.items():
            out = subprocess.run([str(bench), *args], env=dict(env), capture_output=True, text=True,
                                 check=True).stdout
            for k, v in (tok.split("=") for tok in out.split()):
                best[name][k] = min(float(v), best[name].get(k, float(v)))
    return best
