"""GPU-less trial mode (``--simulate-gpus``): the device plugin advertises simulated GPUs over the
real kubelet gRPC protocol (fake kubelet), publishes them in the node inventory and admits a pod
with its limits file, exactly as on a GPU node; the spec is checked and its errors name the flag,
the value and the form; the CLI says that nothing is isolated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dp_helpers import KEYS, NODE, FakeKubelet, bound_pod, create_signed, make_node, write_keys

from deviceplugin.kube import ApiKubeClient
from deviceplugin.server import DevicePlugin, Options
from deviceplugin.simgpu import DEFAULT_MODEL, SimulatedGPUs, SimulateSpecError, parse_spec
from kube_vgpu.codec import decode_inventory
from kube_vgpu.config import config_from_dict
from kube_vgpu.resources import ANN_NODE_INVENTORY


def test_spec_forms_and_errors() -> None:
    assert parse_spec("4x24576") == [(4, 24576, DEFAULT_MODEL)]
    assert parse_spec("2x81920:H100-sim, 1x16384") == [(2, 81920, "H100-sim"), (1, 16384, DEFAULT_MODEL)]
    for bad in ("", "4", "0x1000", "4x0", "4x24576:", "65x1000", "40x1000,30x1000", "4x99999999", "x1000",
                "4x1000;rm -rf"):
        with pytest.raises(SimulateSpecError, match=r"--simulate-gpus=.*allowed: comma-separated COUNTxMIB"):
            parse_spec(bad)


def test_uuids_are_stable_per_node_and_distinct_across_nodes() -> None:
    a, b = SimulatedGPUs("3x1000", "n1"), SimulatedGPUs("3x1000", "n1")
    c = SimulatedGPUs("3x1000", "n2")
    assert [g.uuid for g in a.gpus] == [g.uuid for g in b.gpus]
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in c.gpus}
    assert len({g.uuid for g in a.gpus}) == 3 and all(g.uuid.startswith("GPU-") for g in a.gpus)


def test_simulated_node_registers_advertises_and_admits(kubelet: FakeKubelet, kube_api: Any, sockdir: str,
                                                        tmp_path: Path) -> None:
    make_node(kube_api)
    shim = tmp_path / "vgpu" / "libvgpu.so"
    shim.parent.mkdir()
    shim.write_bytes(b"\x7fELF")
    sim = SimulatedGPUs("2x24576", NODE)
    opts = Options(node_name=NODE, device_plugin_dir=sockdir, shim_host_path=str(shim),
                   cache_host_dir=str(tmp_path / "containers"), heartbeat_seconds=0.5, watch_interval=0.05,
                   health_poll_ms=50, probe_interval=0.1, pod_resources_socket=kubelet.podresources_socket)
    p = DevicePlugin(config_from_dict({"devices": {"splitCount": 4}}), opts,
                     ApiKubeClient(api_client=kube_api.api_client()), nvml=sim, keys=KEYS)
    p.start()
    try:
        kubelet.wait(lambda k: k.updates > 0, what="first ListAndWatch list")
        u = [g.uuid for g in sim.gpus]
        assert sorted(d.ID for d in kubelet.devices) == sorted(f"{x}::{k}" for x in u for k in range(4))
        kubelet.wait(lambda k: ANN_NODE_INVENTORY in (kube_api.get_object("nodes", NODE)["metadata"]
                                                      .get("annotations") or {}), what="inventory")
        inv = decode_inventory(kube_api.get_object("nodes", NODE)["metadata"]["annotations"][ANN_NODE_INVENTORY])
        assert [(d.uuid, d.memory_mib, d.model) for d in inv.devices] == [(x, 24576, DEFAULT_MODEL) for x in u]
        assert p.wait_pods_synced(10)
        create_signed(kube_api, bound_pod("p1", [("c", False, [(u[1], 3000, 30)], {})], bind_time=100))
        (a,) = kubelet.admit("p1", [("c", 1)])
        assert a.started and a.error is None, a.error
        assert dict(a.envs)["NVIDIA_VISIBLE_DEVICES"] == u[1]
        assert a.limits is not None and (a.limits["memory_mib_0"], a.limits["cores_0"]) == ("3000", "30")
    finally:
        p.stop()


def test_cli_refuses_a_bad_spec_naming_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys)
    r = subprocess.run([sys.executable, "-m", "kube_vgpu_cli", "device-plugin", "--node-name", "n1",
                        "--signing-keys-dir", str(keys), "--kubeconfig", str(tmp_path / "none"),
                        "--simulate-gpus", "4xlots"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr  # checked before anything talks to an API server
    assert "--simulate-gpus='4xlots'" in r.stderr and "COUNTxMIB" in r.stderr, r.stderr
