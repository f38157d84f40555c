"""The container's read-only limits file: every process in the container obeys it, whatever its env.

The file is written by ``kube_vgpu.envcontract.limits_file`` (the device plugin's one writer) and read
by the shim from a compiled-in path (``tc_limits`` compiles in a temporary one). Each test plays a
tenant process that tries to get out of the limits: no env at all (``env -i``, the shim loaded through
``/etc/ld.so.preload`` in a private mount namespace), a bigger ``CUDA_DEVICE_MEMORY_LIMIT_0``,
``GPU_CORE_UTILIZATION_POLICY=disable``, ``CUDA_DISABLE_CONTROL=true``, another shared cache file.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.podmatch import pending_containers
from deviceplugin.response import container_spec, limits_dir_name
from deviceplugin.shimcache import write_host_files
from kube_vgpu import envcontract
from kube_vgpu.model import DeviceBooking
from libvgpu.region import read_region
from tests.deviceplugin.dp_helpers import NODE, bound_pod
from tests.libvgpu.shim_helpers import (
    GIB,
    MIB,
    Toolchain,
    limits_path,
    parse,
    preload_ns_command,
    rc_usage,
    run,
)

UUID0 = "GPU-00000000-0000-4000-8000-000000000000"
UUID1 = "GPU-00000000-0000-4000-8000-000000000001"


@pytest.fixture
def limits(tc_limits: Toolchain, tmp_path: Path) -> Iterator[Path]:
    """Writes a 1 GiB / 30 % limits file for one GPU (shared cache in tmp_path); removed afterwards."""
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 1024, 30)], str(tmp_path / "vgpu.cache")))
    yield path
    path.unlink(missing_ok=True)


def _holder(tc: Toolchain, mib: int, **env: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([str(tc.prog), "direct", "hold", str(mib), "60"], env=tc.env(**env), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert rc_usage(parse(p.stdout.readline())["hold"]) == (0, mib * MIB)
    return p


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(timeout=10)


def test_file_limits_a_process_without_env(tc_limits: Toolchain, limits: Path, tmp_path: Path) -> None:
    out = parse(run(tc_limits, "direct", "basic").stdout)
    assert rc_usage(out["alloc512"]) == (0, 512 * MIB)
    assert rc_usage(out["alloc768"]) == (2, 512 * MIB)
    assert int(out["total"]) == GIB
    assert read_region(tmp_path / "vgpu.cache").limit[0] == GIB  # the file's shared cache is used


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_env_i_process_loaded_by_ld_so_preload_is_limited_and_shares(tc_limits: Toolchain, limits: Path,
                                                                     tmp_path: Path) -> None:
    holder = _holder(tc_limits, 700)  # a process started normally holds 700 MiB of the 1 GiB
    try:
        argv = ["env", "-i", str(tc_limits.prog), "direct", "hold", "500", "0"]
        proc = subprocess.run(preload_ns_command(tc_limits, tmp_path, argv), capture_output=True, text=True,
                              timeout=60, env={"PATH": os.environ["PATH"]})
        assert proc.returncode == 0, proc.stderr
        assert rc_usage(parse(proc.stdout)["hold"]) == (2, 700 * MIB)  # refused: 700 + 500 > 1024
        argv = ["env", "-i", str(tc_limits.prog), "direct", "hold", "300", "0"]
        proc = subprocess.run(preload_ns_command(tc_limits, tmp_path / "2", argv), capture_output=True, text=True,
                              timeout=60, env={"PATH": os.environ["PATH"]})
        assert rc_usage(parse(proc.stdout)["hold"]) == (0, 1000 * MIB)  # it shares the container's accounting
    finally:
        _stop(holder)


def test_bigger_env_limit_runs_under_the_file(tc_limits: Toolchain, limits: Path) -> None:
    holder = _holder(tc_limits, 700)
    try:
        proc = run(tc_limits, "direct", "hold", "500", "0", CUDA_DEVICE_MEMORY_LIMIT_0="8g")
        assert rc_usage(parse(proc.stdout)["hold"]) == (2, 700 * MIB)  # not 8 GiB, and the 700 MiB count
        warns = [ln for ln in proc.stderr.splitlines() if "differs from the container's limits file" in ln]
        assert len(warns) == 1 and "CUDA_DEVICE_MEMORY_LIMIT_0=8g" in warns[0] and "WARN" in warns[0], proc.stderr
    finally:
        _stop(holder)


@pytest.mark.parametrize("env", [
    {"CUDA_DISABLE_CONTROL": "true"},
    {"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/elsewhere.cache", "CUDA_DEVICE_MEMORY_LIMIT": "64g"},
    {"CUDA_DEVICE_MEMORY_LIMIT_0": "abc"},
], ids=["disable-control", "other-cache", "invalid-env"])
def test_env_cannot_split_or_lift_the_file_limits(tc_limits: Toolchain, limits: Path, env: dict[str, str]) -> None:
    holder = _holder(tc_limits, 700)
    try:
        proc = run(tc_limits, "direct", "hold", "500", "0", **env)
        assert rc_usage(parse(proc.stdout)["hold"]) == (2, 700 * MIB), proc.stderr
        assert "running under the file's limits" in proc.stderr
        assert not Path("/tmp/elsewhere.cache").exists()
    finally:
        _stop(holder)


def test_core_policy_disable_in_env_is_ignored(tc_limits: Toolchain, limits: Path, tmp_path: Path) -> None:
    env = tc_limits.env(FAKE_CUDA_NS_PER_BLOCK="2500", LIBVGPU_SM_PERIOD_MS="50", GPU_CORE_UTILIZATION_POLICY="disable",
                        FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
    proc = subprocess.run([str(tc_limits.prog), "direct", "sm", "2.1", "100", "1.0"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    windows = [float(m) for m in re.findall(r"window util=([0-9.]+)", proc.stdout)]
    assert len(windows) >= 2 and abs(windows[1] - 30) <= 5, windows  # the file's 30 %, not unlimited
    assert "GPU_CORE_UTILIZATION_POLICY=disable" in proc.stderr


def test_admin_core_policy_disable_in_file(tc_limits: Toolchain, tmp_path: Path) -> None:
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 1024, 30)], str(tmp_path / "c"),
                                            core_policy="disable"))
    try:
        env = tc_limits.env(FAKE_CUDA_NS_PER_BLOCK="2500", LIBVGPU_SM_PERIOD_MS="50",
                            FAKE_GPU_STATE=str(tmp_path / "gpu.state"))
        proc = subprocess.run([str(tc_limits.prog), "direct", "sm", "1.2", "100", "1.0"], env=env,
                              capture_output=True, text=True, timeout=60)
        windows = [float(m) for m in re.findall(r"window util=([0-9.]+)", proc.stdout)]
        assert windows and windows[0] >= 80, windows  # unthrottled (a limit would hold it near 10-30); margin for a loaded machine
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize(("content", "reason"), [
    ("version=2\ndevices=1\nuuid_0=GPU-a\nmemory_mib_0=1024\ncores_0=0\n", "version=2"),
    ("version=1\ndevices=1\nuuid_0=GPU-a\nmemory_mib_0=0\ncores_0=0\n", "memory_mib_0=0"),
    ("version=1\ndevices=1\nuuid_0=GPU-a\nmemory_mib_0=1g\ncores_0=0\n", 'memory_mib_0="1g"'),
    ("version=1\ndevices=1\nuuid_0=GPU-a\ncores_0=0\n", "memory_mib_0"),
    ("version=1\ndevices=1\nuuid_0=GPU-a\nmemory_mib_0=1024\nmemory_mib_0=99999\ncores_0=0\n", "twice"),
    ("\x00\xff garbage", "key=value"),
    ("", "version=0"),
    (envcontract.pending_limits_file(), "state=pending"),
    ("version=1\ndevices=1\nuuid_0=GPU-a\nmemory_mib_0=1024\ncores_0=0\ngraph_memory=max\n",
     'graph_memory="max": expected sum or peak'),
], ids=["version", "zero", "suffix", "missing", "repeat", "garbage", "empty", "pending-placeholder", "graph-memory"])
def test_unusable_file_fails_closed(tc_limits: Toolchain, tmp_path: Path, content: str, reason: str) -> None:
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    try:
        proc = run(tc_limits, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="64g")
        out = parse(proc.stdout)
        assert rc_usage(out["alloc512"]) == (2, 0)  # every allocation refused, the env's 64 GiB ignored
        warns = [ln for ln in proc.stderr.splitlines() if "failing closed" in ln]
        assert len(warns) == 1 and reason in warns[0], proc.stderr
    finally:
        path.unlink(missing_ok=True)


def test_mounted_limits_directory_without_the_file_fails_closed(tc_limits: Toolchain) -> None:
    """The device plugin mounts the limits directory at Allocate and writes the file at
    PreStartContainer: a container whose directory holds no file (PreStart never ran) must not fall
    back to its environment (which the tenant controls)."""
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    try:
        proc = run(tc_limits, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="64g")
        assert rc_usage(parse(proc.stdout)["alloc512"]) == (2, 0), proc.stderr
        warns = [ln for ln in proc.stderr.splitlines() if "failing closed" in ln]
        assert len(warns) == 1 and "its directory is mounted" in warns[0], proc.stderr
    finally:
        path.parent.rmdir()
    # without the directory (the shim used outside Kubernetes) the environment is read as before
    proc = run(tc_limits, "direct", "basic", CUDA_DEVICE_MEMORY_LIMIT_0="1g")
    assert rc_usage(parse(proc.stdout)["alloc512"]) == (0, 512 * MIB), proc.stderr
    assert "failing closed" not in proc.stderr


# ------------------------------------------------------------------ the writer (device plugin side)
def test_writer_output_and_validation() -> None:
    text = envcontract.limits_file([DeviceBooking(UUID0, 4000, 30), DeviceBooking(UUID1, 2000, 100)],
                                   priority=1, core_policy="default")
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == ["version=1", "devices=2", f"uuid_0={UUID0}", "memory_mib_0=4000", "cores_0=30",
                     f"uuid_1={UUID1}", "memory_mib_1=2000", "cores_1=100",
                     "shared_cache=/usr/local/vgpu/cache/vgpu.cache", "core_policy=default",
                     "core_sharing=strict", "graph_memory=sum", "disable_control=false", "priority=1"]
    bad: list[tuple[list[DeviceBooking], dict[str, object], str]] = [
        ([DeviceBooking(UUID0, 0, 30)], {}, "memory_mib_0=0"),
        ([DeviceBooking(UUID0, 10, 101)], {}, "cores_0=101"),
        ([DeviceBooking("GPU a", 10, 1)], {}, "uuid_0='GPU a'"),
        ([DeviceBooking(UUID0, 10, 1)], {"core_policy": "burst"}, "core_policy='burst'"),
        ([DeviceBooking(UUID0, 10, 1)], {"priority": 2}, "priority=2"),
        ([DeviceBooking(UUID0, 10, 1)], {"core_sharing": "burst"}, "core_sharing='burst'"),
        ([DeviceBooking(UUID0, 10, 1)], {"graph_memory": "max"}, "graph_memory='max': allowed values are sum, peak"),
        ([], {}, "devices=0"),
    ]
    for devs, kw, msg in bad:
        with pytest.raises(ValueError, match=re.escape(msg)):
            envcontract.limits_file(devs, **kw)  # type: ignore[arg-type]


def test_device_plugin_mounts_the_file_read_only_outside_the_cache_dir(tmp_path: Path) -> None:
    pc = pending_containers([bound_pod("p", [("c", False, [(UUID0, 1000, 20)], {})])], NODE)[0]
    spec = container_spec(pc, shim_host_path="/s/libvgpu.so", cache_host_dir=str(tmp_path))
    mounts = {m.container_path: m for m in spec.mounts}
    lim = mounts[envcontract.LIMITS_CONTAINER_DIR]
    cache = mounts[envcontract.CACHE_CONTAINER_DIR]
    assert lim.read_only and not cache.read_only
    assert lim.host_path == str(tmp_path / limits_dir_name(pc.uid, "c"))
    assert not lim.host_path.startswith(cache.host_path + os.sep)  # not writable through the cache mount
    written = write_host_files(spec)
    assert written == [os.path.join(lim.host_path, envcontract.LIMITS_FILE_NAME)]
    st = os.stat(written[0])
    assert stat.S_IMODE(st.st_mode) == 0o444
    text = Path(written[0]).read_text()
    assert "memory_mib_0=1000" in text and "cores_0=20" in text and f"uuid_0={UUID0}" in text
    # the same bookings as the env
    assert spec.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m" and spec.envs["CUDA_DEVICE_SM_LIMIT"] == "20"


# ------------------------------------------------------------------ one device mapping (by UUID)
@pytest.mark.parametrize("order", ["FASTEST_FIRST", "PCI_BUS_ID"])
def test_cuda_visible_devices_worker_is_charged_to_its_physical_gpu(tc_limits: Toolchain, tmp_path: Path,
                                                                   order: str) -> None:
    """2-GPU container, 1 GiB each. A worker with CUDA_VISIBLE_DEVICES=1 (its ordinal 0) is charged to GPU 1,
    so 800 MiB still fits on the idle GPU 0 (was: charged to GPU 0, the 800 MiB refused). The GPUs differ
    in SM count, so FASTEST_FIRST numbers them the other way round from the PCI bus order."""
    cfg = tmp_path / "nvml.conf"
    cfg.write_text(f"gpu uuid={UUID0} sm_count=100\ngpu uuid={UUID1} sm_count=132\n")
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 1024, 0), DeviceBooking(UUID1, 1024, 0)],
                                            str(tmp_path / "vgpu.cache")))
    try:
        env = {"FAKE_NVML_CONFIG": str(cfg), "CUDA_DEVICE_ORDER": order}
        gpu1_ordinal = "0" if order == "FASTEST_FIRST" else "1"  # GPU 1 has more SMs
        worker = subprocess.Popen([str(tc_limits.prog), "direct", "hold_on", "0", "800", "60"],
                                  env=tc_limits.env(CUDA_VISIBLE_DEVICES=gpu1_ordinal, **env),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None
            w = parse(worker.stdout.readline())
            assert (int(w["hold"]), int(w["used0"]), int(w["used1"])) == (0, 0, 800 * MIB), w
            gpu0_ordinal = "1" if order == "FASTEST_FIRST" else "0"
            out = parse(run(tc_limits, "direct", "hold_on", gpu0_ordinal, "800", "0", **env).stdout)
            assert (int(out["hold"]), int(out["used0"]), int(out["used1"])) == (0, 800 * MIB, 800 * MIB)
            out = parse(run(tc_limits, "direct", "hold_on", gpu1_ordinal, "400", "0", **env).stdout)
            assert int(out["hold"]) == 2  # GPU 1 is full, whichever numbering reaches it
            region = read_region(tmp_path / "vgpu.cache")
            assert region.used[:2] == [0, 800 * MIB]
        finally:
            _stop(worker)
    finally:
        path.unlink(missing_ok=True)


def test_gpu_outside_the_container_gets_nothing(tc_limits: Toolchain, tmp_path: Path) -> None:
    cfg = tmp_path / "nvml.conf"
    cfg.write_text(f"gpu uuid={UUID0}\ngpu uuid={UUID1}\n")
    path = limits_path(tc_limits)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envcontract.limits_file([DeviceBooking(UUID0, 1024, 0)], str(tmp_path / "c")))
    try:
        out = parse(run(tc_limits, "direct", "hold_on", "1", "1", "0", FAKE_NVML_CONFIG=str(cfg)).stdout)
        assert int(out["hold"]) == 2
    finally:
        path.unlink(missing_ok=True)
