"""An in-process fake of the Kubernetes REST API, served over real HTTP(S) by aiohttp.

See README.md next to this file for usage. In short::

    with FakeKubeAPI() as api:
        v1 = kubernetes.client.CoreV1Api(api.api_client())
        v1.create_node({"metadata": {"name": "n1"}})
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import ipaddress
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web

from .matching import SelectorError, parse_field_selector, parse_label_selector
from .store import DEFAULT_RESOURCES, JSON, ApiError, ResourceType, Store, Watcher, field_getter

__all__ = ["FakeKubeAPI", "ApiError", "RequestInfo", "ResourceType"]

log = logging.getLogger("fakeapi")

VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")

_PATCH_TYPES = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
    "application/apply-patch+json": "apply",
}


@dataclass
class RequestInfo:
    """One request as the fake understood it (see `FakeKubeAPI.request_log`)."""

    method: str
    path: str
    query: dict[str, str]
    verb: str = ""  # get list watch create update patch delete deletecollection ("" for non-resource)
    resource: str = ""  # "pods", "pods/status", "pods/binding", "leases.coordination.k8s.io", ...
    namespace: str | None = None
    name: str | None = None
    content_type: str = ""
    body: Any = None
    status: int | None = None  # filled in once answered (for watches: 200 when the stream starts)


@dataclass
class _Failure:
    verb: str
    resource: str
    status: int
    count: int | None
    message: str | None
    reason: str | None
    namespace: str | None
    name: str | None
    headers: dict[str, str] = field(default_factory=dict)

    def matches(self, info: RequestInfo) -> bool:
        if self.verb not in ("*", info.verb):
            return False
        if self.resource != "*" and not _resource_matches(self.resource, info.resource):
            return False
        if self.namespace is not None and self.namespace != info.namespace:
            return False
        return self.name is None or self.name == info.name


def _resource_matches(pattern: str, resource: str) -> bool:
    if pattern == resource:
        return True
    # "leases" matches "leases.coordination.k8s.io"; "leases/status" matches "leases.coordination.k8s.io/status"
    res_main, _, res_sub = resource.partition("/")
    pat_main, _, pat_sub = pattern.partition("/")
    return res_sub == pat_sub and res_main.split(".", 1)[0] == pat_main


@dataclass
class _AfterCommit:
    """A fault injected after a request was applied (see `FakeKubeAPI.fail_after_commit`)."""

    verb: str
    resource: str
    action: int | str  # an HTTP status, "timeout" or "reset"
    count: int | None
    namespace: str | None
    name: str | None

    def matches(self, info: RequestInfo) -> bool:
        return _Failure(self.verb, self.resource, 0, None, None, None, self.namespace, self.name).matches(info)


@dataclass
class _Latency:
    seconds: float
    verb: str | None
    resource: str | None


def _bool(v: str | None) -> bool:
    return (v or "").lower() in ("true", "1")


class FakeKubeAPI:
    """Fake kube-apiserver in a background thread. `start()` returns the base URL."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: bool = False,
        token: str | None = None,
        history_size: int = 10000,
        namespaces: tuple[str, ...] = ("default", "kube-system", "kube-public", "kube-node-lease"),
        auto_create_namespaces: bool = False,
        graceful_pod_deletion: bool = False,
        bookmark_interval: float = 1.0,
        default_watch_timeout: float = 1800.0,
        version: str = "v1.36.2",
        resources: tuple[ResourceType, ...] = DEFAULT_RESOURCES,
    ):
        self.host = host
        self.port = port
        self.tls = tls
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self.version = version
        self.store = Store(
            resources,
            history_size=history_size,
            namespaces=namespaces,
            auto_create_namespaces=auto_create_namespaces,
            graceful_pod_deletion=graceful_pod_deletion,
        )
        self.requests: list[tuple[str, str]] = []
        self.request_log: list[RequestInfo] = []
        self.errors: list[str] = []  # unexpected exceptions inside the fake (should stay empty)
        self._failures: list[_Failure] = []
        self._after_commit: list[_AfterCommit] = []
        self._hung: asyncio.Event | None = None  # set on stop(): releases "timeout" answers
        self.hung_requests = 0  # requests held without an answer by fail_after_commit("timeout")
        self.connections: set[tuple[Any, ...]] = set()  # peer (host, port) of every connection seen
        self._latencies: list[_Latency] = []
        self._hooks: list[Callable[[RequestInfo], Any]] = []
        self._hooks_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self.ca_cert_path: str | None = None
        self.base_url: str = ""

    # ================================================================== lifecycle
    def start(self) -> str:
        if self._thread is not None:
            return self.base_url
        ssl_ctx = None
        if self.tls:
            ssl_ctx = self._make_tls()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.base_url = f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"
        loop = asyncio.new_event_loop()
        self._loop = loop
        ready = threading.Event()
        failure: list[BaseException] = []

        async def startup() -> None:
            self._hung = asyncio.Event()
            app = web.Application(client_max_size=16 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
            await runner.setup()
            site = web.SockSite(runner, sock, ssl_context=ssl_ctx)
            await site.start()
            self._runner = runner

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(startup())
            except BaseException as exc:  # pragma: no cover - startup failure
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-kube-api:{self.port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            self._thread = None
            raise RuntimeError(f"fake kube-apiserver failed to start: {failure[0]!r}")
        return self.base_url

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self.store.close_watches()
        loop = self._loop
        if self._hung is not None:
            loop.call_soon_threadsafe(self._hung.set)

        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        except Exception as exc:  # pragma: no cover
            log.warning("fake kube-apiserver shutdown: %r", exc)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._thread = None
        self._loop = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> FakeKubeAPI:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _make_tls(self):
        import ssl

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kube-apiserver")])
        now = _dt.datetime.now(_dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        self._tmpdir = tempfile.TemporaryDirectory(prefix="fakeapi-tls-")
        cert_path = os.path.join(self._tmpdir.name, "ca.crt")
        key_path = os.path.join(self._tmpdir.name, "tls.key")
        with open(cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_path, "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        self.ca_cert_path = cert_path
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert_path, key_path)
        return ctx

    # ================================================================== client helpers
    def configuration(self):
        """A `kubernetes.client.Configuration` pointing at this server."""
        from kubernetes import client

        if not self.base_url:
            raise RuntimeError("FakeKubeAPI not started")
        cfg = client.Configuration()
        cfg.host = self.base_url
        if self.tls:
            cfg.ssl_ca_cert = self.ca_cert_path
            cfg.verify_ssl = True
        if self.token:
            cfg.api_key = {"authorization": self.token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return cfg

    def api_client(self):
        """A fresh `kubernetes.client.ApiClient` configured for this server."""
        from kubernetes import client

        return client.ApiClient(self.configuration())

    def kubeconfig(self, path: str | os.PathLike[str], *, context: str = "fake") -> str:
        """Write a kubeconfig for this server to `path`; returns the path as a string."""
        if not self.base_url:
            raise RuntimeError("FakeKubeAPI not started")
        cluster: JSON = {"server": self.base_url}
        if self.tls and self.ca_cert_path:
            with open(self.ca_cert_path, "rb") as f:
                cluster["certificate-authority-data"] = base64.b64encode(f.read()).decode()
        user: JSON = {"token": self.token} if self.token else {}
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": cluster}],
            "users": [{"name": context, "user": user}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
            "current-context": context,
            "preferences": {},
        }
        path = os.fspath(path)
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    # ================================================================== test hooks
    def fail_next(
        self,
        verb: str = "*",
        resource: str = "*",
        status: int = 500,
        count: int | None = 1,
        *,
        message: str | None = None,
        reason: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Answer the next `count` matching requests (None: all of them) with an error `Status`.

        `verb`: one of get list watch create update patch delete deletecollection, or "*".
        `resource`: "pods", "pods/status", "pods/binding", "nodes", "leases", ... or "*".
        """
        if verb != "*" and verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}; use one of {VERBS}")
        if status == 429 and headers is None:
            headers = {"Retry-After": "1"}
        with self._hooks_lock:
            self._failures.append(
                _Failure(verb, resource, status, count, message, reason, namespace, name, headers or {})
            )

    def clear_failures(self) -> None:
        """Drop every pending `fail_next` and `fail_after_commit` fault."""
        with self._hooks_lock:
            self._failures.clear()
            self._after_commit.clear()

    def fail_after_commit(
        self,
        verb: str = "*",
        resource: str = "*",
        action: int | str = 504,
        count: int | None = 1,
        *,
        namespace: str | None = None,
        name: str | None = None,
    ) -> None:
        """Apply the next `count` matching requests (None: all of them) for real, then fail to
        answer them: the write is committed (and its watch events sent) but the client does not
        learn it. `action`: an HTTP status (e.g. 504, answered with a `Status` like the real
        server's timeout), `"timeout"` (no answer at all until the fake stops: the client's read
        timeout fires) or `"reset"` (the connection is closed without an answer). A request that
        fails on its own (404, 409, ...) is answered normally and does not use up the count.
        Not for watches."""
        if verb != "*" and verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}; use one of {VERBS}")
        if not isinstance(action, int) and action not in ("timeout", "reset"):
            raise ValueError(f"action {action!r}: an HTTP status, 'timeout' or 'reset'")
        with self._hooks_lock:
            self._after_commit.append(_AfterCommit(verb, resource, action, count, namespace, name))

    @property
    def connection_count(self) -> int:
        """How many distinct client connections the fake has served requests on (a client that
        reuses its pooled connections adds none per request)."""
        return len(self.connections)

    def add_latency(self, seconds: float, verb: str | None = None, resource: str | None = None) -> None:
        """Delay every matching request by `seconds` (before it is processed)."""
        with self._hooks_lock:
            self._latencies.append(_Latency(seconds, verb, resource))

    def clear_latency(self) -> None:
        with self._hooks_lock:
            self._latencies.clear()

    def add_hook(self, fn: Callable[[RequestInfo], Any]) -> None:
        """Call `fn(info)` before each resource request; if it returns an int status or an ApiError,
        that error is answered instead. Runs on the server thread: keep it quick."""
        with self._hooks_lock:
            self._hooks.append(fn)

    def expire_watches(self) -> None:
        """Close every open watch and make every resourceVersion issued so far too old (410 Gone)."""
        self.store.expire()

    def close_watches(self, resource: str | None = None) -> int:
        """Close open watches (clients may resume from their last resourceVersion). Returns how many."""
        key = self.store.resolve(resource).key if resource else None
        return self.store.close_watches(key)

    def watch_count(self, resource: str | None = None) -> int:
        key = self.store.resolve(resource).key if resource else None
        with self.store.lock:
            return sum(1 for w in self.store.watchers if key is None or w.rtype.key == key)

    def wait_for_watch(self, resource: str | None = None, count: int = 1, timeout: float = 5.0) -> None:
        """Block until at least `count` watches on `resource` are open (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while self.watch_count(resource) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no watch on {resource or 'anything'} after {timeout}s")
            time.sleep(0.01)

    def clear_requests(self) -> None:
        self.requests.clear()
        self.request_log.clear()

    @property
    def resource_version(self) -> str:
        return str(self.store.rv)

    # direct object access (same semantics as HTTP: resourceVersion bumps, watch events)
    def objects(self, resource: str, namespace: str | None = None) -> list[JSON]:
        rt = self.store.resolve(resource)
        return self.store.list(rt, namespace)[0]

    def get_object(self, resource: str, name: str, namespace: str | None = None) -> JSON | None:
        rt = self.store.resolve(resource)
        try:
            return self.store.get(rt, namespace if rt.namespaced else None, name)
        except ApiError:
            return None

    def create_object(self, resource: str, obj: JSON, namespace: str | None = None) -> JSON:
        rt = self.store.resolve(resource)
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or ("default" if rt.namespaced else None)
        return self.store.create(rt, ns, obj)

    def update_object(self, resource: str, obj: JSON, *, subresource: str | None = None) -> JSON:
        rt = self.store.resolve(resource)
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or ("default" if rt.namespaced else None)
        return self.store.update(rt, ns, meta["name"], obj, subresource=subresource)

    def patch_object(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        patch_type: str = "merge",
        subresource: str | None = None,
    ) -> JSON:
        """patch_type: merge | strategic | json | apply."""
        rt = self.store.resolve(resource)
        ns = namespace or ("default" if rt.namespaced else None)
        return self.store.patch(rt, ns, name, patch_type, patch, subresource=subresource)

    def delete_object(
        self, resource: str, name: str, namespace: str | None = None, *, grace_period_seconds: int | None = None
    ) -> JSON:
        rt = self.store.resolve(resource)
        ns = namespace or ("default" if rt.namespaced else None)
        opts = {} if grace_period_seconds is None else {"gracePeriodSeconds": grace_period_seconds}
        return self.store.delete(rt, ns, name, opts)[1]

    def set_pod_phase(self, name: str, phase: str, namespace: str = "default", **status: Any) -> JSON:
        """Play the kubelet: set `status.phase` (and other status fields) through the status subresource."""
        return self.patch_object("pods", name, {"status": {"phase": phase, **status}}, namespace,
                                 subresource="status")

    # ================================================================== HTTP
    def _status_response(self, err: ApiError) -> web.Response:
        return web.Response(
            status=err.code,
            body=json.dumps(err.status()).encode(),
            content_type="application/json",
            headers=err.headers,
        )

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        info = RequestInfo(request.method, request.path, dict(request.query),
                           content_type=request.headers.get("Content-Type", ""))
        self.requests.append((request.method, request.path))
        self.request_log.append(info)
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if peer is not None:
            self.connections.add(tuple(peer))
        try:
            resp = await self._dispatch(request, info)
            if info.verb != "watch":
                resp = await self._after_commit_fault(request, info, resp)
        except ApiError as err:
            resp = self._status_response(err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # never crash: report a 500 like the real server would
            log.exception("fake kube-apiserver: unhandled error for %s %s", request.method, request.path)
            self.errors.append(f"{request.method} {request.path}: {exc!r}")
            resp = self._status_response(ApiError(500, f"Internal error occurred: {exc!r}"))
        if info.status is None:
            info.status = resp.status
        return resp

    async def _after_commit_fault(self, request: web.Request, info: RequestInfo,
                                  resp: web.StreamResponse) -> web.StreamResponse:
        """The request was applied; answer it as a `fail_after_commit` fault says, if one matches."""
        with self._hooks_lock:
            fault = None
            for f in self._after_commit:
                if f.matches(info):
                    fault = f
                    if f.count is not None:
                        f.count -= 1
                        if f.count <= 0:
                            self._after_commit.remove(f)
                    break
        if fault is None:
            return resp
        if fault.action == "reset":
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: the connection is gone
        if fault.action == "timeout":
            self.hung_requests += 1
            assert self._hung is not None
            await self._hung.wait()  # until stop(): the client has long given up
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        assert isinstance(fault.action, int)
        raise ApiError(fault.action, self._default_message(fault.action, info),
                       reason="Timeout" if fault.action == 504 else None)

    def _check_auth(self, request: web.Request) -> None:
        if not self.token:
            return
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized")

    async def _dispatch(self, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        segs = [s for s in path.split("/") if s]
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return self._json(self._version())
        self._check_auth(request)
        if not segs or segs[0] not in ("api", "apis"):
            raise ApiError(404, "the server could not find the requested resource", reason="NotFound",
                           details={})
        if segs[0] == "api":
            if len(segs) == 1:
                return self._json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}]})
            group, version, rest = "", segs[1], segs[2:]
        else:
            if len(segs) == 1:
                return self._json(self._group_list())
            if len(segs) == 2:
                g = next((x for x in self._group_list()["groups"] if x["name"] == segs[1]), None)
                if g is None:
                    raise ApiError(404, "the server could not find the requested resource", details={})
                return self._json({"kind": "APIGroup", "apiVersion": "v1", **g})
            group, version, rest = segs[1], segs[2], segs[3:]
        if not rest:
            return self._json(self._resource_list(group, version))
        return await self._resource_request(request, info, group, version, rest)

    # ---------------------------------------------------------------- discovery
    def _version(self) -> JSON:
        major, minor = self.version.lstrip("v").split(".")[:2]
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "gitVersion": self.version, "gitCommit": "0000000000000000000000000000000000000000",
                "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0",
                "compiler": "gc", "platform": "linux/amd64"}

    def _group_list(self) -> JSON:
        groups: dict[str, list[str]] = {}
        for rt in self.store.types.values():
            if rt.group:
                groups.setdefault(rt.group, [])
                if rt.version not in groups[rt.group]:
                    groups[rt.group].append(rt.version)
        out = []
        for g, versions in groups.items():
            gvs = [{"groupVersion": f"{g}/{v}", "version": v} for v in versions]
            out.append({"name": g, "versions": gvs, "preferredVersion": gvs[0]})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": out}

    def _resource_list(self, group: str, version: str) -> JSON:
        resources = []
        all_verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        for rt in self.store.types.values():
            if rt.group != group or rt.version != version:
                continue
            entry = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                     "kind": rt.kind, "verbs": all_verbs}
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            resources.append(entry)
            for sub in sorted(rt.subresources):
                if sub == "binding":
                    resources.append({"name": f"{rt.plural}/binding", "singularName": "", "namespaced": True,
                                      "kind": "Binding", "verbs": ["create"]})
                else:
                    resources.append({"name": f"{rt.plural}/{sub}", "singularName": "",
                                      "namespaced": rt.namespaced, "kind": rt.kind,
                                      "verbs": ["get", "patch", "update"]})
            if rt.kind == "Pod":
                resources.append({"name": "bindings", "singularName": "binding", "namespaced": True,
                                  "kind": "Binding", "verbs": ["create"]})
        if not resources:
            raise ApiError(404, "the server could not find the requested resource", details={})
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    # ---------------------------------------------------------------- resources
    async def _resource_request(
        self, request: web.Request, info: RequestInfo, group: str, version: str, rest: list[str]
    ) -> web.StreamResponse:
        legacy_watch = False
        if rest[0] == "watch":
            legacy_watch, rest = True, rest[1:]
            if not rest:
                raise ApiError(404, "the server could not find the requested resource", details={})
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if len(rest) > 3:
            raise ApiError(404, "the server could not find the requested resource", details={})
        method = request.method
        q = request.query

        # POST /api/v1/namespaces/{ns}/bindings
        if group == "" and plural == "bindings" and namespace is not None and name is None:
            if method != "POST":
                raise ApiError(405, "the server does not allow this method on the requested resource")
            info.verb, info.resource, info.namespace = "create", "pods/binding", namespace
            body = await self._read_body(request, info)
            bmeta = body.get("metadata") if isinstance(body, dict) else None
            bname = bmeta.get("name") if isinstance(bmeta, dict) else None
            if not isinstance(body, dict) or not isinstance(bmeta, (dict, type(None))) or not isinstance(
                    bname, (str, type(None))):
                raise ApiError(400, "the body of the request was in an unknown format - expected a Binding")
            info.name = bname
            await self._pre(info)
            if not bname:
                raise ApiError(422, 'Binding "" is invalid: metadata.name: Required value: name is required')
            return self._json(self.store.bind(namespace, bname, body, dry_run=self._dry(q)), 201)

        rt = self.store.by_path.get((group, version, plural))
        if rt is None:
            raise ApiError(404, "the server could not find the requested resource", details={})
        if rt.namespaced and name is not None and namespace is None:
            raise ApiError(404, "the server could not find the requested resource", details={})
        if sub is not None and sub not in rt.subresources:
            raise ApiError(404, "the server could not find the requested resource", details={})
        info.namespace, info.name = namespace, name
        info.resource = rt.key + (f"/{sub}" if sub else "")

        if name is None:
            if method == "GET":
                watching = legacy_watch or _bool(q.get("watch"))
                info.verb = "watch" if watching else "list"
                await self._pre(info)
                if watching:
                    return await self._watch(request, info, rt, namespace)
                return self._list(rt, namespace, q)
            if legacy_watch:
                raise ApiError(405, "the server does not allow this method on the requested resource")
            if method == "POST":
                info.verb = "create"
                body = await self._read_body(request, info)
                await self._pre(info)
                if rt.namespaced and namespace is None:
                    raise ApiError(405, "the server does not allow this method on the requested resource")
                return self._json(self.store.create(rt, namespace, body, dry_run=self._dry(q)), 201)
            if method == "DELETE":
                info.verb = "deletecollection"
                body = await self._read_body(request, info, optional=True)
                await self._pre(info)
                labels, fields = self._selectors(rt, q)
                return self._json(self.store.delete_collection(rt, namespace, labels, fields,
                                                               self._delete_options(body, q), dry_run=self._dry(q)))
            raise ApiError(405, "the server does not allow this method on the requested resource")

        if legacy_watch:
            if method != "GET":
                raise ApiError(405, "the server does not allow this method on the requested resource")
            info.verb = "watch"
            await self._pre(info)
            return await self._watch(request, info, rt, namespace, single=name)

        if sub == "binding":
            if method != "POST":
                raise ApiError(405, "the server does not allow this method on the requested resource")
            info.verb = "create"
            body = await self._read_body(request, info)
            await self._pre(info)
            return self._json(self.store.bind(namespace or "", name, body, dry_run=self._dry(q)), 201)

        if method == "GET":
            info.verb = "get"
            await self._pre(info)
            return self._json(self.store.get(rt, namespace, name))
        if method == "PUT":
            info.verb = "update"
            body = await self._read_body(request, info)
            await self._pre(info)
            existed = self.store.data[rt.key].get(((namespace or "") if rt.namespaced else "", name)) is not None
            out = self.store.update(rt, namespace, name, body, subresource=sub, dry_run=self._dry(q))
            return self._json(out, 200 if existed else 201)
        if method == "PATCH":
            info.verb = "patch"
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
            ptype = _PATCH_TYPES.get(ctype)
            if ptype is None:
                raise ApiError(
                    415,
                    f"the body of the request was in an unknown format - accepted media types include: "
                    f"{', '.join(_PATCH_TYPES)}",
                )
            body = await self._read_body(request, info, yaml_ok=ptype == "apply")
            await self._pre(info)
            if ptype == "apply" and not q.get("fieldManager"):
                raise ApiError(400, "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: "
                               "is required for apply patch")
            return self._json(self.store.patch(rt, namespace, name, ptype, body, subresource=sub,
                                               dry_run=self._dry(q)))
        if method == "DELETE":
            if sub is not None:
                raise ApiError(405, "the server does not allow this method on the requested resource")
            info.verb = "delete"
            body = await self._read_body(request, info, optional=True)
            await self._pre(info)
            code, out = self.store.delete(rt, namespace, name, self._delete_options(body, q), dry_run=self._dry(q))
            return self._json(out, code)
        if method == "POST":
            raise ApiError(405, "the server does not allow this method on the requested resource")
        raise ApiError(405, "the server does not allow this method on the requested resource")

    @staticmethod
    def _dry(q: Any) -> bool:
        dry = q.getall("dryRun", []) if hasattr(q, "getall") else []
        for d in dry:
            if d != "All":
                raise ApiError(400, f"Invalid dry run value: {d!r}; supported values: \"All\"")
        return bool(dry)

    async def _pre(self, info: RequestInfo) -> None:
        """Latency, hooks and injected failures, once verb and resource are known."""
        with self._hooks_lock:
            delay = sum(
                lat.seconds for lat in self._latencies
                if (lat.verb in (None, "*", info.verb))
                and (lat.resource in (None, "*") or _resource_matches(lat.resource, info.resource))
            )
            hooks = list(self._hooks)
            failure = None
            for f in self._failures:
                if f.matches(info):
                    failure = f
                    if f.count is not None:
                        f.count -= 1
                        if f.count <= 0:
                            self._failures.remove(f)
                    break
        if delay > 0:
            await asyncio.sleep(delay)
        for hook in hooks:
            out = hook(info)
            if asyncio.iscoroutine(out):
                out = await out
            if isinstance(out, ApiError):
                raise out
            if isinstance(out, int) and not isinstance(out, bool):
                raise ApiError(out, f"injected failure ({out})")
        if failure is not None:
            reason = failure.reason
            if reason is None and failure.status == 409:
                reason = "Conflict"
            if reason is None and failure.status == 410:
                reason = "Expired"
            msg = failure.message or self._default_message(failure.status, info)
            raise ApiError(failure.status, msg, reason=reason, headers=dict(failure.headers),
                           details={"name": info.name, "kind": info.resource.split("/")[0].split(".")[0]}
                           if info.name else None)

    @staticmethod
    def _default_message(status: int, info: RequestInfo) -> str:
        if status == 409:
            return (f'Operation cannot be fulfilled on {info.resource} "{info.name}": the object has been '
                    "modified; please apply your changes to the latest version and try again")
        if status == 404:
            return f'{info.resource} "{info.name}" not found'
        if status == 429:
            return "Too many requests, please try again later."
        if status == 500:
            return "Internal error occurred: injected failure"
        if status == 503:
            return "the server is currently unable to handle the request"
        if status == 504:
            return "Timeout: request did not complete within requested timeout"
        return f"injected failure ({status})"

    async def _read_body(self, request: web.Request, info: RequestInfo, *, optional: bool = False,
                         yaml_ok: bool = False) -> Any:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return None
            raise ApiError(400, "the body of the request was in an unknown format - no content")
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if "protobuf" in ctype or "cbor" in ctype:
            raise ApiError(415, f"the body of the request was in an unknown format - {ctype} is not supported "
                           "by the fake")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"the body of the request was in an unknown format: {exc}") from exc
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            if yaml_ok or "yaml" in ctype:
                try:
                    body = yaml.safe_load(text)
                except yaml.YAMLError as yexc:
                    raise ApiError(400, f"error decoding YAML: {yexc}") from yexc
            else:
                raise ApiError(400, f"couldn't get version/kind; json parse error: {exc}") from exc
        info.body = body
        return body

    def _delete_options(self, body: Any, q: Any) -> JSON:
        opts: JSON = {}
        if isinstance(body, dict):
            opts.update(body)
        elif body is not None:
            raise ApiError(400, "the body of the request was in an unknown format - expected DeleteOptions")
        if "gracePeriodSeconds" in q:
            opts["gracePeriodSeconds"] = q["gracePeriodSeconds"]
        if "propagationPolicy" in q:
            opts["propagationPolicy"] = q["propagationPolicy"]
        return opts

    def _selectors(self, rt: ResourceType, q: Any):
        try:
            labels = parse_label_selector(q.get("labelSelector"))
            fields = parse_field_selector(q.get("fieldSelector"), rt.allowed_fields(), field_getter(rt))
        except SelectorError as exc:
            raise ApiError(400, str(exc)) from exc
        return labels, fields

    def _list(self, rt: ResourceType, namespace: str | None, q: Any) -> web.Response:
        labels, fields = self._selectors(rt, q)
        items, rv = self.store.list(rt, namespace, labels, fields)
        meta: JSON = {"resourceVersion": rv}
        limit_s, cont = q.get("limit"), q.get("continue")
        start_after: tuple[str, str] | None = None
        if cont:
            try:
                tok = json.loads(base64.urlsafe_b64decode(cont.encode()).decode())
                start_after = (tok["ns"], tok["name"])
                tok_rv = int(tok["rv"])
            except Exception as exc:
                raise ApiError(400, "continue key is not valid: incorrect encoded start resourceVersion "
                               "(version meta.k8s.io/v1)") from exc
            if tok_rv < self.store.compacted:
                raise ApiError(410, "The provided continue parameter is too old to display a consistent list "
                               "result. You can start a new list without the continue parameter.",
                               reason="Expired")
            items = [i for i in items
                     if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > start_after]
        if limit_s:
            try:
                limit = int(limit_s)
            except ValueError as exc:
                raise ApiError(400, f"invalid limit {limit_s!r}") from exc
            if 0 < limit < len(items):
                last = items[limit - 1]["metadata"]
                meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                    {"rv": rv, "ns": last.get("namespace", ""), "name": last["name"]}).encode()).decode()
                meta["remainingItemCount"] = len(items) - limit
                items = items[:limit]
        for i in items:  # the real server omits kind/apiVersion on list items
            i.pop("kind", None)
            i.pop("apiVersion", None)
        return self._json({"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta,
                           "items": items})

    async def _watch(
        self, request: web.Request, info: RequestInfo, rt: ResourceType, namespace: str | None,
        single: str | None = None,
    ) -> web.StreamResponse:
        q = request.query
        labels, fields = self._selectors(rt, q)
        if single is not None:
            fields = parse_field_selector(
                ",".join(filter(None, [q.get("fieldSelector"), f"metadata.name={single}"])),
                None, field_getter(rt))
        timeout = self.default_watch_timeout
        if q.get("timeoutSeconds"):
            try:
                timeout = float(q["timeoutSeconds"])
            except ValueError as exc:
                raise ApiError(400, f"invalid timeoutSeconds {q['timeoutSeconds']!r}") from exc
        bookmarks = _bool(q.get("allowWatchBookmarks"))
        loop = asyncio.get_running_loop()
        watcher = Watcher(rt, namespace if rt.namespaced else None, labels, fields, loop)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                       "Cache-Control": "no-cache, private"})
        resp.enable_chunked_encoding()
        try:
            initial = self.store.register_watch(watcher, q.get("resourceVersion"))
        except ApiError as err:
            if err.code != 410:
                raise
            await resp.prepare(request)
            info.status = 200
            await resp.write(_line({"type": "ERROR", "object": err.status()}))
            await resp.write_eof()
            return resp
        info.status = 200
        try:
            await resp.prepare(request)
            for etype, obj in initial:
                await resp.write(_line({"type": etype, "object": obj}))
                watcher.last_rv = max(watcher.last_rv, int(obj["metadata"]["resourceVersion"]))
            deadline = loop.time() + timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                wait = min(remaining, self.bookmark_interval) if bookmarks else remaining
                try:
                    ev = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and not watcher.closed:
                        await resp.write(_line({"type": "BOOKMARK", "object": {
                            "kind": rt.kind, "apiVersion": rt.api_version,
                            "metadata": {"resourceVersion": str(watcher.last_rv)}}}))
                    continue
                if ev is None:
                    break
                out = watcher.translate(ev)
                watcher.last_rv = max(watcher.last_rv, ev.rv)
                if out is not None:
                    await resp.write(_line({"type": out[0], "object": out[1]}))
            await resp.write_eof()
        except ConnectionError:
            pass
        except Exception as exc:  # client went away mid-write, etc.
            if "closing transport" not in str(exc).lower() and "connection" not in str(exc).lower():
                log.debug("watch stream ended: %r", exc)
        finally:
            self.store.unregister_watch(watcher)
        return resp


def _line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"
