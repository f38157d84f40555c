"""``kube-vgpu webhook``: the mutating admission webhook over HTTPS (aiohttp).

Endpoints (docs/CONTRACTS.md):

* ``POST /mutate``: an ``admission.k8s.io/v1`` or ``v1beta1`` AdmissionReview in, the same
  apiVersion out (see :mod:`webhook.admission`). Malformed bodies and bodies over
  ``--max-body-bytes`` get HTTP 400 with a plain-text reason. Every answer carries
  ``Server-Timing: handler;dur=<ms>, read;dur=<ms>[, cpu;dur=<ms>]``: handler = decode, decide and
  encode once the body is in (wall clock); read = receiving the body; cpu = CPU time of the handler
  (on answered reviews; milliseconds).
* ``GET /livez``: 200 while the process runs. ``GET /readyz``: 200 once listening with a certificate.
* ``GET /metrics``: Prometheus text: ``kube_vgpu_webhook_requests_total{outcome}``,
  ``kube_vgpu_webhook_request_duration_seconds`` (histogram, seconds),
  ``kube_vgpu_webhook_cert_reloads_total{result}``, ``kube_vgpu_webhook_cert_expiry_timestamp_seconds``.

The certificate is reloaded when its files change (:mod:`webhook.tlsreload`). Logs are JSON lines
on stderr.

**Bounded** (:class:`Limits`, one flag each): the server accepts connections itself and refuses
(closes at once, with a TCP reset) any beyond ``--max-connections``, counting every connection from
accept to close, TLS handshake included; a TLS handshake must finish within
``--tls-handshake-timeout``; a fresh connection must start a request within ``--idle-timeout``; a
request's headers must be complete within ``--header-timeout`` of its first byte; its body within
``--body-timeout`` (HTTP 408 and close otherwise); an idle keep-alive connection is closed after
``--keepalive-timeout``. Every timeout closes the connection (no graceful TLS shutdown is waited
for longer than 2 s). Closed and refused connections are counted in
``kube_vgpu_webhook_connections_closed_total{reason}``; open ones in ``kube_vgpu_webhook_connections``.

Python's asyncio TLS keeps a 256 KiB read buffer per connection (``asyncio.sslproto``), and a
connection reset during the handshake leaves its protocol in a reference cycle (an exception's
traceback) that only a full garbage collection frees. So the connection cap bounds the buffers of
live connections, and after every ``--gc-every-closed`` connections that ended without a completed
exchange the server runs ``gc.collect()``; see docs/limits.md for the measured figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kube_vgpu import jsonlog
from kube_vgpu.cliflags import PORT, add_level_flag, number_type
from kube_vgpu.config import Config, load_config
from kube_vgpu.config import replace as config_replace
from kube_vgpu.connguard import GuardedProtocol, request_middleware
from kube_vgpu.errors import ConfigError

from .admission import BadReview, answer, decode_review
from .tlsreload import ReloadingTLS

log = logging.getLogger("kube_vgpu.webhook")

DEFAULT_MAX_BODY = 3 * 1024 * 1024
BAD_REQUEST = "bad-request"
ERROR = "error"
#: seconds a closing TLS connection waits for the peer's close_notify
TLS_SHUTDOWN_TIMEOUT = 2.0

# ``reason`` label of kube_vgpu_webhook_connections_closed_total
REFUSED = "refused"  #: over --max-connections, closed at accept
HANDSHAKE_FAILED = "handshake-failed"  #: reset, bad TLS, or over --tls-handshake-timeout
IDLE_TIMEOUT = "idle-timeout"
HEADER_TIMEOUT = "header-timeout"
BODY_TIMEOUT = "body-timeout"
KEEPALIVE_TIMEOUT = "keepalive-timeout"
CLOSED = "closed"  #: any other end (client closed, server answered with Connection: close, ...)


def _limit(default: float, text: str) -> Any:
    """A :class:`Limits` field: its default and its flag's help (the flag is ``--<name with dashes>``)."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True, slots=True)
