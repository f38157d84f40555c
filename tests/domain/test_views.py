"""kube_vgpu.views: typed read-only views of Pod, Node and list objects, one shape rule."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest

from kube_vgpu.errors import ShapeError, VGPUError
from kube_vgpu.views import EMPTY, ContainerView, ListView, NodeView, ObjectView, PodView


def _pod() -> dict:
    return {
        "metadata": {"name": "p", "namespace": "team-a", "uid": "u1", "resourceVersion": "7",
                     "creationTimestamp": "2026-01-01T00:00:00Z",
                     "annotations": {"a": "1"}, "labels": {"app": "x"},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": "rs"}]},
        "spec": {"schedulerName": "kube-vgpu", "nodeName": "n1", "priority": 100,
                 "initContainers": [{"name": "init", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                 "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": 2},
                                                              "requests": {"nvidia.com/gpumem": "3000"}},
                                 "env": [{"name": "A", "value": "b"}]},
                                {"name": "side"}]},
        "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "main"}]},
    }


def test_pod_fields_typed():
    raw = _pod()
    v = PodView(raw)
    assert (v.name, v.namespace, v.uid, v.resource_version, v.key) == ("p", "team-a", "u1", "7", "team-a/p")
    assert (v.scheduler_name, v.node_name, v.phase, v.priority) == ("kube-vgpu", "n1", "Running", 100)
    assert v.creation_timestamp == "2026-01-01T00:00:00Z" and v.deletion_timestamp == ""
    assert v.annotation("a") == "1" and v.annotation("zz") is None and v.label("app") == "x"
    assert v.owner_references[0]["name"] == "rs"
    assert v.condition("PodScheduled") == {"type": "PodScheduled", "status": "True"}
    assert v.condition("Ready") is None and v.admitted
    names = [(c.name, c.init, c.path) for c in v.all_containers()]
    assert names == [("init", True, "spec.initContainers[0]"), ("main", False, "spec.containers[0]"),
                     ("side", False, "spec.containers[1]")]
    main = v.container("main")
    assert main is not None and main.resource("nvidia.com/gpu") == 2
    assert main.resource("nvidia.com/gpumem") == "3000" and main.resource("cpu") is None
    assert main.env()[0]["value"] == "b"
    assert v.container("main", init=True) is None and v.container("init", init=True) is not None
    assert raw == _pod()  # never mutated


def test_view_does_not_copy_and_is_read_only():
    raw = _pod()
    v = PodView(raw)
    assert v.raw is raw and v.meta is raw["metadata"] and v.spec is raw["spec"]
    with pytest.raises(AttributeError):
        v.raw = {}  # type: ignore[misc]
    with pytest.raises(AttributeError):
        v.extra = 1  # type: ignore[attr-defined]
    assert not hasattr(v, "__dict__")
    c = v.containers()[0]
    with pytest.raises(AttributeError):
        c.init = True  # type: ignore[misc]


def test_absent_parts_read_empty():
    v = PodView({})
    assert v.meta is EMPTY and v.spec is EMPTY and v.status is EMPTY
    assert (v.name, v.uid, v.namespace, v.key, v.node_name, v.phase, v.priority) == ("", "", "default", "default/", "", "", 0)
    assert v.annotations == {} and v.labels == {} and v.all_containers() == () and v.conditions() == ()
    assert ObjectView({"metadata": None}).namespace == ""
    assert PodView({"metadata": {"namespace": ""}}).namespace == "default"


def test_of_reuses_a_view():
    v = PodView(_pod())
    assert PodView.of(v) is v
    n = NodeView.of(v)
    assert isinstance(n, NodeView) and n.raw is v.raw


@pytest.mark.parametrize("mutate, path, allowed", [
    (lambda p: p.__setitem__("metadata", "x"), "metadata", "an object"),
    (lambda p: p.__setitem__("spec", ["x"]), "spec", "an object"),
    (lambda p: p.__setitem__("status", 3), "status", "an object"),
])
def test_malformed_top_level_refused_at_construction(mutate, path, allowed):
    raw = _pod()
    mutate(raw)
    with pytest.raises(ShapeError) as e:
        PodView(raw)
    assert e.value.path == path and e.value.allowed == allowed
    assert str(e.value).startswith(f"{path} must be {allowed}, got ")
    assert isinstance(e.value, VGPUError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("mutate, read, path", [
    (lambda p: p["metadata"].__setitem__("annotations", "a=b"), lambda v: v.annotations, "metadata.annotations"),
    (lambda p: p["metadata"].__setitem__("labels", []), lambda v: v.label("x"), "metadata.labels"),
    (lambda p: p["metadata"]["annotations"].__setitem__("k", 1), lambda v: v.annotation("k"),
     'metadata.annotations["k"]'),
    (lambda p: p["metadata"].__setitem__("uid", 5), lambda v: v.uid, "metadata.uid"),
    (lambda p: p["metadata"].__setitem__("name", {"a": 1}), lambda v: v.key, "metadata.name"),
    (lambda p: p["spec"].__setitem__("nodeName", True), lambda v: v.node_name, "spec.nodeName"),
    (lambda p: p["spec"].__setitem__("priority", "high"), lambda v: v.priority, "spec.priority"),
    (lambda p: p["spec"].__setitem__("priority", True), lambda v: v.priority, "spec.priority"),
    (lambda p: p["spec"].__setitem__("containers", {"name": "x"}), lambda v: v.containers(), "spec.containers"),
    (lambda p: p["spec"]["containers"].__setitem__(1, "side"), lambda v: v.all_containers(), "spec.containers[1]"),
    (lambda p: p["spec"]["containers"][0].__setitem__("resources", "big"),
     lambda v: v.containers()[0].resource("x"), "spec.containers[0].resources"),
    (lambda p: p["spec"]["initContainers"][0]["resources"].__setitem__("limits", [1]),
     lambda v: v.init_containers()[0].limits, "spec.initContainers[0].resources.limits"),
    (lambda p: p["spec"]["containers"][0].__setitem__("env", [1]), lambda v: v.containers()[0].env(),
     "spec.containers[0].env[0]"),
    (lambda p: p["status"].__setitem__("phase", 1), lambda v: v.phase, "status.phase"),
    (lambda p: p["status"].__setitem__("conditions", ["x"]), lambda v: v.condition("Ready"), "status.conditions[0]"),
    (lambda p: p["metadata"].__setitem__("ownerReferences", {}), lambda v: v.owner_references,
     "metadata.ownerReferences"),
])
def test_malformed_field_names_its_path(mutate, read, path):
    raw = _pod()
    mutate(raw)
    v = PodView(raw)  # the rest of the object still reads
    with pytest.raises(ShapeError) as e:
        read(v)
    assert e.value.path == path
    assert str(e.value).startswith(f"{path} must be ")


def test_pod_life_rule():
    raw = _pod()
    assert PodView(raw).active and PodView(raw).holds_gpus
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z"
    v = PodView(raw)
    assert v.terminating and v.holds_gpus and not v.active and not v.finished
    for phase in ("Succeeded", "Failed"):
        raw["status"]["phase"] = phase
        v = PodView(raw)
        assert v.finished and not v.holds_gpus and not v.active
    raw["status"]["phase"] = ["Succeeded"]  # malformed: not finished (keeps the booking)
    assert not PodView(raw).finished


def test_container_view_refuses_non_object():
    with pytest.raises(ShapeError) as e:
        ContainerView("x", False, "spec.containers[3]")
    assert e.value.path == "spec.containers[3]"


def test_node_view():
    raw = {"metadata": {"name": "n1", "labels": {"gpu": "yes"}, "annotations": {"inv": "{}"}},
           "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoSchedule"}]},
           "status": {"allocatable": {"nvidia.com/gpu": "80"}, "capacity": {"cpu": "8"},
                      "conditions": [{"type": "Ready", "status": "False"}]}}
    v = NodeView(raw)
    assert (v.name, v.namespace, v.unschedulable, v.ready) == ("n1", "", True, False)
    assert v.allocatable["nvidia.com/gpu"] == "80" and v.capacity["cpu"] == "8"
    assert v.label("gpu") == "yes" and v.annotation("inv") == "{}"
    assert NodeView({"spec": {"unschedulable": "true"}}).unschedulable is False  # only the JSON true cordons
    assert NodeView({}).ready is None
    raw["status"]["allocatable"] = "lots"
    with pytest.raises(ShapeError, match=r"^status.allocatable must be an object, got a string$"):
        _ = NodeView(raw).allocatable


def test_list_view():
    body = {"metadata": {"resourceVersion": "42", "continue": "tok"}, "items": [{"a": 1}]}
    lv = ListView(body)
    assert (lv.resource_version, lv.continue_token, lv.items) == ("42", "tok", [{"a": 1}])
    assert ListView({}).items == () and ListView({}).continue_token == ""
    with pytest.raises(ShapeError, match="^items must be a list"):
        ListView({"items": {}})
    with pytest.raises(ShapeError, match=r"^\(list\) must be an object"):
        ListView([])  # type: ignore[arg-type]


def test_repr_never_raises():
    assert repr(PodView(_pod())) == "PodView(team-a/p)"
    assert repr(NodeView({"metadata": {"name": "n1"}})) == "NodeView(n1)"
    assert repr(PodView({"metadata": {"name": 5}})) == "PodView(<malformed metadata>)"


def test_not_an_object():
    for bad in (None, "pod", [], 3):
        with pytest.raises(ShapeError) as e:
            PodView(bad)  # type: ignore[arg-type]
        assert e.value.path == "(object)"


def test_view_survives_deepcopy_of_raw_unchanged():
    raw = _pod()
    before = copy.deepcopy(raw)
    v = PodView(raw)
    _ = (v.annotations, v.labels, v.all_containers(), v.conditions(), v.priority, v.admitted)
    assert raw == before


# -- guard: no new raw walks of metadata/spec/status outside kube_vgpu/views.py -----------------

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PACKAGES = ("kube_vgpu", "webhook", "scheduler", "deviceplugin", "kubectl_vgpu", "certs", "replay", "kube_vgpu_cli")
#: a read of an object's metadata/spec (any .get) or status (.get(...) or {} / .get(..., {})), or a
#: subscript read of one of them; assignments (``pod["metadata"] = ...``) are writes, not walks
_WALK = re.compile(r'''\.get\(\s*["'](?:metadata|spec)["']'''
                   r'''|\.get\(\s*["']status["']\s*(?:\)\s*or\s*\{\}|,\s*\{\}\s*\))'''
                   r'''|\[\s*["'](?:metadata|spec|status)["']\s*\](?!(?:\s*\[[^\]]*\])*\s*=[^=])''')
#: walks left, per file, and why. Lower a number when you convert a site; never raise one: read
#: through kube_vgpu.views (PodView, NodeView, ObjectView, ListView) instead (docs/architecture.md)
ALLOWED_WALKS: dict[str, tuple[int, str]] = {
    "kubectl_vgpu/cluster.py": (2, "the shape checker reads the raw object to decide whether it can be viewed"),
    "kube_vgpu/dra/claims.py": (1, "the DRA claim reader's own strict shape check of a ResourceClaim"),
    "scheduler/drascore.py": (2, "kept_claim copies the few fields the DRA scorer reads out of a tenant's raw "
                                 "ResourceClaim, marking each of the wrong type, before anything views it"),
}


def _walks() -> dict[str, int]:
    out: dict[str, int] = {}
    for pkg in _PACKAGES:
        for f in sorted((_ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(_ROOT).as_posix()
            if rel == "kube_vgpu/views.py" or rel.startswith("deviceplugin/api/"):
                continue
            n = len(_WALK.findall(f.read_text(encoding="utf-8")))
            if n:
                out[rel] = n
    return out


def test_walk_pattern_counts_reads_not_writes():
    text = '''m = pod.get("metadata") or {}
s = (pod or {}).get("spec")
st = pod.get("status") or {}
st2 = pod.get("status", {})
r = obj["metadata"]["name"]
ok = c.get("status") == "True"
pod["metadata"] = {}
body["metadata"]["resourceVersion"] = rv
x = body["spec"] == y
'''
    assert len(_WALK.findall(text)) == 6


def test_no_new_raw_walks():
    """Objects are read through kube_vgpu.views; the walks left are listed in ALLOWED_WALKS."""
    found = _walks()
    grew = {f: n for f, n in found.items() if n > ALLOWED_WALKS.get(f, (0, ""))[0]}
    assert not grew, (f"raw walks of metadata/spec/status (read through kube_vgpu.views instead, see "
                      f"docs/architecture.md): {grew}")
    stale = {f: (found.get(f, 0), n) for f, (n, _) in ALLOWED_WALKS.items() if found.get(f, 0) < n}
    assert not stale, f"fewer walks than allowed (found, allowed): lower ALLOWED_WALKS: {stale}"
