"""Memory limit: lookup paths, every allocation API, KF-20/22/23/24, reporting (CUDA and NVML)."""

from __future__ import annotations

import pytest

from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, parse, rc_usage, run, run_python

HOOKED = {
    "cuInit", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2", "cuCtxCreate_v2", "cuCtxDestroy_v2",
    "cuMemAlloc_v2", "cuMemAllocManaged", "cuMemAllocPitch_v2", "cuMemAllocAsync", "cuMemAllocFromPoolAsync",
    "cuMemFree_v2", "cuMemFreeAsync", "cuMemCreate", "cuMemRelease", "cuArrayCreate_v2", "cuArray3DCreate_v2",
    "cuArrayDestroy", "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy", "cuMemGetInfo_v2", "cuDeviceTotalMem_v2",
    "cuMemPoolCreate", "cuMemPoolDestroy", "cuLaunchKernel", "cuLaunchKernelEx", "cuGraphInstantiateWithFlags",
    "cuGraphLaunch", "cuGraphExecDestroy", "cuMemMap", "cuMemUnmap", "cuMemPoolTrimTo", "cuCtxSetLimit",
    "cuModuleLoadData",
}


@pytest.mark.parametrize("mode", ["direct", "dlsym", "procaddr"])
def test_lookup_paths_get_hooks_and_enforce(tc: Toolchain, mode: str) -> None:
    out = parse(run(tc, mode, "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert set(out["hooked_names"].strip(",").split(",")) == HOOKED
    assert rc_usage(out["alloc512"]) == (0, 512 * MIB)
    assert rc_usage(out["alloc768"]) == (2, 512 * MIB)  # CUDA_ERROR_OUT_OF_MEMORY, usage unchanged
    assert (int(out["meminfo_rc"]), int(out["free"]), int(out["total"])) == (0, 512 * MIB, GIB)
    assert int(out["totalmem"]) == GIB
    assert rc_usage(out["freed"]) == (0, 0)


def test_kf20_alloc_over_limit(tc: Toolchain) -> None:
    proc = run(tc, "direct", "kf20", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0")
    out = parse(proc.stdout)
    assert int(out["rc"]) == 2
    assert int(out["usage_before"]) == int(out["usage_after"]) == 0
    oom_lines = [ln for ln in proc.stderr.splitlines() if "out of memory" in ln]
    assert len(oom_lines) == 1 and "device 0" in oom_lines[0]


def test_kf22_double_unknown_and_late_frees(tc: Toolchain) -> None:
    out = parse(run(tc, "dlsym", "kf22", CUDA_DEVICE_MEMORY_LIMIT_0="24g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["alloc"]) == (0, GIB)
    assert rc_usage(out["free1"]) == (0, GIB)  # freed into the device's pool, which keeps it reserved
    assert rc_usage(out["trim"]) == (0, 0)  # the pool gave it back to the driver
    assert rc_usage(out["free2"])[1] == 0 and rc_usage(out["free2"])[0] != 0  # double free: driver error, no change
    assert rc_usage(out["unknown"])[1] == 0
    assert rc_usage(out["q"]) == (0, 256 * MIB)
    assert rc_usage(out["ctx_destroy"]) == (0, 0)  # the context took its memory with it
    assert rc_usage(out["late"])[1] == 0  # late free: nothing subtracted twice
    assert rc_usage(out["again"]) == (0, GIB)
    assert rc_usage(out["end"]) == (0, 0)


def test_kf23_async_alloc_free_loop(tc: Toolchain) -> None:
    out = parse(run(tc, "procaddr", "kf23", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert int(out["ooms"]) == 0 and int(out["errs"]) == 0
    assert int(out["max"]) == 256 * MIB
    assert int(out["end"]) == int(out["base"]) == 0


def test_kf24_pool_allocations_counted(tc: Toolchain) -> None:
    out = parse(run(tc, "direct", "kf24", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["pool"])[0] == 0
    assert rc_usage(out["big"]) == (2, 0)
    assert rc_usage(out["small"]) == (0, 512 * MIB)
    assert rc_usage(out["second"]) == (2, 512 * MIB)
    assert rc_usage(out["free"]) == (0, 512 * MIB)  # back to the pool, still reserved
    assert rc_usage(out["destroy"]) == (0, 0)  # destroying the pool releases its reserve


def test_every_allocation_path_and_its_free(tc: Toolchain) -> None:
    out = parse(run(tc, "procaddr", "paths", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    expect = {
        "managed": 8 * MIB, "pitch": int(out["pitch_bytes"]), "create": 64 * MIB,
        "array": 1024 * 1024 * 4 * 4, "array3d": 256 * 256 * 16 * 2 * 2,
        "mipmap": 1024 * 1024 + 512 * 512 + 256 * 256,
    }
    for name, size in expect.items():
        assert rc_usage(out[name]) == (0, size), name
    for name in ("managed_free", "pitch_free", "release", "array_free", "array3d_free", "mipmap_free"):
        assert rc_usage(out[name]) == (0, 0), name
    for name in ("array_oom", "create_oom", "managed_oom", "pitch_oom", "async_oom"):
        assert rc_usage(out[name]) == (2, 0), name
    assert rc_usage(out["array_badformat"]) == (1, 0)  # the driver's CUDA_ERROR_INVALID_VALUE; reserve given back


@pytest.mark.parametrize(("value", "expected"), [("3000m", 3000 * MIB), ("1073741824", GIB), ("2G", 2 * GIB),
                                                 ("1048576k", GIB)])
def test_limit_suffixes(tc: Toolchain, value: str, expected: int) -> None:
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0=value, LIBVGPU_CONTEXT_COST="0").stdout)
    assert int(out["total"]) == expected


def test_global_limit_applies_and_index_overrides(tc: Toolchain) -> None:
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert int(out["total"]) == GIB and rc_usage(out["alloc768"])[0] == 2
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_LIMIT_0="4g",
                    LIBVGPU_CONTEXT_COST="0").stdout)
    assert int(out["total"]) == 4 * GIB and rc_usage(out["alloc768"])[0] == 0


def test_disable_control_passes_through(tc: Toolchain) -> None:
    out = parse(run(tc, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DISABLE_CONTROL="true").stdout)
    assert rc_usage(out["alloc768"])[0] == 0
    assert int(out["total"]) == 143771 * MIB  # the fake H200's physical memory


def test_tiny_limit_below_context_cost(tc: Toolchain, tmp_path) -> None:
    # context cost measured through (fake) NVML: the fake charges FAKE_CUDA_CTX_MIB per context
    state = tmp_path / "gpu.state"
    out = parse(run(tc, "direct", "tiny", CUDA_DEVICE_MEMORY_LIMIT_0="100m", FAKE_GPU_STATE=str(state),
                    FAKE_CUDA_CTX_MIB="300").stdout)
    assert int(out["meminfo_rc"]) == 0
    assert int(out["free"]) == 0 and int(out["total"]) == 100 * MIB
    assert int(out["usage"]) == 300 * MIB
    assert rc_usage(out["alloc"])[0] == 2
    assert rc_usage(out["release"]) == (0, 0)


def test_no_limit_counts_but_never_refuses(tc: Toolchain) -> None:
    out = parse(run(tc, "direct", "basic", LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["alloc768"]) == (0, 512 * MIB + 768 * MIB)
    assert int(out["total"]) == 143771 * MIB


PY_CTYPES = r"""
import ctypes, os
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
cuda = ctypes.CDLL("libcuda.so.1")
shim = ctypes.CDLL(None)
assert cuda.cuInit(0) == 0
ctx = c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
p = c_uint64()
def used():
    u = c_uint64(); lim = c_uint64()
    shim.vgpu_get_usage(0, byref(u), byref(lim))
    return u.value
r1 = cuda.cuMemAlloc_v2(byref(p), c_size_t(600 << 20)); u1 = used()
q = c_uint64()
r2 = cuda.cuMemAlloc_v2(byref(q), c_size_t(600 << 20)); u2 = used()
free, total = c_size_t(), c_size_t()
r3 = cuda.cuMemGetInfo_v2(byref(free), byref(total))
nvml = ctypes.CDLL("libnvidia-ml.so.1")
class Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
class Mem2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
assert nvml.nvmlInit_v2() == 0
h = c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, byref(h)) == 0
m = Mem(); m2 = Mem2(version=(40 | (2 << 24)))
n1 = nvml.nvmlDeviceGetMemoryInfo(h, byref(m)); n2 = nvml.nvmlDeviceGetMemoryInfo_v2(h, byref(m2))
print(f"r1={r1} u1={u1} r2={r2} u2={u2} r3={r3} free={free.value} total={total.value}")
print(f"n1={n1} ntotal={m.total} nfree={m.free} nused={m.used} n2={n2} n2total={m2.total} n2free={m2.free} n2used={m2.used}")
"""


def test_python_ctypes_and_nvml_agree(tc: Toolchain) -> None:
    out = parse(run_python(tc, PY_CTYPES, CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert (int(out["r1"]), int(out["u1"])) == (0, 600 * MIB)
    assert (int(out["r2"]), int(out["u2"])) == (2, 600 * MIB)
    assert (int(out["free"]), int(out["total"])) == (GIB - 600 * MIB, GIB)
    assert int(out["n1"]) == 0 and int(out["n2"]) == 0
    assert (int(out["ntotal"]), int(out["nfree"]), int(out["nused"])) == (GIB, GIB - 600 * MIB, 600 * MIB)
    assert (int(out["n2total"]), int(out["n2free"]), int(out["n2used"])) == (GIB, GIB - 600 * MIB, 600 * MIB)


def test_nvml_follows_cuda_visible_devices(tc: Toolchain, tmp_path) -> None:
    cfg = tmp_path / "nvml.conf"
    cfg.write_text("gpu index=0\ngpu index=1\n")
    code = PY_CTYPES.replace("nvmlDeviceGetHandleByIndex_v2(0,", "nvmlDeviceGetHandleByIndex_v2(1,")
    # the process's CUDA ordinal 0 is the container's GPU 1 (NVML index 1): its limit and usage are GPU 1's,
    # wherever the process's own CUDA_VISIBLE_DEVICES puts it
    out = parse(run_python(tc, code.replace("shim.vgpu_get_usage(0,", "shim.vgpu_get_usage(1,"),
                           CUDA_DEVICE_MEMORY_LIMIT_0="8g", CUDA_DEVICE_MEMORY_LIMIT_1="1g", LIBVGPU_CONTEXT_COST="0",
                           CUDA_VISIBLE_DEVICES="1", FAKE_NVML_CONFIG=str(cfg)).stdout)
    assert (int(out["r1"]), int(out["u1"]), int(out["r2"])) == (0, 600 * MIB, 2)
    assert int(out["total"]) == GIB
    assert int(out["ntotal"]) == GIB and int(out["nused"]) == 600 * MIB


@pytest.mark.parametrize("mode", ["direct", "procaddr"])
def test_vmm_release_while_mapped_stays_charged(tc: Toolchain, mode: str) -> None:
    """cuMemCreate -> cuMemMap -> cuMemRelease (the CUDA samples' order): the physical memory is still
    allocated, so it stays charged until it is unmapped too (was: 4 GiB mapped under a 1 GiB limit)."""
    out = parse(run(tc, mode, "vmm", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0",
                    LIBVGPU_LOG_LEVEL="1").stdout)
    assert int(out["mapped_mib"]) == 1024
    assert rc_usage(out["loop0"]) == (0, 512 * MIB) and rc_usage(out["loop1"]) == (0, GIB)
    for i in range(2, 8):
        assert rc_usage(out[f"loop{i}"]) == (2, GIB)
    assert rc_usage(out["unmap0"]) == (0, 512 * MIB)  # released and unmapped: now free
    assert rc_usage(out["again"]) == (0, GIB)
    assert rc_usage(out["unmap_again"]) == (0, GIB)  # unmapped but not released: still allocated
    assert rc_usage(out["release_again"]) == (0, 512 * MIB)
    assert rc_usage(out["unmap1"]) == (0, 0)
    assert rc_usage(out["released_both"]) == (0, GIB)
    assert rc_usage(out["unmap_both"]) == (0, 0)  # one cuMemUnmap over two mappings
    assert rc_usage(out["double_release"]) == (1, 0)  # the driver refuses; nothing subtracted twice
    assert int(out["free"]) == GIB


def test_fake_vmm_keeps_released_mapped_memory(tc: Toolchain, tmp_path) -> None:
    """The fake driver itself (no shim) keeps release-while-mapped memory allocated, like the driver."""
    code = r"""
import ctypes
from ctypes import byref, c_size_t, c_uint64, c_void_p
cuda = ctypes.CDLL("libcuda.so.1")
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("ht", ctypes.c_int), ("lt", ctypes.c_int), ("id", ctypes.c_int),
                ("w", c_void_p), ("f", ctypes.c_ubyte * 8)]
assert cuda.cuInit(0) == 0
ctx = c_void_p(); assert cuda.cuCtxCreate_v2(byref(ctx), 0, 0) == 0
def free():
    f, t = c_size_t(), c_size_t(); cuda.cuMemGetInfo_v2(byref(f), byref(t)); return t.value - f.value
base = free()
p = Prop(type=1, lt=1, id=0); h = c_uint64(); va = c_uint64()
print("odd=%d" % cuda.cuMemCreate(byref(h), c_size_t(3 << 20), byref(p), c_uint64(0)))
assert cuda.cuMemCreate(byref(h), c_size_t(512 << 20), byref(p), c_uint64(0)) == 0
assert cuda.cuMemAddressReserve(byref(va), c_size_t(512 << 20), c_size_t(0), c_uint64(0), c_uint64(0)) == 0
assert cuda.cuMemMap(va, c_size_t(512 << 20), c_size_t(0), h, c_uint64(0)) == 0
print("release=%d used=%d" % (cuda.cuMemRelease(h), free() - base))
print("unmap=%d used2=%d" % (cuda.cuMemUnmap(va, c_size_t(512 << 20)), free() - base))
"""
    out = parse(run_python(tc, code, preload=False).stdout)
    assert int(out["odd"]) == 1  # not a multiple of the 2 MiB granularity
    assert (int(out["release"]), int(out["used"])) == (0, 512 * MIB)
    assert (int(out["unmap"]), int(out["used2"])) == (0, 0)


def test_nvml_total_never_above_physical(tc: Toolchain) -> None:
    out = parse(run_python(tc, PY_CTYPES, CUDA_DEVICE_MEMORY_LIMIT_0="200g", LIBVGPU_CONTEXT_COST="0").stdout)
    physical = 143771 * MIB
    assert int(out["ntotal"]) == physical and int(out["n2total"]) == physical
    assert int(out["ntotal"]) == int(out["nfree"]) + int(out["nused"])
    assert int(out["total"]) == physical  # cuMemGetInfo too


def test_oom_logging_is_rate_limited(tc: Toolchain) -> None:
    """100,000 refusals in a tight loop (a program probing memory) log one line per second at most,
    not one each (was: 429k lines in 6 s)."""
    proc = run(tc, "direct", "oomloop", "100000", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0")
    assert parse(proc.stdout)["ooms"] == "100000"
    lines = [ln for ln in proc.stderr.splitlines() if "out of memory" in ln]
    assert 1 <= len(lines) <= 100, len(lines)  # the loop takes well under 100 s
    assert "similar refusals not logged" in lines[0]


@pytest.mark.parametrize("mode", ["direct", "procaddr"])
def test_context_limits_that_take_device_memory_are_charged(tc: Toolchain, mode: str) -> None:
    """cuCtxSetLimit's malloc heap, printf FIFO and per-thread stack (x SMs x threads per SM) take
    device memory: charged to the context against the limit, refused past it (the escape: a 2 GiB
    heap under a 1 GiB limit), given back when lowered."""
    out = parse(run(tc, mode, "limits", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["heap300"]) == (0, 300 * MIB)
    assert rc_usage(out["heap2g"]) == (2, 300 * MIB)  # CUDA_ERROR_OUT_OF_MEMORY, nothing more charged
    assert rc_usage(out["alloc800"]) == (2, 300 * MIB)  # the heap counts against the limit
    assert rc_usage(out["heap0"]) == (0, 0)
    assert rc_usage(out["alloc800again"]) == (0, 800 * MIB)
    # 1 KiB per thread x 132 SMs x 2048 threads = 264 MiB: over the 224 MiB left
    assert rc_usage(out["stack1k"]) == (2, 800 * MIB)
    assert rc_usage(out["fifo100m"]) == (0, 900 * MIB)
    assert rc_usage(out["fifo50m"]) == (0, 850 * MIB)


def test_context_limits_are_asan_clean(tc_asan: Toolchain) -> None:
    p = run(tc_asan, "dlsym", "limits", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0")
    assert "ERROR: AddressSanitizer" not in p.stderr, p.stderr[-3000:]
    assert rc_usage(parse(p.stdout)["heap2g"]) == (2, 300 * MIB)