class Limits:
    """Connection limits of the listener (seconds, counts). Each field is a flag of the same name
    (``max_connections``: ``--max-connections``), declared by :func:`build_parser` from the field's help."""

    max_connections: int = _limit(256, "open connections (TLS handshakes included); more are refused at accept")
    tls_handshake_timeout: float = _limit(5.0, "seconds from accept to a finished TLS handshake")
    idle_timeout: float = _limit(10.0, "seconds from the handshake to a request's first byte")
    header_timeout: float = _limit(10.0, "seconds from a request's first byte to its complete headers")
    body_timeout: float = _limit(10.0, "seconds from complete headers to the complete body (then HTTP 408)")
    keepalive_timeout: float = _limit(100.0, "seconds an idle keep-alive connection is kept after a response")
    gc_every_closed: int = _limit(64, "full garbage collection after this many connections ended without a "
                                      "request (frees the TLS buffers of aborted handshakes; 0 = never)")

    def check(self) -> None:
        """Raise ValueError naming the limit that is out of range."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "gc_every_closed":
                if v < 0:
                    raise ValueError(f"--gc-every-closed={v}: must be >= 0 (0 = never)")
            elif not v > 0:
                raise ValueError(f"--{f.name.replace('_', '-')}={v}: must be > 0")
_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def setup_logging(level: str) -> None:
    """JSON logs to stderr at ``level`` (debug|info|warning|error); access logs only on warnings."""
    jsonlog.setup(level, quiet=("aiohttp.access",))


class Metrics:
    """The webhook's Prometheus metrics, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kube_vgpu_webhook_requests", "AdmissionReview requests by outcome",
                                ["outcome"], registry=self.registry)
        self.latency = Histogram("kube_vgpu_webhook_request_duration_seconds",
                                 "Handler time of POST /mutate once the body is read (decode, decide, encode), seconds", buckets=_BUCKETS,
                                 registry=self.registry)
        self.reloads = Counter("kube_vgpu_webhook_cert_reloads", "TLS certificate loads by result",
                               ["result"], registry=self.registry)
        self.expiry = Gauge("kube_vgpu_webhook_cert_expiry_timestamp_seconds",
                            "notAfter of the serving certificate, unix seconds", registry=self.registry)
        self.connections = Gauge("kube_vgpu_webhook_connections",
                                 "Open connections (TLS handshake included)", registry=self.registry)
        self.closed = Counter("kube_vgpu_webhook_connections_closed",
                              "Connections closed or refused, by reason", ["reason"], registry=self.registry)

    def on_reload(self, result: str, not_after: float) -> None:
        self.reloads.labels(result).inc()
        if not_after:
            self.expiry.set(not_after)


def _plain(status: int, text: str, arrived: float, started: float) -> web.Response:
    return web.Response(status=status, text=text + "\n", headers=_timing(arrived, started))


def _timing(arrived: float, started: float) -> dict[str, str]:
    """``Server-Timing`` (W3C): ``handler`` = decode + decide + encode, ``read`` = receiving the body (ms)."""
    now = time.perf_counter()
    return {"Server-Timing": f"handler;dur={(now - started) * 1000:.3f}, read;dur={(started - arrived) * 1000:.3f}"}


def make_app(config: Config, metrics: Metrics, max_body_bytes: int = DEFAULT_MAX_BODY,
             ready: Any = None, body_timeout: float | None = None,
             middlewares: tuple[Any, ...] = ()) -> web.Application:
    """The aiohttp application (routes above). ``ready()`` -> bool decides /readyz (default: True).
    body_timeout: seconds to receive a /mutate body (None = no limit; then HTTP 408 and close)."""

    async def mutate(request: web.Request) -> web.Response:
        arrived = time.perf_counter()
        started = arrived  # reset once the body is in: handler time excludes waiting for the client
        outcome = ERROR
        try:
            if request.content_length is not None and request.content_length > max_body_bytes:
                outcome = BAD_REQUEST
                return _plain(400, f"body of {request.content_length} bytes exceeds --max-body-bytes="
                                   f"{max_body_bytes}", arrived, started)
            try:
                async with asyncio.timeout(body_timeout):
                    body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                outcome = BAD_REQUEST
                return _plain(400, f"body exceeds --max-body-bytes={max_body_bytes}", arrived, started)
            except TimeoutError:
                outcome = BAD_REQUEST
                metrics.closed.labels(BODY_TIMEOUT).inc()
                late = _plain(408, f"body not received within --body-timeout={body_timeout}s", arrived, started)
                late.force_close()
                return late
            started = time.perf_counter()
            cpu0 = time.thread_time()
            try:
                review = decode_review(body)
            except BadReview as e:
                outcome = BAD_REQUEST
                log.info("bad AdmissionReview", extra={"error": str(e)})
                return _plain(400, f"bad AdmissionReview: {e}", arrived, started)
            resp, decision = answer(review, config)
            outcome = decision.outcome
            if not decision.allowed:
                req = review["request"]
                log.info("pod denied", extra={"namespace": req.get("namespace"), "pod": req.get("name"),
                                              "uid": req.get("uid"), "reason": decision.message})
            elif log.isEnabledFor(logging.DEBUG):
                log.debug("pod reviewed", extra={"uid": review["request"]["uid"], "outcome": outcome})
            payload = json.dumps(resp, separators=(",", ":")).encode()
            headers = _timing(arrived, started)
            headers["Server-Timing"] += f", cpu;dur={(time.thread_time() - cpu0) * 1000:.3f}"
            return web.Response(body=payload, content_type="application/json", headers=headers)
        except Exception:  # never let one request take the server down
            log.exception("unexpected error in /mutate")
            outcome = ERROR
            return _plain(500, "internal error", arrived, started)
        finally:
            metrics.requests.labels(outcome).inc()
            metrics.latency.observe(time.perf_counter() - started)

    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready is None or ready():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not ready\n")

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # client_max_size bounds request.read(); the Content-Length check above answers early.
    app = web.Application(client_max_size=max_body_bytes, middlewares=list(middlewares))
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    return app


