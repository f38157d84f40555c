"""``kubectl vgpu quota`` against the recorded cluster JSON (tests/kubectl/data) plus ResourceQuotas:
used is what the allocation records book (MiB and percent units), whatever the pod spec says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubectl_vgpu import quota
from kubectl_vgpu.cluster import load_snapshot
from kubectl_vgpu.main import main

DATA = Path(__file__).parent / "data"


def _quota(ns: str, name: str, hard: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": ns},
            "spec": {"hard": hard}}


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    raw = json.loads((DATA / "cluster.json").read_text())
    raw["resourcequotas"] = {"items": [
        _quota("default", "gpu", {"limits.nvidia.com/gpumem": "10000", "requests.nvidia.com/gpucores": "100",
                                  "cpu": "8"}),
        _quota("batch", "gpu", {"nvidia.com/gpumem": "200000"}),
        _quota("edge", "cpu-only", {"cpu": "4"}),
    ]}
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(raw))
    return p


def test_used_is_what_the_records_book(snapshot: Path) -> None:
    rows = quota.build(load_snapshot(snapshot))
    # default: notebook-alice and notebook-bob (3000 MiB, 30 % each) and pending-binding (5000 MiB,
    # 25 %: its record is written, its Binding not yet seen; it holds its GPUs like any booking);
    # batch: resnet-ddp-0 (2 x 81920 MiB); eval-done-1 has finished and holds nothing
    assert [(r.namespace, r.quota, r.key, r.used, r.hard) for r in rows] == [
        ("batch", "gpu", "nvidia.com/gpumem", 163840, 200000),
        ("default", "gpu", "limits.nvidia.com/gpumem", 11000, 10000),
        ("default", "gpu", "requests.nvidia.com/gpucores", 85, 100),
    ]


def test_cli_table_and_json(snapshot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quota", "--snapshot", str(snapshot)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAMESPACE", "QUOTA", "RESOURCE", "USED", "HARD", "USE%"]
    assert out[2].split() == ["default", "gpu", "limits.nvidia.com/gpumem", "11000", "10000", "110%"]
    assert main(["quota", "--snapshot", str(snapshot), "-o", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got[0] == {"namespace": "batch", "quota": "gpu", "resource": "nvidia.com/gpumem", "used": 163840,
                      "hard": 200000}


def test_no_gpu_quota(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quota", "--snapshot", str(DATA / "cluster.json")]) == 0
    assert "no ResourceQuota names" in capsys.readouterr().out
