"""docs/install.md's recipe for a cluster snapshot (`kubectl get ... -o json` into files, `jq`
joining them) yields a file `kubectl vgpu --snapshot` reads, also for a pod list far over the
128 KiB one command-line argument may hold (the recipe once passed the lists as arguments)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kubectl_vgpu.cluster import load_snapshot

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def _jq_command() -> list[str]:
    text = (ROOT / "docs" / "install.md").read_text()
    block = re.search(r"```sh\n(kubectl get nodes -o json > nodes\.json\n.*?)```", text, re.S)
    assert block, "install.md no longer shows the snapshot recipe"
    line = next(ln for ln in block.group(1).replace("\\\n", " ").splitlines() if ln.startswith("jq "))
    return shlex.split(line.split(">", 1)[0])


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_install_md_snapshot_recipe(tmp_path: Path) -> None:
    raw = json.loads((DATA / "cluster.json").read_text())
    pods = raw["pods"]
    filler = [{"metadata": {"name": f"filler-{i}", "namespace": "default", "uid": f"u{i}",
                            "annotations": {"note": "x" * 200}}, "spec": {}, "status": {"phase": "Running"}}
              for i in range(1000)]
    pods["items"] = pods["items"] + filler
    (tmp_path / "nodes.json").write_text(json.dumps(raw["nodes"]))
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    (tmp_path / "quotas.json").write_text(json.dumps({"kind": "ResourceQuotaList", "items": []}))
    assert (tmp_path / "pods.json").stat().st_size > 128 * 1024
    out = subprocess.run(_jq_command(), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (tmp_path / "snapshot.json").write_text(out.stdout)
    snap = load_snapshot(tmp_path / "snapshot.json")
    assert len(snap.nodes) == len(raw["nodes"]["items"]) and len(snap.pods) == len(pods["items"])
    assert snap.quotas == []
