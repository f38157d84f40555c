"""Hostile or corrupt cluster data: a malformed object is a warning line and is skipped (never a
traceback), terminal control characters are never printed, implausible values are flagged, and
warnings are printed in full."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kube_vgpu.codec import encode_allocation, encode_inventory
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation
from kubectl_vgpu import inspect, simulate
from kubectl_vgpu.cluster import Cluster
from kubectl_vgpu.main import main
from kubectl_vgpu.text import safe

DATA = Path(__file__).parent / "data"
SNAP = DATA / "cluster.json"
SMALL = str(DATA / "pod-3000mib-30pct.yaml")
INV = "kube-vgpu.io/node-inventory"
ALLOC = "kube-vgpu.io/allocation"


def _snapshot(tmp_path: Path, nodes: list[Any] | None = None, pods: list[Any] | None = None) -> str:
    raw = json.loads(SNAP.read_text())
    raw["nodes"]["items"] += nodes or []
    raw["pods"]["items"] += pods or []
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(raw))
    return str(p)


def _flat(text: str) -> str:
    """Wrapped lines joined back (warnings are wrapped at 80 columns, not cut)."""
    return " ".join(line.strip() for line in text.splitlines())


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _pod(**meta: Any) -> dict[str, Any]:
    m = {"namespace": "evil", "name": "p"}
    m.update(meta)
    return {"metadata": m, "status": {"phase": "Running"}}


# --- 4. malformed objects: warning + skipped ---------------------------------------------------

BAD_PODS = [
    (_pod(annotations=["kube-vgpu.io/allocation"]), "pod evil/p: metadata.annotations must be an object, got a list"),
    (_pod(annotations={ALLOC: ["x"]}), 'pod evil/p: metadata.annotations["kube-vgpu.io/allocation"] must be a string'),
    (_pod(labels="x"), "pod evil/p: metadata.labels must be an object"),
    ({"metadata": [], "status": {}}, "pod #"),
    ({"metadata": {"name": 5}}, "metadata.name must be a non-empty string, got a number"),
    (_pod(namespace=["a"]), "metadata.namespace must be a string"),
    ({**_pod(), "status": "Running"}, "pod evil/p: status must be an object, got a string"),
    ({**_pod(), "status": {"phase": ["Running"]}}, "status.phase must be a string"),
    ({**_pod(), "spec": []}, "pod evil/p: spec must be an object"),
    ({**_pod(), "spec": {"nodeName": {}}}, "spec.nodeName must be a string"),
    ("a pod", "not an object (got a string)"),
    (None, "not an object (got null)"),
]
BAD_NODES = [
    ({"metadata": {"name": "n1", "annotations": [INV]}}, "node n1: metadata.annotations must be an object"),
    ({"metadata": {"name": "n1", "annotations": {INV: {"v": 1}}}}, 'metadata.annotations["kube-vgpu.io/node-'),
    ({"metadata": {"name": "n1"}, "status": {"conditions": ["Ready"]}}, "status.conditions[0] must be an object"),
    ({"metadata": {"name": "n1"}, "status": {"conditions": {}}}, "status.conditions must be a list"),
    ({"metadata": {"name": "n1"}, "spec": {"unschedulable": "yes"}}, "spec.unschedulable must be a boolean"),
    ({"metadata": {"name": "n1"}, "status": {"allocatable": []}}, "status.allocatable must be an object"),
    ([], "node #"),
]


@pytest.mark.parametrize("bad,needle", BAD_PODS)
def test_malformed_pod_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: Any,
                                    needle: str) -> None:
    snap = _snapshot(tmp_path, pods=[bad])
    rc, out, err = _run(capsys, "inspect", "--snapshot", snap)
    assert rc == 0 and "Traceback" not in err, err
    assert needle in _flat(out) and "skipped" in out, out
    assert "CLUSTER  7 GPUs on 3 nodes, 7 pods" in out  # the rest of the report is intact
    rc, out, _ = _run(capsys, "inspect", "--snapshot", snap, "-o", "json")
    assert rc == 0 and any(needle in w for w in json.loads(out)["warnings"])


@pytest.mark.parametrize("bad,needle", BAD_NODES)
def test_malformed_node_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: Any,
                                     needle: str) -> None:
    snap = _snapshot(tmp_path, nodes=[bad])
    rc, out, err = _run(capsys, "inspect", "--snapshot", snap)
    assert rc == 0 and needle in _flat(out) and "skipped" in out, (out, err)
    rc, out, err = _run(capsys, "simulate", "-f", SMALL, "--snapshot", snap)
    assert rc == 0 and "Traceback" not in err and needle in err, err


def test_live_listing_goes_through_the_same_checks() -> None:
    c = Cluster(nodes=[{"metadata": {"name": "ok"}}, "x"], pods=[_pod(annotations=[ALLOC])], now=0.0)
    assert [n["metadata"]["name"] for n in c.nodes] == ["ok"] and c.pods == []
    assert len(c.warnings) == 2


# --- 5. control characters never reach the terminal ------------------------------------------

ESC = "\x1b[2J\x1b]0;pwned\x07"


def _hostile_cluster() -> Cluster:
    dev = GPUDevice("GPU-\x1b[31mred", 0, "NVIDIA " + ESC + "H200", 143771, 100, 10)
    node = {"metadata": {"name": "node\x1b[2J", "annotations": {INV: encode_inventory(NodeInventory((dev,), 100.0))}}}
    alloc = PodAllocation("node\x1b[2J", (ContainerAllocation("c" + ESC, False, (DeviceBooking(dev.uuid, 1000, 10),)),))
    pod = {"metadata": {"namespace": "ns\u202e", "name": "p\x9b2J",
                        "annotations": {ALLOC: encode_allocation(alloc), "kube-vgpu.io/bind-phase": "x\ry"}},
           "status": {"phase": "Pend\x08ing"}}
    bad = {"metadata": {"namespace": "ns", "name": "bad\x1b[2J", "annotations": {ALLOC: "\x1b[2J{"}}}
    orphan = copy.deepcopy(pod)
    orphan["metadata"]["name"] = "orphan\x1b"
    orphan["metadata"]["annotations"][ALLOC] = encode_allocation(PodAllocation(
        "node\x1b[2J", (ContainerAllocation("c", False, (DeviceBooking("GPU-\x1bgone", 1, 1),)),)))
    return Cluster([node, {"metadata": {"name": "n\x1b", "annotations": {INV: "\x1b[2J"}}}], [pod, bad, orphan],
                   now=100.0)


def _unsafe(text: str) -> list[str]:
    return [ch for ch in text if ch != "\n" and (not ch.isprintable() or ch in "\u202e")]


def test_control_characters_escaped_in_table() -> None:
    report = inspect.build(_hostile_cluster())
    for details in (False, True):
        text = inspect.render_table(report, details=details)
        assert not _unsafe(text), repr(text)
        assert "\\x1b[2J" in text
    text = inspect.render_table(report, details=True)
    assert "c\\x1b[2J" in text and "p\\x9b2J" in text and "ns\\u202e" in text and "Pend\\x08" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_control_characters_escaped_in_json() -> None:
    out = json.dumps(inspect.to_json(inspect.build(_hostile_cluster())))
    assert "\x1b" not in out and "\\u001b" in out


def test_control_characters_escaped_in_simulate_and_errors(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    raw = json.loads(SNAP.read_text())
    for n in raw["nodes"]["items"]:
        n["metadata"]["name"] += "\x1b[2J"
    for p in raw["pods"]["items"]:
        p["spec"] = {**(p.get("spec") or {}), "nodeName": "x"}
        if ALLOC in (p["metadata"].get("annotations") or {}):
            a = json.loads(p["metadata"]["annotations"][ALLOC])
            a["node"] += "\x1b[2J"
            p["metadata"]["annotations"][ALLOC] = json.dumps(a)
    snap = tmp_path / "s.json"
    snap.write_text(json.dumps(raw))
    rc, out, err = _run(capsys, "simulate", "-f", SMALL, "--snapshot", str(snap))
    assert rc == 0 and "\\x1b[2J" in out and not _unsafe(out + err), out
    bad = tmp_path / "\x1b[2J.json"
    rc, out, err = _run(capsys, "inspect", "--snapshot", str(bad))
    assert rc == 1 and "\\x1b[2J" in err and not _unsafe(err)


def test_safe() -> None:
    assert safe("plain text") == "plain text"
    assert safe("a\tb\x00c\x7fd\x85e\u200bf\U000e0001") == "a\\x09b\\x00c\\x7fd\\x85e\\u200bf\\U000e0001"
    assert safe("GPU 显卡 é") == "GPU 显卡 é"


def test_simulate_render_is_sanitised() -> None:
    assert "\x1b" not in simulate._cut("a\x1bb") and "\x1b" not in "".join(simulate._wrap("\x1b" * 3))


# --- 6. implausible values -----------------------------------------------------------------------

def _inv(*devs: dict[str, Any]) -> str:
    return json.dumps({"v": 1, "hb": 100, "devices": [
        {"uuid": "GPU-a", "idx": 0, "model": "H200", "mem": 143771, "cores": 100, "split": 10, "healthy": True,
         "numa": 0, **d} for d in devs]})


def _alloc(**dev: Any) -> str:
    return json.dumps({"v": 1, "node": "n1", "t": 1, "containers": [
        {"name": "c", "init": False, "devices": [{"uuid": "GPU-a", "mem": 1000, "cores": 10, **dev}]}]})


def _report(inv: str, *allocs: str) -> tuple[inspect.Report, str]:
    node = {"metadata": {"name": "n1", "annotations": {INV: inv}}}
    pods = [{"metadata": {"namespace": "ns", "name": f"p{i}", "annotations": {ALLOC: a}},
             "status": {"phase": "Running"}} for i, a in enumerate(allocs)]
    report = inspect.build(Cluster([node], pods, now=100.0))
    return report, inspect.render_table(report, details=True)


@pytest.mark.parametrize("dev", [{"mem": 10**30}, {"cores": 1000}, {"mem": -5}, {"cores": -1}])
def test_implausible_allocation_is_flagged(dev: dict[str, Any]) -> None:
    report, text = _report(_inv({}), _alloc(**dev))
    # rejected by the codec (out of range), or else flagged as booked beyond the GPU's inventory
    assert any(w.startswith("pod ns/p0: ") or "booked beyond" in w and "ns/p0" in w for w in report.warnings), \
        report.warnings
    assert "warning: " in text and "ns/p0" in text.split("warning: ", 1)[1]


@pytest.mark.parametrize("dev", [{"mem": -100}, {"split": 0}, {"cores": -5}, {"mem": 10**30}])
def test_implausible_inventory_is_flagged(dev: dict[str, Any]) -> None:
    report, text = _report(_inv(dev))
    (node,) = report.nodes
    assert node.problem and node.problem.startswith("invalid inventory: "), node.problem
    assert "  ! invalid inventory: " in text


def test_overbooked_gpu_is_flagged() -> None:
    report, text = _report(_inv({"mem": 2000, "split": 1}), _alloc(mem=1500), _alloc(mem=1500))
    (w,) = [w for w in report.warnings if "booked beyond" in w]
    assert "node n1 GPU 0 (GPU-a)" in w and "memory MiB 3000 of 2000" in w and "slots 2 of 1" in w
    assert "ns/p0, ns/p1" in w


def test_duplicate_uuid_in_inventory_is_flagged() -> None:
    report, text = _report(_inv({}, {"idx": 1}))
    (node,) = report.nodes
    if node.problem:  # the codec refuses the whole inventory
        assert "twice" in node.problem and "twice" in _flat(text)
    else:
        assert [g.device.index for g in node.gpus] == [0]
        (w,) = report.warnings
        assert w == "node n1: inventory lists GPU GPU-a twice (index 0 and 1); only index 0 is shown"
        assert "GPU-a twice" in _flat(text)


def test_duplicate_uuid_check_of_inspect_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Independent of the codec: a decoded inventory with one UUID twice shows it once, with a warning."""
    dev = GPUDevice("GPU-a", 0, "H200", 143771, 100, 10)
    monkeypatch.setattr(inspect, "decode_inventory",
                        lambda _: NodeInventory((dev, GPUDevice("GPU-a", 1, "H200", 143771, 100, 10)), 100.0))
    report, text = _report("ignored")
    assert [g.device.index for g in report.nodes[0].gpus] == [0]
    assert report.warnings == ["node n1: inventory lists GPU GPU-a twice (index 0 and 1); only index 0 is shown"]
    assert "GPU-a twice" in _flat(text)


# --- 7. warnings in full -----------------------------------------------------------------------

def test_long_warnings_are_wrapped_not_cut() -> None:
    reason = "x" * 30 + " the end of a long reason " + "y" * 150 + " FINAL"
    c = Cluster([], [], now=0.0, warnings=[reason])
    text = inspect.render_table(inspect.build(c))
    assert "~" not in text and "FINAL" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    joined = " ".join(line.strip() for line in text.split("warning: ", 1)[1].splitlines())
    assert joined.replace(" ", "") == reason.replace(" ", "")


def test_long_problem_lines_are_wrapped_not_cut() -> None:
    report, text = _report('{"v": 1, "hb": 100, "devices": [{"uuid": "GPU-a"}], "pad": "' + "z" * 200 + '"}')
    assert "~" not in text and "missing field 'idx'" in text
