"""Typed errors raised by the domain rules.

All messages name the offending field, the value and what is allowed, so a webhook or extender can
return them verbatim to a user.
"""

from __future__ import annotations


class VGPUError(ValueError):
    """Base class of every domain error (a ``ValueError``)."""


class QuantityError(VGPUError):
    """A Kubernetes quantity string could not be parsed or is not allowed."""


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
        super().__init__(
            f"{kind} {container!r}: {resource}={value!r} is invalid; allowed: {allowed}"
        )


class CodecError(VGPUError):
    """An annotation could not be decoded (wrong version, malformed JSON, missing field)."""


class ConfigError(VGPUError):
    """The config file is invalid. ``key`` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key {key!r}: {message}")
