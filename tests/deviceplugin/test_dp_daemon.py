"""The device plugin end to end: a fake kubelet over the real v1beta1 gRPC protocol on unix sockets
(GetPreferredAllocation, Allocate, recorded, then PreStartContainer, with kubelet's PodResources API
served from what it allocated), NVML from the fake libnvidia-ml.so.1 (pynvml's real code path), the
fake Kubernetes API. Limits are read from the limits file the container would see."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from dp_helpers import (
    KEYS,
    NODE,
    Admitted,
    FakeGPUs,
    FakeKubelet,
    bound_pod,
    create_signed,
    make_node,
    read_limits,
    write_keys,
    write_region,
)
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.api import api_pb2
from deviceplugin.kube import ApiKubeClient
from deviceplugin.metrics import HealthServer
from deviceplugin.podmatch import ANN_ALLOCATED_CONTAINERS
from deviceplugin.response import alloc_key
from deviceplugin.server import DevicePlugin, Options
from deviceplugin.shimcache import cache_path
from kube_vgpu.codec import decode_inventory
from kube_vgpu.config import Config, config_from_dict
from kube_vgpu.envcontract import limits_file
from kube_vgpu.model import DeviceBooking
from kube_vgpu.resources import ANN_BIND_PHASE, ANN_NODE_INVENTORY

U = [f"GPU-0000000{i}-1111-4000-8000-00000000000{i}" for i in range(4)]
GPUS = [
    {"uuid": U[0], "name": "NVIDIA H200", "memory_mib": 143771, "numa": 0},
    {"uuid": U[1], "name": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960, "numa": 1},
    {"uuid": U[2], "name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920, "numa": 1, "mig": 1},
    {"uuid": U[3], "name": "Tesla T4", "memory_mib": 15360, "numa": 0},
]


@pytest.fixture
def start_plugin(gpus: FakeGPUs, kubelet: FakeKubelet, kube_api: Any, sockdir: str,
                 tmp_path: Path) -> Iterator[Callable[..., DevicePlugin]]:
    plugins: list[DevicePlugin] = []
    make_node(kube_api)

    def start(cfg: Config | None = None, gpu_list: list[dict[str, Any]] | None = None,
              **overrides: Any) -> DevicePlugin:
        gpus.set(gpu_list if gpu_list is not None else GPUS[:2])
        shim = tmp_path / "vgpu" / "libvgpu.so"
        shim.parent.mkdir(exist_ok=True)
        shim.write_bytes(b"\x7fELF")
        timings: dict[str, Any] = {"heartbeat_seconds": 0.5, "watch_interval": 0.05, "health_poll_ms": 50,
                                   "probe_interval": 0.1, "recovery_seconds": 0.6,
                                   "pod_resources_socket": kubelet.podresources_socket}
        opts = Options(node_name=NODE, device_plugin_dir=sockdir, shim_host_path=str(shim),
                       cache_host_dir=str(tmp_path / "containers"), **{**timings, **overrides})
        p = DevicePlugin(cfg or config_from_dict({"devices": {"splitCount": 4}}), opts,
                         ApiKubeClient(api_client=kube_api.api_client()), keys=KEYS)
        p.start()
        plugins.append(p)
        kubelet.wait(lambda k: k.updates > 0, what="first ListAndWatch list")
        assert p.wait_pods_synced(10), "pod watch never listed the node's pods"
        return p

    yield start
    for p in plugins:
        p.stop()


def inventory(kube_api: Any) -> Any:
    """The node inventory annotation, waiting (up to 5 s) for the first heartbeat to write it."""
    deadline = time.time() + 5
    while True:
        node = kube_api.get_object("nodes", NODE)
        text = (node["metadata"].get("annotations") or {}).get(ANN_NODE_INVENTORY)
        if text is not None:
            return decode_inventory(text)
        assert time.time() < deadline, "node inventory never written"
        time.sleep(0.02)


def envs(resp: api_pb2.ContainerAllocateResponse | Admitted) -> dict[str, str]:
    return dict(resp.envs)


def lim(a: Admitted) -> dict[str, str]:
    """The container's limits file (it started: PreStartContainer succeeded)."""
    assert a.started and a.error is None, a.error
    got = a.limits
    assert got is not None and got.get("state") is None, got
    return got


def mem(a: Admitted, i: int = 0) -> str:
    return lim(a)[f"memory_mib_{i}"]


def cores(a: Admitted, i: int = 0) -> str:
    return lim(a)[f"cores_{i}"]


