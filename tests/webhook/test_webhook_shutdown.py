"""Shutdown of the webhook: SIGTERM ends ``kube-vgpu webhook`` with exit code 0 promptly, also while
the API server holds idle keep-alive connections to it and while a client sits in the middle of a
TLS handshake (neither may hold the process for its timeouts)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from wh_helpers import Client, base_pod, limits, review_of

from tests.sigterm import EXIT_BOUND, sigterm_and_wait

#: generous bound for "it exited" on a loaded machine; the time measured is printed, not asserted


def test_cli_exits_0_soon_after_sigterm_with_open_connections(tls_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "kube_vgpu_cli", "webhook", "--bind-address", "127.0.0.1",
                             "--port", str(port), "--tls-cert-file", str(tls_dir / "tls.crt"),
                             "--tls-key-file", str(tls_dir / "tls.key")], stderr=subprocess.PIPE)
    keepalive: Client | None = None
    half = socket.socket()
    try:
        deadline = time.monotonic() + EXIT_BOUND
        while keepalive is None:
            assert proc.poll() is None, "webhook exited before it was ready"
            assert time.monotonic() < deadline, "webhook never ready"
            c = None
            try:
                c = Client(port, tls_dir / "ca.crt")
                if c.request("GET", "/readyz")[0] == 200:
                    keepalive, c = c, None
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
            finally:
                if c is not None:
                    c.close()
        # an idle keep-alive connection, as kube-apiserver keeps, after a real review
        assert keepalive.review(review_of(base_pod(limits(gpu="1"))))["response"]["allowed"]
        half.connect(("127.0.0.1", port))  # a connection that never finishes its TLS handshake
        err, took = sigterm_and_wait(proc, "webhook")
    finally:
        half.close()
        if keepalive is not None:
            keepalive.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    assert any(x["msg"] == "shutting down" for x in lines), lines
    assert not [x for x in lines if x["level"] == "error"], lines
    print(f"\nSHUTDOWN webhook: exit 0 {took:.2f} s after SIGTERM (idle keep-alive and half-open TLS connections)")
