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
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from kube_vgpu.streams import wake_reader

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
    """Optional: what the pod watch (:class:`deviceplugin.podwatch.PodWatcher`) needs. A client without
    it leaves the plugin ordering pods by the listings it makes itself."""

    def list_node_pods_rv(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """Like ``list_node_pods``, with the list's ``resourceVersion``."""
        ...

    def watch_node_pods(self, node: str, resource_version: str, timeout_seconds: int) -> PodStream:
        """A watch from ``resource_version``; raises on API errors (410 Gone included)."""
        ...


class PodStream(Protocol):
    """Watch events ``(type, object)`` as API JSON. ``wake()``, from any thread, makes the iteration
    end soon (a reader blocked waiting for the next event returns); ``close()`` is called by the
    thread that iterates (from another thread it would wait for the blocked read)."""

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class _RawPodStream:
    def __init__(self, resp: Any) -> None:
        self._resp = resp

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        from kubernetes.watch.watch import iter_resp_lines

        try:
            for line in iter_resp_lines(self._resp):
                if not line:
                    continue
                ev = json.loads(line)
                yield str(ev.get("type", "")), ev.get("object") or {}
        finally:
            self.close()

    def wake(self) -> None:
        wake_reader(self._resp)  # shutdown(SHUT_RD): the blocked read sees end-of-file

    def close(self) -> None:
        try:
            self._resp.close()
            self._resp.release_conn()
        except Exception:  # noqa: BLE001, S110 - closing a stream that is already gone
            pass


class ApiKubeClient:
    """:class:`KubeClient` over ``kubernetes.client.CoreV1Api``.

    kubeconfig: path, or None for in-cluster config first, then ``~/.kube/config``.
    timeout: per-request timeout in seconds.
    """

    def __init__(self, kubeconfig: str | None = None, timeout: float = 10.0,
                 api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            if kubeconfig:
                config.load_kube_config(config_file=kubeconfig)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
            api_client = client.ApiClient()
        self.core = client.CoreV1Api(api_client)
        self.timeout = timeout

    def list_node_pods(self, node: str) -> list[dict[str, Any]]:
        resp: Any = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}",
                                                     _preload_content=False, _request_timeout=self.timeout)
        items = json.loads(resp.data).get("items") or []
        # a server that ignores the field selector must not leak other nodes' pods into matching
        return [p for p in items if (p.get("spec") or {}).get("nodeName") == node]

    def list_node_pods_rv(self, node: str) -> tuple[list[dict[str, Any]], str]:
        resp: Any = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}",
                                                     _preload_content=False, _request_timeout=self.timeout)
        body = json.loads(resp.data)
        items = [p for p in body.get("items") or () if (p.get("spec") or {}).get("nodeName") == node]
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch_node_pods(self, node: str, resource_version: str, timeout_seconds: int) -> PodStream:
        resp: Any = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", watch=True, resource_version=resource_version,
            allow_watch_bookmarks=True, timeout_seconds=timeout_seconds, _preload_content=False,
            _request_timeout=(self.timeout, timeout_seconds + self.timeout))
        return _RawPodStream(resp)

    def patch_pod_annotations(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        self.core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}},
                                       _content_type=MERGE_PATCH, _request_timeout=self.timeout,
                                       _preload_content=False)

    def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        self.core.patch_node(node, {"metadata": {"annotations": annotations}},
                             _content_type=MERGE_PATCH, _request_timeout=self.timeout,
                             _preload_content=False)
