"""Shape checks of the extender's request bodies (``k8s.io/kube-scheduler/extender/v1``).

kube-scheduler's Go decoder would refuse a body whose fields have the wrong JSON types; the
extender does the same before touching it, so a malformed or hostile body gets HTTP 400 with an
``Error`` naming the field instead of an exception deep in the handler. The checks are those of
:mod:`kube_vgpu.podshape` (the one shape checker of the webhook, the extender and ``kubectl
vgpu``): of the Pod what placement reads (:data:`~kube_vgpu.podshape.POD_PLACEMENT`), node names,
and of whole nodes only ``metadata.name`` (the one field read).
Unknown fields are ignored, as the Go decoder does.

Each checker returns None when the body is usable, else the error text: the field's path, the
value's type and what is allowed (``Pod.spec.containers[0] must be an object (core/v1 Container),
got a string``).
"""

from __future__ import annotations

from typing import Any

from kube_vgpu import podshape
from kube_vgpu.errors import ShapeError

Obj = dict[str, Any]


def check_pod(pod: Any, field: str = "Pod") -> str | None:
    """A ``core/v1 Pod`` as placement reads it (:data:`kube_vgpu.podshape.POD_PLACEMENT`) named
    ``field``: None, or the error."""
    try:
        podshape.check_pod_placement(pod, field)
    except ShapeError as e:
        return str(e)
    return None


def check_extender_args(args: Any) -> str | None:
    """``ExtenderArgs {Pod, Nodes: NodeList|null, NodeNames: [string]|null}``: None, or the error."""
    try:
        if not isinstance(args, dict):
            raise ShapeError("ExtenderArgs", args, "an object (ExtenderArgs)")
        podshape.check_pod_placement(args.get("Pod"), "Pod")
        names = args.get("NodeNames")
        if names is not None:
            podshape.check_names(names, "NodeNames", "a list of node names")
        nodes = args.get("Nodes")
        if nodes is not None:
            if not isinstance(nodes, dict):
                raise ShapeError("Nodes", nodes, "an object (core/v1 NodeList)")
            items = nodes.get("items")
            if items is not None:
                if not isinstance(items, list):
                    raise ShapeError("Nodes.items", items, "a list of nodes")
                for i, n in enumerate(items):
                    podshape.check_node_name(n, f"Nodes.items[{i}]")
    except ShapeError as e:
        return str(e)
    return None


def check_binding_args(args: Any) -> str | None:
    """``ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}``: strings; PodName and Node
    required. None, or the error."""
    try:
        podshape.check_binding_args(args, "", "ExtenderBindingArgs")
        for k in ("PodName", "Node"):
            if not args.get(k):
                raise ShapeError(k, args.get(k), "a non-empty string (required)")
    except ShapeError as e:
        return str(e)
    return None
