"""``kubectl vgpu inspect`` against recorded cluster JSON (tests/kubectl/data, make_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kube_vgpu.codec import encode_inventory
from kube_vgpu.model import GPUDevice, NodeInventory
from kubectl_vgpu import inspect
from kubectl_vgpu.cluster import Cluster, ClusterError, load_snapshot
from kubectl_vgpu.main import main

DATA = Path(__file__).parent / "data"
SNAP = str(DATA / "cluster.json")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_fixtures_are_current() -> None:
    """The recorded JSON is what make_fixtures.py produces with today's codec."""
    from . import make_fixtures
    assert json.loads((DATA / "cluster.json").read_text()) == json.loads(json.dumps(make_fixtures.cluster()))


def test_table_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    for args in ([], ["-d"]):
        rc, out, _ = run(capsys, "inspect", "--snapshot", SNAP, *args)
        assert rc == 0
        long = [line for line in out.splitlines() if len(line) > 80]
        assert not long, long


def test_table_content(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inspect", "--snapshot", SNAP)
    assert rc == 0
    lines = out.splitlines()
    assert "NODE gpu-node-a  2 GPUs, heartbeat 12s ago" in lines
    gpu0 = next(line for line in lines if "GPU-0fc3eda5" in line)
    # 40000 + 3000 MiB, 50 + 30 cores, 2 slots, 2 pods
    assert gpu0.split() == ["0", "GPU-0fc3eda5", "H200", "43000/143771", "29%", "80/100", "2/10", "2"]
    gpu1 = next(line for line in lines if "GPU-7a1e2c44" in line)
    # bob 3000 + vllm max(init 2000, app 24000) = 27000; vllm holds one slot for init+app
    assert gpu1.split()[3:] == ["27000/143771", "18%", "70/100", "2/10", "2"]
    b2 = next(line for line in lines if "GPU-a100a002" in line)
    assert b2.split()[3:] == ["5000/81920", "6%", "25/100", "1/10", "1"]  # the finished pod holds nothing
    assert "! unhealthy: not offered to new pods" in out
    assert "NODE gpu-node-c  1 GPU, heartbeat 10m ago (STALE)" in lines
    assert any(line.startswith("  ! invalid inventory: node inventory: unsupported version 2") for line in lines)
    assert "cpu-node-1" not in out  # no inventory, no GPU pods: not listed
    assert "CLUSTER  7 GPUs on 3 nodes, 7 pods" in lines
    assert "  memory 244840/638256 MiB (38%)  cores 425/700% (60%)  slots 8/70" in lines


def test_details_list_each_share(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inspect", "--snapshot", SNAP, "-d")
    assert rc == 0
    lines = out.splitlines()
    share = next(line for line in lines if "default/notebook-alice/jupyter" in line)
    assert share.split()[-3:] == ["3000", "MiB", "30%"]
    assert any("inference/vllm-7d9f8c6b5-x2kqp/warmup (init)" in line for line in lines)
    assert any("default/pending-binding/main [Pending/allocating]" in line for line in lines)
    assert sum("batch/resnet-ddp-0/worker" in line for line in lines) == 2  # one line per GPU
    assert "eval-done-1" not in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inspect", "--snapshot", SNAP, "-o", "json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["total"] == {"nodes": 3, "gpus": 7, "pods": 7,
                            "memoryMiB": {"allocated": 244840, "total": 638256},
                            "cores": {"allocated": 425, "total": 700}, "slots": {"allocated": 8, "total": 70}}
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert set(nodes) == {"gpu-node-a", "gpu-node-b", "gpu-node-c", "gpu-node-d"}
    assert nodes["gpu-node-c"]["stale"] is True and nodes["gpu-node-a"]["stale"] is False
    assert nodes["gpu-node-a"]["heartbeatAgeSeconds"] == 12
    assert "unsupported version 2" in nodes["gpu-node-d"]["problem"]
    g1 = nodes["gpu-node-a"]["gpus"][1]
    vllm = next(p for p in g1["pods"] if p["name"].startswith("vllm"))
    assert (vllm["memoryMiB"], vllm["cores"], vllm["slots"]) == (24000, 40, 1)
    assert vllm["containers"] == [{"name": "warmup", "init": True, "memoryMiB": 2000, "cores": 10},
                                  {"name": "vllm", "init": False, "memoryMiB": 24000, "cores": 40}]
    assert nodes["gpu-node-b"]["gpus"][3]["healthy"] is False


def test_empty_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "inspect", "--snapshot", str(DATA / "empty.json"))
    assert rc == 0
    assert "No node has a kube-vgpu inventory" in out
    assert "CLUSTER  0 GPUs on 0 nodes, 0 pods" in out


def test_long_names_still_fit(capsys: pytest.CaptureFixture[str]) -> None:
    dev = GPUDevice("GPU-" + "f" * 32, 7, "NVIDIA GeForce RTX 4090 D with a very long marketing name", 999999,
                    100, 1024)
    node = {"metadata": {"name": "n" * 120, "annotations": {
        "kube-vgpu.io/node-inventory": encode_inventory(NodeInventory((dev,), 100.0))}}}
    from kube_vgpu.codec import encode_allocation
    from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
    alloc = PodAllocation("n" * 120, (ContainerAllocation("c" * 63, False, (DeviceBooking(dev.uuid, 999999, 100),)),))
    pod = {"metadata": {"namespace": "x" * 63, "name": "p" * 253,
                        "annotations": {"kube-vgpu.io/allocation": encode_allocation(alloc)}},
           "status": {"phase": "Running"}}
    report = inspect.build(Cluster([node], [pod], now=1e9 + 100))
    text = inspect.render_table(report, details=True)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "999999/999999" in text


def test_bad_allocation_is_a_warning_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    pod = {"metadata": {"namespace": "a", "name": "b", "annotations": {"kube-vgpu.io/allocation": "{not json"}},
           "status": {"phase": "Running"}}
    report = inspect.build(Cluster([], [pod], now=0.0))
    assert report.warnings and report.warnings[0].startswith("pod a/b: pod allocation: not JSON")
    assert "warning: pod a/b" in inspect.render_table(report)


def test_snapshot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": []}')
    with pytest.raises(ClusterError, match="must be an object"):
        load_snapshot(bad)
    rc, _, err = run(capsys, "inspect", "--snapshot", str(tmp_path / "missing.json"))
    assert rc == 1 and "cannot read snapshot" in err
    bad.write_text("nodes: 1\npods: []\n")
    rc, _, err = run(capsys, "inspect", "--snapshot", str(bad))
    assert rc == 1 and "'nodes' must be" in err
    bad.write_text("nodes: [1]\npods: []\n")  # one bad item: a warning, not a failure
    rc, out, _ = run(capsys, "inspect", "--snapshot", str(bad))
    assert rc == 0 and "warning: node #0: not an object (got a number); skipped" in out


def test_plain_lists_and_yaml_snapshots(tmp_path: Path) -> None:
    raw = json.loads((DATA / "cluster.json").read_text())
    p = tmp_path / "s.yaml"
    import yaml
    p.write_text(yaml.safe_dump({"nodes": raw["nodes"]["items"], "pods": raw["pods"]["items"]}))
    c = load_snapshot(p)
    assert len(c.nodes) == 5 and c.now == 1767225600 - 12  # newest heartbeat when no "time"


def test_live_mode_without_kubeconfig_fails_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc, _, err = run(capsys, "inspect")
    assert rc == 1 and f"cannot load kubeconfig {tmp_path / 'none'}" in err


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    with pytest.raises(SystemExit):
        main(["inspect", "-o", "yaml"])
