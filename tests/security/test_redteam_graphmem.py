"""Red team: CUDA graph memory nodes (docs/shim.md "Memory limit", graph memory).

A graph's allocation node (``cuGraphAddMemAllocNode``, or ``cuMemAllocAsync`` captured from a stream) takes
its memory from the device's graph memory pool when the graph is launched, and what the graph does not free
stays allocated after the launch; the pool keeps what it reserved until ``cuDeviceGraphMemTrim``. The shim
charged none of it: a tenant under a 1 GiB limit launched a graph allocating 600 MiB and then allocated
600 MiB more, 1.2 GiB on the GPU. Each run is its own process on the fake driver and NVML (tests/fakes),
with the plain and the sanitised builds; the fake driver keeps graph memory as described (checked without
the shim).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, play_steps, program_fixtures

SRC = Path(__file__).resolve().parent / "graphmem_redteam.c"
CTX = 300 * MIB  # what a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
LIMIT = 1024 * MIB
BYTES = 600 * MIB  # twice this is past the 1 GiB limit
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

built, built_asan, any_build = program_fixtures(SRC, "graphmem")


def play(build: tuple[Toolchain, Path], *argv: str, shim: bool = True) -> tuple[dict[str, tuple[int, int, int]],
                                                                             dict[str, str]]:
    """Run the program under a 1 GiB limit (contexts not charged): each step's (rc, charged, peak), all lines."""
    return play_steps(build, *argv, shim=shim)


def test_the_fake_driver_allocates_graph_memory_at_launch(built: tuple[Toolchain, Path]) -> None:
    # Without the shim: the allocation node's 600 MiB is taken at the launch and kept after it, and a
    # cuMemAlloc of 600 MiB more comes on top (1.2 GiB besides the context).
    s, _ = play(built, "node", str(BYTES), shim=False)
    assert s["instantiate"][2] == CTX  # nothing allocated before the launch
    assert s["launch"] == (0, s["launch"][1], CTX + BYTES)
    assert s["more"][0] == 0 and s["more"][2] == CTX + 2 * BYTES


def test_graph_allocation_node_is_charged_at_launch(any_build: tuple[Toolchain, Path]) -> None:
    # The launch is let through (it fits) and charged, so the next 600 MiB is refused.
    s, _ = play(any_build, "node", str(BYTES))
    assert s["instantiate"][:2] == (0, 0)
    assert s["launch"] == (0, BYTES, CTX + BYTES)
    assert s["more"] == (OOM, BYTES, CTX + BYTES)  # never more than the limit on the GPU


def test_graph_launch_past_the_limit_is_refused(any_build: tuple[Toolchain, Path]) -> None:
    # 600 MiB allocated first: a graph allocating 600 MiB more is refused before the driver is called.
    s, _ = play(any_build, "prealloc", str(BYTES))
    assert s["pre"][:2] == (0, BYTES)
    assert s["launch"] == (OOM, BYTES, CTX + BYTES)


def test_captured_async_allocation_is_charged_when_the_graph_runs(any_build: tuple[Toolchain, Path]) -> None:
    # cuMemAllocAsync captured into a graph allocates nothing (the shim charged it at capture, and the
    # capture's free released it while the graph allocated at each launch); the launch is charged, the
    # graph pool keeps the memory after cuMemFreeAsync, and cuDeviceGraphMemTrim gives it back.
    s, _ = play(any_build, "capture", str(BYTES))
    assert s["captured_alloc"][:2] == (0, 0) and s["end_capture"][:2] == (0, 0)
    assert s["launch"] == (0, BYTES, CTX + BYTES)
    assert s["more"] == (OOM, BYTES, CTX + BYTES)
    assert s["free_graph_alloc"][:2] == (0, BYTES)  # back in the graph pool, which still holds it
    assert s["more_after_free"] == (OOM, BYTES, CTX + BYTES)
    assert s["trim"][:2] == (0, 0)
    assert s["more_after_trim"][:2] == (0, BYTES)


def test_capture_on_the_per_thread_default_stream_is_left_to_the_graph(any_build: tuple[Toolchain, Path]) -> None:
    # Through a _ptsz entry point the NULL stream is the per-thread default stream, which can be captured:
    # an allocation recorded there is not made, so it is not charged at capture (charged there too, the
    # launch would have counted it twice and been refused under the limit); the launch is charged once.
    s, _ = play(any_build, "capture_ptsz", str(BYTES))
    assert s["begin_capture"][0] == 0
    assert s["captured_alloc"][:2] == (0, 0)
    assert s["launch"] == (0, BYTES, CTX + BYTES)
    assert s["more"] == (OOM, BYTES, CTX + BYTES)


def test_relaunched_graph_is_not_refused_and_does_not_drift(any_build: tuple[Toolchain, Path]) -> None:
    # A legitimate graph allocating 300 MiB under the 1 GiB limit, launched 200 times (freed in the graph, or
    # with cuMemFree after each launch): every launch succeeds, the charge stays at 300 MiB, and the 700 MiB
    # the limit leaves can still be allocated.
    for mode in ("inner", "outer"):
        s, out = play(any_build, "relaunch", "200", str(300 * MIB), mode, str(700 * MIB))
        assert (out["failed"], out["drift"]) == ("0", "0"), (mode, out)
        assert s["last"][:2] == (0, 300 * MIB), mode
        assert s["fill"] == (0, 1000 * MIB, CTX + 1000 * MIB), mode


