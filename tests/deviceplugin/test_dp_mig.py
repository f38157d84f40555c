"""MIG on the device plugin, against the fake NVML (tests/fakes/fakenvml.c, its MIG section) and the
fake kubelet over the real v1beta1 gRPC protocol.

* the fake NVML behaves like the driver and agrees with kube_vgpu.mig's tables: profile infos,
  placements, refusals (overlap, bad start, not in MIG mode, destroy while in use), state shared by
  processes;
* ``migStrategy: none`` skips a GPU in MIG mode; ``single`` advertises each MIG device as one whole
  ``nvidia.com/gpu`` in the inventory and Allocate/PreStart give the MIG uuid; ``mixed`` registers one
  ``nvidia.com/mig-<profile>`` resource per profile whose Allocate gives exactly the chosen MIG devices;
* the dynamic-MIG adapter: a placement chosen by kube_vgpu.mig is created on the fake driver; a GPU
  with a busy MIG device is never repartitioned and a busy or booked instance is never destroyed.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pynvml
import pytest
from dp_helpers import KEYS, NODE, FakeGPUs, FakeKubelet, bound_pod, create_signed, make_node

from deviceplugin import mig as dmig
from deviceplugin.api import api_pb2, api_pb2_grpc
from deviceplugin.kube import ApiKubeClient
from deviceplugin.migserver import socket_name
from deviceplugin.nvml import NVML, PhysicalGPU
from deviceplugin.server import DevicePlugin, Options
from kube_vgpu.codec import decode_inventory
from kube_vgpu.config import config_from_dict
from kube_vgpu.mig import TABLES, Instance, MigError, layout_error, place, table_for
from kube_vgpu.resources import ANN_NODE_INVENTORY

H200 = {"name": "NVIDIA H200", "memory_mib": 143771, "mig": 1}
MODELS = {"A100-40GB": ("NVIDIA A100-SXM4-40GB", 40960), "A100-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
          "H100-80GB": ("NVIDIA H100 80GB HBM3", 81559), "H200-141GB": ("NVIDIA H200", 143771)}


@pytest.fixture
def migstate(gpus: FakeGPUs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh MIG state file for the fake driver (FAKE_NVML_MIG_STATE)."""
    p = tmp_path / "mig.state"
    monkeypatch.setenv("FAKE_NVML_MIG_STATE", str(p))
    return p


@pytest.fixture
def nvml(migstate: Path) -> Any:
    n = NVML()
    n.init()
    yield n
    n.shutdown()


def _run_on(lib: Path, uuid: str, pid: int) -> None:
    """The fake driver's test hook: process ``pid`` runs on MIG device ``uuid`` (0: none)."""
    assert ctypes.CDLL(str(lib)).fake_nvml_mig_run(uuid.encode(), pid) == 0


def _err(fn: Any, *args: Any) -> int:
    with pytest.raises(pynvml.NVMLError) as e:
        fn(*args)
    return int(e.value.value)


# ------------------------------------------------------------------ the fake driver


@pytest.mark.parametrize("key", sorted(MODELS))
def test_fake_driver_reports_the_tables(gpus: FakeGPUs, nvml: NVML, key: str) -> None:
    name, mib = MODELS[key]
    gpus.set([{"name": name, "memory_mib": mib, "mig": 1}])
    nvml.discover()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    t = table_for(name, mib)
    assert t is TABLES[key]
    assert pynvml.nvmlDeviceGetMigMode(h) == [1, 1] and pynvml.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    for p in t.profiles:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, p.index)
        assert (info.id, info.name.decode() if isinstance(info.name, bytes) else info.name) == (p.profile_id, f"MIG {p.name}")
        assert (info.sliceCount, info.instanceCount, info.memorySizeMB) == (p.compute_slices, p.instances, p.memory_mib)
        n = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.profile_id, None, ctypes.byref(n))
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * n.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.profile_id, arr, ctypes.byref(n))
        assert [(x.start, x.size) for x in arr] == [(s, p.memory_slices) for s in p.starts]
        assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id) == p.instances


