"""Kubernetes API access for the extender, with the official ``kubernetes`` client.

Every method here blocks, but for the ``async`` ones; the service calls the blocking ones from
worker threads (``loop.run_in_executor``), never on the event loop. Objects are returned as plain JSON dicts
(``_preload_content=False``), the same shape the watch delivers.

The calls on the bind's path (read a pod, patch its metadata, POST its Binding) go through
:class:`~kube_vgpu.kubeapi.JSONClient`: plain JSON on kept-alive ``http.client`` connections built
from the same configuration, without the generated client's validation and models or urllib3 (the
same requests, errors and timeouts; a pod read over TLS costs about 0.25 ms of CPU instead of 0.6
ms); the bind's Binding goes from the event loop through its asynchronous twin
(:class:`~kube_vgpu.kubeapi.AsyncJSONClient`), which spares the bind a hop to a worker thread.
Lists, watches and leases use the generated client.

The client factory, the list+watch loop (:class:`~kube_vgpu.kubeapi.Reflector`) and the error
helpers are the shared ones of :mod:`kube_vgpu.kubeapi`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kube_vgpu.kubeapi import AsyncJSONClient, JSONClient, read_json, release
from kube_vgpu.kubeapi import load_api_client as _load
from kube_vgpu.views import ListView

log = logging.getLogger("kube_vgpu.scheduler.kube")

Obj = dict[str, Any]


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """The extender's ApiClient (:func:`kube_vgpu.kubeapi.load_api_client`, in-cluster first), with
    enough pooled connections for its API workers and watches that no call dials a new one."""
    return _load(kubeconfig, pool_maxsize=64)


def _pod_path(namespace: str, name: str, sub: str = "") -> str:
    """``/api/v1/namespaces/NS/pods/NAME[/sub]`` with both names percent-encoded (they may come from
    an unauthenticated /bind body: a ``/`` or ``..`` in them never changes the path)."""
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}{sub}"


#: the API path of each kind the extender lists and watches (all namespaces)
_COLLECTIONS = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods", "resourcequotas": "/api/v1/resourcequotas"}


def _binding(namespace: str, name: str, uid: str, node: str, resource_version: str,
             annotations: dict[str, str] | None) -> Obj:
    """The Binding object of :meth:`KubeAPI.create_binding`."""
    meta: Obj = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    if resource_version:
        meta["resourceVersion"] = resource_version
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def _applied(answer: Obj) -> None:
    """Check the answer to a Binding that was not an HTTP error: the API server answers one it
    applied with a Status of status ``Success``. Anything else (a redirect's empty body, a page of
    something in between) tells nothing of whether it was applied: raises ValueError, as for an
    answer that is not JSON (:func:`~kube_vgpu.kubeapi.outcome_unknown`: the bind reads the pod back)."""
    if not isinstance(answer, dict) or answer.get("status") != "Success":
        raise ValueError(f"the answer to the Binding is not the API server's Success Status: {str(answer)[:200]!r}")


class KubeAPI:
    """The API calls the extender makes (blocking). ``timeout``: per-request seconds.
    ``generated_client``: send the bind's calls through the generated ``CoreV1Api`` instead of
    :class:`~kube_vgpu.kubeapi.JSONClient` (same requests and errors; kept to compare the two in
    ``benchmarks/extender_bench.py --api``)."""

    def __init__(self, api_client: client.ApiClient, timeout: float = 10.0, generated_client: bool = False):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coord = client.CoordinationV1Api(api_client)
        self.timeout = timeout
        self.http: JSONClient | None = None if generated_client else JSONClient(api_client, timeout)
        #: the Binding's client on the event loop (None: a proxy configuration, or the generated
        #: client; then the bind sends it from a worker thread with :meth:`create_binding`)
        self.aio: AsyncJSONClient | None = \
            AsyncJSONClient(self.http) if self.http is not None and not self.http.via_urllib3 else None

    # -- pods ---------------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> Obj:
        """GET the pod. Raises ApiException (404 when gone), a urllib3 error without an answer."""
        if self.http is not None:
            return self.http.request("GET", _pod_path(namespace, name))
        return read_json(self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                   _request_timeout=self.timeout))

    def _merge_patch(self, namespace: str, name: str, body: Obj) -> Obj:
        if self.http is not None:
            return self.http.request("PATCH", _pod_path(namespace, name), body, "application/merge-patch+json")
        return read_json(self.core.patch_namespaced_pod(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False,
            _request_timeout=self.timeout))

    def patch_pod_metadata(self, namespace: str, name: str, resource_version: str,
                           annotations: dict[str, str], labels: dict[str, str]) -> Obj:
        """Merge-patch annotations and labels, guarded by ``resource_version`` (optimistic
        concurrency: the API server answers 409 Conflict if the pod changed). Returns the pod."""
        body: Obj = {"metadata": {"annotations": annotations, "labels": labels}}
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
        return self._merge_patch(namespace, name, body)

    def remove_pod_metadata(self, namespace: str, name: str, resource_version: str,
                            annotations: list[str], labels: list[str]) -> Obj:
        """Merge-patch the given annotation and label keys away (null), guarded by
        ``resource_version`` (409 Conflict if the pod changed since). Returns the pod."""
        body: Obj = {"metadata": {"annotations": dict.fromkeys(annotations),
                                  "labels": dict.fromkeys(labels)}}
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
        return self._merge_patch(namespace, name, body)

    def create_binding(self, namespace: str, name: str, uid: str, node: str, resource_version: str = "",
                       annotations: dict[str, str] | None = None) -> None:
        """POST pods/NAME/binding (what kube-scheduler's default binder does), with the pod's uid
        and, when given, its ``resource_version`` as preconditions: the API server answers 409
        Conflict instead of binding a pod that changed since (or a new pod of that name).
        ``annotations`` are the Binding's own: the API server copies them onto the pod in the same
        atomic update that sets ``spec.nodeName`` (so the pod is bound with them, or neither
        happens). The answer (a Status) is read and its connection returned to the pool. Raises
        ApiException (HTTP >= 400; status 0: TLS error) or a urllib3 error (no answer: the outcome
        is unknown)."""
        body: Any = _binding(namespace, name, uid, node, resource_version, annotations)
        if self.http is not None:
            _applied(self.http.request("POST", _pod_path(namespace, name, "/binding"), body))
            return
        resp: Any = self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False,
                                                            _request_timeout=self.timeout)
        try:
            resp.data  # noqa: B018 - read the Status to the end, so the connection can be reused
        finally:
            release(resp)

    async def create_binding_async(self, namespace: str, name: str, uid: str, node: str, resource_version: str = "",
                                   annotations: dict[str, str] | None = None) -> None:
        """:meth:`create_binding` sent from the event loop (:attr:`aio`; the caller checks it is
        there): the same request, answers and errors."""
        assert self.aio is not None
        _applied(await self.aio.post(_pod_path(namespace, name, "/binding"),
                                     _binding(namespace, name, uid, node, resource_version, annotations)))

    async def aclose(self) -> None:
        """Close the event loop's connections (:attr:`aio`), on that loop."""
        if self.aio is not None:
            await self.aio.close()

    # -- list / watch -------------------------------------------------------------------------
    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[Obj], str]:
        """List ``nodes``, ``pods`` or ``resourcequotas`` (all namespaces): (items, list resourceVersion)."""
        kw: dict[str, Any] = {"_preload_content": False, "_request_timeout": 120}
        if label_selector:
            kw["label_selector"] = label_selector
        if field_selector:
            kw["field_selector"] = field_selector
        resp: Any = self._lister(kind)(**kw)
        body = ListView(read_json(resp))
        return list(body.items), body.resource_version

    def watch_objects(self, kind: str, resource_version: str, timeout_seconds: int,
                      label_selector: str | None = None, field_selector: str | None = None) -> Any:
        """Start a watch; returns the raw streaming response (iterate with iter_resp_lines)."""
        kw: dict[str, Any] = {"watch": True, "resource_version": resource_version, "allow_watch_bookmarks": True,
                              "timeout_seconds": timeout_seconds, "_preload_content": False,
                              "_request_timeout": (10, timeout_seconds + 30)}
        if label_selector:
            kw["label_selector"] = label_selector
        if field_selector:
            kw["field_selector"] = field_selector
        return self._lister(kind)(**kw)

    def watch_lines(self, kind: str, resource_version: str, timeout_seconds: int,
                    label_selector: str | None = None, field_selector: str | None = None
                    ) -> AsyncGenerator[bytes, None]:
        """:meth:`watch_objects` streamed on the event loop (:attr:`aio`; the caller checks it is
        there): the same request, its answer line by line (one JSON event each)."""
        assert self.aio is not None
        query: dict[str, str] = {"watch": "true", "allowWatchBookmarks": "true",
                                 "resourceVersion": resource_version, "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            query["labelSelector"] = label_selector
        if field_selector:
            query["fieldSelector"] = field_selector
        return self.aio.lines(f"{_COLLECTIONS[kind]}?{urlencode(query)}", read_timeout=timeout_seconds + 30)

    def _lister(self, kind: str) -> Callable[..., Any]:
        if kind == "nodes":
            return self.core.list_node
        if kind == "resourcequotas":
            return self.core.list_resource_quota_for_all_namespaces
        return self.core.list_pod_for_all_namespaces

    # -- leases -------------------------------------------------------------------------------
    def get_lease(self, namespace: str, name: str) -> Obj | None:
        """The Lease as a dict, or None when it does not exist."""
        try:
            return read_json(self.coord.read_namespaced_lease(name, namespace, _preload_content=False,
                                                          _request_timeout=self.timeout))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _raw_call(self, method: str, path: str, params: dict[str, str], body: Obj) -> Obj:
        """A JSON request through the client's ApiClient (auth, TLS, timeouts) without the typed
        models. Raises ApiException for HTTP >= 400."""
        ac = self.api_client
        resp = ac.call_api(*ac.param_serialize(
            method=method, resource_path=path, path_params=params, body=body,
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            auth_settings=["BearerToken"]), _request_timeout=self.timeout)
        try:
            data = resp.read()
        finally:
            release(resp.response)
        if resp.status >= 400:
            e = ApiException(status=resp.status, reason=resp.reason)
            e.body = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
            raise e
        return json.loads(data) if data else {}

    def create_lease(self, namespace: str, body: Obj) -> Obj:
        """POST a Lease (JSON dict). Raises ApiException (409 if it exists)."""
        return self._raw_call("POST", "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
                              {"namespace": namespace}, body)

    def replace_lease(self, namespace: str, name: str, body: Obj) -> Obj:
        """PUT a Lease (carrying its resourceVersion: 409 Conflict if someone else wrote it)."""
        return self._raw_call("PUT", "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
                              {"namespace": namespace, "name": name}, body)
