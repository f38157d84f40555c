"""``kube-vgpu dra-plugin`` as a process: flags, ResourceSlices published, registration with the fake
kubelet, a claim prepared over the real gRPC API, SIGTERM ends it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from deviceplugin.dra.main import parser
from kube_vgpu.dra import DRIVER_NAME
from tests.dra.dra_node_helpers import NODE, NS, Node, make_root, remove_root, result
from tests.fakeapi import FakeKubeAPI
from tests.fakes.dra_kubelet import FakeDRAKubelet

ROOT = Path(__file__).resolve().parents[2]


def test_flags_and_defaults() -> None:
    a = parser().parse_args(["--node-name", "n"])
    assert (a.plugin_dir, a.registry_dir, a.cdi_dir, a.state_dir, a.dev_root) == (
        f"/var/lib/kubelet/plugins/{DRIVER_NAME}", "/var/lib/kubelet/plugins_registry", "/var/run/cdi", "", "/dev")
    assert a.device_taints == "auto" and a.simulate_gpus == ""


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, "NODE_NAME": ""}
    for args in ([], ["--node-name", "n", "--simulate-gpus", "lots"]):
        p = subprocess.run([sys.executable, "-m", "kube_vgpu_cli", "dra-plugin", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr


def test_process_publishes_registers_prepares_and_stops(tmp_path: Path) -> None:
    api = FakeKubeAPI(auto_create_namespaces=True)
    api.start()
    root = make_root()
    n = Node(api=api, root=root)
    o = n.opts
    kubelet = FakeDRAKubelet(o.registry_dir)
    proc = None
    try:
        api.create_object("nodes", {"metadata": {"name": NODE}})
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kube_vgpu_cli", "dra-plugin", "--node-name", NODE, "--kubeconfig", str(kubeconfig),
             "--simulate-gpus", "2x24576", "--plugin-dir", o.plugin_dir, "--registry-dir", o.registry_dir,
             "--cdi-dir", o.cdi_dir, "--shim-host-path", o.shim_host_path, "--cache-host-dir", o.cache_host_dir,
             "--dev-root", o.dev_root, "--log-level", "debug", "--metrics-port", "0",
             "--metrics-bind-address", "127.0.0.1"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        up, serving = threading.Event(), threading.Event()
        metrics: list[str] = []

        def read() -> None:
            assert proc is not None and proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if "ResourceSlices published" in line:
                    up.set()
                if "DRA plugin up" in line:
                    metrics.append(json.loads(line)["metrics"])
                    serving.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        kubelet.start()
        kubelet.wait_registered(DRIVER_NAME, timeout=60)
        assert up.wait(60), "".join(lines)
        slices = api.objects("resourceslices")
        assert [d["name"] for s in slices for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        c = n.claim("c1", [result("gpu-1", "3000Mi", "30")])
        uid = c["metadata"]["uid"]
        r = kubelet.prepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid]
        assert r.error == "" and list(r.devices[0].cdi_device_ids) == [f"kube-vgpu.io/vgpu={uid}-gpu-1"]
        lim = n.limits(uid)
        assert lim is not None and (lim["memory_mib_0"], lim["cores_0"]) == ("3000", "30")
        assert n.cdi_spec(uid) is not None
        assert serving.wait(60), "".join(lines)
        base = f"http://{metrics[0]}"
        assert urllib.request.urlopen(f"{base}/livez", timeout=10).status == 200
        with urllib.request.urlopen(f"{base}/readyz", timeout=10) as r:  # registered, published, shim present
            assert (r.status, r.read()) == (200, b"ok\n")
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert f'kube_vgpu_dra_prepares_total{{node="{NODE}",result="ok"}} 1.0' in text
        assert f'kube_vgpu_dra_prepared_claims{{node="{NODE}"}} 1.0' in text
        assert f'kube_vgpu_dra_registered{{node="{NODE}"}} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)
        assert not os.path.exists(os.path.join(o.registry_dir, f"{DRIVER_NAME}-reg.sock"))
        assert not os.path.exists(os.path.join(o.plugin_dir, "dra.sock"))
        assert uid in n.checkpoint()["claims"]  # kept for the next start
        assert api.objects("resourceslices")  # left for the next start to adopt
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        kubelet.stop()
        api.stop()
        remove_root(root)
