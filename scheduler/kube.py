"""Kubernetes API access for the extender, with the official ``kubernetes`` client.

Every method here blocks (urllib3); the service calls them from worker threads
(``loop.run_in_executor``), never on the event loop. Objects are returned as plain JSON dicts
(``_preload_content=False``), the same shape the watch delivers.

:class:`Reflector` is an informer-style list+watch loop for one resource kind: it lists (recording
the list's ``resourceVersion``), then watches from there with bookmarks; on ``410 Gone`` (watch
expired) or any API/connection error it backs off and relists; every ``resync_seconds`` it relists
anyway (a full replace, so nothing missed can persist). Events are handed to callbacks that the
caller marshals onto its event loop.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from kube_vgpu.streams import wake_reader

log = logging.getLogger("kube_vgpu.scheduler.kube")

Obj = dict[str, Any]


def load_api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """An ApiClient from ``kubeconfig``, else in-cluster config, else ``~/.kube/config``.

    Raises: kubernetes.config.ConfigException when no configuration is found.
    """
    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = 64  # >= the service's api_workers + the watches: no call dials a new connection
    return client.ApiClient(cfg)


def _json(resp: Any) -> Obj:
    """Read the whole body of a ``_preload_content=False`` response, hand its connection back to
    the pool (a response left unread keeps its connection, and the next call dials a new one) and
    decode it. Raises ValueError for a body that is not JSON."""
    try:
        data = resp.data
    finally:
        _release(resp)
    return json.loads(data) if data else {}


def _release(resp: Any) -> None:
    """Return the connection of a urllib3 response to its pool (idempotent, never raises)."""
    try:
        resp.release_conn()
    except Exception:  # noqa: BLE001 - a connection that broke meanwhile is simply dropped
        pass


def outcome_unknown(e: BaseException) -> bool:
    """True when a failed write may still have been applied by the API server: a 5xx (including
    504 Timeout, which the server may answer after committing), a 429, or no HTTP answer at all
    (timeout, connection reset, TLS error; the client raises those as urllib3 errors or as
    ApiException with status 0). Any other HTTP error is a definite refusal."""
    if isinstance(e, ApiException):
        return not e.status or e.status == 429 or e.status >= 500
    return isinstance(e, Exception)


def is_conflict(e: BaseException) -> bool:
    """True for HTTP 409 Conflict (resourceVersion mismatch)."""
    return isinstance(e, ApiException) and e.status == 409


def is_not_found(e: BaseException) -> bool:
    """True for HTTP 404 Not Found."""
    return isinstance(e, ApiException) and e.status == 404


def api_error_text(e: BaseException) -> str:
    """A short text for an API error: the Status message if the server sent one."""
    if isinstance(e, ApiException):
        try:
            msg = json.loads(e.body or "{}").get("message")
        except (ValueError, AttributeError):
            msg = None
        return f"API {e.status}: {msg or e.reason}"
    return f"{type(e).__name__}: {e}"


class KubeAPI:
    """The API calls the extender makes (blocking). ``timeout``: per-request seconds."""

    def __init__(self, api_client: client.ApiClient, timeout: float = 10.0):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coord = client.CoordinationV1Api(api_client)
        self.timeout = timeout

    # -- pods ---------------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> Obj:
        """GET the pod. Raises ApiException (404 when gone)."""
        return _json(self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                   _request_timeout=self.timeout))

    def patch_pod_metadata(self, namespace: str, name: str, resource_version: str,
                           annotations: dict[str, str], labels: dict[str, str]) -> Obj:
        """Merge-patch annotations and labels, guarded by ``resource_version`` (optimistic
        concurrency: the API server answers 409 Conflict if the pod changed). Returns the pod."""
        body: Obj = {"metadata": {"annotations": annotations, "labels": labels}}
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
        return _json(self.core.patch_namespaced_pod(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False,
            _request_timeout=self.timeout))

    def remove_pod_metadata(self, namespace: str, name: str, resource_version: str,
                            annotations: list[str], labels: list[str]) -> Obj:
        """Merge-patch the given annotation and label keys away (null), guarded by
        ``resource_version`` (409 Conflict if the pod changed since). Returns the pod."""
        body: Obj = {"metadata": {"annotations": dict.fromkeys(annotations),
                                  "labels": dict.fromkeys(labels)}}
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
        return _json(self.core.patch_namespaced_pod(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False,
            _request_timeout=self.timeout))

    def create_binding(self, namespace: str, name: str, uid: str, node: str, resource_version: str = "",
                       annotations: dict[str, str] | None = None) -> None:
        """POST pods/NAME/binding (what kube-scheduler's default binder does), with the pod's uid
        and, when given, its ``resource_version`` as preconditions: the API server answers 409
        Conflict instead of binding a pod that changed since (or a new pod of that name).
        ``annotations`` are the Binding's own: the API server copies them onto the pod in the same
        atomic update that sets ``spec.nodeName`` (so the pod is bound with them, or neither
        happens). The answer (a Status) is read and its connection returned to the pool. Raises
        ApiException or a urllib3 error."""
        meta: Obj = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        if annotations:
            meta["annotations"] = annotations
        body: Any = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                     "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        resp: Any = self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False,
                                                            _request_timeout=self.timeout)
        try:
            resp.data  # noqa: B018 - read the Status to the end, so the connection can be reused
        finally:
            _release(resp)

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
        obj = _json(resp)
        return list(obj.get("items") or []), str((obj.get("metadata") or {}).get("resourceVersion") or "")

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
            return _json(self.coord.read_namespaced_lease(name, namespace, _preload_content=False,
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
            _release(resp.response)
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


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 / Status code 410): relist."""


class Reflector:
    """List + watch one kind in a daemon thread.

    kind: ``nodes`` or ``pods``; on_replace(items, resource_version): called after every (re)list
    with the full set and the list's resourceVersion;
    on_event(type, obj): ADDED/MODIFIED/DELETED; both are called from the reflector thread, so
    the caller marshals them (``loop.call_soon_threadsafe``). on_synced(): after the first list.
    on_list_start(): in the reflector thread, right before each list request is sent (a list
    without resourceVersion is a consistent read: it reflects every write acknowledged before).
    """

    def __init__(self, api: KubeAPI, kind: str, on_replace: Callable[[list[Obj], str], None],
                 on_event: Callable[[str, Obj], None], on_synced: Callable[[], None] | None = None,
                 label_selector: str | None = None, resync_seconds: float = 300.0,
                 field_selector: str | None = None,
                 watch_timeout: int = 300, backoff: tuple[float, float] = (0.2, 10.0),
                 on_list_start: Callable[[], None] | None = None):
        self.api = api
        self.on_list_start = on_list_start
        self.kind = kind
        self.on_replace = on_replace
        self.on_event = on_event
        self.on_synced = on_synced
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.resync_seconds = resync_seconds
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.resource_version = ""
        self.relists = 0
        self.errors = 0
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"reflector-{self.kind}", daemon=True)
            self._thread.start()

    def stop(self, join: float = 5.0) -> None:
        """Stop: wakes the thread blocked reading the open watch (its socket's read side is shut
        down, see :func:`kube_vgpu.streams.wake_reader`; the reflector thread then closes the
        response itself) and joins the thread (up to ``join`` s). After stop() the thread neither
        logs nor calls back (a list in flight ends on its own). Never closes the response from
        this thread: that waits for the reader's buffer lock, i.e. for the next watch event."""
        self._stop.set()
        resp = self._resp
        if resp is not None:
            wake_reader(resp)
        if self._thread is not None:
            self._thread.join(join)

    def _relist(self) -> None:
        if self.on_list_start is not None:
            self.on_list_start()
        items, rv = self.api.list_objects(self.kind, self.label_selector, self.field_selector)
        if self._stop.is_set():
            return
        self.resource_version = rv
        self.relists += 1
        self.on_replace(items, rv)

    def _watch_once(self, deadline: float) -> None:
        timeout = max(1, min(self.watch_timeout, int(deadline - time.monotonic()) + 1))
        timeout = max(1, int(timeout * random.uniform(0.9, 1.0)))
        resp = self.api.watch_objects(self.kind, self.resource_version, timeout, self.label_selector,
                                     self.field_selector)
        self._resp = resp
        if self._stop.is_set():  # stop() ran before _resp was set: it woke nothing
            wake_reader(resp)
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return
                if not line:
                    continue
                ev = json.loads(line)
                typ = ev.get("type")
                obj = ev.get("object") or {}
                if typ == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message") or "resourceVersion too old")
                    raise ApiException(status=obj.get("code") or 500, reason=obj.get("message") or "watch error")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = str(rv)
                if typ == "BOOKMARK":
                    continue
                if typ in ("ADDED", "MODIFIED", "DELETED") and not self._stop.is_set():
                    self.on_event(typ, obj)
                if time.monotonic() >= deadline:
                    return
        finally:
            self._resp = None
            try:
                if self._stop.is_set():
                    resp.close()  # from the reading thread itself: never blocks
                resp.release_conn()
            except Exception:  # noqa: BLE001 - a connection that broke meanwhile is simply dropped
                pass

    def _run(self) -> None:
        delay = self.backoff[0]
        need_list = True
        first = True
        next_resync = 0.0
        while not self._stop.is_set():
            try:
                if need_list or time.monotonic() >= next_resync:
                    self._relist()
                    need_list = False
                    next_resync = time.monotonic() + self.resync_seconds
                    if self._stop.is_set():
                        return
                    if first and self.on_synced is not None:
                        self.on_synced()
                    first = False
                self._watch_once(next_resync)
                delay = self.backoff[0]
            except Gone as e:
                if self._stop.is_set():
                    return
                log.info("watch expired, relisting", extra={"reason": f"{self.kind}: {e}"})
                need_list = True
            except ApiException as e:
                if self._stop.is_set():
                    return
                self.errors += 1
                need_list = need_list or e.status == 410
                log.warning("list/watch failed", extra={"error": api_error_text(e), "reason": self.kind})
                self._stop.wait(delay)
                delay = min(self.backoff[1], delay * 2)
            except Exception as e:  # noqa: BLE001 - connection errors: back off, keep going
                if self._stop.is_set():
                    return
                self.errors += 1
                log.warning("list/watch failed", extra={"error": f"{type(e).__name__}: {e}", "reason": self.kind})
                self._stop.wait(delay)
                delay = min(self.backoff[1], delay * 2)