class _Guard(GuardedProtocol):
    """Wraps aiohttp's per-connection protocol and enforces the idle, header and keep-alive timeouts.

    States: ``idle`` (handshake done, no byte yet), ``headers`` (a request's first byte seen),
    ``request`` (aiohttp handed the request to the app: the handler bounds the body), ``keepalive``
    (response done). A timer per state; when it fires the transport is aborted.
    """

    def __init__(self, owner: _Listener, inner: asyncio.Protocol):
        super().__init__(inner)
        self.owner = owner
        self.state = "idle"
        self.reason = CLOSED  #: why the timer, if it fires, closes the connection
        self.slot: _Slot | None = None

    def _arm(self, seconds: float, reason: str) -> None:
        self.reason = reason
        self.arm(seconds)

    def expired(self) -> None:
        if self.slot is not None:
            self.slot.reason = self.reason
        self.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.owner.guards[transport] = self
        self._arm(self.owner.limits.idle_timeout, IDLE_TIMEOUT)
        self.pass_connection(transport)

    def data_received(self, data: bytes) -> None:
        if self.state in ("idle", "keepalive"):
            self.state = "headers"
            self._arm(self.owner.limits.header_timeout, HEADER_TIMEOUT)
        self.inner.data_received(data)

    def closed(self) -> None:
        if self.transport is not None:
            self.owner.guards.pop(self.transport, None)
        if self.slot is not None:
            self.slot.release()

    def request_started(self) -> None:
        self.state = "request"
        self.disarm()
        if self.slot is not None:
            self.slot.served = True

    def request_finished(self) -> None:
        self.state = "keepalive"
        self._arm(self.owner.limits.keepalive_timeout, KEEPALIVE_TIMEOUT)


class _Slot:
    """One accepted connection's place under the cap; released exactly once."""

    __slots__ = ("owner", "released", "reason", "served")

    def __init__(self, owner: _Listener):
        self.owner = owner
        self.released = False
        self.reason = CLOSED
        self.served = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.owner.release(self)