def test_fake_driver_refuses_like_the_driver(gpus: FakeGPUs, nvml: NVML, fake_nvml_lib: Path) -> None:
    gpus.set([H200, {"name": "NVIDIA H200", "memory_mib": 143771, "mig": 0}])
    (g0, g1), _ = nvml.discover()
    m = nvml.mig_create(g0.uuid, "3g.71gb", 4)
    assert m.uuid.startswith("MIG-") and (m.profile, m.start, m.memory_mib, m.parent) == ("3g.71gb", 4, 72704, g0.uuid)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = 4, 2
    assert _err(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, ctypes.byref(pl)) == \
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES  # a 2g.35gb on the 3g's slices
    pl.start = 1
    assert _err(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, ctypes.byref(pl)) == \
        pynvml.NVML_ERROR_INVALID_ARGUMENT  # 2g starts at 0, 2 or 4 only
    assert _err(pynvml.nvmlDeviceCreateGpuInstance, pynvml.nvmlDeviceGetHandleByIndex(1), 19) == \
        pynvml.NVML_ERROR_NOT_SUPPORTED  # not in MIG mode
    gi = pynvml.nvmlDeviceGetGpuInstanceById(h, m.gi)
    assert _err(pynvml.nvmlGpuInstanceDestroy, gi) == pynvml.NVML_ERROR_IN_USE  # it has a compute instance
    _run_on(fake_nvml_lib, m.uuid, os.getpid())
    assert [x.processes for x in nvml.mig_devices(g0.uuid)] == [1]
    with pytest.raises(pynvml.NVMLError) as e:
        nvml.mig_destroy(g0.uuid, m.uuid)
    assert e.value.value == pynvml.NVML_ERROR_IN_USE
    _run_on(fake_nvml_lib, m.uuid, 0)
    nvml.mig_destroy(g0.uuid, m.uuid)
    assert nvml.mig_devices(g0.uuid) == []


def test_fake_driver_state_outlives_the_process(gpus: FakeGPUs, nvml: NVML, migstate: Path, fake_nvml_lib: Path) -> None:
    gpus.set([H200])
    (g0,), _ = nvml.discover()
    made = [nvml.mig_create(g0.uuid, "1g.18gb", s).uuid for s in (0, 6)]
    code = ("import ctypes,sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); import pynvml as N; N.nvmlInit();"
            "h=N.nvmlDeviceGetHandleByIndex(0);"
            "print(','.join(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h,i)) for i in range(2)))")
    out = subprocess.run([sys.executable, "-c", code, str(fake_nvml_lib)], capture_output=True, text=True,
                         env=dict(os.environ), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == made


@pytest.mark.parametrize("key", sorted(MODELS))
def test_domain_placements_are_what_the_driver_accepts(gpus: FakeGPUs, nvml: NVML, key: str) -> None:
    """kube_vgpu.mig's geometry and the driver's agree: every placement place() chooses is created
    without a refusal, and a request place() refuses finds no room on the driver either."""
    name, mib = MODELS[key]
    gpus.set([{"name": name, "memory_mib": mib, "mig": 1}])
    (g0,), _ = nvml.discover()
    rng = random.Random(7)
    table = TABLES[key]
    sizes = sorted({p.memory_mib for p in table.profiles})
    placed = 0
    for _ in range(4):
        for m in nvml.mig_devices(g0.uuid):
            nvml.mig_destroy(g0.uuid, m.uuid)
        layout: list[Instance] = []
        for _ in range(8):
            req = rng.choice([1000] + [m - 1 for m in sizes] + [m + 1 for m in sizes[:-1]])
            try:
                pl = place(req, table, layout)
            except MigError:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                smallest = next(p for p in table.profiles if p.memory_mib >= req and not p.media)
                if not any(p.memory_mib >= req and not p.media
                           and pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.profile_id)
                           for p in table.profiles):
                    continue
                pytest.fail(f"place() refused {req} MiB ({smallest.name}) on {layout} but the driver has room")
            nvml.mig_create(g0.uuid, pl.profile.name, pl.start)
            layout.append(Instance(pl.profile.name, pl.start))
            placed += 1
        assert sorted((m.profile, m.start) for m in nvml.mig_devices(g0.uuid)) == sorted(
            (i.profile, i.start) for i in layout)
        assert layout_error(table, layout) is None
    assert placed >= 8  # the rounds really exercised the driver


