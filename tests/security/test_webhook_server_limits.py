"""A hostile client against the webhook's listener: slowloris, idle and stalled connections, connection
floods. Short limits are configured per test; every test waits for the server to act (the connection
closed, a counter moved), with a generous safety deadline that only turns a hang into a failure.
Nothing is timed."""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from certs import pki, store
from kube_vgpu.config import Config
from tests.webhook.wh_helpers import Client, base_pod, limits, review_of
from webhook import server as server_mod
from webhook.server import BackgroundServer, Limits, WebhookServer

#: only turns a server that never acts into a failed test; no assertion depends on it
SAFETY = 60.0
CLOSED_TOTAL = "kube_vgpu_webhook_connections_closed_total"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    store.write_files(d, pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-vgpu"), ["127.0.0.1"]))
    return d


@contextmanager
def serve(tls: Path, **lim: float) -> Iterator[tuple[WebhookServer, int]]:
    base = dict(idle_timeout=30.0, header_timeout=30.0, body_timeout=30.0, keepalive_timeout=30.0,
                tls_handshake_timeout=30.0)
    srv = WebhookServer(Config(), str(tls / "tls.crt"), str(tls / "tls.key"), host="127.0.0.1", port=0,
                        limits=Limits(**{**base, **lim}))  # type: ignore[arg-type]
    with BackgroundServer(srv) as bg:
        yield srv, bg.port


def wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for: {what}"
        time.sleep(0.01)


def closed(srv: WebhookServer, reason: str) -> float:
    return srv.metrics.registry.get_sample_value(CLOSED_TOTAL, {"reason": reason}) or 0.0


def tls_conn(port: int, ca: Path) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(ca))
    return ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=SAFETY), server_hostname="127.0.0.1")


def wait_closed(sock: socket.socket, trickle: bytes | None = None) -> bytes:
    """Keep the connection (sending ``trickle`` between reads) until the server closes it; returns
    whatever the server sent before closing."""
    got = b""
    deadline = time.monotonic() + SAFETY
    sock.settimeout(0.05)
    while True:
        assert time.monotonic() < deadline, "the server never closed the connection"
        try:
            if trickle:
                sock.sendall(trickle)
            data = sock.recv(65536)
        except (TimeoutError, ssl.SSLWantReadError):
            continue
        except (ConnectionError, ssl.SSLError, OSError):
            return got
        if not data:
            return got
        got += data


def good_review(port: int, ca: Path) -> bool:
    c = Client(port, ca)
    try:
        return c.review(review_of(base_pod(limits(gpumem="1000"))))["response"]["allowed"] is True
    finally:
        c.close()


def client_hello() -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    out = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname="webhook")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# --- timeouts ----------------------------------------------------------------------------------------

def test_slowloris_headers_closed_after_header_timeout(tls: Path) -> None:
    with serve(tls, header_timeout=0.3) as (srv, port):
        s = tls_conn(port, tls / "ca.crt")
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: webhook\r\n")
        # a header line every 50 ms: bytes keep arriving, but the headers never end
        assert wait_closed(s, trickle=b"X-Slow: 1\r\n") == b""
        s.close()
        wait_for(lambda: closed(srv, "header-timeout") == 1, "header-timeout counted")
        assert good_review(port, tls / "ca.crt")


def test_idle_connection_closed_after_idle_timeout(tls: Path) -> None:
    with serve(tls, idle_timeout=0.3) as (srv, port):
        s = tls_conn(port, tls / "ca.crt")
        assert wait_closed(s) == b""
        s.close()
        wait_for(lambda: closed(srv, "idle-timeout") == 1, "idle-timeout counted")


