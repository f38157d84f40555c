"""Red team: references to VMM memory the shim must follow (docs/shim.md "Memory limit"), and launch
entry points that must meet the SM limiter (docs/shim.md "SM limit").

The driver keeps the physical memory of a ``cuMemCreate`` handle while anything refers to it: the handle
itself, every mapping, every reference ``cuMemRetainAllocationHandle`` hands out (the same handle value,
each needing its own ``cuMemRelease``) and every shareable handle exported from it (a file descriptor,
which can be imported again or passed to another process). A tenant under a 1 GiB limit plays both to
hold its memory with nothing charged, then allocates the same again: 1.2 GiB on the GPU. Each run is its
own process on the fake driver and NVML (tests/fakes), with the plain and the sanitised builds; the fake
driver keeps the memory exactly as described (checked without the shim).

The driver still exports the deprecated launches (``cuLaunch``, ``cuLaunchGrid``, ``cuLaunchGridAsync``,
``cuLaunchCooperativeKernelMultiDevice``): a tenant under a 25 % SM limit that launches only through them
kept the GPU busy all the time.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, play_steps, program_fixtures

SRC = Path(__file__).resolve().parent / "shim5_redteam.c"
CTX = 300 * MIB  # what a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
BYTES = 600 * MIB  # twice this is past the 1 GiB limit

built, built_asan, any_build = program_fixtures(SRC, "shim5")


def play(build: tuple[Toolchain, Path], *argv: str, shim: bool = True) -> dict[str, tuple[int, int, int]]:
    """Run the program under a 1 GiB limit (contexts not charged); each step's (rc, charged, peak)."""
    return play_steps(build, *argv, shim=shim, timeout=60)[0]


def test_the_fake_driver_keeps_retained_and_exported_memory(built: tuple[Toolchain, Path]) -> None:
    # Without the shim: the memory a retained reference or an exported descriptor holds stays allocated
    # after release and unmap, as the driver keeps it; the second 600 MiB comes on top (1.2 GiB).
    for scenario in ("retain", "export"):
        s = play(built, scenario, str(BYTES), shim=False)
        assert s["more"][0] == 0 and s["more"][2] == CTX + 2 * BYTES, (scenario, s)


def test_retained_allocation_handle_keeps_the_memory_charged(any_build: tuple[Toolchain, Path]) -> None:
    # cuMemCreate, map, release (charged while mapped), then cuMemRetainAllocationHandle on the mapping and
    # unmap: the shim took the unmap for the end of the memory and uncharged it while the retained
    # reference kept it; mapped again, it was held with nothing charged, and 600 MiB more fit under 1 GiB.
    s = play(any_build, "retain", str(BYTES))
    assert s["retain"] == (0, BYTES, CTX + BYTES)
    assert s["unmap"][:2] == (0, BYTES)  # the retained reference holds it: still charged
    assert s["remap"][:2] == (0, BYTES)
    assert s["more"] == (2, BYTES, CTX + BYTES)  # refused: never more than the limit on the GPU
    # given back once the retained reference is released and the last mapping unmapped
    assert s["release_retained"][:2] == (0, BYTES)
    assert s["unmap_last"][:2] == (0, 0)


def test_exported_handle_stays_charged_after_its_release(any_build: tuple[Toolchain, Path]) -> None:
    # cuMemCreate, export a file descriptor, release: the descriptor keeps the memory, but the shim saw an
    # unmapped, released handle and uncharged it; imported from the descriptor and mapped, it was held with
    # nothing charged, and 600 MiB more fit under 1 GiB.
    s = play(any_build, "export", str(BYTES))
    assert s["export"] == (0, BYTES, CTX + BYTES)
    assert s["release"][:2] == (0, BYTES)
    assert s["map"][:2] == (0, BYTES)
    assert s["more"] == (2, BYTES, CTX + BYTES)


def test_failed_export_does_not_pin_the_charge(any_build: tuple[Toolchain, Path]) -> None:
    # Only an export that succeeded keeps the handle charged past its release.
    s = play(any_build, "export_fail")
    assert s["export_bad_type"][:2] == (1, 64 * MIB)
    assert s["release"][:2] == (0, 0)


@pytest.mark.parametrize(("api", "blocks", "per_launch_ns"),
                         [("grid", 5000, 0), ("gridasync", 5000, 0), ("multi", 5000, 0), ("launch", 1, 5_000_000)])
def test_deprecated_launches_meet_the_sm_limit(any_build: tuple[Toolchain, Path], tmp_path: Path, api: str,
                                               blocks: int, per_launch_ns: int) -> None:
    # 80 kernels of 5 ms each back to back under a 25 % SM limit: through cuLaunchKernel the GPU is busy
    # about a quarter of the time; through the deprecated launches the shim did not see, all the time.
    tc, prog = any_build
    env = tc.env(CUDA_DEVICE_SM_LIMIT="25", FAKE_GPU_STATE=str(tmp_path / "gpu.state"),
                 FAKE_CUDA_NS_PER_LAUNCH=str(per_launch_ns), LIBVGPU_LOG_LEVEL="1")
    proc = subprocess.run([str(prog), "launch", api, "80", str(blocks)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    assert out["rc"] == "0", proc.stdout
    # throttled: well below the 96-100 % the unhooked launches reached (a loaded machine only lowers it)
    assert float(out["busy"]) < 0.6, (api, out)


@pytest.mark.parametrize("mode", ["keep", "destroy"])
def test_pools_past_the_shims_table_are_charged_or_refused(any_build: tuple[Toolchain, Path], mode: str) -> None:
    # The shim follows each pool's reserve in a table of 64 pools; a pool beyond it (64 pools in use, or 64
    # created and destroyed: their places were never given back) was charged only for its live
    # allocations, so 600 MiB freed into a pool that keeps its reserve was uncharged while the pool held it,
    # and 600 MiB more fit under 1 GiB. Destroyed pools' places are reused; with 64 in use, refused.
    s = play(any_build, "pools", "64", mode, str(BYTES))
    if mode == "keep":
        assert s["pool_alloc"][0] == 2  # CUDA_ERROR_OUT_OF_MEMORY: its reserve could not be charged
        assert s["more"][0] == 0 and s["more"][2] <= CTX + 1024 * MIB
    else:
        assert s["pool_alloc"][:2] == (0, BYTES)
        assert s["pool_free"][:2] == (0, BYTES)  # the pool keeps it reserved: still charged
        assert s["more"] == (2, BYTES, CTX + BYTES)


@pytest.mark.parametrize("way", ["deepbind", "next", "mopen", "procaddr"])
def test_entry_points_found_other_ways_are_the_hooks(any_build: tuple[Toolchain, Path], way: str) -> None:
    # A tenant looks the driver's allocation up past the usual path: dlopen with RTLD_DEEPBIND,
    # dlsym(RTLD_NEXT), a fresh copy of libcuda in a new link-map namespace (dlmopen), or
    # cuGetProcAddress_v2 for an old version with the per-thread-stream flag. Each hands out the shim's
    # hook, so 2 GiB under a 1 GiB limit is refused.
    tc, prog = any_build
    if tc.built.asan and way in ("deepbind", "mopen"):
        pytest.skip("the sanitizer runtime refuses RTLD_DEEPBIND and new link-map namespaces")
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_LOG_LEVEL="1")
    proc = subprocess.run([str(prog), "lookup", way], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    assert (out["hooked"], out["alloc"]) == ("1", "2"), out
