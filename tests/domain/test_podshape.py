"""The one shape checker (kube_vgpu.podshape): every wrong JSON type at every declared field is
refused with a ShapeError whose path leads to exactly the value it names; random malformed objects
never raise anything else; valid objects pass; and the webhook, the extender and kubectl vgpu report
the same field for the same malformed pod."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import podshape
from kube_vgpu.errors import ShapeError, json_type
from kube_vgpu.podshape import NODE, POD, POD_PLACEMENT, Leaf, ListOf, MapOf, Obj

CAPTURE = Path("/work/shared/reference/captures/scheduler_filter.json")

VALID_POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": "7",
                 "labels": {"app": "x"}, "annotations": {"nvidia.com/use-gputype": "H100"},
                 "ownerReferences": [{"kind": "Job", "name": "j"}]},
    "spec": {"schedulerName": "kube-vgpu-scheduler", "hostNetwork": False,
             "volumes": [{"name": "v", "hostPath": {"path": "/tmp"}}],
             "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
             "initContainers": [{"name": "init", "restartPolicy": "Always",
                                 "resources": {"limits": {"cpu": "1"}}}],
             "containers": [{"name": "c", "image": "busybox",
                             "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": "4000"},
                                           "requests": {"cpu": 0.5}},
                             "volumeMounts": [{"name": "v", "mountPath": "/v", "subPath": "s"}],
                             "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"x": 1}}],
                             "envFrom": [{"prefix": "P_", "configMapRef": {"name": "cm"}}],
                             "securityContext": {"privileged": False, "capabilities": {"add": ["SYS_ADMIN"]}}}]},
    "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled"}]},
}

VALID_NODE: dict[str, Any] = {
    "metadata": {"name": "n1", "labels": {"a": "b"}, "annotations": {"kube-vgpu.io/node-inventory": "{}"}},
    "spec": {"unschedulable": True, "taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]},
    "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"nvidia.com/gpu": "8"},
               "capacity": {"cpu": 4}},
}

_TOKEN = re.compile(r'\.?([A-Za-z]+)|\[(\d+)\]|\[("(?:[^"\\]|\\.)*")\]')


def resolve(obj: Any, path: str) -> Any:
    """The value at ``path`` (podshape's path syntax) in ``obj``; KeyError/IndexError if none."""
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        assert m is not None, f"unparsable path {path!r} at {pos}"
        field, index, key = m.groups()
        obj = obj[field] if field is not None else obj[int(index)] if index is not None else obj[json.loads(key)]
        pos = m.end()
    return obj


def wrong_values(shape: Leaf | Obj | ListOf | MapOf) -> list[Any]:
    """JSON values of the wrong type for ``shape`` (never null: null is an absent optional field)."""
    every = [True, 3, 2.5, "s", ["x"], {"k": "v"}]
    if isinstance(shape, Leaf):
        return [v for v in every if not isinstance(v, shape.types) or (shape.no_bool and isinstance(v, bool))]
    if isinstance(shape, ListOf):
        return [v for v in every if not isinstance(v, list)]
    return [v for v in every if not isinstance(v, dict)]


def declared(shape: Obj, base: dict[str, Any]) -> list[tuple[tuple[Any, ...], Leaf | Obj | ListOf | MapOf]]:
    """(location in ``base``, shape) of every declared field, list item and map value present in
    ``base`` (plus absent top-level fields of the objects that are)."""
    out: list[tuple[tuple[Any, ...], Leaf | Obj | ListOf | MapOf]] = []

    def walk(s: Leaf | Obj | ListOf | MapOf, v: Any, loc: tuple[Any, ...]) -> None:
        if isinstance(s, Obj) and isinstance(v, dict):
            for k, sub in s.fields.items():
                out.append(((*loc, k), sub))
                if k in v:
                    walk(sub, v[k], (*loc, k))
        elif isinstance(s, ListOf) and isinstance(v, list):
            for i, x in enumerate(v):
                out.append(((*loc, i), s.item))
                walk(s.item, x, (*loc, i))
        elif isinstance(s, MapOf) and isinstance(v, dict):
            for k in v:
                out.append(((*loc, k), s.value))
    walk(shape, base, ())
    return out


def put(obj: Any, loc: tuple[Any, ...], value: Any) -> Any:
    obj = copy.deepcopy(obj)
    cur = obj
    for k in loc[:-1]:
        cur = cur[k]
    cur[loc[-1]] = value
    return obj


def assert_names_the_value(e: ShapeError, obj: Any, prefix: str = "") -> None:
    """The error's path leads to exactly the value it reports, and the message says path, type and
    what is allowed."""
    path = e.path
    if prefix:
        assert path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "["), path
        path = path[len(prefix):]
    assert resolve(obj, path) is e.value or resolve(obj, path) == e.value, (e.path, e.value)
    assert str(e) == f"{e.path} must be {e.allowed}, got {json_type(e.value)}"
    assert e.allowed


def test_valid_objects_pass() -> None:
    podshape.check_pod(VALID_POD)
    podshape.check_pod_placement(VALID_POD)
    podshape.check_node(VALID_NODE)
    if CAPTURE.exists():
        podshape.check_pod(json.loads(CAPTURE.read_text())["Pod"])
    podshape.check_pod({})  # every field is optional


