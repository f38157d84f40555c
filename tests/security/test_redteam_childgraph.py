"""Red team: kernels hidden in child graph nodes (docs/shim.md "SM limit").

``cuGraphLaunch`` is paced by the blocks of the graph's kernel nodes, counted when the graph is instantiated:
between two NVML samples (and throughout where NVML cannot be asked) that count is all the limiter knows of a
launch. The shim counted only the launched graph's own kernel nodes: a tenant under a 25 % SM limit that put
its kernels into a child graph node (``cuGraphAddChildGraphNode``, one or more levels down) launched graphs
the shim priced at one block each, and one that instantiated a graph of one-block kernels and then updated
the executable (``cuGraphExecUpdate_v2``) to kernels forty times larger kept the one-block price: the fake
GPU ran them at 100 %. Each run is a process on the fake driver (tests/fakes), which runs a child graph's
kernels in place and an updated executable's new kernels, with the plain and the sanitised builds; the busy %
is what the fake GPU ran (launches x kernels x blocks x ns per block over the elapsed time).

Two regimes: ``estimate`` takes NVML away (``LIBVGPU_NVML_LIBRARY`` names no library), so launches are paced
by their block count alone at the shim's initial 1 us per block, which the fake's kernels cost: this isolates
the count. ``measured`` keeps NVML, whose samples correct each period by the GPU time really used.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import Toolchain, parse, program_fixtures

SRC = Path(__file__).resolve().parent / "childgraph_redteam.c"
LIMIT = 25  # % of the GPU's SMs
KERNELS, BLOCKS = "100", "40"  # 4000 blocks per graph launch
TOLERANCE = 6.0  # percentage points
#: regime -> environment: NVML taken away (pacing by the block count alone), or NVML's samples kept
REGIMES = {
    "estimate": {"FAKE_CUDA_NS_PER_BLOCK": "1000", "LIBVGPU_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"},
    "measured": {"FAKE_CUDA_NS_PER_BLOCK": "2500", "LIBVGPU_SM_PERIOD_MS": "50"},
}

built, built_asan, any_build = program_fixtures(SRC, "childgraph")


def busy(build: tuple[Toolchain, Path], wrap: str, regime: str, tmp: Path, seconds: str = "2",
         **extra: str) -> float:
    """Busy % of the fake GPU while the program launches its graph (wrapped as ``wrap``) for ``seconds``."""
    tc, prog = build
    env = tc.env(LIBVGPU_CONTEXT_COST="0", FAKE_GPU_STATE=str(tmp / f"{wrap}-{regime}.state"),
                 LIBVGPU_LOG_LEVEL="1", **REGIMES[regime], **extra)
    proc = subprocess.run([str(prog), wrap, seconds, KERNELS, BLOCKS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    assert out["instantiate"] == "0", out
    return float(out["util"])


def test_the_fake_runs_child_graph_kernels_unlimited(built: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # Without an SM limit the child graph's kernels keep the fake GPU busy: the attack has something to gain.
    assert busy(built, "nested", "estimate", tmp_path, "1") >= 80


@pytest.mark.parametrize("wrap", ["child", "nested", "update"])
def test_kernels_in_child_graphs_are_counted(any_build: tuple[Toolchain, Path], tmp_path: Path, wrap: str) -> None:
    # Paced by the block count alone: a 25 % tenant's kernels in a child graph node, two child levels down, or
    # swapped in by an update are counted, and it stays at 25 % (it ran at 100 % before).
    got = busy(any_build, wrap, "estimate", tmp_path, CUDA_DEVICE_SM_LIMIT=str(LIMIT))
    assert abs(got - LIMIT) <= TOLERANCE, (wrap, got)


@pytest.mark.parametrize("wrap", ["plain", "child", "nested"])
def test_child_graph_tenant_is_held_with_nvml(built: tuple[Toolchain, Path], tmp_path: Path, wrap: str) -> None:
    # With NVML's samples too (and kernels costing 2.5x the initial estimate), held as a plain graph is.
    got = busy(built, wrap, "measured", tmp_path, "3", CUDA_DEVICE_SM_LIMIT=str(LIMIT))
    assert abs(got - LIMIT) <= TOLERANCE, (wrap, got)
