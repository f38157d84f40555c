"""Shape check of the ``core/v1 Pod`` fields the webhook reads, before any rule looks at them.

The API server decodes a pod into typed structs before admission, so a real request always has the
right shapes; a hand-made or corrupted review may not. Every field the webhook (and the domain
parser) walks is checked here, and the first mismatch is reported with its JSON path, e.g.
``spec.containers[0] must be an object, got a string``. ``null`` stands for an absent optional
field, as in the API's own JSON.

Checked: ``metadata`` (object; ``name``/``namespace``/``generateName``/``uid`` strings;
``labels``/``annotations`` maps of string to string), ``spec`` (object; ``schedulerName``/``nodeName``
strings; ``volumes`` a list of objects with a string ``name``; ``containers``/``initContainers``
lists of containers), and per container: ``name`` string, ``resources`` object whose
``limits``/``requests`` map names to quantities (string or number), ``volumeMounts`` a list of
objects with a string ``mountPath``, ``env`` a list of objects with a string ``name``, a string
``value`` and an object ``valueFrom``, ``securityContext`` an object with a boolean ``privileged``.
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


def _container(c: Any, path: str) -> None:
    c = _obj(c, path, optional=False)
    _str(c, "name", path)
    res = _obj(c.get("resources"), f"{path}.resources")
    _quantities(res.get("limits"), f"{path}.resources.limits")
    _quantities(res.get("requests"), f"{path}.resources.requests")
    for i, m in enumerate(_list(c.get("volumeMounts"), f"{path}.volumeMounts")):
        p = f"{path}.volumeMounts[{i}]"
        m = _obj(m, p, optional=False)
        _str(m, "mountPath", p)
        _str(m, "name", p)
    for i, e in enumerate(_list(c.get("env"), f"{path}.env")):
        p = f"{path}.env[{i}]"
        e = _obj(e, p, optional=False)
        _str(e, "name", p)
        _str(e, "value", p)
        _obj(e.get("valueFrom"), f"{p}.valueFrom")
    sc = _obj(c.get("securityContext"), f"{path}.securityContext")
    priv = sc.get("privileged")
    if priv is not None and not isinstance(priv, bool):
        raise _fail(f"{path}.securityContext.privileged", "a boolean", priv)


def check_pod(pod: Any) -> None:
    """Raise :class:`ShapeError` naming the first field of ``pod`` that has the wrong JSON type."""
    pod = _obj(pod, "request.object", optional=False)
    meta = _obj(pod.get("metadata"), "metadata")
    for k in ("name", "namespace", "generateName", "uid"):
        _str(meta, k, "metadata")
    _string_map(meta.get("labels"), "metadata.labels")
    _string_map(meta.get("annotations"), "metadata.annotations")
    spec = _obj(pod.get("spec"), "spec")
    _str(spec, "schedulerName", "spec")
    _str(spec, "nodeName", "spec")
    for i, v in enumerate(_list(spec.get("volumes"), "spec.volumes")):
        v = _obj(v, f"spec.volumes[{i}]", optional=False)
        _str(v, "name", f"spec.volumes[{i}]")
    for key in ("initContainers", "containers"):
        for i, c in enumerate(_list(spec.get(key), f"spec.{key}")):
            _container(c, f"spec.{key}[{i}]")


__all__ = ["ShapeError", "check_pod"]