@pytest.mark.parametrize("shape,base,check", [
    (POD, VALID_POD, podshape.check_pod),
    (POD_PLACEMENT, VALID_POD, podshape.check_pod_placement),
    (NODE, VALID_NODE, podshape.check_node),
])
def test_every_declared_field_is_checked(shape: Obj, base: dict[str, Any], check: Any) -> None:
    """A wrong JSON type at any declared place is refused, naming that place (with a prefix too)."""
    places = declared(shape, base)
    assert len(places) > 20
    for loc, sub in places:
        for bad in wrong_values(sub):
            obj = put(base, loc, bad)
            for prefix in ("", "Pod"):
                with pytest.raises(ShapeError) as ei:
                    check(obj, prefix)
                assert_names_the_value(ei.value, obj, prefix)
                assert ei.value.value == bad, (loc, bad, str(ei.value))


def test_required_values_and_the_root() -> None:
    with pytest.raises(ShapeError, match=r"^Pod must be an object \(core/v1 Pod\), got null$"):
        podshape.check_pod(None, "Pod")
    with pytest.raises(ShapeError, match=r"^request.oldObject must be an object \(core/v1 Pod\), got a list$"):
        podshape.check_pod([], "request.oldObject", "request.oldObject")
    with pytest.raises(ShapeError, match=r'^metadata.labels\["a"\] must be a string, got null$'):
        podshape.check_pod({"metadata": {"labels": {"a": None}}})  # map values are never optional
    with pytest.raises(ShapeError, match=r"^spec.containers\[1\] must be an object \(core/v1 Container\), got null$"):
        podshape.check_pod({"spec": {"containers": [{}, None]}})
    with pytest.raises(ShapeError, match=r'quantity \(string or number\), got a boolean$'):
        podshape.check_pod({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": True}}}]}})
    long_key = "k" * 100 + "\x1b"
    with pytest.raises(ShapeError) as ei:
        podshape.check_pod({"metadata": {"annotations": {long_key: 1}}})
    assert ei.value.path == 'metadata.annotations["' + "k" * 60 + '..."]' and "\x1b" not in str(ei.value)
    with pytest.raises(ShapeError, match=r"^NodeNames\[2\] must be a string, got a number$"):
        podshape.check_names(["a", "b", 3], "NodeNames")


leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
junk = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.sampled_from(["metadata", "spec", "status", "name", "labels", "annotations", "containers",
                     "initContainers", "resources", "limits", "requests", "env", "value", "volumes",
                     "hostPath", "path", "phase", "securityContext", "capabilities", "add", "x"]) | st.text(max_size=4),
    kids, max_size=4), max_leaves=12)


def _places(v: Any, loc: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    out.append(loc)
    if isinstance(v, dict):
        for k, x in v.items():
            _places(x, (*loc, k), out)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _places(x, (*loc, i), out)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """``base`` with up to 3 values anywhere in it (declared or not) replaced by random JSON."""
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        locs: list[tuple[Any, ...]] = []
        _places(obj, (), locs)
        loc = draw(st.sampled_from(locs))
        value = draw(junk)
        if not loc:
            return value
        obj = put(obj, loc, value)
    return obj


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(pod=mutated(VALID_POD), node=mutated(VALID_NODE), prefix=st.sampled_from(["", "Pod"]))
def test_random_malformed_objects_get_a_field_named_error(pod: Any, node: Any, prefix: str) -> None:
    for check, obj in ((podshape.check_pod, pod), (podshape.check_pod_placement, pod), (podshape.check_node, node)):
        try:
            check(obj, prefix)
        except ShapeError as e:
            if e.path in (prefix, prefix or "(object)"):
                assert not isinstance(obj, dict)
            else:
                assert_names_the_value(e, obj, prefix)


def _placement_paths() -> set[str]:
    out: set[str] = set()

    def walk(s: Leaf | Obj | ListOf | MapOf, path: str) -> None:
        out.add(path)
        if isinstance(s, Obj):
            for k, sub in s.fields.items():
                walk(sub, f"{path}.{k}" if path else k)
        elif isinstance(s, ListOf):
            walk(s.item, path)
    walk(POD_PLACEMENT, "")
    return out


PLACEMENT = _placement_paths()


def _placement_field(path: str) -> bool:
    """Whether the placement subset checks the field at ``path`` (list indexes and map keys dropped)."""
    return re.sub(r"\[[^\]]*\]$", "", re.sub(r"\[\d+\]", "", path)) in PLACEMENT or \
        re.sub(r"\[\d+\]", "", path) in PLACEMENT


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(pod=mutated(VALID_POD))
def test_the_three_components_name_the_same_field(pod: Any) -> None:
    """webhook, extender and kubectl vgpu report a pod through the same checker: the same path."""
    from kubectl_vgpu.cluster import object_problem
    from scheduler.wire import check_extender_args
    from webhook.shape import check_pod as webhook_check

    try:
        webhook_check(pod)
        web = None
    except ShapeError as e:
        web = e
    ext = check_extender_args({"Pod": pod, "NodeNames": ["n"]})
    kubectl = object_problem(pod, "pod")
    if web is None:  # the full check passed: the subsets and kubectl agree (kubectl also needs a name)
        assert ext is None
        assert kubectl is None or kubectl.startswith("metadata")
        return
    if ext is not None and web.path != "request.object" and _placement_field(web.path):
        # the extender checks a subset, in the same order: a field it checks is reported alike
        assert ext == f"Pod.{web}"
    if kubectl is not None and isinstance(pod, dict) and not kubectl.startswith(("metadata must", "metadata.name")):
        assert kubectl == str(web)