# ------------------------------------------------------------------ the device plugin


def _plugin(kube_api: Any, sockdir: str, kubelet: FakeKubelet, tmp_path: Path, strategy: str) -> DevicePlugin:
    make_node(kube_api)
    shim = tmp_path / "vgpu" / "libvgpu.so"
    shim.parent.mkdir(exist_ok=True)
    shim.write_bytes(b"\x7fELF")
    opts = Options(node_name=NODE, device_plugin_dir=sockdir, shim_host_path=str(shim),
                   cache_host_dir=str(tmp_path / "containers"), heartbeat_seconds=0.5, watch_interval=0.05,
                   health_poll_ms=50, probe_interval=0.1, pod_resources_socket=kubelet.podresources_socket)
    cfg = config_from_dict({"devices": {"splitCount": 4, "migStrategy": "none"},
                            "nodes": [{"name": NODE, "migStrategy": strategy}]})
    return DevicePlugin(cfg, opts, ApiKubeClient(api_client=kube_api.api_client()), keys=KEYS)


def _inventory(kube_api: Any, kubelet: FakeKubelet) -> Any:
    kubelet.wait(lambda k: ANN_NODE_INVENTORY in (kube_api.get_object("nodes", NODE)["metadata"]
                                                  .get("annotations") or {}), what="inventory")
    return decode_inventory(kube_api.get_object("nodes", NODE)["metadata"]["annotations"][ANN_NODE_INVENTORY])


def _partition(gpus: FakeGPUs, layout: list[tuple[str, int]]) -> tuple[list[PhysicalGPU], list[str]]:
    """GPU 0: an H200 in MIG mode holding ``layout``; GPU 1: a plain H200. Returns the GPUs and the
    MIG uuids, as an admin's nvidia-smi would leave them."""
    gpus.set([H200, {"name": "NVIDIA H200", "memory_mib": 143771}])
    n = NVML()
    n.init()
    try:
        found, _ = n.discover()
        migs = [n.mig_create(found[0].uuid, prof, start).uuid for prof, start in layout]
    finally:
        n.shutdown()
    return found, migs


@pytest.mark.parametrize("strategy", ["none"])  # dynamic: tests/deviceplugin/test_dp_mig_dynamic.py
def test_strategy_none_skips_the_mig_gpu(gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any,
                                         sockdir: str, tmp_path: Path, strategy: str) -> None:
    found, _ = _partition(gpus, [("1g.18gb", 0)])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, strategy)
    p.start()
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert sorted(d.ID for d in kubelet.devices) == [f"{found[1].uuid}::{k}" for k in range(4)]
        assert [d.uuid for d in _inventory(kube_api, kubelet).devices] == [found[1].uuid]
        assert [r.resource_name for r in kubelet.registrations] == ["nvidia.com/gpu"]
    finally:
        p.stop()


