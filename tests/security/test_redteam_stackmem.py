"""Red team: the stack a kernel launch makes the driver grow (docs/shim.md "Memory limit").

A kernel whose threads need more local memory (``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``: a large local
array, a deep stack) than the context's stack size makes the driver grow the stack at launch, for every
thread that can be resident (bytes per thread x threads per SM x SMs: a 64 KiB frame is ~16 GiB on an
H200), and keep it; ``cuCtxGetLimit(CU_LIMIT_STACK_SIZE)`` then reports the grown size. The shim charged
the stack only when the program called ``cuCtxSetLimit``, so a tenant under a 1 GiB limit held 16 GiB of
the GPU with one launch. Each run is its own process on the fake driver and NVML (tests/fakes), which
grows and keeps the stack as described (checked without the shim), with the plain and the sanitised builds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import MIB, Toolchain, play_steps, program_fixtures

SRC = Path(__file__).resolve().parent / "stackmem_redteam.c"
CTX = 300 * MIB  # what a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
THREADS = 132 * 2048  # threads resident at once on the fake H200: SMs x threads per SM
DEEP = 64 * 1024  # the attack's local memory per thread
MID = 2048  # a big frame that fits under 1 GiB: 2 KiB x THREADS = 528 MiB
LOCAL = f"deep={DEEP},mid={MID}"
APIS = ["kernel", "kernel_ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "launch", "grid", "gridasync", "multi",
        "graph", "graphset", "graphupdate", "graphnode"]
# the step that meets the check: a graph's instantiation; an executable's kernel node given the kernel, or
# the executable updated to a graph of it
STEP = {"graph": "instantiate", "graphset": "setparams", "graphupdate": "update", "graphnode": "setparams"}

built, built_asan, any_build = program_fixtures(SRC, "stackmem")


def play(build: tuple[Toolchain, Path], api: str, kernel: str, more: int,
         shim: bool = True) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """Run the program under a 1 GiB limit (contexts not charged): each step's (rc, charged, peak), and
    every ``name=value`` line."""
    return play_steps(build, api, kernel, str(more), shim=shim, timeout=60, FAKE_CUDA_LOCAL_BYTES=LOCAL)


@pytest.mark.parametrize("api", ["kernel", "graph", "graphset", "graphupdate", "graphnode"])
def test_the_fake_driver_grows_the_stack_at_launch(built: tuple[Toolchain, Path], api: str) -> None:
    # Without the shim: the launch grows the stack to the kernel's 64 KiB per thread (16 GiB above the
    # default 1 KiB), the context keeps it (cuCtxGetLimit reports it) and frees it when destroyed.
    s, out = play(built, api, "deep", 400 * MIB, shim=False)
    assert out["local"] == str(DEEP) and out["local_rc"] == "0"
    assert s["launch"][0] == 0 and s["launch"][2] == CTX + (DEEP - 1024) * THREADS, s
    assert out["stack"] == str(DEEP)
    assert s["more"][0] == 0 and s["more"][2] == CTX + (DEEP - 1024) * THREADS + 400 * MIB
    assert out["held"] == "0"


@pytest.mark.parametrize("api", APIS)
def test_a_launch_cannot_grow_the_stack_past_the_limit(built: tuple[Toolchain, Path], api: str) -> None:
    # The attack: one launch of a kernel with a 64 KiB frame under a 1 GiB limit took 16 GiB of the GPU,
    # nothing charged. Now refused before the driver is called (graph: its instantiation; an executable's
    # kernel node given the kernel: that call), nothing held.
    s, out = play(built, api, "deep", 400 * MIB)
    step = STEP.get(api, "launch")
    assert s[step][:2] == (2, 0), s  # CUDA_ERROR_OUT_OF_MEMORY, nothing charged
    assert s[step][2] == CTX, s  # the driver never grew the stack
    assert out["stack"] == "1024"
    assert s["more"] == (0, 400 * MIB, CTX + 400 * MIB)
    assert s["again"][:2] == (1 if api == "graph" else 0 if api.startswith("graph") else 2, 400 * MIB), s
    # graph: no executable to launch; graphset, graphupdate, graphnode: the executable still runs its ordinary
    # kernel
    assert s["destroy"][:2] == (0, 0)


@pytest.mark.parametrize("api", ["kernel", "multi", "graph", "graphset", "graphupdate", "graphnode"])
def test_a_big_frame_within_the_limit_is_charged_and_runs(any_build: tuple[Toolchain, Path], api: str) -> None:
    # A 2 KiB frame: charged by cuCtxSetLimit's rule (2 KiB x threads = 528 MiB) and run; the charge stays
    # with the context (the driver keeps the stack), so 600 MiB more does not fit; a relaunch costs
    # nothing more; the context's destruction gives it back.
    s, out = play(any_build, api, "mid", 600 * MIB)
    step = STEP.get(api, "launch")
    assert s[step][:2] == (0, MID * THREADS), s
    assert s["launch"][0] == 0 and s["launch"][2] == CTX + (MID - 1024) * THREADS, s
    assert out["stack"] == str(MID)
    assert s["more"][:2] == (2, MID * THREADS)
    assert s["again"][:2] == (0, MID * THREADS)
    assert s["destroy"][:2] == (0, 0)
    assert out["held"] == "0"


def test_an_ordinary_kernel_is_not_charged(any_build: tuple[Toolchain, Path]) -> None:
    # No local memory beyond the default stack: nothing charged, 1 GiB (the limit) still allocatable.
    s, out = play(any_build, "kernel", "plain", 1024 * MIB)
    assert out["local"] == "0"
    assert s["launch"] == (0, 0, CTX)
    assert s["more"][:2] == (0, 1024 * MIB)
    assert s["again"][:2] == (0, 1024 * MIB)
