"""The fake libnvidia-ml.so.1 driven by the real pynvml code path (also used by the device plugin tests)."""

from __future__ import annotations

from pathlib import Path

from tests.libvgpu.shim_helpers import Toolchain, parse, run_python

PYNVML = r"""
import ctypes, os
ctypes.CDLL(os.environ["FAKE_NVML_PATH"], mode=ctypes.RTLD_GLOBAL)
import pynvml as n
n.nvmlInit()
print("count=%d driver=%s" % (n.nvmlDeviceGetCount(), n.nvmlSystemGetDriverVersion()))
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    try:
        m = n.nvmlDeviceGetMemoryInfo(h)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        print("gpu%d uuid=%s name=%s total=%d total2=%d index=%d minor=%d numa=%d mig=%d util=%d cc=%d.%d bus=%s procs=%d"
              % (i, n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetName(h).replace(" ", "_"), m.total, m2.total,
                 n.nvmlDeviceGetIndex(h), n.nvmlDeviceGetMinorNumber(h), n.nvmlDeviceGetNumaNodeId(h),
                 n.nvmlDeviceGetMigMode(h)[0], n.nvmlDeviceGetUtilizationRates(h).gpu,
                 *n.nvmlDeviceGetCudaComputeCapability(h), n.nvmlDeviceGetPciInfo(h).busId,
                 len(n.nvmlDeviceGetComputeRunningProcesses(h))))
    except n.NVMLError as e:
        print("gpu%d error=%d" % (i, e.value))
h0 = n.nvmlDeviceGetHandleByIndex(0)
s = n.nvmlEventSetCreate()
n.nvmlDeviceRegisterEvents(h0, n.nvmlEventTypeXidCriticalError, s)
print("supported=%d" % n.nvmlDeviceGetSupportedEventTypes(h0))
got = []
for _ in range(3):
    try:
        d = n.nvmlEventSetWait(s, 200)
        got.append("%d:%d" % (n.nvmlDeviceGetIndex(d.device), d.eventData))
    except n.NVMLError as e:
        got.append("timeout" if e.value == n.NVML_ERROR_TIMEOUT else "err%d" % e.value)
print("events=" + ",".join(got))
n.nvmlEventSetFree(s)
n.nvmlShutdown()
"""


def test_pynvml_against_fake_config_and_events(tc: Toolchain, tmp_path: Path) -> None:
    cfg = tmp_path / "nvml.conf"
    cfg.write_text(
        "# test config\n"
        "driver=535.104.05\n"
        'gpu index=0 uuid=GPU-aaaa name="NVIDIA A100-SXM4-80GB" memory_mib=81920 numa=1 mig=1 util=37 cc=8.0\n'
        "gpu index=1 fail=1\n"
    )
    events = tmp_path / "events"
    events.write_text("1 79\n0 48\n0 13\n")
    out = run_python(tc, PYNVML, preload=False, FAKE_NVML_PATH=str(tc.built.libnvml), FAKE_NVML_CONFIG=str(cfg),
                     FAKE_NVML_EVENTS=str(events)).stdout
    kv = parse(out)
    assert kv["count"] == "2" and kv["driver"] == "535.104.05"
    assert kv["uuid"] == "GPU-aaaa" and kv["name"] == "NVIDIA_A100-SXM4-80GB"
    assert int(kv["total"]) == int(kv["total2"]) == 81920 * 1024 * 1024
    assert (kv["numa"], kv["mig"], kv["util"], kv["cc"]) == ("1", "1", "37", "8.0")
    assert "gpu1 error=15" in out  # NVML_ERROR_GPU_IS_LOST
    # GPU 1 is not registered: its line stays; GPU 0's XIDs come once each, then the wait times out
    assert kv["events"] == "0:48,0:13,timeout"
    assert events.read_text() == "1 79\n"


def test_pynvml_sees_simulated_activity(tc: Toolchain, tmp_path: Path) -> None:
    state = tmp_path / "gpu.state"
    code = r"""
import ctypes, os, time
cuda = ctypes.CDLL("libcuda.so.1")
ctypes.CDLL(os.environ["FAKE_NVML_PATH"], mode=ctypes.RTLD_GLOBAL)
import pynvml as n
from ctypes import byref, c_void_p, c_uint64
assert cuda.cuInit(0) == 0
ctx = c_void_p(); assert cuda.cuCtxCreate_v2(byref(ctx), 0, 0) == 0
p = c_uint64(); assert cuda.cuMemAlloc_v2(byref(p), ctypes.c_size_t(1 << 30)) == 0
mod = c_void_p(); f = c_void_p()
cuda.cuModuleLoadData(byref(mod), b"x"); cuda.cuModuleGetFunction(byref(f), mod, b"k")
# 1 s of simulated GPU work queued at once (the queue is deep enough to take it without waiting), so the
# GPU stays busy however the host schedules this process; then wait until that work has covered NVML's
# 200 ms window, and read it while the GPU is still busy
t0 = time.monotonic()
for _ in range(10):
    assert cuda.cuLaunchKernel(f, 100000, 1, 1, 1, 1, 1, 0, None, None, None) == 0
while time.monotonic() - t0 < 0.25:
    time.sleep(0.01)
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
procs = n.nvmlDeviceGetComputeRunningProcesses(h)
print("used=%d util=%d procs=%s" % (n.nvmlDeviceGetMemoryInfo(h).used, n.nvmlDeviceGetUtilizationRates(h).gpu,
      ",".join("%d:%d" % (x.pid, x.usedGpuMemory) for x in procs)))
print("pid=%d" % os.getpid())
"""
    out = parse(run_python(tc, code, preload=False, FAKE_NVML_PATH=str(tc.built.libnvml), FAKE_GPU_STATE=str(state),
                           FAKE_CUDA_CTX_MIB="300", FAKE_NVML_UTIL_WINDOW_MS="200",
                           FAKE_CUDA_MAX_QUEUE_US="2000000").stdout)
    assert int(out["used"]) == (1024 + 300) * 1024 * 1024
    assert int(out["util"]) >= 90
    assert out["procs"] == f"{out['pid']}:{(1024 + 300) * 1024 * 1024}"
