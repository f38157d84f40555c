"""The Kubernetes API layer every component shares (official ``kubernetes`` client; blocking calls,
run from threads, never on an event loop):

* :func:`load_api_client`: the client from a kubeconfig or the in-cluster ServiceAccount;
* :class:`Reflector`: an informer-style list+watch loop for one resource kind: it lists (recording
  the list's ``resourceVersion``), then watches from there with bookmarks; on ``410 Gone`` (watch
  expired) or any API/connection error it backs off and relists; every ``resync_seconds`` it relists
  anyway (a full replace, so nothing missed can persist). Events go to callbacks (the extender
  marshals them onto its event loop; the device plugin handles them in the thread);
* :class:`ListWatch`: what a Reflector needs from a component's API client (its list and watch);
* :class:`JSONClient`: plain JSON requests over the same client's kept-alive connections (same
  kubeconfig or in-cluster configuration, TLS, proxy and bearer token), without the generated
  client's typed models and validation: the extender's hot path (its pod reads and the bind);
* error helpers: :func:`outcome_unknown`, :func:`is_conflict`, :func:`is_not_found`,
  :func:`api_error_text`; and :func:`read_json` / :func:`release` for ``_preload_content=False``
  responses (read to the end, connection handed back to the pool).

Objects are plain API JSON dicts.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .streams import wake_reader
from .views import ObjectView

log = logging.getLogger("kube_vgpu.kubeapi")

Obj = dict[str, Any]


def load_api_client(kubeconfig: str | None = None, *, context: str | None = None, in_cluster_first: bool = True,
                    pool_maxsize: int | None = None) -> client.ApiClient:
    """An ApiClient from ``kubeconfig`` (and ``context``) when given; else the in-cluster
    ServiceAccount, then ``~/.kube/config`` (``in_cluster_first``, the components' order), or the
    other way round (a command-line tool's order). ``pool_maxsize``: connections kept per host (at
    least the caller's concurrent calls, so none dials a new connection).

    Raises: kubernetes.config.ConfigException when no configuration is found.
    """
    cfg = client.Configuration()

    def from_file() -> None:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)

    if kubeconfig or context:
        from_file()
    elif in_cluster_first:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            from_file()
    else:
        try:
            from_file()
        except config.ConfigException:
            config.load_incluster_config(client_configuration=cfg)
    if pool_maxsize is not None:
        cfg.connection_pool_maxsize = pool_maxsize
    return client.ApiClient(cfg)


class JSONClient:
    """JSON requests to the API server on the connections of an ``ApiClient`` (blocking; thread-safe).

    It sends through ``api_client.rest_client.pool_manager``, the urllib3 pool the generated client
    itself uses: the same host, TLS settings (CA, client certificate, ``verify_ssl``,
    ``tls_server_name``), proxy and kept-alive connections, and the same bearer token
    (``Configuration.auth_settings()``, which refreshes an in-cluster token). What it leaves out is
    the generated client's per-call work: argument validation, model serialisation and the typed
    decoding of answers. Bodies are encoded and answers decoded with orjson.

    Errors are those of the generated client, so :func:`outcome_unknown`, :func:`is_conflict`,
    :func:`is_not_found` and :func:`api_error_text` read them alike: an HTTP status >= 400 raises
    ``ApiException`` (``status``, ``reason``, ``body`` text, ``headers``); a TLS failure raises
    ``ApiException`` with status 0; no answer at all (timeout, connection reset or refused) raises
    the urllib3 error. Retries are the pool's defaults, as for the generated client: a connection
    that could not be opened is dialled again, a request that was sent is never sent twice.
    """

    def __init__(self, api_client: client.ApiClient, timeout: float = 10.0):
        """``timeout``: total seconds per request (connect, send and read)."""
        self.configuration = api_client.configuration
        self.base = str(self.configuration.host).rstrip("/")
        self.pool: urllib3.PoolManager = api_client.rest_client.pool_manager
        self.user_agent = str(api_client.user_agent or "")
        self.timeout = urllib3.Timeout(total=timeout)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.user_agent:
            h["User-Agent"] = self.user_agent
        if content_type:
            h["Content-Type"] = content_type
        auth = self.configuration.auth_settings().get("BearerToken")
        if auth and auth.get("value"):
            h["Authorization"] = str(auth["value"])
        return h

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Obj:
        """``method`` ``path`` (absolute API path, query included) with ``body`` (a JSON value, or
        None for no body). Returns the decoded answer ({} when empty). Raises ApiException for HTTP
        >= 400 or a TLS error, a urllib3 error when no answer came, ValueError when the answer is not
        JSON."""
        data = None if body is None else orjson.dumps(body)
        try:
            resp = self.pool.request(method, self.base + path, body=data,
                                     headers=self._headers(content_type if data is not None else None),
                                     timeout=self.timeout, preload_content=True)
        except urllib3.exceptions.SSLError as e:  # as the generated client reports it
            raise ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e
        raw = resp.data
        if resp.status >= 400:
            err = ApiException(status=resp.status, reason=resp.reason)
            err.body = raw.decode("utf-8", "replace") if raw else ""
            err.headers = resp.headers
            raise err
        return orjson.loads(raw) if raw else {}


def read_json(resp: Any) -> Obj:
    """Read the whole body of a ``_preload_content=False`` response, hand its connection back to
    the pool (a response left unread keeps its connection, and the next call dials a new one) and
    decode it. Raises ValueError for a body that is not JSON."""
    try:
        data = resp.data
    finally:
        release(resp)
    return json.loads(data) if data else {}


def release(resp: Any) -> None:
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


class ListWatch(Protocol):
    """What a :class:`Reflector` needs from a component's API client."""

    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[Obj], str]:
        """(items, the list's resourceVersion) of ``kind`` (all namespaces)."""
        ...

    def watch_objects(self, kind: str, resource_version: str, timeout_seconds: int,
                      label_selector: str | None = None, field_selector: str | None = None) -> Any:
        """A watch from ``resource_version``: the raw streaming response (``iter_resp_lines``)."""
        ...


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410 / Status code 410): relist."""


class Reflector:
    """List + watch one kind in a daemon thread.

    kind: ``nodes``, ``pods`` or ``resourcequotas``; on_replace(items, resource_version): called after every (re)list
    with the full set and the list's resourceVersion;
    on_event(type, obj): ADDED/MODIFIED/DELETED; both are called from the reflector thread, so
    the caller marshals them (``loop.call_soon_threadsafe``). on_synced(): after the first list.
    on_list_start(): in the reflector thread, right before each list request is sent (a list
    without resourceVersion is a consistent read: it reflects every write acknowledged before).
    backoff: (first, most) seconds between attempts after errors; thread_name: default
    ``reflector-<kind>``.
    """

    def __init__(self, api: ListWatch, kind: str, on_replace: Callable[[list[Obj], str], None],
                 on_event: Callable[[str, Obj], None], on_synced: Callable[[], None] | None = None,
                 label_selector: str | None = None, resync_seconds: float = 300.0,
                 field_selector: str | None = None,
                 watch_timeout: int = 300, backoff: tuple[float, float] = (0.2, 10.0),
                 on_list_start: Callable[[], None] | None = None, thread_name: str | None = None):
        self.api = api
        self.thread_name = thread_name or f"reflector-{kind}"
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
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def alive(self) -> bool:
        """The thread is running."""
        return self._thread is not None and self._thread.is_alive()

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
                rv = ObjectView(obj).resource_version
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