def test_trickled_body_gets_408_after_body_timeout(tls: Path) -> None:
    with serve(tls, body_timeout=0.3) as (srv, port):
        s = tls_conn(port, tls / "ca.crt")
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{")
        answer = wait_closed(s, trickle=b" ")
        s.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
        wait_for(lambda: closed(srv, "body-timeout") == 1, "body-timeout counted")


def test_keepalive_connection_closed_after_keepalive_timeout(tls: Path) -> None:
    with serve(tls, keepalive_timeout=0.3) as (srv, port):
        s = tls_conn(port, tls / "ca.crt")
        body = json.dumps(review_of(base_pod(limits(gpu="1")))).encode()
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = wait_closed(s)
        s.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"allowed":true' in answer
        wait_for(lambda: closed(srv, "keepalive-timeout") == 1, "keepalive-timeout counted")


@pytest.mark.parametrize("send", [b"", b"partial"])
def test_stalled_tls_handshake_closed_after_handshake_timeout(tls: Path, send: bytes) -> None:
    with serve(tls, tls_handshake_timeout=0.3) as (srv, port):
        s = socket.create_connection(("127.0.0.1", port), timeout=SAFETY)
        hello = client_hello()
        s.sendall(hello[: len(hello) // 2] if send else b"")  # half a ClientHello, or nothing
        wait_closed(s)
        s.close()
        wait_for(lambda: closed(srv, "handshake-failed") == 1, "handshake-failed counted")
        wait_for(lambda: srv.listener is not None and srv.listener.open == 0, "slot released")


# --- the connection cap ------------------------------------------------------------------------------------

def test_connections_beyond_the_cap_are_refused_without_growth(tls: Path) -> None:
    with serve(tls, max_connections=3) as (srv, port):
        held = [tls_conn(port, tls / "ca.crt") for _ in range(3)]
        assert srv.listener is not None
        wait_for(lambda: srv.listener.open == 3, "three connections open")  # type: ignore[union-attr]
        for _ in range(5):
            with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                extra = tls_conn(port, tls / "ca.crt")
                extra.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
                assert extra.recv(1) == b""  # the server reset it at accept
                extra.close()
        wait_for(lambda: closed(srv, "refused") == 5, "five refusals counted")
        assert srv.listener.open == 3
        assert srv.metrics.registry.get_sample_value("kube_vgpu_webhook_connections") == 3
        # a slot frees when a connection ends; then a new client is served
        held.pop().close()
        wait_for(lambda: srv.listener.open == 2, "slot released")  # type: ignore[union-attr]
        assert good_review(port, tls / "ca.crt")
        for s in held:
            s.close()


def test_good_review_after_an_abuse_burst(tls: Path) -> None:
    with serve(tls, max_connections=32, tls_handshake_timeout=0.5, header_timeout=0.5, idle_timeout=0.5,
               gc_every_closed=16) as (srv, port):
        hello = client_hello()
        for _ in range(200):  # aborted handshakes: a ClientHello, then a reset
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=SAFETY)
                s.sendall(hello)
                reset(s)
            except ConnectionError:
                pass  # refused at the cap
        slow = []
        for _ in range(40):  # slowloris, more than the cap
            try:
                s = tls_conn(port, tls / "ca.crt")
                s.sendall(b"POST /mutate HTTP/1.1\r\n")
                slow.append(s)
            except (ssl.SSLError, ConnectionError, OSError):
                pass
        # never more than the cap open at once (how many of the 40 got in depends on how fast the
        # server's header timeout freed slots on this machine: a count of `slow` would be a race)
        assert srv.listener is not None and srv.listener.peak_open <= 32
        for s in slow:
            wait_closed(s)
            s.close()
        assert srv.listener is not None
        wait_for(lambda: srv.listener.open == 0, "every abusive connection closed")  # type: ignore[union-attr]
        assert srv.listener.gc_runs >= 1  # the aborted handshakes' TLS buffers were collected
        assert closed(srv, "handshake-failed") + closed(srv, "refused") >= 200
        assert good_review(port, tls / "ca.crt")


# --- flags ---------------------------------------------------------------------------------------------

def test_limit_flags_parse_and_reach_the_server(tls: Path) -> None:
    args = server_mod.build_parser().parse_args([
        "--tls-cert-file", "c", "--tls-key-file", "k", "--max-connections", "7", "--tls-handshake-timeout", "1.5",
        "--idle-timeout", "2", "--header-timeout", "3", "--body-timeout", "4", "--keepalive-timeout", "5",
        "--gc-every-closed", "0", "--system-user", "system:serviceaccount:ns:a", "--system-user",
        "system:serviceaccount:ns:b", "--protected-host-path", "/srv/x"])
    assert server_mod.limits_from_args(args) == Limits(7, 1.5, 2.0, 3.0, 4.0, 5.0, 0)
    cfg = server_mod.with_cli_lists(Config(), args)
    assert cfg.webhook.system_users == ("system:serviceaccount:ns:a", "system:serviceaccount:ns:b")
    assert cfg.webhook.protected_host_paths == ("/srv/x",)


@pytest.mark.parametrize("flag", ["--max-connections=0", "--header-timeout=0", "--body-timeout=-1",
                                  "--gc-every-closed=-1", "--protected-host-path=relative"])
def test_bad_limit_flags_exit_1(tls: Path, flag: str) -> None:
    assert server_mod.main(["--tls-cert-file", str(tls / "tls.crt"), "--tls-key-file", str(tls / "tls.key"),
                            "--bind-address", "127.0.0.1", "--port", "0", flag]) == 1
