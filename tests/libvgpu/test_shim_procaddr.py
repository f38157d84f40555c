"""Version-exact cuGetProcAddress: the hook handed out has the ABI of the versioned entry point the
driver's own table names for (name, cudaVersion, flags).

The fake driver's cuGetProcAddress works like the real one (a version table, exported addresses), and
``fake_cuda_proc_table`` lets the test walk that table: for every entry the shim must return exactly
what the driver returned, or the hook *named like that versioned symbol* (dladdr), never a hook of
another version (cuCtxCreate at 11040 used to get the _v2 hook for a _v3 call).
"""

from __future__ import annotations

from pathlib import Path

from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, run_python

PRELUDE = r"""
import ctypes, os
from ctypes import byref, c_char_p, c_int, c_uint64, c_void_p, POINTER
cuda = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None)
class DlInfo(ctypes.Structure):
    _fields_ = [("fname", c_char_p), ("fbase", c_void_p), ("sname", c_char_p), ("saddr", c_void_p)]
def where(addr):
    i = DlInfo()
    if not addr or not libc.dladdr(c_void_p(addr), byref(i)):
        return "-", "-"
    return os.path.basename(i.fname or b"").decode(), (i.sname or b"-").decode()
gpa = cuda.cuGetProcAddress_v2
gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
assert cuda.cuInit(0) == 0
"""

WALK = PRELUDE + r"""
tab = cuda.fake_cuda_proc_table
i = 0
while True:
    name, ver, sym, pt = c_char_p(), c_int(), c_char_p(), c_int()
    if tab(i, byref(name), byref(ver), byref(sym), byref(pt)) != 0:
        break
    for flags in ([0, 2] if pt.value else [0]):
        want = sym.value.decode() + ("_ptsz" if flags else "")
        for v in (ver.value, ver.value + 5):  # the entry's own version, and one between entries
            pfn, st = c_void_p(), c_int()
            rc = gpa(name.value, byref(pfn), v, flags, byref(st))
            lib, sname = where(pfn.value)
            print("row name=%s ver=%d flags=%d want=%s rc=%d lib=%s sym=%s" % (name.value.decode(), v, flags, want,
                                                                            rc, lib, sname))
    i += 1
"""


def _rows(text: str) -> list[dict[str, str]]:
    return [parse(ln) for ln in text.splitlines() if ln.startswith("row ")]


def test_every_table_entry_gets_the_hook_of_its_exact_versioned_symbol(tc: Toolchain) -> None:
    rows = _rows(run_python(tc, WALK, CUDA_DEVICE_MEMORY_LIMIT_0="1g").stdout)
    assert len(rows) > 150
    hooked = set()
    for r in rows:
        assert r["rc"] == "0", r
        assert r["sym"] == r["want"], r  # the ABI asked for, nothing else
        assert r["lib"] in ("libvgpu.so", "libcuda.so.1"), r
        if r["lib"] == "libvgpu.so":
            hooked.add(r["want"])
    # every versioned context-creation entry point is hooked, and the memory/launch ones
    assert {"cuCtxCreate", "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4", "cuMemAlloc_v2",
            "cuMemCreate", "cuMemMap", "cuMemUnmap", "cuLaunchKernel", "cuLaunchKernel_ptsz",
            "cuGraphInstantiateWithFlags", "cuGraphInstantiate_v2", "cuGetProcAddress", "cuGetProcAddress_v2",
            "cuDevicePrimaryCtxRelease_v2", "cuMemAllocAsync_ptsz"} <= hooked
    # lookups below an entry point's first version fail like the driver's
    by = {(r["name"], int(r["ver"])): r for r in rows}
    assert by[("cuCtxCreate", 11040)]["want"] == "cuCtxCreate_v3"
    assert by[("cuCtxCreate", 12055)]["want"] == "cuCtxCreate_v4"


CTX_V3_V4 = PRELUDE + r"""
CUDA = ctypes.CFUNCTYPE(c_int, POINTER(c_void_p), c_void_p, c_int, ctypes.c_uint, c_int)
CUDA4 = ctypes.CFUNCTYPE(c_int, POINTER(c_void_p), c_void_p, ctypes.c_uint, c_int)
shim = ctypes.CDLL(None)
def used(d):
    u, l = c_uint64(), c_uint64(); shim.vgpu_get_usage(d, byref(u), byref(l)); return u.value
for label, ver in (("v3", 11040), ("v4", 12050)):
    pfn, st = c_void_p(), c_int()
    assert gpa(b"cuCtxCreate", byref(pfn), ver, 0, byref(st)) == 0
    ctx = c_void_p()
    if label == "v3":
        rc = CUDA(pfn.value)(byref(ctx), None, 0, 0, 1)          # params, nparams, flags, device 1
    else:
        class Params(ctypes.Structure):
            _fields_ = [("aff", c_void_p), ("n", c_int), ("cig", c_void_p)]
        prm = Params()
        rc = CUDA4(pfn.value)(byref(ctx), ctypes.cast(byref(prm), c_void_p), 0, 1)
    dev = c_int(-1); cuda.cuCtxGetDevice(byref(dev))
    p = c_uint64(); r = cuda.cuMemAlloc_v2(byref(p), ctypes.c_size_t(600 << 20))
    print("%s_rc=%d %s_dev=%d %s_alloc=%d %s_used0=%d %s_used1=%d" % (label, rc, label, dev.value, label, r, label,
                                                                    used(0), label, used(1)))
    cuda.cuMemFree_v2(p); cuda.cuCtxDestroy_v2(ctx)
"""


def test_cuctxcreate_v3_v4_land_on_the_requested_device(tc: Toolchain, tmp_path: Path) -> None:
    cfg = tmp_path / "nvml.conf"
    cfg.write_text("gpu index=0\ngpu index=1\n")
    out = parse(run_python(tc, CTX_V3_V4, FAKE_NVML_CONFIG=str(cfg), CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                           CUDA_DEVICE_MEMORY_LIMIT_1="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    for v in ("v3", "v4"):
        assert out[f"{v}_rc"] == "0" and out[f"{v}_dev"] == "1", out
        assert out[f"{v}_alloc"] == "0"
        assert (int(out[f"{v}_used0"]), int(out[f"{v}_used1"])) == (0, 600 * MIB)  # charged to GPU 1
