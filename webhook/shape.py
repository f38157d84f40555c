"""Shape check of the ``core/v1 Pod`` fields the webhook reads, before any rule looks at them.

The API server decodes a pod into typed structs before admission, so a real request always has the
right shapes; a hand-made or corrupted review may not. The check is the project's one pod shape
check, :func:`kube_vgpu.podshape.check_pod` (:data:`kube_vgpu.podshape.POD`: metadata, spec with
volumes, app, init and ephemeral containers with their resources, volume mounts, env, envFrom and
security context, tolerations, status): the first mismatch is reported with its JSON path, the
value's type and what is allowed, e.g. ``spec.containers[0] must be an object (core/v1 Container),
got a string``. ``null`` stands for an absent optional field, as in the API's own JSON.
"""

from __future__ import annotations

from typing import Any

from kube_vgpu import podshape
from kube_vgpu.errors import ShapeError


def check_pod(pod: Any, root: str = "request.object") -> None:
    """Raise :class:`ShapeError` naming the first field of ``pod`` that has the wrong JSON type.

    root: how the pod itself is named in a message (``request.object`` or ``request.oldObject``);
    fields of the new object are named from the pod (``spec.containers[0]``), fields of the old one
    with the root in front (``request.oldObject.spec.containers[0]``).
    """
    podshape.check_pod(pod, "" if root == "request.object" else root, root)


__all__ = ["ShapeError", "check_pod"]
