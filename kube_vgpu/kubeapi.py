"""The Kubernetes API layer every component shares (official ``kubernetes`` client; blocking calls
run from threads and never on an event loop, but for :class:`AsyncJSONClient`):

* :func:`load_api_client`: the client from a kubeconfig or the in-cluster ServiceAccount;
* :class:`Reflector`: an informer-style list+watch loop for one resource kind: it lists (recording
  the list's ``resourceVersion``), then watches from there with bookmarks; on ``410 Gone`` (watch
  expired) or any API/connection error it backs off and relists; every ``resync_seconds`` it relists
  anyway (a full replace, so nothing missed can persist). Events go to callbacks (the extender
  marshals them onto its event loop; the device plugin handles them in the thread);
* :class:`ListWatch`: what a Reflector needs from a component's API client (its list and watch);
* :class:`JSONClient`: plain JSON requests on kept-alive ``http.client`` connections built from
  the same kubeconfig or in-cluster configuration (TLS, client certificate, bearer token; a proxy
  configuration goes through the generated client's urllib3 pool), without the generated client's
  typed models and validation: the extender's hot path (its pod reads and the bind);
  :class:`AsyncJSONClient` sends its POSTs from an event loop (the extender's Binding);
* error helpers: :func:`outcome_unknown`, :func:`is_conflict`, :func:`is_not_found`,
  :func:`api_error_text`; and :func:`read_json` / :func:`release` for ``_preload_content=False``
  responses (read to the end, connection handed back to the pool).

Objects are plain API JSON dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import random
import select
import ssl
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import aiohttp.http_exceptions
import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import should_bypass_proxies as _bypass_proxy
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


class _Connection(http.client.HTTPConnection):
    """One kept-alive connection to the API server: TCP (plus TLS when ``context`` is given, with
    ``server_name`` as SNI and the name the certificate must match), the configuration's socket
    options, TCP_NODELAY (http.client's default)."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext | None,
                 server_name: str, socket_options: list[tuple[int, int, Any]]):
        super().__init__(host, port, timeout=timeout)
        self.context = context
        self.server_name = server_name
        self.socket_options = socket_options

    def connect(self) -> None:
        super().connect()  # TCP; raises OSError (TimeoutError for a connect timeout)
        for opt in self.socket_options:
            self.sock.setsockopt(*opt)
        if self.context is not None:
            self.sock = self.context.wrap_socket(self.sock, server_hostname=self.server_name)


def _dropped(sock: Any) -> bool:
    """True when an idle kept-alive socket is readable: the server closed it (FIN, TLS
    close_notify, reset) or sent something unasked; either way it must not carry a request."""
    if sock is None:
        return True
    try:
        poller = select.poll()  # not select(): no limit on the descriptor's number
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


#: errors of a request sent on a reused connection that the server had already closed (nothing
#: of an answer read): a GET is sent again once on a new connection, a write never
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
          ssl.SSLEOFError, ssl.SSLZeroReturnError)