def test_registers_and_advertises_slots_with_overrides(start_plugin: Callable[..., DevicePlugin],
                                                       kubelet: FakeKubelet, kube_api: Any, tmp_path: Path) -> None:
    cfg = config_from_dict({"devices": {"splitCount": 4},
                            "nodes": [{"name": NODE, "splitCount": 3, "memoryScaling": 1.5, "excludeGPUs": [U[3]]}]})
    start_plugin(cfg, GPUS)
    reg = kubelet.registrations[0]
    assert (reg.version, reg.endpoint, reg.resource_name) == ("v1beta1", "kube-vgpu.sock", "nvidia.com/gpu")
    assert reg.options.get_preferred_allocation_available and reg.options.pre_start_required
    kubelet.wait(lambda k: k.options is not None, what="GetDevicePluginOptions")
    assert kubelet.options is not None and kubelet.options.get_preferred_allocation_available
    assert kubelet.options.pre_start_required
    devs = {d.ID: d for d in kubelet.devices}
    # MIG GPU (U[2]) and the excluded one (U[3]) are not advertised; split 3 from the node override
    assert sorted(devs) == sorted(f"{u}::{k}" for u in U[:2] for k in range(3))
    assert all(d.health == "Healthy" for d in devs.values())
    assert [n.ID for n in devs[f"{U[1]}::0"].topology.nodes] == [1]
    assert [n.ID for n in devs[f"{U[0]}::2"].topology.nodes] == [0]
    inv = inventory(kube_api)
    by = {d.uuid: d for d in inv.devices}
    assert set(by) == set(U[:2])
    assert by[U[0]].memory_mib == int(143771 * 1.5) and by[U[1]].memory_mib == int(40960 * 1.5)
    assert by[U[1]].model == "NVIDIA A100-SXM4-40GB" and by[U[1]].numa == 1 and by[U[1]].split == 3
    assert inv.heartbeat > time.time() - 30
    # the preload file next to the shim names the shim's container path
    assert (tmp_path / "vgpu" / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"


def test_heartbeat_keeps_inventory_fresh(start_plugin: Callable[..., DevicePlugin], kube_api: Any) -> None:
    start_plugin()
    first = inventory(kube_api).heartbeat
    deadline = time.time() + 5
    while inventory(kube_api).heartbeat == first:
        assert time.time() < deadline, "heartbeat did not advance"
        time.sleep(0.1)


def test_xid_marks_gpu_unhealthy_and_it_recovers(start_plugin: Callable[..., DevicePlugin], gpus: FakeGPUs,
                                                 kubelet: FakeKubelet, kube_api: Any) -> None:
    start_plugin()
    gpus.xid(1, 13)  # application error: ignored
    gpus.xid(1, 79)  # GPU has fallen off the bus
    kubelet.wait(lambda k: k.health().get(f"{U[1]}::0") == "Unhealthy", what="XID -> Unhealthy")
    h = kubelet.health()
    assert all(h[f"{U[1]}::{k}"] == "Unhealthy" for k in range(4))
    assert all(h[f"{U[0]}::{k}"] == "Healthy" for k in range(4))
    deadline = time.time() + 5
    while {d.uuid: d.healthy for d in inventory(kube_api).devices}[U[1]]:
        assert time.time() < deadline, "inventory did not report the GPU unhealthy"
        time.sleep(0.05)
    kubelet.wait(lambda k: k.health().get(f"{U[1]}::0") == "Healthy", what="recovery after quiet period")


def test_failing_gpu_is_unhealthy_until_queries_succeed(start_plugin: Callable[..., DevicePlugin],
                                                        gpus: FakeGPUs, kubelet: FakeKubelet) -> None:
    start_plugin()
    gpus.set([GPUS[0], {**GPUS[1], "fail": 1}])
    kubelet.wait(lambda k: k.health().get(f"{U[1]}::3") == "Unhealthy", what="failed GPU -> Unhealthy")
    assert kubelet.health()[f"{U[0]}::3"] == "Healthy"
    gpus.set(GPUS[:2])
    kubelet.wait(lambda k: k.health().get(f"{U[1]}::3") == "Healthy", what="GPU back")


def test_gpu_lost_at_start_is_not_advertised(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet) -> None:
    start_plugin(gpu_list=[GPUS[0], {**GPUS[1], "fail": 1}])
    assert {d.ID.split("::")[0] for d in kubelet.devices} == {U[0]}


def test_two_pods_bound_at_once_get_their_own_limits(start_plugin: Callable[..., DevicePlugin],
                                                     kubelet: FakeKubelet, kube_api: Any, tmp_path: Path) -> None:
    start_plugin()
    # p1 and p2 share GPU 0 with different limits (binpack); p3 spans both GPUs
    create_signed(kube_api, bound_pod("p1", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100))
    create_signed(kube_api, bound_pod("p2", [("c", False, [(U[0], 5000, 50)], {})], bind_time=101))
    create_signed(kube_api, bound_pod("p3", [("c", False, [(U[1], 1000, 10), (U[0], 2000, 10)], {})],
                                             bind_time=102))
    (r1,) = kubelet.admit("p1", [("c", 1)])
    (r2,) = kubelet.admit("p2", [("c", 1)])
    (r3,) = kubelet.admit("p3", [("c", 2)])
    assert (mem(r1), cores(r1), mem(r2), cores(r2)) == ("3000", "30", "5000", "50")
    assert envs(r1)["NVIDIA_VISIBLE_DEVICES"] == U[0] == envs(r2)["NVIDIA_VISIBLE_DEVICES"]
    # Allocate hands out no limit from a guess: only the GPUs behind the IDs
    assert set(envs(r1)) == {"NVIDIA_VISIBLE_DEVICES"}
    assert envs(r3)["NVIDIA_VISIBLE_DEVICES"] == f"{U[0]},{U[1]}"
    l3 = lim(r3)  # the booking's order in the file (the shim maps GPUs by uuid)
    assert (l3["uuid_0"], l3["memory_mib_0"], l3["uuid_1"], l3["memory_mib_1"]) == (U[1], "1000", U[0], "2000")
    for name in ("p1", "p2", "p3"):
        ann = kube_api.get_object("pods", name, "default")["metadata"]["annotations"]
        assert ann[ANN_BIND_PHASE] == "success" and ann[ANN_ALLOCATED_CONTAINERS] == "c"
    mounts = r1.mounts()
    assert mounts["/etc/ld.so.preload"].read_only and mounts["/usr/local/vgpu/libvgpu.so"].read_only
    cache = mounts["/usr/local/vgpu/cache"]
    key = alloc_key(r1.ids)
    assert not cache.read_only and cache.host_path == str(tmp_path / "containers" / key)
    assert os.path.isdir(cache.host_path)
    # the read-only limits file every process of the container obeys, written at PreStartContainer
    lm = mounts["/usr/local/vgpu/limits"]
    assert lm.read_only and lm.host_path == str(tmp_path / "containers" / f"{key}.limits")
    path = os.path.join(lm.host_path, "vgpu.limits")
    assert os.stat(path).st_mode & 0o777 == 0o444
    with open(path) as f:
        text = f.read()
    assert text == limits_file([DeviceBooking(U[0], 3000, 30)], "/usr/local/vgpu/cache/vgpu.cache")
    uid = kube_api.get_object("pods", "p1", "default")["metadata"]["uid"]
    assert (Path(lm.host_path) / "owner").read_text() == f"{uid} c\n"


def test_same_gpu_pods_without_preference_each_get_their_own_limits(start_plugin: Callable[..., DevicePlugin],
                                                                    kubelet: FakeKubelet, kube_api: Any) -> None:
    """Two pods booked on one GPU with different limits, kubelet without GetPreferredAllocation:
    PreStartContainer names the pod exactly, so each gets its own limits (no ambiguity to refuse)."""
    start_plugin()
    create_signed(kube_api, bound_pod("p1", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100))
    create_signed(kube_api, bound_pod("p2", [("c", False, [(U[0], 5000, 50)], {})], bind_time=101))
    kubelet.use_preferred = False
    (r2,) = kubelet.admit("p2", [("c", 1)])
    (r1,) = kubelet.admit("p1", [("c", 1)])
    assert (mem(r1), cores(r1), mem(r2), cores(r2)) == ("3000", "30", "5000", "50")


def test_gpus_other_than_booked_fail_prestart_with_clear_error(start_plugin: Callable[..., DevicePlugin],
                                                               kubelet: FakeKubelet, kube_api: Any) -> None:
    """kubelet (no preference) gives the container a slot on GPU 0 while its pod is booked on GPU 1:
    PreStartContainer refuses, naming pod, container, booked and assigned GPUs; the container keeps
    the fail-closed placeholder and nothing is recorded."""
    plugin = start_plugin()
    create_signed(kube_api, bound_pod("p1", [("c", False, [(U[1], 3000, 30)], {})]))
    kubelet.use_preferred = False
    (a,) = kubelet.admit("p1", [("c", 1)])
    assert not a.started and a.code == grpc.StatusCode.FAILED_PRECONDITION
    assert a.error is not None
    assert "pod default/p1 container c" in a.error and f"assigned GPUs {U[0]}" in a.error
    assert f"booked {U[1]}" in a.error
    assert a.limits is not None and a.limits["state"] == "pending" and "memory_mib_0" not in a.limits
    ann = kube_api.get_object("pods", "p1", "default")["metadata"]["annotations"]
    assert ann[ANN_BIND_PHASE] == "allocating" and ANN_ALLOCATED_CONTAINERS not in ann
    assert plugin.status.prestarts == {"ok": 0, "error": 1}


def test_pod_deleted_before_allocate_does_not_hold_up_the_next(start_plugin: Callable[..., DevicePlugin],
                                                               kubelet: FakeKubelet, kube_api: Any) -> None:
    start_plugin()
    create_signed(kube_api, bound_pod("gone", [("c", False, [(U[0], 7000, 70)], {})], bind_time=50))
    create_signed(kube_api, bound_pod("next", [("c", False, [(U[0], 2000, 20)], {})], bind_time=60))
    kube_api.delete_object("pods", "gone", "default")
    (r,) = kubelet.admit("next", [("c", 1)])
    assert mem(r) == "2000"
    assert kube_api.get_object("pods", "next", "default")["metadata"]["annotations"][ANN_BIND_PHASE] == "success"


def test_kf06_init_container_without_gpu(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                         kube_api: Any) -> None:
    start_plugin()
    create_signed(kube_api, bound_pod("kf06", [("setup", True, None, {}),
                                                      ("app", False, [(U[1], 4000, 0)], {})]))
    (r,) = kubelet.admit("kf06", [("app", 1)])  # kubelet calls Allocate only for the app container
    assert envs(r)["NVIDIA_VISIBLE_DEVICES"] == U[1] and mem(r) == "4000"
    ann = kube_api.get_object("pods", "kf06", "default")["metadata"]["annotations"]
    assert ann[ANN_ALLOCATED_CONTAINERS] == "app" and ann[ANN_BIND_PHASE] == "success"


def test_gpu_init_and_app_containers_in_order(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                              kube_api: Any) -> None:
    start_plugin()
    create_signed(kube_api, bound_pod("multi", [("init", True, [(U[0], 1000, 0)], {}),
                                                       ("app", False, [(U[1], 6000, 60)], {})]))
    create_signed(kube_api, bound_pod("other", [("c", False, [(U[0], 9000, 0)], {})], bind_time=2000))
    ri, ra = kubelet.admit("multi", [("init", 1), ("app", 1)])
    assert (mem(ri), mem(ra)) == ("1000", "6000")
    ann = kube_api.get_object("pods", "multi", "default")["metadata"]["annotations"]
    assert ann[ANN_ALLOCATED_CONTAINERS] == "init,app" and ann[ANN_BIND_PHASE] == "success"
    (ro,) = kubelet.admit("other", [("c", 1)])
    assert mem(ro) == "9000"


def test_disable_control_opt_out(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                 kube_api: Any) -> None:
    start_plugin()
    env = {"env": [{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]}
    create_signed(kube_api, bound_pod("free", [("c", False, [(U[0], 3000, 30)], env)]))
    (r,) = kubelet.admit("free", [("c", 1)])
    assert envs(r) == {"NVIDIA_VISIBLE_DEVICES": U[0]}
    assert lim(r)["disable_control"] == "true"  # the file says so: no enforcement


def test_kubelet_restart_registers_again(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                         kube_api: Any) -> None:
    plugin = start_plugin()
    assert len(kubelet.registrations) == 1
    kubelet.restart()
    kubelet.wait(lambda k: len(k.registrations) >= 2, what="re-registration after kubelet restart")
    assert os.path.exists(plugin.socket_path)
    kubelet.wait(lambda k: k.updates >= 2, what="ListAndWatch on the new connection")
    create_signed(kube_api, bound_pod("after", [("c", False, [(U[1], 1234, 0)], {})]))
    (r,) = kubelet.admit("after", [("c", 1)])
    assert mem(r) == "1234"
    assert plugin.status.registrations >= 2


def _unbound(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the scheduler extender leaves it just before its Binding: annotations written
    (allocation, bind-phase allocating, bind-time), spec.nodeName not set yet."""
    del pod["spec"]["nodeName"]
    return pod


def _bind(kube_api: Any, name: str) -> None:
    from kubernetes import client

    client.CoreV1Api(kube_api.api_client()).create_namespaced_pod_binding(
        name, "default", {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                          "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}},
        _preload_content=False)


def _wait_seen(plugin: DevicePlugin, kube_api: Any, *names: str) -> None:
    uids = {kube_api.get_object("pods", n, "default")["metadata"]["uid"] for n in names}
    deadline = time.time() + 10
    while not uids <= set(plugin.arrivals.snapshot()):
        assert time.time() < deadline, f"pod watch did not see {names}"
        time.sleep(0.02)


def test_concurrent_binds_allocate_in_binding_order_not_bind_time(start_plugin: Callable[..., DevicePlugin],
                                                                  kubelet: FakeKubelet, kube_api: Any) -> None:
    """(a) The extender wrote a's annotations (bind-time 100) before b's (101), but b's Binding
    committed first: kubelet sees b first and admits it first; b must get b's limits."""
    plugin = start_plugin()
    create_signed(kube_api, _unbound(bound_pod("a", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100)))
    create_signed(kube_api, _unbound(bound_pod("b", [("c", False, [(U[0], 5000, 50)], {})], bind_time=101)))
    _bind(kube_api, "b")
    _wait_seen(plugin, kube_api, "b")
    _bind(kube_api, "a")
    _wait_seen(plugin, kube_api, "a")
    (rb,) = kubelet.admit("b", [("c", 1)])  # kubelet admits b (it saw b first)
    assert (mem(rb), cores(rb)) == ("5000", "50")
    ann = kube_api.get_object("pods", "b", "default")["metadata"]["annotations"]
    assert ann[ANN_BIND_PHASE] == "success"
    assert kube_api.get_object("pods", "a", "default")["metadata"]["annotations"][ANN_BIND_PHASE] == "allocating"
    (ra,) = kubelet.admit("a", [("c", 1)])
    assert (mem(ra), cores(ra)) == ("3000", "30")
    assert kube_api.errors == []


def test_pod_watch_recovers_from_expired_watch(start_plugin: Callable[..., DevicePlugin],
                                               kubelet: FakeKubelet, kube_api: Any) -> None:
    """After the watch is closed with every resourceVersion too old (410), the plugin lists again and
    goes on numbering pods in binding order."""
    plugin = start_plugin()
    kube_api.wait_for_watch("pods")
    kube_api.expire_watches()
    create_signed(kube_api, _unbound(bound_pod("a", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100)))
    create_signed(kube_api, _unbound(bound_pod("b", [("c", False, [(U[0], 5000, 50)], {})], bind_time=101)))
    kube_api.wait_for_watch("pods")
    _bind(kube_api, "b")
    _wait_seen(plugin, kube_api, "b")
    _bind(kube_api, "a")
    _wait_seen(plugin, kube_api, "a")
    snap = plugin.arrivals.snapshot()
    uid = {n: kube_api.get_object("pods", n, "default")["metadata"]["uid"] for n in ("a", "b")}
    assert snap[uid["b"]].seq is not None and snap[uid["a"]].seq is not None
    assert snap[uid["b"]].seq < snap[uid["a"]].seq
    (rb,) = kubelet.admit("b", [("c", 1)])
    assert mem(rb) == "5000"
    assert plugin.alive()


def test_pod_kubelet_skipped_does_not_steal_the_preference(start_plugin: Callable[..., DevicePlugin],
                                                           kubelet: FakeKubelet, kube_api: Any) -> None:
    """(b) 'stuck' is bound first but kubelet never admits it (rejected by another admission handler,
    phase not Failed yet); 'two' bound after it was admitted, so 'stuck' no longer gets the preference
    over 'one', bound later still."""
    plugin = start_plugin()
    create_signed(kube_api, bound_pod("stuck", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100))
    _wait_seen(plugin, kube_api, "stuck")
    create_signed(kube_api, bound_pod("two", [("c", False, [(U[0], 1000, 10), (U[1], 1000, 10)], {})],
                                             bind_time=101))
    _wait_seen(plugin, kube_api, "two")
    (r2,) = kubelet.admit("two", [("c", 2)])
    assert envs(r2)["NVIDIA_VISIBLE_DEVICES"] == f"{U[0]},{U[1]}"
    create_signed(kube_api, bound_pod("one", [("c", False, [(U[0], 5000, 50)], {})], bind_time=102))
    _wait_seen(plugin, kube_api, "one")
    (r1,) = kubelet.admit("one", [("c", 1)])
    assert (mem(r1), cores(r1)) == ("5000", "50")
    assert kube_api.get_object("pods", "one", "default")["metadata"]["annotations"][ANN_BIND_PHASE] == "success"
    assert kube_api.get_object("pods", "stuck", "default")["metadata"]["annotations"][ANN_BIND_PHASE] == "allocating"


def test_pod_pending_past_the_staleness_period_does_not_steal_the_preference(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """(b) with nothing admitted since: a pod pending longer than pending_stale_seconds is demoted."""
    plugin = start_plugin(pending_stale_seconds=0.3)
    create_signed(kube_api, bound_pod("stuck", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100))
    _wait_seen(plugin, kube_api, "stuck")
    time.sleep(0.5)
    create_signed(kube_api, bound_pod("fresh", [("c", False, [(U[0], 5000, 50)], {})], bind_time=101))
    _wait_seen(plugin, kube_api, "fresh")
    (r,) = kubelet.admit("fresh", [("c", 1)])
    assert mem(r) == "5000"
    assert kube_api.get_object("pods", "fresh", "default")["metadata"]["annotations"][ANN_BIND_PHASE] == "success"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_endpoints_and_metrics(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                      kube_api: Any) -> None:
    plugin = start_plugin()
    http = HealthServer(plugin, "127.0.0.1", 0)
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        assert _get(base + "/livez")[0] == 200
        deadline = time.time() + 5
        while _get(base + "/readyz")[0] != 200:
            assert time.time() < deadline, _get(base + "/readyz")
            time.sleep(0.05)
        create_signed(kube_api, bound_pod("m", [("c", False, [(U[0], 3000, 30)], {})]))
        (a,) = kubelet.admit("m", [("c", 1)])
        assert a.started
        code, text = _get(base + "/metrics")
        assert code == 200
        samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
                   for fam in text_string_to_metric_families(text) for smp in fam.samples}
        lab = tuple(sorted({"node": NODE, "gpu_uuid": U[0], "gpu_index": "0", "model": "NVIDIA H200"}.items()))
        assert samples[("kube_vgpu_gpu_memory_allocated_bytes", lab)] == 3000 * 1024 * 1024
        assert samples[("kube_vgpu_gpu_cores_allocated_percent", lab)] == 30
        assert samples[("kube_vgpu_gpu_slots_allocated", lab)] == 1
        assert samples[("kube_vgpu_gpu_memory_capacity_bytes", lab)] == 143771 * 1024 * 1024
        assert samples[("kube_vgpu_gpu_cores_capacity_percent", lab)] == 100
        assert ("kube_vgpu_gpu_slots_capacity", lab) in samples
        assert ("kube_vgpu_gpu_memory_used_bytes", lab) in samples
        assert ("kube_vgpu_gpu_utilization_percent", lab) in samples
        assert samples[("kube_vgpu_gpu_healthy", lab)] == 1
        assert samples[("kube_vgpu_device_plugin_allocations_total", (("node", NODE), ("result", "ok")))] == 1
        assert samples[("kube_vgpu_device_plugin_prestarts_total", (("node", NODE), ("result", "ok")))] == 1
        assert samples[("kube_vgpu_device_plugin_registered", (("node", NODE),))] == 1
        clab = tuple(sorted({"node": NODE, "namespace": "default", "pod": "m", "container": "c", "vgpu_index": "0",
                             "gpu_uuid": U[0]}.items()))
        assert samples[("kube_vgpu_container_memory_allocated_bytes", clab)] == 3000 * 1024 * 1024
        assert samples[("kube_vgpu_container_cores_allocated_percent", clab)] == 30
        assert not any(n.startswith(("hami_", "GPUDevice", "vGPU")) for n, _ in samples)  # compat is opt-in
        # per-container usage appears once the shim's cache file exists
        uid = kube_api.get_object("pods", "m", "default")["metadata"]["uid"]
        assert plugin.cache_dir_for(uid, "c") == alloc_key(a.ids)
        write_region(Path(cache_path(plugin.opts.cache_host_dir, uid, "c", alloc_key(a.ids))), {0: 700 * 1024 * 1024},
                     oom_refusals=3)
        samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
                   for fam in text_string_to_metric_families(_get(base + "/metrics")[1]) for smp in fam.samples}
        assert samples[("kube_vgpu_container_memory_used_bytes", clab)] == 700 * 1024 * 1024
        rlab = tuple(sorted((k, v) for k, v in clab if k not in ("vgpu_index", "gpu_uuid")))
        assert samples[("kube_vgpu_container_oom_refusals_total", rlab)] == 3  # one series per container
        assert _get(base + "/nope")[0] == 404
    finally:
        http.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_runs_against_fake_kubelet_and_stops_on_sigterm(gpus: FakeGPUs, fake_nvml_lib: Path,
                                                           kubelet: FakeKubelet, kube_api: Any, sockdir: str,
                                                           tmp_path: Path) -> None:
    """`kube-vgpu device-plugin` as a process: pynvml finds the fake through LD_LIBRARY_PATH."""
    make_node(kube_api)
    gpus.set(GPUS[:1])
    kubeconfig = kube_api.kubeconfig(tmp_path / "kubeconfig")
    port = _free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_lib.parent), "NODE_NAME": NODE}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu_cli", "device-plugin", "--kubeconfig", kubeconfig,
         "--device-plugin-dir", sockdir, "--shim-host-path", str(tmp_path / "vgpu" / "libvgpu.so"),
         "--cache-host-dir", str(tmp_path / "containers"), "--metrics-port", str(port),
         "--metrics-bind-address", "127.0.0.1", "--heartbeat-seconds", "1", "--log-level", "debug",
         "--signing-keys-dir", str(write_keys(tmp_path / "keys"))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kubelet.wait(lambda k: k.updates > 0, timeout=20, what="registration by the CLI process")
        assert sorted(d.ID for d in kubelet.devices) == [f"{U[0]}::{k}" for k in range(10)]
        assert _get(f"http://127.0.0.1:{port}/livez")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err[-3000:]
    assert '"level": "info"' in err and "registered with kubelet" in err
    # values travel in fields, not in the message (like every component's logs)
    reg = next(json.loads(line) for line in err.splitlines() if '"registered with kubelet"' in line)
    assert reg["resource"] == "nvidia.com/gpu" and reg["socket"]


