"""The one JSON shape check of the Kubernetes objects kube-vgpu reads (Pod, Node, the extender's
request bodies), before any rule walks them.

The API server decodes objects into typed structs, so what it serves always has the right shapes; a
hand-made admission review, a body posted to the extender's unauthenticated port or a corrupted
snapshot may not. The webhook (``webhook/shape.py``), the extender (``scheduler/wire.py``) and
``kubectl vgpu`` (``kubectl_vgpu/cluster.py``) all check through this module, so a field is checked
the same way everywhere and every refusal reads alike: a
:class:`~kube_vgpu.errors.ShapeError` naming the field's JSON path, the value's type and what is
allowed, e.g. ``spec.containers[0].resources.limits["nvidia.com/gpu"] must be a quantity (string or
number), got a list``. The first mismatch is reported. ``null`` stands for an absent optional field,
as in the API's own JSON; items of a list and values of a map are never optional. Fields not
declared here are not checked (unknown fields are ignored, as the Go decoder does).

The shapes are declared once, as data (:data:`POD`, its placement subset :data:`POD_PLACEMENT`,
:data:`NODE`, :data:`NODE_NAME`, :data:`BINDING_ARGS`), and compiled into plain closures when this module is imported: checking the
capture-shaped pod of ``benchmarks/extender_bench.py`` takes a few microseconds, so the extender
checks every request on its hot path. Pure: no I/O, never mutates its input.

Paths: fields are joined with ``.`` (``spec.containers``), list items as ``[i]``, map keys as
``["key"]`` (JSON-quoted, so control characters are escaped, and clipped to 60 characters). A
``prefix`` names where the object sits (``Pod``: ``Pod.spec.containers[0]``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ShapeError

__all__ = ["ShapeError", "Leaf", "Obj", "ListOf", "MapOf", "STRING", "BOOLEAN", "QUANTITY", "NUMBER",
           "ANY_OBJECT", "METADATA", "CONTAINER", "POD", "POD_PLACEMENT", "NODE", "NODE_NAME", "BINDING_ARGS",
           "compile_shape", "check_pod", "check_pod_placement", "check_node", "check_node_name", "check_binding_args", "check_names",
           "key_path", "join"]

#: longest map key quoted in a path
_QUOTE = 60


@dataclass(frozen=True)
class Leaf:
    """A value checked by its JSON type only. ``types``: accepted Python types; ``allowed``: how a
    message names them; ``no_bool``: refuse booleans even though ``bool`` is an ``int``."""

    types: tuple[type, ...]
    allowed: str
    no_bool: bool = False


@dataclass(frozen=True)
class Obj:
    """A JSON object with these (optional) fields; other fields are not checked."""

    fields: Mapping[str, Leaf | Obj | ListOf | MapOf]
    allowed: str = "an object"


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose items (never null) all have the ``item`` shape."""

    item: Leaf | Obj | ListOf | MapOf
    allowed: str = "a list"


@dataclass(frozen=True)
class MapOf:
    """A JSON object used as a map: any keys, every value (never null) of the ``value`` shape."""

    value: Leaf
    allowed: str = "an object"


STRING = Leaf((str,), "a string")
BOOLEAN = Leaf((bool,), "a boolean")
NUMBER = Leaf((int, float), "a number", no_bool=True)
QUANTITY = Leaf((str, int, float), "a quantity (string or number)", no_bool=True)
ANY_OBJECT = Leaf((dict,), "an object")

#: ``ObjectMeta``: what any component reads of it
METADATA = Obj({
    "name": STRING, "namespace": STRING, "uid": STRING, "generateName": STRING, "resourceVersion": STRING,
    "deletionTimestamp": STRING, "creationTimestamp": STRING,
    "labels": MapOf(STRING), "annotations": MapOf(STRING),
    "ownerReferences": ListOf(ANY_OBJECT),
})

_RESOURCES = Obj({"limits": MapOf(QUANTITY), "requests": MapOf(QUANTITY)})

#: a ``core/v1 Container`` (app, init or ephemeral), as far as the webhook and the request parser read it
CONTAINER = Obj({
    "name": STRING, "restartPolicy": STRING,
    "resources": _RESOURCES,
    "volumeMounts": ListOf(Obj({"mountPath": STRING, "name": STRING, "subPath": STRING})),
    "env": ListOf(Obj({"name": STRING, "value": STRING, "valueFrom": ANY_OBJECT})),
    "envFrom": ListOf(Obj({"prefix": STRING, "configMapRef": ANY_OBJECT, "secretRef": ANY_OBJECT})),
    "securityContext": Obj({"privileged": BOOLEAN, "capabilities": Obj({"add": ListOf(STRING)})}),
}, "an object (core/v1 Container)")

