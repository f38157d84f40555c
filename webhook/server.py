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
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import threading
import time
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kube_vgpu import jsonlog
from kube_vgpu.config import Config, load_config
from kube_vgpu.errors import ConfigError

from .admission import BadReview, answer, decode_review
from .tlsreload import ReloadingTLS

log = logging.getLogger("kube_vgpu.webhook")

DEFAULT_MAX_BODY = 3 * 1024 * 1024
BAD_REQUEST = "bad-request"
ERROR = "error"
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
             ready: Any = None) -> web.Application:
    """The aiohttp application (routes above). ``ready()`` -> bool decides /readyz (default: True)."""

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
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                outcome = BAD_REQUEST
                return _plain(400, f"body exceeds --max-body-bytes={max_body_bytes}", arrived, started)
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
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    return app


class WebhookServer:
    """One running webhook: app + HTTPS listener + certificate watcher.

    port 0 picks a free port (see ``port`` after :meth:`start`). reload_interval: seconds between
    certificate file checks. Raises (start): OSError if the address is taken; ssl.SSLError/OSError
    if the certificate pair cannot be loaded.
    """

    def __init__(self, config: Config, cert_file: str, key_file: str, host: str = "0.0.0.0",
                 port: int = 8443, max_body_bytes: int = DEFAULT_MAX_BODY, reload_interval: float = 2.0):
        self.config = config
        self.cert_file, self.key_file = cert_file, key_file
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.reload_interval = reload_interval
        self.metrics = Metrics()
        self.tls: ReloadingTLS | None = None
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task[None] | None = None
        self._ready = False

    async def start(self) -> None:
        self.tls = ReloadingTLS(self.cert_file, self.key_file, self.reload_interval, self.metrics.on_reload)
        app = make_app(self.config, self.metrics, self.max_body_bytes, ready=lambda: self._ready)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.tls.base, backlog=1024)
        await site.start()
        addrs = self._runner.addresses
        if addrs:
            self.port = int(addrs[0][1])
        self._watch = asyncio.get_running_loop().create_task(self.tls.watch())
        self._ready = True
        log.info("webhook listening", extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        self._ready = False
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--bind-address", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8443)
    p.add_argument("--tls-cert-file", required=True, help="PEM certificate chain (reloaded when it changes)")
    p.add_argument("--tls-key-file", required=True, help="PEM private key (reloaded when it changes)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help="largest accepted request body in bytes; larger ones get HTTP 400")
    p.add_argument("--cert-check-seconds", type=float, default=2.0,
                   help="how often the certificate files are checked for changes")
    return p


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
    if args.max_body_bytes <= 0:
        log.error("--max-body-bytes must be > 0")
        return 1
    server = WebhookServer(config, args.tls_cert_file, args.tls_key_file, args.bind_address, args.port,
                           args.max_body_bytes, args.cert_check_seconds)
    try:
        asyncio.run(_serve(server))
    except OSError as e:  # includes ssl.SSLError
        log.error("cannot start webhook", extra={"error": str(e)})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