def _allocate(kubelet: FakeKubelet, *ids: str) -> api_pb2.ContainerAllocateResponse:
    assert kubelet.stub is not None
    resp = kubelet.stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=list(ids))]), timeout=10)
    return resp.container_responses[0]


def _refused(kubelet: FakeKubelet, *ids: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _allocate(kubelet, *ids)
    return e.value


def test_zero_mib_booking_is_refused_over_grpc(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                               kube_api: Any) -> None:
    """KF-17: 0 MiB would be a limit of 0, which older shims read as no limit: PreStart refuses."""
    plugin = start_plugin()
    create_signed(kube_api, bound_pod("zero", [("c", False, [(U[0], 0, 30)], {})]))
    (a,) = kubelet.admit("zero", [("c", [f"{U[0]}::0"])])
    assert not a.started and a.code == grpc.StatusCode.FAILED_PRECONDITION
    details = a.error or ""
    assert "default/zero" in details and "container c" in details and U[0] in details
    assert "0 MiB booked; refusing to hand out an unlimited limit" in details
    assert a.limits is not None and a.limits["state"] == "pending"
    ann = kube_api.get_object("pods", "zero", "default")["metadata"]["annotations"]
    assert ann[ANN_BIND_PHASE] == "allocating" and ANN_ALLOCATED_CONTAINERS not in ann
    assert plugin.status.prestarts == {"ok": 0, "error": 1}


def test_gpu_container_without_booking_is_refused_over_grpc(start_plugin: Callable[..., DevicePlugin],
                                                            kubelet: FakeKubelet, kube_api: Any) -> None:
    start_plugin()
    gpu1 = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    create_signed(kube_api, bound_pod("nobook", [("first", False, None, gpu1),
                                                        ("second", False, [(U[1], 3000, 30)], {})]))
    first, second = kubelet.admit("nobook", [("first", [f"{U[1]}::0"]), ("second", [f"{U[1]}::1"])])
    assert not first.started and first.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "pod default/nobook container first" in (first.error or "")
    assert "refusing to hand out an unlimited limit" in (first.error or "")
    assert first.limits is not None and first.limits["state"] == "pending"  # not "second"'s limits
    assert mem(second) == "3000"
    ann = kube_api.get_object("pods", "nobook", "default")["metadata"]["annotations"]
    assert ann[ANN_ALLOCATED_CONTAINERS] == "second" and ann[ANN_BIND_PHASE] == "allocating"


def test_allocate_rejects_ids_never_advertised(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                               kube_api: Any) -> None:
    start_plugin()  # split 4: U0::0..3 and U1::0..3
    create_signed(kube_api, bound_pod("p", [("c", False, [(U[0], 3000, 30)], {})]))
    for bad in ("{u}::999", "{u}", "{u}::4", "GPU-nope::0", "{u}::0 ", "{u}::00"):
        dev = bad.format(u=U[0])
        err = _refused(kubelet, dev)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, dev
        assert repr(dev) in (err.details() or "") and "not advertised" in (err.details() or ""), dev
    ann = kube_api.get_object("pods", "p", "default")["metadata"]["annotations"]
    assert ANN_ALLOCATED_CONTAINERS not in ann
    r = _allocate(kubelet, f"{U[0]}::3")  # an advertised ID still works (limits follow at PreStart)
    assert envs(r) == {"NVIDIA_VISIBLE_DEVICES": U[0]}
    assert read_limits(r) == {"version": "1", "state": "pending", "devices": "0"}


def test_allocate_rejects_duplicate_ids_and_two_slots_of_one_gpu(start_plugin: Callable[..., DevicePlugin],
                                                                 kubelet: FakeKubelet, kube_api: Any) -> None:
    start_plugin()
    create_signed(kube_api, bound_pod("p", [("c", False, [(U[0], 1000, 10), (U[1], 1000, 10)], {})]))
    err = _refused(kubelet, f"{U[0]}::0", f"{U[0]}::0")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than once" in (err.details() or "") and f"{U[0]}::0" in (err.details() or "")
    err = _refused(kubelet, f"{U[0]}::0", f"{U[0]}::1")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert f"{U[0]}::0, {U[0]}::1 (GPU {U[0]})" in details and "distinct physical GPUs" in details
    assert ANN_ALLOCATED_CONTAINERS not in kube_api.get_object("pods", "p", "default")["metadata"]["annotations"]
    r = _allocate(kubelet, f"{U[0]}::0", f"{U[1]}::2")
    assert envs(r)["NVIDIA_VISIBLE_DEVICES"] == f"{U[0]},{U[1]}"


def test_disable_control_accepts_1_and_any_case(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                                kube_api: Any) -> None:
    start_plugin()
    for i, value in enumerate(("1", "TRUE", "True")):
        env = {"env": [{"name": "CUDA_DISABLE_CONTROL", "value": value}]}
        create_signed(kube_api, bound_pod(f"free{i}", [("c", False, [(U[0], 3000, 30)], env)],
                                                 bind_time=100 + i))
        (r,) = kubelet.admit(f"free{i}", [("c", 1)])
        assert envs(r) == {"NVIDIA_VISIBLE_DEVICES": U[0]} and lim(r)["disable_control"] == "true", value


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_cache_dirs_of_gone_pods_are_removed(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                             kube_api: Any, tmp_path: Path) -> None:
    plugin = start_plugin()  # heartbeat 0.5 s
    root = tmp_path / "containers"
    create_signed(kube_api, bound_pod("keep", [("c", False, [(U[0], 1000, 10)], {})], bind_time=1))
    create_signed(kube_api, bound_pod("gone", [("c", False, [(U[1], 1000, 10)], {})], bind_time=2))
    (ak,) = kubelet.admit("keep", [("c", 1)])
    (ag,) = kubelet.admit("gone", [("c", 1)])
    keep, gone = root / alloc_key(ak.ids), root / alloc_key(ag.ids)
    keep_l, gone_l = root / f"{alloc_key(ak.ids)}.limits", root / f"{alloc_key(ag.ids)}.limits"
    write_region(gone / "vgpu.cache", {0: 1})
    stale = root / "0d3c7f4e-0000-4000-8000-000000000000_app"  # a pod deleted while the plugin was down
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "f").write_text("x")
    # an allocation no container was identified for (PreStart never came): kept within the grace period
    # (here: the default hour), removed once older
    orphan = _allocate(kubelet, f"{U[1]}::3")
    orphan_dir = Path(next(m.host_path for m in orphan.mounts if m.container_path == "/usr/local/vgpu/cache"))
    old_orphan = root / "alloc-00000000000000aa"
    (root / "alloc-00000000000000aa.limits").mkdir()
    old_orphan.mkdir()
    past = time.time() - 7200
    os.utime(root / "alloc-00000000000000aa.limits", (past, past))
    foreign = root / "not-a-cache-dir"
    foreign.mkdir()
    (root / "alloc-not-hex").mkdir()
    (root / "stray_file").write_text("x")
    _wait_for(lambda: not stale.exists() and not old_orphan.exists(), "the stale directories to be removed")
    assert keep.is_dir() and gone.is_dir() and keep_l.is_dir() and gone_l.is_dir()  # both pods still exist
    assert orphan_dir.is_dir()
    kube_api.delete_object("pods", "gone", "default")
    _wait_for(lambda: not gone.exists() and not gone_l.exists(), "the deleted pod's directories to be removed")
    time.sleep(0.7)  # more heartbeats
    assert keep.is_dir() and keep_l.is_dir() and orphan_dir.is_dir() and (root / "alloc-not-hex").is_dir()
    assert keep.is_dir() and foreign.is_dir() and (root / "stray_file").exists()
    assert plugin.alive()