class JSONClient:
    """JSON requests to the API server for an ``ApiClient``'s configuration (blocking; thread-safe).

    It sends over a small pool of kept-alive ``http.client`` connections built from the same
    ``kubernetes.client.Configuration`` the generated client uses: its host (and path prefix), TLS
    settings (``ssl_ca_cert`` / ``ca_cert_data``, client certificate ``cert_file`` / ``key_file``,
    ``verify_ssl``, ``assert_hostname=False``, ``tls_server_name`` as SNI and verified name; the CA and
    certificate files are read again for new connections once they change, as urllib3 does),
    ``socket_options`` / ``keep_alive``, and bearer token (``Configuration.auth_settings()``, which
    refreshes a kubeconfig or in-cluster token, read again every ``token_ttl`` seconds and after a
    401). What it leaves out is the generated
    client's per-call work (argument validation, models, typed decoding) and urllib3's (about 0.6
    ms of CPU per request over TLS against 0.25 ms). Bodies are encoded and answers decoded with
    orjson. When the configuration names a proxy the host does not bypass, or an
    ``assert_hostname`` other than the SNI name, requests go through the generated client's urllib3
    pool instead (same errors).

    Errors are those of the generated client, so :func:`outcome_unknown`, :func:`is_conflict`,
    :func:`is_not_found` and :func:`api_error_text` read them alike: an HTTP status >= 400 raises
    ``ApiException`` (``status``, ``reason``, ``body`` text, ``headers``); a TLS failure raises
    ``ApiException`` with status 0; no answer raises a urllib3 error: ``MaxRetryError`` when no
    connection could be opened (dialled 3 times), ``ReadTimeoutError`` after ``timeout`` seconds
    without an answer, ``ProtocolError`` when the connection broke. Retries: a kept-alive
    connection is checked before use and replaced when the server closed it (the request was
    surely not sent); a GET that finds its reused connection closed under it (no byte of an
    answer read) is sent once more on a new connection; a write is never sent twice.
    """

    def __init__(self, api_client: client.ApiClient, timeout: float = 10.0, token_ttl: float = 1.0):
        """``timeout``: seconds for connecting, and for each wait on the server while sending and
        reading an answer. ``token_ttl``: seconds a bearer token read from the configuration is
        used before it is read again (a 401 answer makes the next request read it at once).
        Raises ValueError for a host that is not an http(s) URL, OSError / ssl.SSLError for
        unreadable CA or client-certificate files."""
        cfg = self.configuration = api_client.configuration
        self.token_ttl = token_ttl
        self._auth: tuple[float, str] = (0.0, "")  # (monotonic time to read it again, value)
        self.base = str(cfg.host).rstrip("/")
        self.pool: urllib3.PoolManager = api_client.rest_client.pool_manager
        self.user_agent = str(api_client.user_agent or "")
        self.timeout = timeout
        self._u3_timeout = urllib3.Timeout(total=timeout)
        url = urlsplit(self.base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"Configuration.host {self.base!r}: expected an http:// or https:// URL")
        self.prefix = url.path.rstrip("/")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        assert_hostname = cfg.assert_hostname
        self.via_urllib3 = bool(cfg.proxy and not _bypass_proxy(self.base, cfg.no_proxy or "")) or \
            isinstance(assert_hostname, str)
        self.context: ssl.SSLContext | None = None
        #: the TLS files' identities (:meth:`_tls_files`) the context was built from
        self._tls_stamp: tuple[object, ...] = ()
        if url.scheme == "https" and not self.via_urllib3:
            self._tls_stamp = self._tls_files()
            self.context = self._build_context()
        self.server_name = str(cfg.tls_server_name or self.host)
        if cfg.socket_options is not None:
            self.socket_options: list[tuple[int, int, Any]] = list(cfg.socket_options)
        elif getattr(cfg, "keep_alive", False):
            from kubernetes.utils.keepalive import tcp_keepalive_socket_options
            self.socket_options = list(tcp_keepalive_socket_options())
        else:
            self.socket_options = []
        self.max_idle = max(1, int(cfg.connection_pool_maxsize or 4))
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self.dials = 0  #: connections opened so far

    def _tls_files(self) -> tuple[object, ...]:
        """(path, mtime in ns, size, inode) of the CA file and the client certificate and key, or
        (path, None) for one that cannot be read: the identity the TLS context was built from."""
        cfg = self.configuration
        out: list[object] = []
        for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file):
            if path:
                try:
                    st = os.stat(path)
                    out.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
                except OSError:
                    out.append((path, None))
        return tuple(out)

    def _build_context(self) -> ssl.SSLContext:
        """The TLS context of the configuration (files read now). Raises OSError / ssl.SSLError for
        unreadable CA or client-certificate files."""
        cfg = self.configuration
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None, cadata=cfg.ca_cert_data or None)
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif cfg.assert_hostname is False:
            ctx.check_hostname = False
        return ctx

    def _dial_context(self) -> ssl.SSLContext | None:
        """The TLS context for a new connection: built again when the CA or client-certificate
        files changed since (a rotated cluster CA or client certificate; urllib3 reads them at every
        new connection too); kept-alive connections keep theirs. Raises ApiException (status 0)
        when the changed files cannot be read (no connection without verification)."""
        if self.context is None:
            return None
        stamp = self._tls_files()
        if stamp == self._tls_stamp:
            return self.context
        try:
            ctx = self._build_context()
        except (OSError, ssl.SSLError) as e:
            raise ApiException(status=0, reason=f"TLS files unreadable: {type(e).__name__}: {e}") from e
        with self._lock:
            self.context, self._tls_stamp = ctx, stamp
        return ctx

    def _token(self) -> str:
        """The ``Authorization`` value ("" for none): ``Configuration.auth_settings()``, asked at
        most every ``token_ttl`` seconds. Its refresh hook (kubeconfig or in-cluster token) re-sets
        the whole configuration, ``host`` included, whose setter reads the proxy environment: about
        0.1 ms per call, which per request would be a fifth of the request's CPU."""
        now = time.monotonic()
        due, value = self._auth
        if now < due:
            return value
        auth = self.configuration.auth_settings().get("BearerToken")
        value = str(auth["value"]) if auth and auth.get("value") else ""
        self._auth = (now + self.token_ttl, value)
        return value

    def _headers(self, content_type: str | None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.user_agent:
            h["User-Agent"] = self.user_agent
        if content_type:
            h["Content-Type"] = content_type
        token = self._token()
        if token:
            h["Authorization"] = token
        return h

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Obj:
        """``method`` ``path`` (absolute API path, query included) with ``body`` (a JSON value, or
        None for no body). Returns the decoded answer ({} when empty). Raises ApiException for HTTP
        >= 400 or a TLS error, a urllib3 error when no answer came (see the class), ValueError when
        the answer is not JSON."""
        data = None if body is None else orjson.dumps(body)
        headers = self._headers(content_type if data is not None else None)
        if self.via_urllib3:
            return self._via_urllib3(method, path, data, headers)
        for attempt in (0, 1):
            conn, reused = self._take(path)
            try:
                conn.request(method, self.prefix + path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except TimeoutError as e:
                conn.close()
                raise urllib3.exceptions.ReadTimeoutError(
                    None, self.base + path, f"Read timed out. (read timeout={self.timeout})") from e  # type: ignore[arg-type]
            except _STALE as e:
                conn.close()
                if method == "GET" and reused and attempt == 0:
                    continue  # the server had closed the kept-alive connection: read again
                raise urllib3.exceptions.ProtocolError("Connection aborted.", e) from e
            except ssl.SSLError as e:
                conn.close()
                raise ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e
            except (http.client.HTTPException, OSError) as e:
                conn.close()
                raise urllib3.exceptions.ProtocolError("Connection aborted.", e) from e
            self._give_back(conn)
            if resp.status >= 400:
                if resp.status == 401:
                    self._auth = (0.0, "")  # the token may have been rotated: read it again next time
                err = ApiException(status=resp.status, reason=resp.reason)
                err.body = raw.decode("utf-8", "replace") if raw else ""
                err.headers = resp.headers
                raise err
            return orjson.loads(raw) if raw else {}
        raise AssertionError("unreachable")  # the second attempt returns or raises

    def _take(self, path: str) -> tuple[_Connection, bool]:
        """An idle kept-alive connection the server has not closed (True), else a new one (False).
        Raises ApiException (status 0) for a TLS handshake failure, urllib3's MaxRetryError when no
        connection could be opened in 3 tries."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not _dropped(conn.sock):
                return conn, True
            conn.close()
        err: Exception | None = None
        context = self._dial_context()
        for _ in range(3):
            conn = _Connection(self.host, self.port, self.timeout, context, self.server_name,
                               self.socket_options)
            try:
                conn.connect()
            except ssl.SSLError as e:  # as the generated client reports it
                conn.close()
                raise ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e
            except TimeoutError:
                conn.close()
                err = urllib3.exceptions.ConnectTimeoutError(
                    None, f"Connection to {self.host} timed out. (connect timeout={self.timeout})")
            except OSError as e:
                conn.close()
                err = urllib3.exceptions.NewConnectionError(
                    None, f"Failed to establish a new connection: {e}")  # type: ignore[arg-type]
            else:
                with self._lock:
                    self.dials += 1
                return conn, False
        raise urllib3.exceptions.MaxRetryError(None, self.base + path, err)  # type: ignore[arg-type]

    def _give_back(self, conn: _Connection) -> None:
        """Keep ``conn`` for the next request (when the server keeps it open and the pool has room)."""
        if conn.sock is not None:
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (those in use close when their request ends)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _via_urllib3(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> Obj:
        """The request through the generated client's urllib3 pool (proxy configurations)."""
        try:
            resp = self.pool.request(method, self.base + path, body=data, headers=headers,
                                     timeout=self._u3_timeout, preload_content=True,
                                     redirect=False)  # followed, a 307 would send a write twice
        except urllib3.exceptions.SSLError as e:  # as the generated client reports it
            raise ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e
        raw = resp.data
        if resp.status >= 400:
            err = ApiException(status=resp.status, reason=resp.reason)
            err.body = raw.decode("utf-8", "replace") if raw else ""
            err.headers = resp.headers
            raise err
        return orjson.loads(raw) if raw else {}


class EventTooLong(urllib3.exceptions.ProtocolError):
    """A watch event longer than :meth:`AsyncJSONClient.lines` reads: the watch cannot go past it
    (a reflector relists: a list has no line limit)."""


#: the longest watch event line :meth:`AsyncJSONClient.lines` reads, in bytes (8 MiB; objects are
#: at most about 1.5 MiB in etcd, and their JSON in a watch event stays well below this)
WATCH_MAX_LINE = 8 << 20


class AsyncJSONClient:
    """:class:`JSONClient`'s requests sent from an event loop (aiohttp's client on its own
    kept-alive connections), for a call on a hot path that would otherwise cost a hop to a worker
    thread and back (about 0.2 ms of CPU: two thread wake-ups and the GIL hand-over): the extender's
    Binding. Same configuration (host and path prefix, TLS context and SNI name, bearer token,
    headers, timeouts for connecting and for each wait on the server) and the same errors as
    :class:`JSONClient`, so :func:`outcome_unknown` and the other helpers read them alike: HTTP >=
    400 raises ``ApiException``; a TLS failure ``ApiException`` with status 0; no connection
    urllib3's ``MaxRetryError``; no answer in time ``ReadTimeoutError``; a broken connection
    ``ProtocolError``. No request is ever sent twice (aiohttp retries only idempotent methods on a
    reused connection the server had closed, and this client refuses every method but POST).
    Not for a configuration :class:`JSONClient` sends through urllib3 (a proxy): ValueError.

    The session belongs to the event loop of the first request (made there, closed by
    :meth:`close`); a request from another loop starts a new one. At most ``max_connections``
    requests are in flight; more wait for a connection, within the connect timeout (then: no
    answer, as above). Watch streams (:meth:`lines`) have a session of their own. The TLS context is the
    synchronous client's, looked up at most once a second (a rotated CA is used from then on)."""

    def __init__(self, sync: JSONClient, context_ttl: float = 1.0, max_connections: int = 64):
        if sync.via_urllib3:
            raise ValueError("a proxy configuration is served by JSONClient through urllib3 only")
        self.sync = sync
        self.context_ttl = context_ttl
        self._tls: tuple[float, ssl.SSLContext | None] = (0.0, None)
        self._sessions: dict[str, aiohttp.ClientSession] = {}  #: requests / watches (:meth:`_session_here`)
        self._loop: asyncio.AbstractEventLoop | None = None
        # connect: waiting for a free connection (at most max_connections in use) and dialling it
        self._timeout = aiohttp.ClientTimeout(total=None, connect=sync.timeout, sock_connect=sync.timeout,
                                              sock_read=sync.timeout)
        self.max_connections = max_connections
        self._server_hostname = sync.server_name if sync.server_name != sync.host else None

    def _session_here(self, watches: bool = False) -> aiohttp.ClientSession:
        """The running loop's session for requests (at most ``max_connections`` in flight) or, with
        ``watches``, for watch streams (each holds its connection while it streams; their own
        session, so that requests filling theirs never hold back a watch's reconnection)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._sessions = {}
            self._loop = loop
        key = "watches" if watches else "requests"
        session = self._sessions.get(key)
        if session is None or session.closed:
            session = self._sessions[key] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0 if watches else self.max_connections, ssl=False),
                timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=True)
        return session

    def _context(self) -> ssl.SSLContext | None:
        now = time.monotonic()
        due, ctx = self._tls
        if now >= due:
            ctx = self.sync._dial_context()  # ApiException (status 0) when the new files are unreadable
            self._tls = (now + self.context_ttl, ctx)
        return ctx

    @contextlib.asynccontextmanager
    async def _errors(self, url: str) -> AsyncIterator[None]:
        """Raise aiohttp's errors (from the request or from reading its answer) as
        :class:`JSONClient` raises them (see the class)."""
        try:
            yield
        except aiohttp.ClientSSLError as e:  # as the generated client reports a TLS failure
            raise ApiException(status=0, reason=f"{type(e).__name__}: {e}") from e
        except aiohttp.ClientConnectorError as e:  # nothing sent: no connection
            raise urllib3.exceptions.MaxRetryError(None, url, urllib3.exceptions.NewConnectionError(  # type: ignore[arg-type]
                None, f"Failed to establish a new connection: {e}")) from e  # type: ignore[arg-type]
        except TimeoutError as e:  # aiohttp's ServerTimeoutError and asyncio's timeout
            raise urllib3.exceptions.ReadTimeoutError(
                None, url, f"Read timed out. (read timeout={self.sync.timeout})") from e  # type: ignore[arg-type]
        except (aiohttp.ClientError, OSError) as e:
            raise urllib3.exceptions.ProtocolError("Connection aborted.", e) from e

    def _refused(self, status: int, reason: str | None, raw: bytes, headers: Any) -> ApiException:
        """The ApiException of an HTTP error answer (a 401 makes the next request read the token)."""
        if status == 401:
            self.sync._auth = (0.0, "")  # the token may have been rotated: read it again next time
        err = ApiException(status=status, reason=reason)
        err.body = raw.decode("utf-8", "replace") if raw else ""
        err.headers = headers
        return err

    async def post(self, path: str, body: Any) -> Obj:
        """POST ``body`` (a JSON value) to ``path`` (absolute API path). Returns the decoded
        answer ({} when empty). Raises as described in the class."""
        sync = self.sync
        data = orjson.dumps(body)
        headers = sync._headers("application/json")
        url = sync.base + path
        ctx = self._context()
        async with self._errors(url), self._session_here().post(
                url, data=data, headers=headers, ssl=ctx if ctx is not None else False,
                server_hostname=self._server_hostname if ctx is not None else None,
                allow_redirects=False) as resp:
            raw = await resp.read()
        if resp.status >= 400:
            raise self._refused(resp.status, resp.reason, raw, resp.headers)
        return orjson.loads(raw) if raw else {}

    async def lines(self, path: str, read_timeout: float, max_line: int = WATCH_MAX_LINE
                    ) -> AsyncGenerator[bytes, None]:
        """GET ``path`` (a watch) and yield its answer line by line as it streams (each line one
        JSON event, its newline kept), until the server ends it. ``read_timeout``: seconds the
        stream may stay silent (the server ends a watch after its ``timeoutSeconds`` and sends a
        bookmark about once a minute); ``max_line``: the longest line read, in bytes (an object up to the
        API server's size limit fits). Raises as described in the class (a line longer than
        ``max_line``: :class:`EventTooLong`, a ``ProtocolError``). Close it (``contextlib.aclosing``) when leaving early."""
        sync = self.sync
        url = sync.base + path
        ctx = self._context()
        timeout = aiohttp.ClientTimeout(total=None, connect=sync.timeout, sock_connect=sync.timeout,
                                        sock_read=read_timeout)
        async with self._errors(url), self._session_here(watches=True).get(
                url, headers=sync._headers(None), ssl=ctx if ctx is not None else False,
                server_hostname=self._server_hostname if ctx is not None else None, allow_redirects=False,
                timeout=timeout, read_bufsize=max_line // 2) as resp:
            if resp.status >= 400:
                raise self._refused(resp.status, resp.reason, await resp.read(), resp.headers)
            try:
                async for line in resp.content:
                    yield line
            except aiohttp.http_exceptions.LineTooLong as e:  # longer than max_line
                raise EventTooLong("watch event too long", e) from e

    async def close(self) -> None:
        """Close the sessions and their connections (on their own event loop; idempotent)."""
        sessions, self._sessions = self._sessions, {}
        if self._loop is asyncio.get_running_loop():
            for session in sessions.values():
                if not session.closed:
                    await session.close()


def read_json(resp: Any) -> Obj:
    """Read the whole body of a ``_preload_content=False`` response, hand its connection back to
    the pool (a response left unread keeps its connection, and the next call dials a new one) and
    decode it. Raises ValueError for a body that is not JSON."""
    try:
        data = resp.data
    finally:
        release(resp)
    return orjson.loads(data) if data else {}


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


@dataclass(eq=False)
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

    api: ListWatch
    kind: str
    on_replace: Callable[[list[Obj], str], None]
    on_event: Callable[[str, Obj], None]
    on_synced: Callable[[], None] | None = None
    label_selector: str | None = None
    resync_seconds: float = 300.0
    field_selector: str | None = None
    watch_timeout: int = 300
    backoff: tuple[float, float] = (0.2, 10.0)
    on_list_start: Callable[[], None] | None = None
    thread_name: str = ""
    resource_version: str = field(default="", init=False)
    relists: int = field(default=0, init=False)
    errors: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.thread_name = self.thread_name or f"reflector-{self.kind}"
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None
        self._delay = self.backoff[0]  #: the wait after the next error
        self._need_list = True  #: relist before the next watch (first, after 410)
        self._first = True  #: no list has completed yet
        self._next_resync = 0.0  #: monotonic time of the next full relist

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

    # -- shared by the thread (:meth:`_run`) and the event loop (:class:`AsyncReflector`) ------
    def _list_due(self) -> bool:
        return self._need_list or time.monotonic() >= self._next_resync

    def _replace(self, items: list[Obj], rv: str) -> None:
        self.resource_version = rv
        self.relists += 1
        self.on_replace(items, rv)

    def _listed(self) -> None:
        """After a (re)list: watch from it until the next resync; the first one syncs."""
        self._need_list = False
        self._next_resync = time.monotonic() + self.resync_seconds
        if self._first and self.on_synced is not None:
            self.on_synced()
        self._first = False

    def _watch_timeout(self, deadline: float) -> int:
        """The watch's ``timeoutSeconds``: up to the deadline (the next resync), at most
        ``watch_timeout``, jittered so that many reflectors do not reconnect at once."""
        timeout = max(1, min(self.watch_timeout, int(deadline - time.monotonic()) + 1))
        return max(1, int(timeout * random.uniform(0.9, 1.0)))

    def _line(self, line: bytes | str) -> None:
        """One line of a watch: an event to ``on_event``; a bookmark moves the resourceVersion
        only. Raises Gone (410) or ApiException for an ERROR event."""
        ev = orjson.loads(line)
        typ = ev.get("type")
        obj = ev.get("object") or {}
        if typ == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message") or "resourceVersion too old")
            raise ApiException(status=obj.get("code") or 500, reason=obj.get("message") or "watch error")
        rv = ObjectView(obj).resource_version
        if rv:
            self.resource_version = str(rv)
        if typ in ("ADDED", "MODIFIED", "DELETED") and not self._stop.is_set():
            self.on_event(typ, obj)

    def _failed(self, e: Exception) -> float:
        """After a list or watch error: seconds to wait before the next attempt (0 after Gone:
        relist at once; otherwise the backoff, doubling up to its most). Counts and logs it."""
        if isinstance(e, Gone):
            log.info("watch expired, relisting", extra={"reason": f"{self.kind}: {e}"})
            self._need_list = True
            return 0.0
        self.errors += 1
        if isinstance(e, EventTooLong):  # the watch cannot get past that event; a list can
            self._need_list = True
        if isinstance(e, ApiException):
            self._need_list = self._need_list or e.status == 410
            log.warning("list/watch failed", extra={"error": api_error_text(e), "reason": self.kind})
        else:  # connection errors
            log.warning("list/watch failed", extra={"error": f"{type(e).__name__}: {e}", "reason": self.kind})
        delay = self._delay
        self._delay = min(self.backoff[1], delay * 2)
        return delay

    # -- the thread ---------------------------------------------------------------------------
    def _relist(self) -> None:
        if self.on_list_start is not None:
            self.on_list_start()
        items, rv = self.api.list_objects(self.kind, self.label_selector, self.field_selector)
        if self._stop.is_set():
            return
        self._replace(items, rv)

    def _watch_once(self, deadline: float) -> None:
        resp = self.api.watch_objects(self.kind, self.resource_version, self._watch_timeout(deadline),
                                     self.label_selector, self.field_selector)
        self._resp = resp
        if self._stop.is_set():  # stop() ran before _resp was set: it woke nothing
            wake_reader(resp)
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return
                if line:
                    self._line(line)
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
        while not self._stop.is_set():
            try:
                if self._list_due():
                    self._relist()
                    if self._stop.is_set():
                        return
                    self._listed()
                self._watch_once(self._next_resync)
                self._delay = self.backoff[0]
            except Exception as e:  # noqa: BLE001 - API and connection errors: back off, keep going
                if self._stop.is_set():
                    return
                self._stop.wait(self._failed(e))


class AsyncListWatch(Protocol):
    """What an :class:`AsyncReflector` needs from a component's API client: the blocking list (run
    in a worker thread) and a watch streamed on the event loop."""

    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[Obj], str]:
        """(items, the list's resourceVersion) of ``kind`` (all namespaces)."""
        ...

    def watch_lines(self, kind: str, resource_version: str, timeout_seconds: int,
                    label_selector: str | None = None, field_selector: str | None = None
                    ) -> AsyncGenerator[bytes, None]:
        """A watch from ``resource_version``, line by line (:meth:`AsyncJSONClient.lines`)."""
        ...


@dataclass(eq=False)
class AsyncReflector(Reflector):
    """:class:`Reflector` on an event loop: the same list, watch, bookmarks, 410 relist, backoff
    and resync, and the same callbacks and counters, but the watch streams on the loop
    (:meth:`AsyncListWatch.watch_lines`) and the callbacks run there, with no thread between the
    stream and the cache (a thread's events each cost a wake-up of the loop and a hand-over of the
    GIL). Only the list runs in a worker thread (lists are rare and large). :meth:`start` runs it
    as a task of the running loop; :meth:`astop` cancels it."""

    api: AsyncListWatch  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name=self.thread_name)

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def astop(self) -> None:
        """Cancel the task and wait for it (an open watch is closed; a list in flight in its
        worker thread ends on its own, its answer dropped)."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            try:
                if self._list_due():
                    if self.on_list_start is not None:
                        self.on_list_start()
                    self._replace(*await loop.run_in_executor(None, self.api.list_objects, self.kind,
                                                              self.label_selector, self.field_selector))
                    self._listed()
                deadline = self._next_resync
                async with contextlib.aclosing(self.api.watch_lines(
                        self.kind, self.resource_version, self._watch_timeout(deadline), self.label_selector,
                        self.field_selector)) as lines:
                    async for line in lines:
                        if line.strip():
                            self._line(line)
                        if time.monotonic() >= deadline:
                            break
                self._delay = self.backoff[0]
            except Exception as e:  # noqa: BLE001 - API and connection errors: back off, keep going
                await asyncio.sleep(self._failed(e))
