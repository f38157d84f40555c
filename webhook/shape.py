"""Shape check of the ``core/v1 Pod`` fields the webhook reads, before any rule looks at them.

The API server decodes a pod into typed structs before admission, so a real request always has the
right shapes; a hand-made or corrupted review may not. Every field the webhook (and the domain
parser) walks is checked here, and the first mismatch is reported with its JSON path, e.g.
``spec.containers[0] must be an object, got a string``. ``null`` stands for an absent optional
field, as in the API's own JSON.

Checked: ``metadata`` (object; ``name``/``namespace``/``generateName``/``uid`` strings;
``labels``/``annotations`` maps of string to string), ``spec`` (object; ``schedulerName``/``nodeName``/
``runtimeClassName`` strings; ``hostPID``/``hostIPC``/``hostNetwork`` booleans; ``volumes`` a list of
objects with a string ``name`` and a ``hostPath`` object with a string ``path``;
``containers``/``initContainers``/``ephemeralContainers`` lists of containers), and per container:
``name``/``restartPolicy`` strings, ``resources`` object whose ``limits``/``requests`` map names to
quantities (string or number), ``volumeMounts`` a list of objects with string ``mountPath``/``name``/
``subPath``, ``env`` a list of objects with a string ``name``, a string ``value`` and an object
``valueFrom``, ``envFrom`` a list of objects with a string ``prefix``, ``securityContext`` an object
with a boolean ``privileged`` and ``capabilities.add`` a list of strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

#: longest value text quoted in a message
_QUOTE = 60


class ShapeError(ValueError):
    """The pod is not a valid ``core/v1 Pod`` shape; the message names the field path."""


def _type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _key(k: str) -> str:
    """A map key in a path: ``labels["app"]`` (quoted, control characters escaped, clipped)."""
    text = k if len(k) <= _QUOTE else k[:_QUOTE] + "..."
    return f"[{json.dumps(text)}]"


def _fail(path: str, want: str, got: Any) -> ShapeError:
    return ShapeError(f"{path} must be {want}, got {_type(got)}; the pod is not a valid core/v1 Pod")


def _obj(v: Any, path: str, optional: bool = True) -> Mapping[str, Any]:
    if v is None and optional:
        return {}
    if not isinstance(v, dict):
        raise _fail(path, "an object", v)
    return v


def _list(v: Any, path: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _fail(path, "a list", v)
    return v


def _str(parent: Mapping[str, Any], key: str, path: str) -> None:
    v = parent.get(key)
    if v is not None and not isinstance(v, str):
        raise _fail(f"{path}.{key}", "a string", v)


def _string_map(v: Any, path: str) -> None:
    for k, val in _obj(v, path).items():
        if not isinstance(val, str):
            raise _fail(f"{path}{_key(k)}", "a string", val)


def _quantities(v: Any, path: str) -> None:
    for k, val in _obj(v, path).items():
        if isinstance(val, bool) or not isinstance(val, str | int | float):
            raise _fail(f"{path}{_key(k)}", "a quantity (string or number)", val)


def _bool(parent: Mapping[str, Any], key: str, path: str) -> None:
    v = parent.get(key)
    if v is not None and not isinstance(v, bool):
        raise _fail(f"{path}.{key}", "a boolean", v)


def _container(c: Any, path: str) -> None:
    c = _obj(c, path, optional=False)
    _str(c, "name", path)
    _str(c, "restartPolicy", path)
    res = _obj(c.get("resources"), f"{path}.resources")
    _quantities(res.get("limits"), f"{path}.resources.limits")
    _quantities(res.get("requests"), f"{path}.resources.requests")
    for i, m in enumerate(_list(c.get("volumeMounts"), f"{path}.volumeMounts")):
        p = f"{path}.volumeMounts[{i}]"
        m = _obj(m, p, optional=False)
        _str(m, "mountPath", p)
        _str(m, "name", p)
        _str(m, "subPath", p)
    for i, e in enumerate(_list(c.get("env"), f"{path}.env")):
        p = f"{path}.env[{i}]"
        e = _obj(e, p, optional=False)
        _str(e, "name", p)
        _str(e, "value", p)
        _obj(e.get("valueFrom"), f"{p}.valueFrom")
    for i, e in enumerate(_list(c.get("envFrom"), f"{path}.envFrom")):
        p = f"{path}.envFrom[{i}]"
        e = _obj(e, p, optional=False)
        _str(e, "prefix", p)
        _obj(e.get("configMapRef"), f"{p}.configMapRef")
        _obj(e.get("secretRef"), f"{p}.secretRef")
    sc = _obj(c.get("securityContext"), f"{path}.securityContext")
    _bool(sc, "privileged", f"{path}.securityContext")
    caps = _obj(sc.get("capabilities"), f"{path}.securityContext.capabilities")
    for i, cap in enumerate(_list(caps.get("add"), f"{path}.securityContext.capabilities.add")):
        if not isinstance(cap, str):
            raise _fail(f"{path}.securityContext.capabilities.add[{i}]", "a string", cap)


def check_pod(pod: Any, root: str = "request.object") -> None:
    """Raise :class:`ShapeError` naming the first field of ``pod`` that has the wrong JSON type.

    root: how the pod itself is named in a message (``request.object`` or ``request.oldObject``);
    fields of the new object are named from the pod (``spec.containers[0]``), fields of the old one
    with the root in front (``request.oldObject.spec.containers[0]``).
    """
    pod = _obj(pod, root, optional=False)
    pre = "" if root == "request.object" else f"{root}."
    meta = _obj(pod.get("metadata"), f"{pre}metadata")
    for k in ("name", "namespace", "generateName", "uid"):
        _str(meta, k, f"{pre}metadata")
    _string_map(meta.get("labels"), f"{pre}metadata.labels")
    _string_map(meta.get("annotations"), f"{pre}metadata.annotations")
    spec = _obj(pod.get("spec"), f"{pre}spec")
    for k in ("schedulerName", "nodeName", "runtimeClassName"):
        _str(spec, k, f"{pre}spec")
    for k in ("hostPID", "hostIPC", "hostNetwork"):
        _bool(spec, k, f"{pre}spec")
    for i, v in enumerate(_list(spec.get("volumes"), f"{pre}spec.volumes")):
        p = f"{pre}spec.volumes[{i}]"
        v = _obj(v, p, optional=False)
        _str(v, "name", p)
        _str(_obj(v.get("hostPath"), f"{p}.hostPath"), "path", f"{p}.hostPath")
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(_list(spec.get(key), f"{pre}spec.{key}")):
            _container(c, f"{pre}spec.{key}[{i}]")


__all__ = ["ShapeError", "check_pod"]