#: a ``core/v1 Pod``: every field the webhook, the extender, the device plugin's pod matching and
#: ``kubectl vgpu`` read
POD = Obj({
    "metadata": METADATA,
    "spec": Obj({
        "schedulerName": STRING, "nodeName": STRING, "runtimeClassName": STRING, "priorityClassName": STRING,
        "hostPID": BOOLEAN, "hostIPC": BOOLEAN, "hostNetwork": BOOLEAN,
        "volumes": ListOf(Obj({"name": STRING, "hostPath": Obj({"path": STRING})})),
        "initContainers": ListOf(CONTAINER), "containers": ListOf(CONTAINER),
        "ephemeralContainers": ListOf(CONTAINER),
        "tolerations": ListOf(Obj({"key": STRING, "operator": STRING, "value": STRING, "effect": STRING})),
    }),
    "status": Obj({"phase": STRING, "conditions": ListOf(ANY_OBJECT)}),
}, "an object (core/v1 Pod)")

#: a ``core/v1 Pod`` as far as placement reads it (metadata, the containers' names, restart policy and
#: resources, scheduler and node name, phase): the extender's check on every request it is posted
#: (a subset of :data:`POD`, so the hot path walks nothing it does not read)
_PLACEMENT_CONTAINER = Obj({"name": STRING, "restartPolicy": STRING, "resources": _RESOURCES},
                           CONTAINER.allowed)
POD_PLACEMENT = Obj({
    "metadata": METADATA,
    "spec": Obj({"schedulerName": STRING, "nodeName": STRING,
                 "initContainers": ListOf(_PLACEMENT_CONTAINER), "containers": ListOf(_PLACEMENT_CONTAINER)}),
    "status": Obj({"phase": STRING}),
}, POD.allowed)

#: a ``core/v1 Node``
NODE = Obj({
    "metadata": METADATA,
    "spec": Obj({"unschedulable": BOOLEAN, "taints": ListOf(Obj({"key": STRING, "value": STRING,
                                                                  "effect": STRING}))}),
    "status": Obj({"conditions": ListOf(ANY_OBJECT), "allocatable": MapOf(QUANTITY),
                   "capacity": MapOf(QUANTITY)}),
}, "an object (core/v1 Node)")

#: a Node of which only the name is read (the extender's ``Nodes.items`` when kube-scheduler sends
#: whole nodes: thousands of them per request, so nothing else is walked)
NODE_NAME = Obj({"metadata": Obj({"name": STRING})}, "an object (core/v1 Node)")

#: ``ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}`` (kube-scheduler extender v1)
BINDING_ARGS = Obj({"PodName": STRING, "PodNamespace": STRING, "PodUID": STRING, "Node": STRING},
                   "an object (ExtenderBindingArgs)")


def join(prefix: str, name: str) -> str:
    """The path of field ``name`` of the object at ``prefix`` (``""``: the object itself)."""
    return f"{prefix}.{name}" if prefix else name


def key_path(prefix: str, key: object) -> str:
    """The path of map key ``key`` of the map at ``prefix``: ``prefix["key"]`` (JSON-quoted, clipped)."""
    text = str(key)
    if len(text) > _QUOTE:
        text = text[:_QUOTE] + "..."
    return f"{prefix}[{json.dumps(text)}]"