def test_cache_cleanup_tolerates_errors_and_never_removes_live_pods(start_plugin: Callable[..., DevicePlugin],
                                                                    kube_api: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from deviceplugin import server

    plugin = start_plugin(heartbeat_seconds=3600)
    root = tmp_path / "containers"
    create_signed(kube_api, bound_pod("live", [("c", False, [(U[0], 1000, 10)], {})]))
    live_uid = kube_api.get_object("pods", "live", "default")["metadata"]["uid"]
    pods = plugin.kube.list_node_pods(NODE)
    a, b, live = root / "aaaa_c", root / "bbbb_c", root / f"{live_uid}_c"
    for d in (a, b, live):
        d.mkdir()
    real = server.remove_tree

    def flaky(path: str) -> None:
        if path.endswith("aaaa_c"):
            raise PermissionError(13, "Permission denied", path)
        if path.endswith("bbbb_c"):
            real(path)  # someone else removed it first
            raise FileNotFoundError(2, "No such file or directory", path)
        real(path)

    monkeypatch.setattr(server, "remove_tree", flaky)
    with caplog.at_level("WARNING", logger="kube_vgpu.deviceplugin"):
        assert plugin.clean_cache_dirs(pods) == []
    # a moved aside at once (never removed under the Allocate lock), kept there while it cannot be removed
    assert not a.exists() and any(n.endswith("-aaaa_c") for n in os.listdir(root))
    assert not b.exists() and live.is_dir()
    assert any("cannot remove the cache directory" in r.getMessage() and str(getattr(r, "path", "")).endswith("aaaa_c")
               and "Permission denied" in getattr(r, "error", "") for r in caplog.records)
    monkeypatch.setattr(server, "remove_tree", real)
    # the next removal takes it: this call's, or the plugin's removal thread's if it ran first
    assert plugin.clean_cache_dirs(pods) in ([str(a)], [])
    assert not any(n.endswith("-aaaa_c") for n in os.listdir(root)) and live.is_dir()


# ------------------------------------------------------------------ exact identification at PreStartContainer

def test_kubelet_admitting_out_of_bind_order_never_hands_out_another_pods_limits(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """Six pods bound in the order p0..p5 (the arrival order GetPreferredAllocation guesses by),
    each with its own limits, some sharing a GPU; kubelet admits them in another order. Every
    container either starts with exactly its own pod's limits, or (kubelet took GPUs the guess meant
    for another pod) does not start, with an error naming its pod, booked and assigned GPUs."""
    plugin = start_plugin()
    book = {"p0": (U[0], 1000, 10), "p1": (U[1], 2000, 20), "p2": (U[0], 3000, 30),
            "p3": (U[1], 4000, 40), "p4": (U[0], 5000, 50), "p5": (U[1], 6000, 60)}
    for i, (name, b) in enumerate(book.items()):
        create_signed(kube_api, _unbound(bound_pod(name, [("c", False, [b], {})], bind_time=100 + i)))
        _bind(kube_api, name)
        _wait_seen(plugin, kube_api, name)
    order = ["p3", "p0", "p5", "p4", "p1", "p2"]
    got = {name: kubelet.admit(name, [("c", 1)])[0] for name in order}
    started = {n for n, a in got.items() if a.started}
    for name, a in got.items():
        uuid, mib, pct = book[name]
        if a.started:
            lm = lim(a)
            assert (lm["uuid_0"], lm["memory_mib_0"], lm["cores_0"]) == (uuid, str(mib), str(pct)), name
            assert envs(a)["NVIDIA_VISIBLE_DEVICES"] == uuid
        else:
            assigned = a.ids[0].split("::")[0]
            assert assigned != uuid and a.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"pod default/{name} container c" in (a.error or "")
            assert f"assigned GPUs {assigned}" in (a.error or "") and f"booked {uuid}" in (a.error or "")
            assert a.limits is not None and a.limits["state"] == "pending" and "memory_mib_0" not in a.limits
    # the guess (arrival order, p0 first) sent p3 to p0's GPU, and the order kubelet used later
    # demoted p1/p2 in the guess: some containers are refused, the others start, none with another's limits
    assert "p3" not in started and "p0" in started and len(started) >= 3, {n: a.error for n, a in got.items()}
    for name in book:
        ann = kube_api.get_object("pods", name, "default")["metadata"]["annotations"]
        assert ann[ANN_BIND_PHASE] == ("success" if name in started else "allocating"), name
    assert plugin.status.prestarts == {"ok": len(started), "error": 6 - len(started)}


def test_same_shape_pods_admitted_in_reverse_order_get_their_own_limits(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """Pods booked on the same GPU (same shape, different limits) admitted in reverse bind order:
    the preference's guess does not matter, PodResources names the pod, each gets its own limits."""
    plugin = start_plugin()
    for i in range(4):
        create_signed(kube_api, _unbound(bound_pod(f"s{i}", [("c", False, [(U[0], 1000 * (i + 1), 10 * (i + 1))], {})],
                                                   bind_time=100 + i)))
        _bind(kube_api, f"s{i}")
        _wait_seen(plugin, kube_api, f"s{i}")
    for i in reversed(range(4)):
        (a,) = kubelet.admit(f"s{i}", [("c", 1)])
        assert (mem(a), cores(a)) == (str(1000 * (i + 1)), str(10 * (i + 1)))


def test_container_restart_calls_prestart_again_idempotently(start_plugin: Callable[..., DevicePlugin],
                                                             kubelet: FakeKubelet, kube_api: Any) -> None:
    plugin = start_plugin()
    create_signed(kube_api, bound_pod("r", [("c", False, [(U[1], 2500, 25)], {})]))
    (a,) = kubelet.admit("r", [("c", 1)])
    first = lim(a)
    before = kube_api.get_object("pods", "r", "default")["metadata"]
    again = kubelet.start_container("r", "c")
    assert again.started and lim(again) == first
    after = kube_api.get_object("pods", "r", "default")["metadata"]
    assert after["resourceVersion"] == before["resourceVersion"]  # progress not written twice
    assert plugin.status.prestarts == {"ok": 2, "error": 0}


def test_prestart_without_podresources_fails_closed(start_plugin: Callable[..., DevicePlugin],
                                                    kubelet: FakeKubelet, kube_api: Any, sockdir: str) -> None:
    """kubelet's PodResources API cannot be asked: the container does not start (UNAVAILABLE, kubelet
    retries), its limits directory keeps the placeholder, nothing is recorded."""
    start_plugin(pod_resources_socket=os.path.join(sockdir, "missing.sock"))
    create_signed(kube_api, bound_pod("p", [("c", False, [(U[0], 3000, 30)], {})]))
    (a,) = kubelet.admit("p", [("c", 1)])
    assert not a.started and a.code == grpc.StatusCode.UNAVAILABLE
    assert "PodResources" in (a.error or "") and "missing.sock" in (a.error or "")
    assert a.limits is not None and a.limits["state"] == "pending"
    assert ANN_ALLOCATED_CONTAINERS not in kube_api.get_object("pods", "p", "default")["metadata"]["annotations"]


def test_allocate_of_reused_ids_resets_the_previous_holders_limits(start_plugin: Callable[..., DevicePlugin],
                                                                   kubelet: FakeKubelet, kube_api: Any) -> None:
    """The same device IDs handed to a new pod after the old one is gone: Allocate puts the
    placeholder back and drops the old owner, so the new container never starts under the old limits."""
    start_plugin()
    create_signed(kube_api, bound_pod("old", [("c", False, [(U[0], 7000, 70)], {})], bind_time=1))
    (a,) = kubelet.admit("old", [("c", [f"{U[0]}::0"])])
    assert mem(a) == "7000"
    kube_api.delete_object("pods", "old", "default")
    kubelet.remove("old")
    create_signed(kube_api, bound_pod("new", [("c", False, [(U[0], 1000, 10)], {})], bind_time=2))
    (b,) = kubelet.admit("new", [("c", [f"{U[0]}::0"])], start=False)
    assert b.limits == {"version": "1", "state": "pending", "devices": "0"}
    lm = b.mounts()["/usr/local/vgpu/limits"].host_path
    assert not os.path.exists(os.path.join(lm, "owner"))
    assert mem(kubelet.start_container("new", "c")) == "1000"


def test_progress_of_a_pod_kubelet_already_reports_is_recorded_per_container(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """kubelet reports container statuses once the pod's first container exists: the second
    container's PreStart still records its own progress (and only then ``success``)."""
    start_plugin()
    create_signed(kube_api, bound_pod("two", [("a", False, [(U[0], 1000, 10)], {}), ("b", False, [(U[1], 2000, 20)], {})]))
    first, second = kubelet.admit("two", [("a", 1), ("b", 1)], start=False)
    assert mem(kubelet.start_container("two", "a")) == "1000"
    ann = kube_api.get_object("pods", "two", "default")["metadata"]["annotations"]
    assert (ann[ANN_ALLOCATED_CONTAINERS], ann[ANN_BIND_PHASE]) == ("a", "allocating")
    kube_api.patch_object("pods", "two", {"status": {"phase": "Pending", "containerStatuses": [
        {"name": n, "ready": False, "restartCount": 0, "image": "busybox", "imageID": "",
         "state": {"waiting": {"reason": "ContainerCreating"}}} for n in ("a", "b")]}}, "default",
        subresource="status")
    assert mem(kubelet.start_container("two", "b")) == "2000"
    ann = kube_api.get_object("pods", "two", "default")["metadata"]["annotations"]
    assert (ann[ANN_ALLOCATED_CONTAINERS], ann[ANN_BIND_PHASE]) == ("a,b", "success")


@pytest.mark.parametrize(("devices", "want"), [({}, ("default", "strict", "sum")),
                                               ({"corePolicy": "disable", "coreSharing": "work_conserving",
                                                 "graphMemoryBound": "peak"},
                                                ("disable", "work_conserving", "peak"))])
def test_admin_core_policy_and_sharing_reach_the_limits_file(start_plugin: Callable[..., DevicePlugin],
                                                             kubelet: FakeKubelet, kube_api: Any,
                                                             devices: dict[str, str],
                                                             want: tuple[str, str, str]) -> None:
    """devices.corePolicy / devices.coreSharing / devices.graphMemoryBound (the admin's, from the config)
    are written into every container's read-only limits file, where the shim reads them (never from the
    tenant's env)."""
    start_plugin(config_from_dict({"devices": {"splitCount": 4, **devices}}))
    create_signed(kube_api, bound_pod("p1", [("c", False, [(U[0], 3000, 30)], {})], bind_time=100))
    (a,) = kubelet.admit("p1", [("c", 1)])
    got = lim(a)
    assert (got["core_policy"], got["core_sharing"], got["graph_memory"]) == want


def test_inventory_publishes_the_nvlink_topology(start_plugin: Callable[..., DevicePlugin], kube_api: Any) -> None:
    """An 8-GPU box with two NVLink islands of 4 (two links between every pair of an island), GPUs 0-3
    on NUMA node 0 behind one PCIe switch, 4-7 on NUMA node 1, as the fake NVML reports it
    (nvmlDeviceGetTopologyCommonAncestor, nvmlDeviceGetNvLinkState / RemotePciInfo): the inventory
    carries each GPU's rank to every other, NVLink within an island, across NUMA between them."""
    from kube_vgpu.topology import NVLINK, SYSTEM

    gpus = []
    for i in range(8):
        island = [j for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i]
        gpus.append({"uuid": f"GPU-0000000{i}-aaaa-4000-8000-00000000000{i}", "name": "NVIDIA H200",
                     "memory_mib": 143771, "numa": i // 4, "switch": 0 if i < 4 else 1 + i,
                     "nvlink": ",".join(str(j) for j in island for _ in range(2))})
    start_plugin(gpu_list=gpus)
    devs = inventory(kube_api).devices
    assert [len(d.links) for d in devs] == [8] * 8
    for a, d in enumerate(devs):
        for b in range(8):
            want = 0 if a == b else (NVLINK + 2 if a // 4 == b // 4 else SYSTEM)
            assert d.links[b] == want, (a, b, d.links)


def test_inventory_without_nvlink_ranks_pcie_switch_above_host_bridge(start_plugin: Callable[..., DevicePlugin],
                                                                     kube_api: Any) -> None:
    from kube_vgpu.topology import HOST_BRIDGE, PCIE_SWITCH, SYSTEM

    gpus = [{"uuid": f"GPU-0000000{i}-bbbb-4000-8000-00000000000{i}", "name": "NVIDIA H200", "memory_mib": 143771,
             "numa": 0 if i < 3 else 1, "switch": 0 if i < 2 else 10 + i} for i in range(4)]
    start_plugin(gpu_list=gpus)
    links = [d.links for d in inventory(kube_api).devices]
    assert links[0][1] == PCIE_SWITCH and links[0][2] == HOST_BRIDGE and links[0][3] == SYSTEM, links
