"""The few Kubernetes API calls the device plugin makes (official ``kubernetes`` client).

* list the pods bound to this node: ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>``;
* merge-patch pod annotations (``application/merge-patch+json``; a None value deletes the key);
* merge-patch node annotations (the inventory);
* watch the pods bound to this node (``?watch=true&fieldSelector=spec.nodeName=<node>``): the order
  pods appear in is the order kubelet sees them (see :mod:`deviceplugin.podwatch`).

Objects are returned as plain API JSON (``dict``), which is what :mod:`deviceplugin.podmatch` reads.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from kube_vgpu.kubeapi import load_api_client, read_json
from kube_vgpu.views import ListView, PodView

MERGE_PATCH = "application/merge-patch+json"


class KubeClient(Protocol):
    """What the device plugin needs from the API server. Methods raise on API errors."""

    def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        """All pods whose ``spec.nodeName`` is ``node`` (API JSON)."""
        ...

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge-patch ``metadata.annotations`` of a pod."""
        ...

    def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        """Merge-patch ``metadata.annotations`` of a node."""
        ...


@runtime_checkable
class PodWatchClient(Protocol):
    """Optional: what the pod watch (:class:`deviceplugin.podwatch.PodWatcher`, a
    :class:`kube_vgpu.kubeapi.Reflector`) needs: the shared :class:`kube_vgpu.kubeapi.ListWatch`. A
    client without it leaves the plugin ordering pods by the listings it makes itself."""

    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]: ...

    def watch_objects(self, kind: str, resource_version: str, timeout_seconds: int,
                      label_selector: str | None = None, field_selector: str | None = None) -> Any: ...


class ApiKubeClient:
    """:class:`KubeClient` over ``kubernetes.client.CoreV1Api``.

    kubeconfig: path, or None for in-cluster config first, then ``~/.kube/config``.
    timeout: per-request timeout in seconds.
    """

    def __init__(self, kubeconfig: str | None = None, timeout: float = 10.0,
                 api_client: Any = None) -> None:
        from kubernetes import client

        if api_client is None:
            api_client = load_api_client(kubeconfig)
        self.core = client.CoreV1Api(api_client)
        self.timeout = timeout

    def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        resp: Any = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}",
                                                     _preload_content=False, _request_timeout=self.timeout)
        items = ListView(json.loads(resp.data)).items
        # a server that ignores the field selector must not leak other nodes' pods into matching
        return [p for p in items if PodView(p).node_name == node]

    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
        """Pods only (the pod watch's list): (items, the list's resourceVersion)."""
        if kind != "pods":
            raise ValueError(f"the device plugin lists only pods, not {kind!r}")
        resp: Any = self.core.list_pod_for_all_namespaces(field_selector=field_selector, label_selector=label_selector,
                                                     _preload_content=False, _request_timeout=self.timeout)
        body = ListView(read_json(resp))
        return list(body.items), body.resource_version

    def watch_objects(self, kind: str, resource_version: str, timeout_seconds: int,
                      label_selector: str | None = None, field_selector: str | None = None) -> Any:
        """Pods only: a watch from ``resource_version`` (raw streaming response, bookmarks on)."""
        if kind != "pods":
            raise ValueError(f"the device plugin watches only pods, not {kind!r}")
        return self.core.list_pod_for_all_namespaces(
            field_selector=field_selector, label_selector=label_selector, watch=True,
            resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=timeout_seconds,
            _preload_content=False, _request_timeout=(self.timeout, timeout_seconds + self.timeout))

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}},
                                       _content_type=MERGE_PATCH, _request_timeout=self.timeout,
                                       _preload_content=False)

    def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        self.core.patch_node(node, {"metadata": {"annotations": annotations}},
                             _content_type=MERGE_PATCH, _request_timeout=self.timeout,
                             _preload_content=False)
