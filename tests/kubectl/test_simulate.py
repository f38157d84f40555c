"""``kubectl vgpu simulate`` against recorded cluster JSON: every policy, reasons, dry run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kube_vgpu.config import NODE_POLICIES
from kube_vgpu.podspec import parse_pod
from kubectl_vgpu import simulate
from kubectl_vgpu.cluster import load_snapshot
from kubectl_vgpu.main import main

DATA = Path(__file__).parent / "data"
SNAP = str(DATA / "cluster.json")
SMALL = str(DATA / "pod-3000mib-30pct.yaml")
BIG = str(DATA / "pod-2x120000mib.yaml")


def test_every_policy_places_the_sample_pod(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "-f", SMALL, "--snapshot", SNAP, "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["dryRun"] is True
    by = {p["policy"]: p for p in doc["policies"]}
    assert list(by) == list(NODE_POLICIES)
    # gpu-node-a is the more used node: binpack picks it, spread the emptier gpu-node-b.
    assert by["binpack"]["node"] == "gpu-node-a"
    assert by["spread"]["node"] == "gpu-node-b"
    for p in doc["policies"]:
        assert p["node"] in ("gpu-node-a", "gpu-node-b")
        assert {r["node"] for r in p["ranking"]} == {"gpu-node-a", "gpu-node-b"}
        assert p["ranking"][0]["node"] == p["node"]
        # comparable across policies: the chosen node gets the extender's top score, the other 0
        assert p["extenderScore"] == 10 and [r["extenderScore"] for r in p["ranking"]] == [10, 0]
        (cont,) = p["containers"]
        assert cont[0]["memoryMiB"] == 3000 and cont[0]["cores"] == 30
    # The spread GPU policy puts it on the emptier H200 (#1) on gpu-node-a, and never on the
    # unhealthy A100 #3 or the exclusive ones on gpu-node-b.
    assert by["binpack"]["containers"][0][0]["index"] == 1
    assert by["spread"]["containers"][0][0]["index"] == 2
    rej = doc["rejected"]
    assert set(rej) == {"cpu-node-1", "gpu-node-c", "gpu-node-d"}
    assert "cordoned" in rej["gpu-node-c"]
    assert "no vGPU inventory" in rej["cpu-node-1"]
    assert "unsupported version 2" in rej["gpu-node-d"]
    assert doc["rejectedCodes"] == {"cpu-node-1": "no_inventory", "gpu-node-d": "bad_inventory"}


def test_table_explains_rejections_within_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "-f", BIG, "--snapshot", SNAP])
    out = capsys.readouterr().out
    assert rc == 3  # fits nowhere
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "(fits nowhere)" in out
    text = " ".join(out.split())  # reasons are wrapped
    doc = json.loads(_run_json(capsys, ["simulate", "-f", BIG, "--snapshot", SNAP, "-o", "json"]))
    assert doc["rejectedCodes"]["gpu-node-a"] == doc["rejectedCodes"]["gpu-node-b"] == "insufficient_memory"
    for node in ("gpu-node-a", "gpu-node-b"):  # the one renderer's detail, numbers and GPU included
        assert f"{node}: {doc['rejected'][node]}" in text
    assert "116771 MiB" in doc["rejected"]["gpu-node-a"] and "120000 MiB" in doc["rejected"]["gpu-node-a"]


def test_policy_subset_and_stale_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    raw = json.loads(Path(SNAP).read_text())
    for n in raw["nodes"]["items"]:  # uncordon the stale L4 node: staleness alone must reject it
        n["spec"].pop("unschedulable", None)
    p = tmp_path / "s.json"
    p.write_text(json.dumps(raw))
    rc = main(["simulate", "-f", SMALL, "--snapshot", str(p), "--policy", "fgd", "--policy", "bestfit",
               "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [x["policy"] for x in doc["policies"]] == ["fgd", "bestfit"]
    assert "stale" in doc["rejected"]["gpu-node-c"]


def test_dry_run_changes_nothing() -> None:
    cluster = load_snapshot(SNAP)
    before = copy.deepcopy((cluster.nodes, cluster.pods))
    import yaml
    pod = parse_pod(yaml.safe_load(Path(SMALL).read_text()))
    sim = simulate.simulate(cluster, pod)
    assert (cluster.nodes, cluster.pods) == before
    assert all(r.node for r in sim.results)


def test_pod_policy_annotation_does_not_mask_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = Path(SMALL).read_text().replace("  namespace: default\n", "  namespace: default\n  annotations:\n"
                                           "    hami.io/node-scheduler-policy: spread\n")
    f = tmp_path / "pod.yaml"
    f.write_text(text)
    main(["simulate", "-f", str(f), "--snapshot", SNAP, "--policy", "binpack", "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["policies"][0]["node"] == "gpu-node-a"


def test_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "pod.yaml"
    f.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n  - name: a\n"
                 "    resources: {limits: {nvidia.com/gpumem-percentage: '150'}}\n")
    assert main(["simulate", "-f", str(f), "--snapshot", SNAP]) == 2
    assert "gpumem-percentage" in capsys.readouterr().err
    f.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n  - name: a\n")
    assert main(["simulate", "-f", str(f), "--snapshot", SNAP]) == 2
    assert "asks for no vGPU resource" in capsys.readouterr().err
    assert main(["simulate", "-f", str(tmp_path / "nope.yaml"), "--snapshot", SNAP]) == 1
    with pytest.raises(SystemExit):
        main(["simulate", "-f", SMALL, "--policy", "random"])


def test_custom_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {gpuPolicy: binpack, inventoryStaleSeconds: 100000}\n")
    pod = tmp_path / "pod.yaml"
    pod.write_text(Path(SMALL).read_text().replace('gpucores: "30"', 'gpucores: "10"'))
    rc = main(["simulate", "-f", str(pod), "--snapshot", SNAP, "--config", str(cfg), "--policy", "binpack",
               "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["gpuPolicy"] == "binpack"
    assert doc["policies"][0]["containers"][0][0]["index"] == 0  # binpack GPU: the fuller H200
    main(["simulate", "-f", str(pod), "--snapshot", SNAP, "--policy", "binpack", "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpuPolicy"] == "spread"
    assert doc["policies"][0]["containers"][0][0]["index"] == 1  # default spread GPU: the emptier one
    cfg.write_text("scheduling: {nodePolicy: nope}\n")
    assert main(["simulate", "-f", SMALL, "--snapshot", SNAP, "--config", str(cfg)]) == 2
    assert "scheduling.nodePolicy" in capsys.readouterr().err


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    main(argv)
    return capsys.readouterr().out


def test_what_if_is_the_name_and_simulate_its_alias(capsys: pytest.CaptureFixture[str]) -> None:
    rc_new = main(["what-if", "-f", SMALL, "--snapshot", SNAP, "-o", "json"])
    new = capsys.readouterr().out
    rc_old = main(["simulate", "-f", SMALL, "--snapshot", SNAP, "-o", "json"])
    assert (rc_new, new) == (rc_old, capsys.readouterr().out) and json.loads(new)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "what-if" in out and "kube-vgpu replay" in out


def test_an_empty_cluster_is_not_reported_as_rejecting_nothing(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """With no node at all, what-if says so (it once printed "No node rejected the pod." under six
    "fits nowhere" lines) and exits 3 (fits nowhere)."""
    snap = tmp_path / "empty.json"
    snap.write_text(json.dumps({"nodes": {"items": []}, "pods": {"items": []}}))
    assert main(["what-if", "-f", SMALL, "--snapshot", str(snap)]) == 3
    out = capsys.readouterr().out
    assert "No node in the cluster (or the snapshot) to place the pod on." in out
    assert "No node rejected the pod." not in out