class _Listener:
    """Accepts TCP connections on ``sock`` itself: refuses those over the cap, runs the TLS handshake
    under its timeout, and hands finished ones to aiohttp through a :class:`_Guard`."""

    def __init__(self, sock: socket.socket, ssl_ctx: ssl.SSLContext, factory: Callable[[], asyncio.Protocol],
                 limits: Limits, metrics: Metrics):
        self.sock = sock
        self.ssl_ctx = ssl_ctx
        self.factory = factory
        self.limits = limits
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.open = 0
        self.peak_open = 0  #: the most connections open at once since start (never above the cap)
        self.guards: dict[asyncio.BaseTransport, _Guard] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._unserved_since_gc = 0
        self._gc_pending = False
        self.gc_runs = 0

    def start(self) -> None:
        self.sock.setblocking(False)
        self.loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(128):  # like asyncio's own accept loop: a batch per wake-up
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE & co.: keep listening
                log.warning("accept failed", extra={"error": str(e)})
                return
            if self.open >= self.limits.max_connections:
                # refused: a reset at once, nothing allocated for it
                try:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                conn.close()
                self.metrics.closed.labels(REFUSED).inc()
                continue
            conn.setblocking(False)
            slot = _Slot(self)
            self.open += 1
            self.peak_open = max(self.peak_open, self.open)
            self.metrics.connections.set(self.open)
            task = self.loop.create_task(self._handshake(conn, slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handshake(self, conn: socket.socket, slot: _Slot) -> None:
        guard: _Guard | None = None

        def make() -> asyncio.Protocol:
            nonlocal guard
            guard = _Guard(self, self.factory())
            guard.slot = slot
            return guard

        try:
            await self.loop.connect_accepted_socket(
                make, conn, ssl=self.ssl_ctx, ssl_handshake_timeout=self.limits.tls_handshake_timeout,
                ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT)
        except asyncio.CancelledError:
            conn.close()
            slot.release()
            raise
        except Exception:  # reset, TLS alert, handshake timeout: the connection is gone
            if guard is None or guard.transport is None:
                slot.reason = HANDSHAKE_FAILED
                conn.close()
                slot.release()

    def release(self, slot: _Slot) -> None:
        self.open -= 1
        self.metrics.connections.set(self.open)
        self.metrics.closed.labels(slot.reason).inc()
        if slot.served or not self.limits.gc_every_closed:
            return
        self._unserved_since_gc += 1
        if self._unserved_since_gc >= self.limits.gc_every_closed and not self._gc_pending:
            self._gc_pending = True
            self.loop.call_soon(self._collect)

    def _collect(self) -> None:
        """Free the TLS buffers that aborted handshakes leave in reference cycles."""
        self._gc_pending = False
        self._unserved_since_gc = 0
        gc.collect()
        self.gc_runs += 1

    def middleware(self) -> Any:
        """aiohttp middleware telling the connection's guard when a request starts and ends."""
        return request_middleware(self.guards)

    async def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass


class WebhookServer:
    """One running webhook: app + HTTPS listener + certificate watcher.

    port 0 picks a free port (see ``port`` after :meth:`start`). reload_interval: seconds between
    certificate file checks. limits: connection limits (:class:`Limits`). Raises (start): OSError if
    the address is taken; ssl.SSLError/OSError if the certificate pair cannot be loaded.
    """

    def __init__(self, config: Config, cert_file: str, key_file: str, host: str = "0.0.0.0",
                 port: int = 8443, max_body_bytes: int = DEFAULT_MAX_BODY, reload_interval: float = 2.0,
                 limits: Limits | None = None):
        self.config = config
        self.cert_file, self.key_file = cert_file, key_file
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.reload_interval = reload_interval
        self.limits = limits or Limits()
        self.limits.check()
        self.metrics = Metrics()
        self.tls: ReloadingTLS | None = None
        self.listener: _Listener | None = None
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task[None] | None = None
        self._ready = False

    async def start(self) -> None:
        self.tls = ReloadingTLS(self.cert_file, self.key_file, self.reload_interval, self.metrics.on_reload)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=1024)
        self.port = int(sock.getsockname()[1])

        def protocol() -> asyncio.Protocol:
            server = self._runner.server if self._runner is not None else None
            assert server is not None, "runner not set up"
            return server()

        self.listener = _Listener(sock, self.tls.base, protocol, self.limits, self.metrics)
        app = make_app(self.config, self.metrics, self.max_body_bytes, ready=lambda: self._ready,
                       body_timeout=self.limits.body_timeout, middlewares=(self.listener.middleware(),))
        # aiohttp's own keep-alive timer (armed at connect and after each response) only backs ours
        # up, so it fires later; lingering (reading a body nobody asked for) is bounded by the body timeout
        backup = max(self.limits.keepalive_timeout, self.limits.idle_timeout) + 5.0
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, keepalive_timeout=backup,
                                     lingering_time=self.limits.body_timeout)
        await self._runner.setup()
        self.listener.start()
        self._watch = asyncio.get_running_loop().create_task(self.tls.watch())
        self._ready = True
        log.info("webhook listening", extra={"host": self.host, "port": self.port,
                                             "max_connections": self.limits.max_connections})

    async def stop(self) -> None:
        self._ready = False
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
        if self.listener is not None:
            await self.listener.close()
        if self._runner is not None:
            await self._runner.cleanup()