def test_strategy_single_advertises_mig_devices_as_whole_gpus(gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet,
                                                               kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, migs = _partition(gpus, [("1g.18gb", 0), ("1g.18gb", 6)])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, "single")
    p.start()
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert sorted(d.ID for d in kubelet.devices) == sorted(
            [f"{found[1].uuid}::{k}" for k in range(4)] + [f"{u}::0" for u in migs])
        inv = _inventory(kube_api, kubelet)
        by = {d.uuid: d for d in inv.devices}
        for u in migs:
            d = by[u]
            assert (d.model, d.memory_mib, d.cores, d.split, d.index) == ("NVIDIA H200 MIG 1g.18gb", 18432, 100, 1, 0)
        assert by[found[1].uuid].split == 4 and found[0].uuid not in by
        assert p.wait_pods_synced(10)
        create_signed(kube_api, bound_pod("p1", [("c", False, [(migs[1], 18432, 100)], {})], bind_time=100))
        (a,) = kubelet.admit("p1", [("c", 1)])
        assert a.started and a.error is None, a.error
        assert a.ids == [f"{migs[1]}::0"]
        assert dict(a.envs)["NVIDIA_VISIBLE_DEVICES"] == migs[1]
        assert a.limits is not None and (a.limits["uuid_0"], a.limits["memory_mib_0"]) == (migs[1], "18432")
    finally:
        p.stop()


def test_strategy_single_refuses_mixed_profiles(gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet,
                                                kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, migs = _partition(gpus, [("1g.18gb", 0), ("3g.71gb", 4)])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, "single")
    p.start()
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert sorted(d.ID for d in kubelet.devices) == [f"{found[1].uuid}::{k}" for k in range(4)]
        assert not {d.uuid for d in _inventory(kube_api, kubelet).devices} & set(migs)
    finally:
        p.stop()


def test_strategy_mixed_registers_one_resource_per_profile(gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet,
                                                           kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, migs = _partition(gpus, [("1g.18gb", 0), ("1g.18gb", 1), ("3g.71gb", 4)])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, "mixed")
    p.start()
    try:
        kubelet.wait(lambda k: len(k.registrations) >= 3, what="three registrations")
        regs = {r.resource_name: r for r in kubelet.registrations}
        assert sorted(regs) == ["nvidia.com/gpu", "nvidia.com/mig-1g.18gb", "nvidia.com/mig-3g.71gb"]
        assert regs["nvidia.com/mig-1g.18gb"].endpoint == socket_name("1g.18gb")
        assert not regs["nvidia.com/mig-1g.18gb"].options.pre_start_required
        # the vGPU inventory holds only the plain GPU: MIG devices are counted by kube-scheduler
        assert [d.uuid for d in _inventory(kube_api, kubelet).devices] == [found[1].uuid]
        with grpc.insecure_channel(f"unix://{os.path.join(sockdir, socket_name('1g.18gb'))}") as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            first = next(iter(stub.ListAndWatch(api_pb2.Empty(), timeout=10)))
            assert sorted(d.ID for d in first.devices) == sorted(migs[:2])
            assert all(d.health == "Healthy" for d in first.devices)
            resp = stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[migs[1]])]), timeout=10)
            assert dict(resp.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": migs[1]}
            assert not resp.container_responses[0].mounts
            # a device of another resource (the 3g) or a made-up one is never handed out here
            for bad in (migs[2], found[0].uuid, "MIG-00000000-0000-0000-0000-000000000000"):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                        api_pb2.ContainerAllocateRequest(devices_ids=[bad])]), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad in (e.value.details() or "")
        with grpc.insecure_channel(f"unix://{os.path.join(sockdir, socket_name('3g.71gb'))}") as ch:
            stub = api_pb2_grpc.DevicePluginStub(ch)
            stream = stub.ListAndWatch(api_pb2.Empty(), timeout=60)
            first = next(stream)
            assert [(d.ID, d.health) for d in first.devices] == [(migs[2], "Healthy")]
            gpus.xid(0, 79)  # the GPU fell off the bus: its MIG devices are unhealthy, pushed at once
            assert [(d.ID, d.health) for d in next(stream).devices] == [(migs[2], "Unhealthy")]
            stream.cancel()
        # kubelet restarts (every plugin socket removed): each resource is served and registered again
        kubelet.restart()
        kubelet.wait(lambda k: len(k.registrations) >= 6, what="registrations after the kubelet restart")
        assert sorted(r.resource_name for r in kubelet.registrations[3:]) == sorted(regs)
        assert os.path.exists(os.path.join(sockdir, socket_name("3g.71gb")))
    finally:
        p.stop()
    assert not os.path.exists(os.path.join(sockdir, socket_name("1g.18gb")))