def test_trim_gives_the_charge_back(any_build: tuple[Toolchain, Path]) -> None:
    # The graph frees its 600 MiB, but the pool keeps it reserved (charged) until cuDeviceGraphMemTrim.
    s, _ = play(any_build, "trim", str(BYTES))
    assert s["launch"] == (0, BYTES, CTX + BYTES)
    assert s["more_before_trim"] == (OOM, BYTES, CTX + BYTES)
    assert s["trim"][:2] == (0, 0)
    assert s["more"][:2] == (0, 900 * MIB)
    assert s["more"][2] <= CTX + LIMIT


def test_exec_update_cannot_grow_the_allocation_unchecked(any_build: tuple[Toolchain, Path]) -> None:
    # 600 MiB held, an executable allocating (and freeing) 100 MiB launched, then updated with a graph of
    # the same shape allocating 900 MiB: what the executable can take is recorded again, so its next launch
    # is refused instead of taking 800 MiB more past the limit.
    s, _ = play(any_build, "update", str(100 * MIB), str(900 * MIB), str(BYTES))
    assert s["launch_small"] == (0, 700 * MIB, CTX + 700 * MIB)
    assert s["update"][0] == 0
    assert s["launch_big"] == (OOM, 700 * MIB, CTX + 700 * MIB)


def test_graph_upload_is_checked_like_a_launch(any_build: tuple[Toolchain, Path]) -> None:
    # cuGraphUpload, and instantiation with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD, reserve the graph's memory
    # ahead of its launch: past the limit they are refused; once there is room, charged.
    s, _ = play(any_build, "upload", str(BYTES))
    assert s["upload"] == (OOM, BYTES, CTX + BYTES)
    assert s["instantiate_upload"] == (OOM, BYTES, CTX + BYTES)
    assert s["free_pre"][:2] == (0, 0)
    assert s["instantiate_upload_fits"] == (0, BYTES, CTX + BYTES)
    assert s["launch"] == (0, BYTES, CTX + BYTES)


def test_allocation_node_in_a_child_graph_is_checked(any_build: tuple[Toolchain, Path]) -> None:
    # A child graph moved into its parent (cuGraphAddNode, ownership moved) may hold memory nodes: the parent's
    # launch allocates them. The shim walks child graphs, so 600 MiB held plus a child allocating 600 MiB is
    # refused. Without the shim the fake driver allocates it (1.2 GiB besides the context).
    tc_prog = any_build
    s, _ = play(tc_prog, "child", str(BYTES), shim=False)
    assert s["launch"][0] == 0 and s["launch"][2] == CTX + 2 * BYTES
    s, _ = play(tc_prog, "child", str(BYTES))
    assert s["add_child"][0] == 0
    assert s["launch"] == (OOM, BYTES, CTX + BYTES)


def test_concurrent_graph_launches_never_share_one_unused_reserve(any_build: tuple[Toolchain, Path]) -> None:
    # Two threads each launch a graph allocating 450 MiB (freed with cuMemFree after each launch) next to
    # 200 MiB held, under 1 GiB: one 450 MiB fits, two do not. Both checks must not count on the same
    # unused reserve of the graph pool (each would need nothing more and the pool would grow past the limit):
    # whatever the interleaving, the GPU never holds more than the limit, nothing fails but refusals, and
    # the charge ends at what the pool reserves.
    s, out = play(any_build, "race", str(450 * MIB), str(200 * MIB), "1500")
    assert out["other"] == "0", out
    assert int(out["launched"]) >= 1 and int(out["launched"]) + int(out["refused"]) == 3000, out
    assert s["end"][2] <= CTX + LIMIT, s
    assert s["end"][1] == 200 * MIB + 450 * MIB, s  # the 200 MiB and the pool's 450 MiB reserve


def test_allocation_nodes_on_two_gpus_are_each_checked_on_their_gpu(any_build: tuple[Toolchain, Path],
                                                                     tmp_path: Path) -> None:
    # Two GPUs, 1 GiB each; a graph launched from GPU 0's context allocates 100 MiB on GPU 0 and 600 MiB on
    # GPU 1. With 500 MiB held on GPU 1 the launch would put 1.1 GiB there: refused. With 400 MiB held it
    # fits (1000 MiB) and is let through, each GPU charged what its own pool reserves.
    tc, prog = any_build
    conf = tmp_path / "two.conf"
    conf.write_text("gpu index=0\ngpu index=1\n")
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1",
                 FAKE_NVML_CONFIG=str(conf))

    def launch(pre1_mib: int) -> tuple[str, str]:
        proc = subprocess.run([str(prog), "multidev", str(100 * MIB), str(600 * MIB), str(pre1_mib * MIB)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        out = parse(proc.stdout)
        return out["launch"], out["launch@1"]

    dev0, dev1 = launch(500)
    assert (dev0.split(":")[:2], dev1) == (["2", "0"], f"2:{500 * MIB}:{CTX + 500 * MIB}")
    dev0, dev1 = launch(400)
    assert dev0.split(":")[:2] == ["0", str(100 * MIB)]
    assert dev1 == f"0:{1000 * MIB}:{CTX + 1000 * MIB}"