class _Emitter:
    """Writes the Python source of one shape's checker: straight-line code (a ``dict.get`` and an
    ``isinstance`` per field, a loop per list or map), so a check costs no call per nested object.
    The path of a field is built only when it is wrong."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.n = 0

    def var(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def const(self, value: Any) -> str:
        name = f"_c{len(self.consts)}"
        self.consts[name] = value
        return name

    @staticmethod
    def rel(parts: list[str]) -> str:
        """The relative path as a Python expression (an f-string of literal parts and ``{i}`` indexes)."""
        text = "".join(parts)
        return "f" + repr(text) if "{" in text else repr(text)

    def type_test(self, var: str, leaf: Leaf) -> str:
        t = self.const(leaf.types if len(leaf.types) > 1 else leaf.types[0])
        bad = f"not isinstance({var}, {t})"
        return f"{bad} or {var}.__class__ is bool" if leaf.no_bool else bad

    def emit(self, shape: Leaf | Obj | ListOf | MapOf, var: str, parts: list[str], ind: int) -> None:
        pad = "    " * ind
        out = self.lines
        where = f"_at(p, name, {self.rel(parts)})"
        if isinstance(shape, Leaf):
            out.append(f"{pad}if {self.type_test(var, shape)}:")
            out.append(f"{pad}    raise _E({where}, {var}, {shape.allowed!r})")
            return
        if isinstance(shape, Obj):
            out.append(f"{pad}if not isinstance({var}, dict):")
            out.append(f"{pad}    raise _E({where}, {var}, {shape.allowed!r})")
            get = self.var("g")
            out.append(f"{pad}{get} = {var}.get")
            for k, sub in shape.fields.items():
                x = self.var("x")
                out.append(f"{pad}{x} = {get}({k!r})")
                out.append(f"{pad}if {x} is not None:")
                self.emit(sub, x, [*parts, f".{k}" if parts else k], ind + 1)
            return
        if isinstance(shape, ListOf):
            out.append(f"{pad}if not isinstance({var}, list):")
            out.append(f"{pad}    raise _E({where}, {var}, {shape.allowed!r})")
            i, x = self.var("i"), self.var("x")
            out.append(f"{pad}for {i}, {x} in enumerate({var}):")
            self.emit(shape.item, x, [*parts, f"[{{{i}}}]"], ind + 1)
            return
        out.append(f"{pad}if not isinstance({var}, dict):")
        out.append(f"{pad}    raise _E({where}, {var}, {shape.allowed!r})")
        k, x = self.var("k"), self.var("x")
        out.append(f"{pad}for {k}, {x} in {var}.items():")
        out.append(f"{pad}    if {self.type_test(x, shape.value)}:")
        out.append(f"{pad}        raise _E(key_path({where}, {k}), {x}, {shape.value.allowed!r})")


def _at(prefix: str, name: str | None, rel: str) -> str:
    """The full path of the field at ``rel`` (``""``: the checked value itself, named ``name``)."""
    if not rel:
        return name or prefix or "(object)"
    return f"{prefix}.{rel}" if prefix else rel


def _compile(shape: Leaf | Obj | ListOf | MapOf) -> Callable[[Any, str, str | None], None]:
    """The checker ``(value, prefix, name) -> None`` of ``shape``: raises ShapeError for the first
    mismatch (``value`` None included)."""
    em = _Emitter()
    em.emit(shape, "v", [], 1)
    src = "def check(v, p, name):\n" + "\n".join(em.lines) + "\n"
    env: dict[str, Any] = {"_E": ShapeError, "_at": _at, "key_path": key_path, **em.consts}
    exec(compile(src, f"<podshape {shape.allowed}>", "exec"), env)  # noqa: S102 - our own declarations only
    fn: Callable[[Any, str, str | None], None] = env["check"]
    return fn


def compile_shape(shape: Leaf | Obj | ListOf | MapOf) -> Callable[..., None]:
    """A checker ``(value, prefix="", name=None) -> None`` of ``shape`` (compile once, call often):
    ``value`` is required (null is refused); ``prefix``: the path of ``value`` in front of its
    fields' paths; ``name``: how ``value`` itself is named when it is wrong (default: ``prefix``,
    else ``(object)``). The checker raises ShapeError naming the first wrong field."""
    fn = _compile(shape)

    def checker(value: Any, prefix: str = "", name: str | None = None) -> None:
        fn(value, prefix, name)
    checker.__doc__ = f"Check {shape.allowed}; raises ShapeError naming the first wrong field."
    return checker


_POD = _compile(POD)
_NODE = _compile(NODE)
_POD_PLACEMENT = _compile(POD_PLACEMENT)
check_node_name = compile_shape(NODE_NAME)
check_binding_args = compile_shape(BINDING_ARGS)


def check_pod(pod: Any, prefix: str = "", name: str | None = None) -> None:
    """Check a ``core/v1 Pod`` (see :data:`POD`). ``prefix`` / ``name``: as for :func:`check`.
    Raises ShapeError naming the first wrong field."""
    _POD(pod, prefix, name)


def check_pod_placement(pod: Any, prefix: str = "", name: str | None = None) -> None:
    """Check the fields of a ``core/v1 Pod`` that placement reads (see :data:`POD_PLACEMENT`): the
    extender's hot path. Raises ShapeError naming the first wrong field."""
    _POD_PLACEMENT(pod, prefix, name)


def check_node(node: Any, prefix: str = "", name: str | None = None) -> None:
    """Check a ``core/v1 Node`` (see :data:`NODE`). Raises ShapeError naming the first wrong field."""
    _NODE(node, prefix, name)


def check_names(names: Any, path: str, allowed: str = "a list of names") -> None:
    """A JSON list of strings (e.g. 5,000 node names: checked at C speed when they all are).
    Raises ShapeError naming the list or its first non-string item."""
    if not isinstance(names, list):
        raise ShapeError(path, names, allowed)
    try:
        "".join(names)  # refuses any non-str item, in C
    except TypeError:
        i, n = next((i, n) for i, n in enumerate(names) if not isinstance(n, str))
        raise ShapeError(f"{path}[{i}]", n, "a string") from None