class BackgroundServer:
    """Run a :class:`WebhookServer` on its own event loop in a daemon thread (tests, benchmarks).

    Use as a context manager; ``port`` is valid inside it.
    """

    def __init__(self, server: WebhookServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="webhook", daemon=True)

    @property
    def port(self) -> int:
        return self.server.port

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kube-vgpu webhook", description="mutating admission webhook (HTTPS)")
    p.add_argument("--config", help="kube-vgpu config file (kube-vgpu.io/v1); default: built-in defaults")
    add_level_flag(p)
    p.add_argument("--bind-address", default="0.0.0.0", help="address of the HTTPS listener (default %(default)s)")
    p.add_argument("--port", type=PORT,
                   default=8443, help="port of the HTTPS listener (default %(default)s)")
    p.add_argument("--tls-cert-file", required=True, help="PEM certificate chain (reloaded when it changes)")
    p.add_argument("--tls-key-file", required=True, help="PEM private key (reloaded when it changes)")
    p.add_argument("--max-body-bytes", type=number_type("a number of bytes >= 1", minimum=1, integer=True),
                   default=DEFAULT_MAX_BODY,
                   help="largest accepted request body in bytes; larger ones get HTTP 400 (default %(default)s)")
    p.add_argument("--cert-check-seconds", type=number_type("a number of seconds > 0", above=0), default=2.0,
                   help="how often the certificate files are checked for changes, seconds (default %(default)s)")
    for f in fields(Limits):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f.metadata["help"] + " (default %(default)s)")
    p.add_argument("--system-user", action="append", default=[],
                   help="a user name allowed to change system-owned pod annotations/labels, added to "
                        "webhook.systemUsers (repeat)")
    p.add_argument("--protected-host-path", action="append", default=[],
                   help="a host path vGPU pods may not mount, added to webhook.protectedHostPaths (repeat)")
    return p


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The :class:`Limits` given on the command line. Raises ValueError for a value out of range."""
    lim = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    lim.check()
    return lim


def with_cli_lists(config: Config, args: argparse.Namespace) -> Config:
    """``config`` with ``--system-user`` and ``--protected-host-path`` added to the webhook lists.
    Raises ValueError for a protected path that is not absolute."""
    for hp in args.protected_host_path:
        if not hp.startswith("/"):
            raise ValueError(f"--protected-host-path={hp!r}: must be an absolute path")
    wh = config.webhook
    users = wh.system_users + tuple(u for u in args.system_user if u and u not in wh.system_users)
    paths = wh.protected_host_paths + tuple(p for p in args.protected_host_path if p not in wh.protected_host_paths)
    return config_replace(config, webhook=replace(wh, system_users=users, protected_host_paths=paths))


async def _serve(server: WebhookServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await server.start()
    # Everything allocated so far (modules, config, TLS contexts) lives for the whole process: keep
    # it out of the collector's view so full collections stay short (handler tail latency).
    gc.collect()
    gc.freeze()
    await stop.wait()
    log.info("shutting down")
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the webhook until SIGTERM/SIGINT. Returns 0, or 1 on a config/certificate/bind error."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = load_config(args.config)
    except (ConfigError, OSError) as e:
        log.error("cannot load config", extra={"error": str(e)})
        return 1
    try:
        limits = limits_from_args(args)
        config = with_cli_lists(config, args)
    except ValueError as e:
        log.error("bad flag", extra={"error": str(e)})
        return 1
    for flag, path in (("--tls-cert-file", args.tls_cert_file), ("--tls-key-file", args.tls_key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            log.error(f"{flag}={path!r}: cannot read it ({e.strerror or e}); allowed: a readable PEM file")
            return 1
    server = WebhookServer(config, args.tls_cert_file, args.tls_key_file, args.bind_address, args.port,
                           args.max_body_bytes, args.cert_check_seconds, limits)
    try:
        asyncio.run(_serve(server))
    except OSError as e:  # includes ssl.SSLError
        log.error("cannot start webhook", extra={"error": str(e), "tlsCertFile": args.tls_cert_file,
                                                  "tlsKeyFile": args.tls_key_file,
                                                  "address": f"{args.bind_address}:{args.port}"})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