# ------------------------------------------------------------------ dynamic MIG on the driver


def test_dynamic_placement_is_created_on_the_driver(gpus: FakeGPUs, nvml: NVML) -> None:
    gpus.set([H200])
    (g0,), _ = nvml.discover()
    table = TABLES["H200-141GB"]
    a = place(20000, table, [])
    m = dmig.ensure(nvml, g0, a.profile.name, a.start)
    assert (m.profile, m.start) == ("1g.35gb", 6)
    assert dmig.ensure(nvml, g0, "1g.35gb", 6).uuid == m.uuid  # the same device again, not a second one


def test_busy_gpu_is_not_repartitioned(gpus: FakeGPUs, nvml: NVML, fake_nvml_lib: Path) -> None:
    gpus.set([H200])
    (g0,), _ = nvml.discover()
    old = dmig.repartition(nvml, g0, [Instance("7g.141gb", 0)])
    _run_on(fake_nvml_lib, old[0].uuid, os.getpid())
    with pytest.raises(MigError, match=f"GPU {g0.uuid} is not repartitioned: MIG device.*{old[0].uuid}"):
        dmig.repartition(nvml, g0, [Instance("3g.71gb", 0), Instance("3g.71gb", 4)])
    assert [m.uuid for m in nvml.mig_devices(g0.uuid)] == [old[0].uuid]  # untouched
    with pytest.raises(MigError, match="has running processes; it is not destroyed"):
        dmig.ensure(nvml, g0, "1g.18gb", 0)
    _run_on(fake_nvml_lib, old[0].uuid, 0)  # the process ended: the GPU is idle
    new = dmig.repartition(nvml, g0, [Instance("3g.71gb", 0), Instance("3g.71gb", 4)])
    assert sorted((m.profile, m.start) for m in new) == [("3g.71gb", 0), ("3g.71gb", 4)]
    assert old[0].uuid not in {m.uuid for m in nvml.mig_devices(g0.uuid)}


def test_a_dead_process_does_not_keep_a_gpu_busy(gpus: FakeGPUs, nvml: NVML, fake_nvml_lib: Path) -> None:
    gpus.set([H200])
    (g0,), _ = nvml.discover()
    (m,) = dmig.repartition(nvml, g0, [Instance("4g.71gb", 0)])
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        _run_on(fake_nvml_lib, m.uuid, proc.pid)
        with pytest.raises(MigError, match="running processes"):
            dmig.repartition(nvml, g0, [])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    assert dmig.repartition(nvml, g0, []) == []  # as the driver: a process that exited holds nothing


def test_booked_instance_in_the_way_is_kept(gpus: FakeGPUs, nvml: NVML) -> None:
    gpus.set([H200])
    (g0,), _ = nvml.discover()
    (m,) = dmig.repartition(nvml, g0, [Instance("2g.35gb", 4)])
    with pytest.raises(MigError, match="is booked by another pod"):
        dmig.ensure(nvml, g0, "3g.71gb", 4, booked={m.uuid})
    # idle and unbooked: a leftover, replaced
    n = dmig.ensure(nvml, g0, "3g.71gb", 4)
    assert (n.profile, n.start) == ("3g.71gb", 4) and m.uuid not in {x.uuid for x in nvml.mig_devices(g0.uuid)}
    with pytest.raises(MigError, match="layout not valid"):
        dmig.repartition(nvml, g0, [Instance("3g.71gb", 0), Instance("4g.71gb", 0)])
