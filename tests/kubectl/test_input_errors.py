"""``kubectl vgpu`` on bad input a user gives it (a manifest, a snapshot, a kubeconfig): one line
naming the file, where and what is wrong, and what to pass instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubectl_vgpu.main import main

DATA = Path(__file__).parent / "data"
SNAP = str(DATA / "cluster.json")
POD = (DATA / "pod-3000mib-30pct.yaml").read_text()
DEPLOYMENT = """apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec:
  template:
    spec:
      containers:
      - name: c
        resources: {limits: {nvidia.com/gpumem: "3000"}}
"""


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\\x0a" not in err, err  # one readable line
    return err


def test_manifest_that_is_not_yaml_names_line_and_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "pod.yaml"
    f.write_text("apiVersion: v1\nkind: Pod\nspec: [\n")
    assert main(["what-if", "-f", str(f), "--snapshot", SNAP]) == 1
    err = _err(capsys)
    assert f"cannot read {f}: not valid YAML: line 4, column 1: expected the node content" in err, err


def test_missing_manifest_says_so_without_errno_noise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "nope.yaml"
    assert main(["what-if", "-f", str(f), "--snapshot", SNAP]) == 1
    assert _err(capsys).endswith(f"cannot read {f}: No such file or directory\n")


def test_a_deployment_instead_of_a_pod_names_what_was_found(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "deploy.yaml"
    f.write_text(DEPLOYMENT)
    assert main(["what-if", "-f", str(f), "--snapshot", SNAP]) == 2
    assert "expected exactly one Pod manifest (kind: Pod), found 0 Pods and Deployment" in _err(capsys)
    f.write_text(POD + "---\n" + POD)
    assert main(["what-if", "-f", str(f), "--snapshot", SNAP]) == 2
    assert "found 2 Pods" in _err(capsys)
    f.write_text(POD + "---\n" + DEPLOYMENT)  # the one Pod is evaluated, the rest ignored
    assert main(["what-if", "-f", str(f), "--snapshot", SNAP, "--policy", "binpack"]) == 0


def test_snapshot_that_is_not_yaml_names_line_and_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "snap.yaml"
    f.write_text("nodes: [\n")
    assert main(["inspect", "--snapshot", str(f)]) == 1
    assert f"snapshot {f} is not JSON/YAML: line 2, column 1: expected the node content" in _err(capsys)


def test_missing_kubeconfig_is_named_not_hidden_behind_in_cluster(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """$KUBECONFIG names a missing file outside a cluster: the error said only 'Service host/port
    is not set' (the in-cluster fallback's), not which kubeconfig failed."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert main(["inspect"]) == 1
    err = _err(capsys)
    assert f"cannot load kubeconfig {tmp_path / 'missing'}: Invalid kube-config file" in err, err
    assert "not in a cluster either" in err and err.endswith("pass --kubeconfig or --snapshot\n")
    # cordon cannot take a snapshot: its hint says what it can take
    assert main(["cordon", "n1", "0"]) == 1
    assert _err(capsys).endswith("pass --kubeconfig or --context\n")


def test_kubeconfig_that_is_not_yaml_names_line_and_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kc = tmp_path / "kubeconfig"
    kc.write_text("clusters: [\n")
    assert main(["inspect", "--kubeconfig", str(kc)]) == 1
    err = _err(capsys)
    assert f"cannot load kubeconfig {kc}: not valid YAML: line 2, column 1" in err, err
    monkeypatch.setenv("KUBECONFIG", str(kc))  # the file's error, no in-cluster error beside it
    assert main(["quota"]) == 1
    err = _err(capsys)
    assert f"cannot load kubeconfig {kc}: not valid YAML" in err and "in a cluster" not in err, err


def test_config_file_errors_name_the_flag_and_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--config errors were Python's '[Errno 2] ...' without the flag, or PyYAML's multi-line text."""
    missing = tmp_path / "none.yaml"
    assert main(["inspect", "--snapshot", SNAP, "--config", str(missing)]) == 2
    assert _err(capsys).endswith(f"--config {missing}: cannot read: No such file or directory\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduling: [1\n")
    assert main(["quota", "--snapshot", SNAP, "--config", str(bad)]) == 2
    assert f"--config {bad}: not valid YAML: line 2, column 1: expected ',' or ']'" in _err(capsys)
    bad.write_text("scheduling: {nodePolicyy: fgd}\n")
    assert main(["what-if", "-f", str(DATA / "pod-3000mib-30pct.yaml"), "--snapshot", SNAP, "--config", str(bad)]) == 2
    assert f"--config {bad}: config key 'scheduling.nodePolicyy': unknown key; allowed:" in _err(capsys)
