"""``migStrategy: dynamic`` on the device plugin, against the fake NVML (FAKE_NVML_MIG_STATE) and
the fake kubelet over the real v1beta1 gRPC protocol (docs/mig.md):

* the GPU in MIG mode is published in the inventory with its profile table and allowlist, and
  kubelet sees one device ID per allowed placement (``<uuid>::mig-<profile>@<start>``);
* GetPreferredAllocation steers kubelet to the booked placement; Allocate creates that MIG instance
  (or reuses it) and answers NVIDIA_VISIBLE_DEVICES with its MIG uuid; PreStart checks the ID is the
  signed booking's placement and writes the limits file for the MIG device;
* an idle, unbooked instance in the way is replaced; a busy one or one another pod booked is never
  destroyed (Allocate refused, the instance kept); a container on a placement that is not its
  booking, or whose record a tenant edited, does not start.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from dp_helpers import KEYS, NODE, FakeGPUs, FakeKubelet, bound_pod, create_signed, make_node

from deviceplugin.kube import ApiKubeClient
from deviceplugin.nvml import NVML, PhysicalGPU
from deviceplugin.podmatch import mig_slot_id
from deviceplugin.server import DevicePlugin, Options
from kube_vgpu.codec import decode_inventory, encode_allocation
from kube_vgpu.config import config_from_dict
from kube_vgpu.mig import TABLES, allowed_profiles
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.resources import ANN_ALLOCATION, ANN_NODE_INVENTORY

H200 = {"name": "NVIDIA H200", "memory_mib": 143771, "mig": 1}


@pytest.fixture
def migstate(gpus: FakeGPUs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "mig.state"
    monkeypatch.setenv("FAKE_NVML_MIG_STATE", str(p))
    return p


def _driver(gpus: FakeGPUs, layout: list[tuple[str, int]]) -> tuple[list[PhysicalGPU], list[str]]:
    """GPU 0: an H200 in MIG mode holding ``layout`` (leftover instances); GPU 1: a plain H200."""
    gpus.set([H200, {"name": "NVIDIA H200", "memory_mib": 143771}])
    n = NVML()
    n.init()
    try:
        found, _ = n.discover()
        migs = [n.mig_create(found[0].uuid, prof, start).uuid for prof, start in layout]
    finally:
        n.shutdown()
    return found, migs


def _instances(gpu: str) -> dict[tuple[str, int], str]:
    n = NVML()
    n.init()
    try:
        n.discover()
        return {(m.profile, m.start): m.uuid for m in n.mig_devices(gpu)}
    finally:
        n.shutdown()


def _plugin(kube_api: Any, sockdir: str, kubelet: FakeKubelet, tmp_path: Path,
            profiles: list[str] | None = None) -> DevicePlugin:
    make_node(kube_api)
    shim = tmp_path / "vgpu" / "libvgpu.so"
    shim.parent.mkdir(exist_ok=True)
    shim.write_bytes(b"\x7fELF")
    opts = Options(node_name=NODE, device_plugin_dir=sockdir, shim_host_path=str(shim),
                   cache_host_dir=str(tmp_path / "containers"), heartbeat_seconds=0.5, watch_interval=0.05,
                   health_poll_ms=50, probe_interval=0.1, pod_resources_socket=kubelet.podresources_socket)
    devices: dict[str, Any] = {"splitCount": 4, "migStrategy": "none"}
    if profiles is not None:
        devices["migProfiles"] = profiles
    cfg = config_from_dict({"devices": devices, "nodes": [{"name": NODE, "migStrategy": "dynamic"}]})
    p = DevicePlugin(cfg, opts, ApiKubeClient(api_client=kube_api.api_client()), keys=KEYS)
    p.start()
    return p


def _mig_pod(kube_api: Any, name: str, gpu: str, profile: str, start: int, *, create: bool = True) -> dict[str, Any]:
    """A pod the scheduler bound with a signed dynamic-MIG booking ``profile@start`` on ``gpu``."""
    mem = TABLES["H200-141GB"].profile(profile).memory_mib
    pod = bound_pod(name, [("c", False, [(gpu, 1000, 0)], {})], bind_time=100)
    alloc = PodAllocation(NODE, (ContainerAllocation("c", False, (DeviceBooking(gpu, mem, 14, profile, start),)),), 100.0)
    pod["metadata"]["annotations"][ANN_ALLOCATION] = encode_allocation(alloc)
    return create_signed(kube_api, pod) if create else pod


def test_dynamic_gpu_is_published_with_its_geometry_and_placement_ids(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, _ = _driver(gpus, [])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, profiles=["1g.18gb", "3g.71gb", "1g.10gb"])
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        g0 = found[0].uuid
        want = [mig_slot_id(g0, "1g.18gb", s) for s in range(7)] + [mig_slot_id(g0, "3g.71gb", s) for s in (0, 4)]
        assert sorted(d.ID for d in kubelet.devices) == sorted(want + [f"{found[1].uuid}::{k}" for k in range(4)])
        kubelet.wait(lambda k: ANN_NODE_INVENTORY in (kube_api.get_object("nodes", NODE)["metadata"]
                                                      .get("annotations") or {}), what="inventory")
        inv = decode_inventory(kube_api.get_object("nodes", NODE)["metadata"]["annotations"][ANN_NODE_INVENTORY])
        d = {x.uuid: x for x in inv.devices}[g0]
        # the allowlist restricted to the model's profiles (1g.10gb is another model's name)
        assert (d.mig, d.mig_profiles, d.split, d.memory_mib, d.cores, d.links) == (
            "H200-141GB", ("1g.18gb", "3g.71gb"), 7, 143771, 100, ())
    finally:
        p.stop()


def test_allocate_creates_the_booked_instance_and_prestart_writes_its_limits(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, (leftover,) = _driver(gpus, [("2g.35gb", 2)])  # idle and booked by nobody
    g0 = found[0].uuid
    p = _plugin(kube_api, sockdir, kubelet, tmp_path)
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert len([d for d in kubelet.devices if d.ID.startswith(g0)]) == sum(
            len(x.starts) for x in allowed_profiles(TABLES["H200-141GB"], ()))
        assert p.wait_pods_synced(10)
        _mig_pod(kube_api, "small", g0, "1g.18gb", 6)
        (a,) = kubelet.admit("small", [("c", 1)])  # kubelet takes the plugin's preference
        assert a.ids == [mig_slot_id(g0, "1g.18gb", 6)]
        assert a.started and a.error is None, a.error
        made = _instances(g0)
        mig = made[("1g.18gb", 6)]
        assert a.envs["NVIDIA_VISIBLE_DEVICES"] == mig and mig.startswith("MIG-")
        assert a.limits is not None
        assert (a.limits["uuid_0"], a.limits["memory_mib_0"], a.limits["cores_0"]) == (mig, "18432", "100")
        assert made[("2g.35gb", 2)] == leftover  # not in the way: kept
        # a 3g.71gb at 0 needs slices 0-3: the idle, unbooked leftover 2g.35gb@2 is replaced
        _mig_pod(kube_api, "big", g0, "3g.71gb", 0)
        (b,) = kubelet.admit("big", [("c", 1)])
        assert b.started, b.error
        made = _instances(g0)
        assert set(made) == {("1g.18gb", 6), ("3g.71gb", 0)} and leftover not in made.values()
        assert b.envs["NVIDIA_VISIBLE_DEVICES"] == made[("3g.71gb", 0)]
        assert made[("1g.18gb", 6)] == mig  # the first pod's instance is untouched
    finally:
        p.stop()


def test_busy_or_booked_instances_are_never_destroyed(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path,
        fake_nvml_lib: Path) -> None:
    found, (busy,) = _driver(gpus, [("1g.18gb", 4)])
    g0 = found[0].uuid
    assert ctypes.CDLL(str(fake_nvml_lib)).fake_nvml_mig_run(busy.encode(), os.getpid()) == 0
    p = _plugin(kube_api, sockdir, kubelet, tmp_path)
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert p.wait_pods_synced(10)
        # a stale booking on slices 4-5 (the node's truth: a process runs there): refused, kept
        _mig_pod(kube_api, "late", g0, "1g.35gb", 4)
        with pytest.raises(grpc.RpcError) as e:
            kubelet.admit("late", [("c", 1)])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert busy in (e.value.details() or "") and "has running processes" in (e.value.details() or "")
        assert _instances(g0) == {("1g.18gb", 4): busy}
        # pod "first" is booked at 1g.18gb@6 and not started yet; a container handed an overlapping
        # placement (kubelet without the preference) must not take its instance away
        _mig_pod(kube_api, "first", g0, "1g.18gb", 6)
        (f,) = kubelet.admit("first", [("c", [mig_slot_id(g0, "1g.18gb", 6)])], start=False)
        mine = _instances(g0)[("1g.18gb", 6)]
        _mig_pod(kube_api, "other", g0, "1g.35gb", 6)
        with pytest.raises(grpc.RpcError) as e:
            kubelet.admit("other", [("c", [mig_slot_id(g0, "1g.35gb", 6)])])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "is booked by another pod" in (
            e.value.details() or "")
        assert _instances(g0)[("1g.18gb", 6)] == mine
        assert kubelet.start_container("first", "c").started
    finally:
        p.stop()


def test_a_container_never_starts_on_a_placement_other_than_its_signed_booking(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, _ = _driver(gpus, [])
    g0 = found[0].uuid
    p = _plugin(kube_api, sockdir, kubelet, tmp_path)
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert p.wait_pods_synced(10)
        # kubelet hands the container another placement than the one booked for it
        _mig_pod(kube_api, "moved", g0, "1g.18gb", 5)
        (a,) = kubelet.admit("moved", [("c", [mig_slot_id(g0, "7g.141gb", 0)])])
        assert not a.started and a.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "booked MIG placement 1g.18gb@5" in (a.error or "")
        kubelet.remove("moved")
        # a tenant edits its signed record to a bigger profile: the record no longer verifies
        pod = _mig_pod(kube_api, "greedy", g0, "1g.18gb", 3)
        bigger = PodAllocation(NODE, (ContainerAllocation("c", False, (
            DeviceBooking(g0, 144384, 100, "7g.141gb", 0),)),), 100.0)
        kube_api.patch_object("pods", "greedy", {"metadata": {"annotations": {
            ANN_ALLOCATION: encode_allocation(bigger)}}}, pod["metadata"]["namespace"], patch_type="merge")
        (g,) = kubelet.admit("greedy", [("c", [mig_slot_id(g0, "7g.141gb", 0)])])
        assert not g.started and g.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "allocation signature invalid: does not match the record" in (g.error or ""), g.error
        kubelet.remove("greedy")
        # the IDs a vGPU slot would use are not MIG placements of the dynamic GPU
        with pytest.raises(grpc.RpcError) as e:
            kubelet.admit("greedy", [("c", [f"{g0}::0"])])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        p.stop()


def test_a_gpu_whose_model_the_allowlist_does_not_cover_is_not_advertised(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    found, _ = _driver(gpus, [])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, profiles=["1g.10gb"])  # an A100/H100 name only
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert sorted(d.ID for d in kubelet.devices) == [f"{found[1].uuid}::{k}" for k in range(4)]
    finally:
        p.stop()
