"""Shape checks of the extender's request bodies (``k8s.io/kube-scheduler/extender/v1``).

kube-scheduler's Go decoder would refuse a body whose fields have the wrong JSON types; the
extender does the same before touching it, so a malformed or hostile body gets HTTP 400 with an
``Error`` naming the field instead of an exception deep in the handler. Only the fields the
extender reads are checked (unknown fields are ignored, as the Go decoder does).

Each checker returns None when the body is usable, else the error text.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

#: object fields of metadata whose values must be strings (string maps)
_STRING_MAPS = ("annotations", "labels")
_META_STRINGS = ("name", "namespace", "uid", "generateName", "resourceVersion")


def json_type(v: Any) -> str:
    """The JSON type name of a decoded value (null, boolean, number, string, array, object), for errors."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _want(field: str, v: Any, kind: str) -> str:
    return f"{field}: must be {kind}, got {json_type(v)}"


def check_metadata(meta: Any, field: str) -> str | None:
    """``ObjectMeta``: an object; name/namespace/uid strings; annotations/labels string maps."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        return _want(field, meta, "an object")
    for k in _META_STRINGS:
        v = meta.get(k)
        if v is not None and not isinstance(v, str):
            return _want(f"{field}.{k}", v, "a string")
    for k in _STRING_MAPS:
        m = meta.get(k)
        if m is None:
            continue
        if not isinstance(m, dict):
            return _want(f"{field}.{k}", m, "an object of strings")
        for mk, mv in m.items():
            if not isinstance(mv, str):
                return _want(f"{field}.{k}[{mk!r}]", mv, "a string")
    dt = meta.get("deletionTimestamp")
    if dt is not None and not isinstance(dt, str):
        return _want(f"{field}.deletionTimestamp", dt, "a string")
    return None


def _check_containers(cs: Any, field: str) -> str | None:
    if cs is None:
        return None
    if not isinstance(cs, list):
        return _want(field, cs, "an array")
    for i, c in enumerate(cs):
        f = f"{field}[{i}]"
        if not isinstance(c, dict):
            return _want(f, c, "an object")
        name = c.get("name")
        if name is not None and not isinstance(name, str):
            return _want(f"{f}.name", name, "a string")
        res = c.get("resources")
        if res is None:
            continue
        if not isinstance(res, dict):
            return _want(f"{f}.resources", res, "an object")
        for k in ("limits", "requests"):
            m = res.get(k)
            if m is None:
                continue
            if not isinstance(m, dict):
                return _want(f"{f}.resources.{k}", m, "an object")
            for rk, rv in m.items():
                if not isinstance(rv, (str, int, float)) or isinstance(rv, bool):
                    return _want(f"{f}.resources.{k}[{rk!r}]", rv, "a quantity (string or number)")
    return None


def check_pod(pod: Any, field: str = "Pod") -> str | None:
    """A ``core/v1 Pod`` as far as the extender reads it (metadata, spec containers, status)."""
    if pod is None:
        return f"{field}: required (ExtenderArgs without a Pod)"
    if not isinstance(pod, dict):
        return _want(field, pod, "an object (core/v1 Pod)")
    err = check_metadata(pod.get("metadata"), f"{field}.metadata")
    if err:
        return err
    spec = pod.get("spec")
    if spec is not None:
        if not isinstance(spec, dict):
            return _want(f"{field}.spec", spec, "an object")
        for k in ("containers", "initContainers"):
            err = _check_containers(spec.get(k), f"{field}.spec.{k}")
            if err:
                return err
        nn = spec.get("nodeName")
        if nn is not None and not isinstance(nn, str):
            return _want(f"{field}.spec.nodeName", nn, "a string")
    status = pod.get("status")
    if status is not None:
        if not isinstance(status, dict):
            return _want(f"{field}.status", status, "an object")
        ph = status.get("phase")
        if ph is not None and not isinstance(ph, str):
            return _want(f"{field}.status.phase", ph, "a string")
    return None


def check_extender_args(args: Any) -> str | None:
    """``ExtenderArgs {Pod, Nodes: NodeList|null, NodeNames: [string]|null}``."""
    if not isinstance(args, dict):
        return _want("ExtenderArgs", args, "an object")
    err = check_pod(args.get("Pod"))
    if err:
        return err
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list):
            return _want("NodeNames", names, "an array of node names")
        try:  # C-speed type check (the list can hold 5,000 names): join refuses a non-str
            "".join(names)
        except TypeError:
            i, n = next((i, n) for i, n in enumerate(names) if not isinstance(n, str))
            return _want(f"NodeNames[{i}]", n, "a string")
    nodes = args.get("Nodes")
    if nodes is not None:
        if not isinstance(nodes, dict):
            return _want("Nodes", nodes, "an object (core/v1 NodeList)")
        items = nodes.get("items")
        if items is not None:
            if not isinstance(items, list):
                return _want("Nodes.items", items, "an array of nodes")
            for i, n in enumerate(items):  # only what the extender reads: metadata.name
                if not isinstance(n, dict):
                    return _want(f"Nodes.items[{i}]", n, "an object (core/v1 Node)")
                m = n.get("metadata")
                if m is None:
                    continue
                if not isinstance(m, dict):
                    return _want(f"Nodes.items[{i}].metadata", m, "an object")
                name = m.get("name")
                if name is not None and not isinstance(name, str):
                    return _want(f"Nodes.items[{i}].metadata.name", name, "a string")
    return None


def check_binding_args(args: Any) -> str | None:
    """``ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}``: strings; PodName and Node
    required."""
    if not isinstance(args, dict):
        return _want("ExtenderBindingArgs", args, "an object")
    for k in ("PodName", "PodNamespace", "PodUID", "Node"):
        v = args.get(k)
        if v is not None and not isinstance(v, str):
            return _want(k, v, "a string")
    for k in ("PodName", "Node"):
        if not args.get(k):
            return f"{k}: required (ExtenderBindingArgs without a {k})"
    return None
