"""Typed errors raised by the domain rules.

All messages name the offending field, the value and what is allowed, so a webhook or extender can
return them verbatim to a user.
"""

from __future__ import annotations


class VGPUError(ValueError):
    """Base class of every domain error (a ``ValueError``)."""


class QuantityError(VGPUError):
    """A Kubernetes quantity string could not be parsed or is not allowed."""


#: the ``container`` (and, for a value that is no Pod at all, the ``resource``) of a
#: :class:`RequestError` about the pod itself rather than one of its containers
POD_LEVEL = "(pod)"


class RequestError(VGPUError):
    """A container's vGPU request is invalid.

    Attributes:
        container: container name (``"init:<name>"`` is not used; ``kind`` says which list).
        resource: the resource name, e.g. ``nvidia.com/gpumem``.
        value: the raw value as written in the pod spec.
        allowed: a human description of what is allowed.
    """

    def __init__(self, container: str, resource: str, value: object, allowed: str, kind: str = "container"):
        self.container = container
        self.resource = resource
        self.value = value
        self.allowed = allowed
        self.kind = kind
        # a container's quantities passed the API server's validation; a pod-level value (an
        # annotation: free text up to 256 KiB) is quoted cut (see quoted)
        text = quoted(value) if kind in ("pod", "annotation") else repr(value)
        # a pod-level field has no container to name (POD_LEVEL): "pod: <field>=<value> ..."
        who = kind if container == POD_LEVEL else f"{kind} {container!r}"
        field = "" if resource == POD_LEVEL else f"{resource}="
        super().__init__(f"{who}: {field}{text} is invalid; allowed: {allowed}")


#: the most characters of a value an error message quotes
MAX_QUOTED = 120


def quoted(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_QUOTED` characters with the value's full length named.
    A tenant's annotation can hold 256 KiB: quoted whole, one invalid value made the extender's
    answer carry it once per node (250 MB for 1,000 nodes)."""
    text = repr(value)
    if len(text) <= MAX_QUOTED:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters written out"
    return f"{text[:MAX_QUOTED]}... ({size})"


class CodecError(VGPUError):
    """An annotation could not be decoded (wrong version, malformed JSON, missing field)."""


class ConfigError(VGPUError):
    """The config file is invalid. ``key`` is the dotted path of the offending key, or ``(yaml)``
    when the file is not YAML (then the text is the message alone: where and what, on one line)."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(message if key == "(yaml)" else f"config key {key!r}: {message}")


def yaml_problem(err: Exception) -> str:
    """A YAML parse error on one line: ``line L, column C: <problem>`` (PyYAML's own text spans
    several lines and quotes the input around the mark)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or next(iter(str(err).splitlines()), "") or type(err).__name__
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def json_type(value: object) -> str:
    """The JSON type of a decoded value, as error messages name it (``null``, ``a boolean``,
    ``a number``, ``a string``, ``a list``, ``an object``; else the Python type's name)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class ShapeError(VGPUError):
    """A Kubernetes object read through :mod:`kube_vgpu.views` does not have the JSON shape of its
    kind: a field holds the wrong JSON type.

    Attributes:
        path: the field's JSON path in the object, e.g. ``metadata.annotations`` or
            ``spec.containers[0].resources``.
        value: the value found there.
        allowed: what the field may hold, e.g. ``an object``.
    """

    def __init__(self, path: str, value: object, allowed: str):
        self.path = path
        self.value = value
        self.allowed = allowed
        super().__init__(f"{path} must be {allowed}, got {json_type(value)}")
