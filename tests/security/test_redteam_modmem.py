"""Red team: device memory the driver allocates when a module or library is loaded (docs/shim.md "Modules
and libraries").

Loading a module makes the driver allocate device memory for its code and its static ``__device__`` globals
(``.nv.global``/``.bss``): a cubin declaring ``__device__ char big[60ull << 30];`` holds 60 GiB as soon as it
is loaded, with no allocation call the shim counted. A tenant under a 1 GiB limit loaded such a module and
held 60 GiB of a shared GPU (its neighbours ran out of memory). ``cuLibraryLoadData`` (CUDA 12) does the same
in every context the process holds and in each one it creates later. Each run is its own process on the fake
driver and NVML (tests/fakes: an image ``FAKEMOD:<bytes>`` takes that many bytes, visible in NVML's
per-process used memory), with the plain and the sanitised builds; the fake driver's behaviour is checked
without the shim.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, parse, program_fixtures

SRC = Path(__file__).resolve().parent / "modmem_redteam.c"
CTX = 300 * MIB  # what a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
HUGE = 60 * GIB  # the hostile module's __device__ array, far past the 1 GiB limit
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

built, built_asan, any_build = program_fixtures(SRC, "modmem")


def play(build: tuple[Toolchain, Path], tmp: Path, *argv: str, shim: bool = True, **env: str
         ) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """Run the program under a 1 GiB limit on a fake GPU whose memory NVML reports per process: each step's
    (rc, charged, held), and every ``name=value`` line. Contexts are not charged unless ``env`` says so."""
    tc, prog = build
    e = tc.env(shim, CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_LOG_LEVEL="1", FAKE_GPU_STATE=str(tmp / "gpu.state"))
    e.setdefault("LIBVGPU_CONTEXT_COST", "0")
    e.update(env)
    if e["LIBVGPU_CONTEXT_COST"] == "":
        del e["LIBVGPU_CONTEXT_COST"]
    proc = subprocess.run([str(prog), *argv], env=e, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    steps: dict[str, tuple[int, int, int]] = {}
    for k, v in out.items():
        if v.count(":") == 2:
            rc, charged, held = (int(x) for x in v.split(":"))
            steps[k] = (rc, charged, held)
    return steps, out


def test_the_fake_driver_allocates_module_memory(built: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # Without the shim: each way of loading takes the module's memory on the GPU (NVML's per-process
    # figure), and unloading gives it back; a 60 GiB module is loaded next to a 1 GiB "limit".
    for how in ("data", "dataex", "fatbin", "file", "proc"):
        s, _ = play(built, tmp_path, "module", how, str(HUGE), str(600 * MIB), shim=False)
        assert s["load"] == (0, 0, CTX + HUGE), how
        assert s["unload"] == (0, 0, CTX), how
    s, _ = play(built, tmp_path, "library", "data", str(HUGE), str(600 * MIB), shim=False, CUDA_MODULE_LOADING="EAGER")
    assert s["load"] == (0, 0, CTX + HUGE)
    assert s["unload"] == (0, 0, CTX)
    s, _ = play(built, tmp_path, "ctxgone", str(400 * MIB), str(600 * MIB), shim=False)
    assert s["load"][2] == 2 * CTX + CTX + 400 * MIB - CTX  # two contexts and the module
    assert s["destroy"][2] == CTX  # freed with its context
    s, out = play(built, tmp_path, "libnoctx", str(HUGE), str(600 * MIB), shim=False, CUDA_MODULE_LOADING="EAGER")
    assert out["load"] == "0" and s["destroy"][2] == 0  # nothing allocated without a context
    assert s["ctx"] == (0, 0, CTX + HUGE)  # loaded into the new context


def test_the_fake_driver_loads_libraries_lazily_by_default(built: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # Without the shim, CUDA_MODULE_LOADING unset (the driver's default since CUDA 12.2) or LAZY: a library
    # takes nothing at its load, nor in a context created later; its first use in a context loads it there.
    for how in ("launch", "kernel", "global", "managed", "module"):
        s, _ = play(built, tmp_path, "lazy", how, str(HUGE), str(600 * MIB), shim=False)
        assert s["load"] == (0, 0, CTX), how
        assert s["use"] == (0, 0, CTX + HUGE), how
        assert s["unload"] == (0, 0, CTX), how
    s, _ = play(built, tmp_path, "lazyother", str(HUGE), str(600 * MIB), shim=False, CUDA_MODULE_LOADING="LAZY")
    assert s["load"] == (0, 0, 2 * CTX)
    assert s["use2"] == (0, 0, 2 * CTX + HUGE)  # loaded into the second context at its first launch there
    s, out = play(built, tmp_path, "libfirst", str(HUGE), str(600 * MIB), shim=False)
    assert out["load"] == "0" and s["ctx"] == (0, 0, CTX)
    assert s["use"] == (0, 0, CTX + HUGE)


def test_lazy_library_first_use_is_charged(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The attack, with the CUDA defaults (lazy loading): a library with a 60 GiB __device__ array is loaded
    # while the context exists (the driver takes nothing yet), then its first use there (a launch of one of
    # its kernels, cuKernelGetFunction, cuLibraryGetGlobal/GetManaged, cuLibraryGetModule) pulls the 60 GiB
    # in, where the shim measures nothing (launches are its hot path). The shim loads the library into the
    # context inside the load's measurement: the load is refused, and no first use can take the memory.
    for how in ("launch", "kernel", "global", "managed", "module"):
        s, _ = play(any_build, tmp_path, "lazy", how, str(HUGE), str(600 * MIB))
        assert s["load"] == (OOM, 0, CTX), how
        assert s["alloc"][:2] == (0, 600 * MIB), how
    # a legitimate 500 MiB library is charged from its load on, its first use adds nothing, and its unload
    # gives the charge back
    s, _ = play(any_build, tmp_path, "lazy", "launch", str(500 * MIB), str(600 * MIB))
    assert s["load"] == (0, 500 * MIB, CTX + 500 * MIB)
    assert s["use"] == (0, 500 * MIB, CTX + 500 * MIB)
    assert s["alloc"] == (OOM, 500 * MIB, CTX + 500 * MIB)
    assert s["unload"] == (0, 0, CTX)
    assert s["alloc_after"] == (0, 600 * MIB, CTX + 600 * MIB)


def test_lazy_library_in_a_context_not_current_at_the_load(any_build: tuple[Toolchain, Path],
                                                          tmp_path: Path) -> None:
    # A second context exists but is not current when the library is loaded (nor, in one case, any other);
    # a kernel of it is then launched there. The shim loads the library into every context it knows of inside the load's measurement: a
    # 60 GiB library is refused, a 200 MiB one is charged for both copies until it is unloaded.
    for how in ("created", "primary"):  # the second context: cuCtxCreate, or the primary context retained
        for cur in ("cur", "nocur"):  # the first context current at the load, or none
            s, _ = play(any_build, tmp_path, "lazyother", str(HUGE), str(600 * MIB), how, cur)
            assert s["load"] == (OOM, 0, 2 * CTX), (how, cur)
        s, _ = play(any_build, tmp_path, "lazyother", str(200 * MIB), str(700 * MIB), how)
        assert s["load"] == (0, 400 * MIB, 2 * CTX + 400 * MIB), how
        assert s["use2"] == (0, 400 * MIB, 2 * CTX + 400 * MIB), how
        assert s["alloc"] == (OOM, 400 * MIB, 2 * CTX + 400 * MIB), how
        assert s["unload"] == (0, 0, 2 * CTX), how


def test_small_lazy_libraries_load_use_and_unload_without_drift(any_build: tuple[Toolchain, Path],
                                                               tmp_path: Path) -> None:
    # Legitimate use with the CUDA defaults: 100 times a 4 MiB library loaded, a kernel of it launched, and
    # unloaded: none fails, the charge is the same after every first use and back to nothing at the end, and
    # the whole limit can then be allocated.
    s, out = play(any_build, tmp_path, "libloop", "100", str(4 * MIB), str(1024 * MIB))
    assert (out["failed"], out["drift"]) == ("0", "0"), out
    assert s["end"] == (0, 0, CTX)
    assert s["alloc"] == (0, 1024 * MIB, CTX + 1024 * MIB)


def test_lazy_library_loaded_before_the_first_context(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # As the CUDA runtime does: the program's fatbins are loaded as libraries before any context exists, then
    # the first context (the primary one, or cuCtxCreate) is created and a kernel launched. The shim loads
    # every loaded library into a new context inside the creation's measurement (after the context's own
    # cost is measured): a 60 GiB library makes the creation fail with CUDA_ERROR_OUT_OF_MEMORY; a 500 MiB
    # one is charged to the context and given back at the unload. Contexts are measured (300 MiB each).
    for how in ("created", "primary"):
        s, out = play(any_build, tmp_path, "libfirst", str(HUGE), str(600 * MIB), how, LIBVGPU_CONTEXT_COST="")
        assert out["load"] == "0", how
        assert s["ctx"] == (OOM, 0, 0), how
        s, out = play(any_build, tmp_path, "libfirst", str(500 * MIB), str(600 * MIB), how, LIBVGPU_CONTEXT_COST="")
        assert s["ctx"] == (0, CTX + 500 * MIB, CTX + 500 * MIB), how
        assert s["use"] == (0, CTX + 500 * MIB, CTX + 500 * MIB), how
        assert s["alloc"] == (OOM, CTX + 500 * MIB, CTX + 500 * MIB), how
        assert s["unload"] == (0, CTX, CTX), how


def test_huge_module_is_refused(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The attack: a module with a 60 GiB __device__ array under a 1 GiB limit, by every load entry point
    # (cuGetProcAddress's included). The shim measures what the load took, finds it past the limit, unloads
    # the module again and returns CUDA_ERROR_OUT_OF_MEMORY: nothing is left on the GPU beyond the context.
    for how in ("data", "dataex", "fatbin", "file", "proc"):
        s, _ = play(any_build, tmp_path, "module", how, str(HUGE), str(600 * MIB))
        assert s["load"] == (OOM, 0, CTX), how
        assert s["alloc"][:2] == (0, 600 * MIB), how


def test_huge_module_is_refused_by_the_device_wide_figure(built: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The driver gives no per-process figure (FAKE_NVML_USED_NA): the device's used-memory rise is charged.
    s, _ = play(built, tmp_path, "module", "data", str(HUGE), str(600 * MIB), FAKE_NVML_USED_NA="1")
    assert s["load"] == (OOM, 0, CTX)
    s, _ = play(built, tmp_path, "module", "data", str(500 * MIB), str(600 * MIB), FAKE_NVML_USED_NA="1")
    assert s["load"] == (0, 500 * MIB, CTX + 500 * MIB)
    assert s["alloc"] == (OOM, 500 * MIB, CTX + 500 * MIB)


def test_module_memory_is_charged_and_returned_at_unload(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # A legitimate 500 MiB module fits and is charged: 600 MiB more is refused while it is loaded, allowed
    # once it is unloaded.
    s, _ = play(any_build, tmp_path, "module", "data", str(500 * MIB), str(600 * MIB))
    assert s["load"] == (0, 500 * MIB, CTX + 500 * MIB)
    assert s["alloc"] == (OOM, 500 * MIB, CTX + 500 * MIB)
    assert s["unload"] == (0, 0, CTX)
    assert s["alloc_after"] == (0, 600 * MIB, CTX + 600 * MIB)


def test_small_modules_load_and_unload_without_drift(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # 200 loads and unloads of a 4 MiB module: none fails, the charge is the same after every load and back
    # to nothing at the end, and the whole limit can then be allocated.
    s, out = play(any_build, tmp_path, "loop", "200", str(4 * MIB), str(1024 * MIB))
    assert (out["failed"], out["drift"]) == ("0", "0"), out
    assert s["end"] == (0, 0, CTX)
    assert s["alloc"] == (0, 1024 * MIB, CTX + 1024 * MIB)


def test_module_charge_goes_with_its_context(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The driver frees a module with its context: destroying the context gives the charge back.
    s, _ = play(any_build, tmp_path, "ctxgone", str(400 * MIB), str(1000 * MIB))
    assert s["load"][:2] == (0, 400 * MIB)
    assert s["destroy"][:2] == (0, 0)
    assert s["alloc"][:2] == (0, 1000 * MIB)


@pytest.mark.parametrize("loading", ["EAGER", "LAZY"])
def test_huge_library_is_refused(any_build: tuple[Toolchain, Path], tmp_path: Path, loading: str) -> None:
    # cuLibraryLoadData / cuLibraryLoadFromFile load a copy into the context the process holds (with lazy
    # loading, the shim forces it in): 60 GiB is refused and unloaded again; 500 MiB is charged until
    # cuLibraryUnload.
    for how in ("data", "file"):
        s, _ = play(any_build, tmp_path, "library", how, str(HUGE), str(600 * MIB), CUDA_MODULE_LOADING=loading)
        assert s["load"] == (OOM, 0, CTX), how
        s, _ = play(any_build, tmp_path, "library", how, str(500 * MIB), str(600 * MIB), CUDA_MODULE_LOADING=loading)
        assert s["load"] == (0, 500 * MIB, CTX + 500 * MIB), how
        assert s["alloc"] == (OOM, 500 * MIB, CTX + 500 * MIB), how
        assert s["unload"] == (0, 0, CTX), how
        assert s["alloc_after"] == (0, 600 * MIB, CTX + 600 * MIB), how


@pytest.mark.parametrize("loading", ["EAGER", "LAZY"])
def test_library_loaded_without_a_context_is_charged_in_the_next_one(any_build: tuple[Toolchain, Path],
                                                                     tmp_path: Path, loading: str) -> None:
    # Loaded while the process holds no context, a library takes nothing; the driver loads it into the next
    # context created (lazy: the shim forces it in). The shim measures that creation: a 60 GiB library makes
    # the creation fail with CUDA_ERROR_OUT_OF_MEMORY (the context destroyed again); a 500 MiB one is charged
    # to the context (contexts measured: 300 MiB each) and given back when the library is unloaded.
    for how in ("created", "primary"):  # cuCtxCreate, or cuDevicePrimaryCtxRetain
        s, out = play(any_build, tmp_path, "libnoctx", str(HUGE), str(600 * MIB), how, LIBVGPU_CONTEXT_COST="",
                      CUDA_MODULE_LOADING=loading)
        assert out["load"] == "0", how
        assert s["ctx"] == (OOM, 0, 0), how
        s, out = play(any_build, tmp_path, "libnoctx", str(500 * MIB), str(600 * MIB), how, LIBVGPU_CONTEXT_COST="",
                      CUDA_MODULE_LOADING=loading)
        assert s["ctx"] == (0, CTX + 500 * MIB, CTX + 500 * MIB), how
        assert s["alloc"] == (OOM, CTX + 500 * MIB, CTX + 500 * MIB), how
        assert s["unload"] == (0, CTX, CTX), how


def test_loads_racing_context_creations_keep_the_accounting_whole(any_build: tuple[Toolchain, Path],
                                                                  tmp_path: Path) -> None:
    # One thread loads and unloads a library while another creates a context, loads and unloads a module in
    # it and destroys it, 100 times each: no deadlock (the measurements and context creations take the
    # per-GPU creation locks in one order), nothing fails, and once all is gone nothing stays charged.
    s, out = play(any_build, tmp_path, "race", "100", str(4 * MIB))
    assert out["failed"] == "0", out
    assert s["end"] == (0, 0, CTX)


def test_allocation_in_the_driver_during_a_load_does_not_shrink_its_measure(any_build: tuple[Toolchain, Path],
                                                                          tmp_path: Path) -> None:
    # The attack: while one thread loads a 1000 MiB module, another allocates 900 MiB. The shim reserves an
    # allocation's size before the driver's call, so at the load's closing reading the allocation can be
    # charged while NVML does not show it yet (a large cuMemAlloc takes milliseconds in the driver; the fake
    # NVML's listing gate holds the closing listing, its figures taken, until the allocation returned). Its
    # charge used to be subtracted from the load's rise as if the driver had already allocated it: the module
    # was charged 100 MiB and the tenant held 1900 MiB under a 1 GiB limit. A rise of the process's own charge
    # during the load is no longer subtracted (it may not be on the GPU yet): the module is measured whole and
    # refused, and what the tenant holds stays within the limit.
    s, _ = play(any_build, tmp_path, "inflight", str(1000 * MIB), str(900 * MIB))
    assert s["alloc"][0] == 0  # the allocation fits on its own
    assert s["load"][0] == OOM
    assert s["load"][2] - CTX <= GIB
    assert s["end"][1] == s["end"][2] - CTX  # charged what it holds (the context is not charged here)
    # a module that fits next to the allocation is charged whole: 100 MiB + 900 MiB
    s, _ = play(any_build, tmp_path, "inflight", str(100 * MIB), str(900 * MIB))
    assert s["load"] == (0, 1000 * MIB, CTX + 1000 * MIB)
    assert s["unload"] == (0, 900 * MIB, CTX + 900 * MIB)


def test_free_during_a_loads_opening_reading_does_not_shrink_its_measure(any_build: tuple[Toolchain, Path],
                                                                         tmp_path: Path) -> None:
    # The attack: the tenant holds 900 MiB and frees it in another thread while the load's opening NVML
    # reading is under way (the listing's figures, taken at its start, still show the 900 MiB; the free is
    # done and its charge given back before the shim read its own charge). The opening reading then held
    # 900 MiB in NVML's figure but not in the charge, so the rise read 900 MiB low: the 1000 MiB module was
    # charged 100 MiB. The shim reads its own charge before NVML's figures at the opening reading (after them
    # at the closing one), so a free in between makes the load look larger, never smaller.
    s, _ = play(any_build, tmp_path, "inflight", str(1000 * MIB), str(900 * MIB), "free")
    assert s["before"][:2] == (0, 900 * MIB)
    assert s["alloc"][0] == 0  # the free
    assert s["load"] == (0, 1000 * MIB, CTX + 1000 * MIB)  # charged whole


@pytest.mark.parametrize("kind", ["library", "module"])
def test_unload_racing_a_load_that_reuses_the_handle(any_build: tuple[Toolchain, Path], tmp_path: Path,
                                                     kind: str) -> None:
    # The attack: a 100 MiB library (module) is unloaded in one thread; the driver frees it and can hand the
    # same handle to the next load, which another thread makes at once, 900 MiB, before the unload's thread
    # gave the charge back. The load's charge was recorded under the handle over the old one's entry, then the
    # unload took that entry and gave back 900 MiB: the new library was held uncharged (and, a library, no
    # longer known as loaded, so later contexts would get their copies unmeasured) while 100 MiB stayed
    # charged for nothing; 900 MiB more could then be allocated. An unload now holds off loads (the creation
    # locks) until its charge is given back: the second load is charged whole and the allocation refused.
    s, out = play(any_build, tmp_path, "reuse", kind, str(100 * MIB), str(900 * MIB), str(900 * MIB))
    assert s["load1"] == (0, 100 * MIB, CTX + 100 * MIB)
    assert s["unload1"][0] == 0 and s["load2"][0] == 0
    assert out["same"] == "1"  # the driver handed the unloaded handle to the second load
    assert s["alloc"][0] == OOM  # 900 MiB loaded and charged: no room for 900 MiB more
    assert s["unload2"] == (0, 0, CTX)
    assert s["end"] == (0, 0, CTX)


def test_double_unloads_give_back_nothing_twice(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The attack: give a charge back twice to get room for more. A library unloaded twice, a module unloaded
    # after its context was destroyed (the driver freed it with the context, which gave its charge back), and
    # twice; a module unloaded twice. Each second unload is the driver's error and gives nothing back: the
    # charge never falls below what is held, and the full limit is then all that can be allocated.
    s, _ = play(any_build, tmp_path, "twice", str(200 * MIB), str(1024 * MIB))
    assert s["libload"] == (0, 200 * MIB, CTX + 200 * MIB)
    assert s["lib1"] == (0, 0, CTX)
    assert s["lib2"][0] != 0 and s["lib2"][1:] == (0, CTX)
    assert s["modload"] == (0, 200 * MIB, 2 * CTX + 200 * MIB)
    assert s["destroy"] == (0, 0, CTX)
    for step in ("modgone", "modgone2", "mod2"):
        assert s[step][0] != 0 and s[step][1:] == (0, CTX), step
    assert s["modload2"] == (0, 200 * MIB, CTX + 200 * MIB)
    assert s["mod1"] == (0, 0, CTX)
    assert s["alloc"] == (0, 1024 * MIB, CTX + 1024 * MIB)


def test_context_destroyed_during_a_load_does_not_shrink_its_measure(any_build: tuple[Toolchain, Path],
                                                                      tmp_path: Path) -> None:
    # The attack: a second context holds 900 MiB; another thread destroys it while a 1000 MiB module is loaded
    # in the first, its driver call landing between the load's two readings and its charge given back only
    # after them (the fake driver holds the destroy there). NVML's figure fell by the context and its 900 MiB
    # while the charge had not yet: the rise read negative and the module came in uncharged (1000 MiB held,
    # nothing charged, once the destroy finished). A load now holds destroys off (the lock a library load's
    # forcing already held) from its first reading to its charge: the destroy waits, the module is measured
    # whole and refused next to the 900 MiB, then the destroy completes.
    s, _ = play(any_build, tmp_path, "destroyrace", str(1000 * MIB), str(900 * MIB))
    assert s["alloc"][:2] == (0, 900 * MIB)
    assert s["destroy"][0] == 0
    assert s["load"][0] == OOM
    assert s["end"] == (0, 0, CTX)
