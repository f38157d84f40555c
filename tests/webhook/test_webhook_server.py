"""The webhook over real TLS on 127.0.0.1: certificates from ``certs``, an aiohttp client that
trusts only that CA, AdmissionReview JSON in the shape of the real capture."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from wh_helpers import CAPTURE, Client, base_pod, decode_patch, limits, review_of

from certs import pki, store
from kube_vgpu.config import Config
from webhook import server as server_mod
from webhook.server import BackgroundServer, WebhookServer


def test_capture_review_over_tls(client: Client) -> None:
    if CAPTURE.exists():
        review = json.loads(CAPTURE.read_text())
    else:
        review = review_of(base_pod())
    pod = review["request"]["object"]
    # the capture used a test resource; ask for a vGPU instead
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpumem": "4000"},
                                                 "requests": {"nvidia.com/gpumem": "4000"}}
    resp = client.review(review)
    assert resp["apiVersion"] == "admission.k8s.io/v1" and resp["kind"] == "AdmissionReview"
    assert resp["response"]["uid"] == review["request"]["uid"] and resp["response"]["allowed"] is True
    out = jsonpatch.apply_patch(pod, decode_patch(resp))
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    assert out["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpumem": "4000", "nvidia.com/gpu": "1", "nvidia.com/gpucores": "0"}
    assert out["metadata"] == pod["metadata"]  # managedFields etc. untouched
    review["request"]["object"] = out
    again = client.review(review)
    assert again["response"] == {"uid": review["request"]["uid"], "allowed": True}


def test_capture_pod_unchanged_when_no_vgpu(client: Client) -> None:
    review = json.loads(CAPTURE.read_text()) if CAPTURE.exists() else review_of(base_pod(
        {"limits": {"example.com/gpu-mem": "4"}}))
    resp = client.review(review)
    assert resp["response"] == {"uid": review["request"]["uid"], "allowed": True}


def test_v1beta1_answered_in_kind(client: Client) -> None:
    review = review_of(base_pod(limits(gpu="1")), "admission.k8s.io/v1beta1")
    resp = client.review(review)
    assert resp["apiVersion"] == "admission.k8s.io/v1beta1"
    assert resp["response"]["uid"] == review["request"]["uid"]
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "kube-vgpu-scheduler"} in decode_patch(resp)


def test_denial_over_tls(client: Client) -> None:
    resp = client.review(review_of(base_pod(limits(gpu="1", pct="99.1"))))
    assert resp["response"]["allowed"] is False
    assert resp["response"]["status"]["code"] == 400
    assert "nvidia.com/gpumem-percentage='99.1'" in resp["response"]["status"]["message"]


@pytest.mark.parametrize("body,needle", [
    (b"not json", "not JSON"),
    (b"[1,2]", "JSON list"),
    (b'{"kind":"Pod","apiVersion":"v1"}', "kind='Pod'"),
    (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v2"}', "apiVersion"),
    (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}', "request is missing"),
    (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{"object":{}}}', "uid"),
    (b"\xff\xfe", "not JSON"),
    (b"", "not JSON"),
])
def test_malformed_bodies_400(client: Client, body: bytes, needle: str) -> None:
    status, text, _ = client.request("POST", "/mutate", body)
    assert status == 400 and needle in text.decode()
    assert client.request("GET", "/livez")[0] == 200


def test_huge_body_400_and_server_survives(client: Client, server: BackgroundServer) -> None:
    big = b"{" + b" " * (server.server.max_body_bytes + 10) + b"}"
    status, text, _ = client.request("POST", "/mutate", big)
    assert status == 400 and b"max-body-bytes" in text

    async def chunks() -> Any:  # no Content-Length: the limit applies while reading
        for _ in range(100):
            yield b" " * 4096

    status, text, _ = client.loop.run_until_complete(client._req("POST", "/mutate", chunks(), None))  # type: ignore[arg-type]
    assert status == 400 and b"max-body-bytes" in text
    assert client.review(review_of(base_pod(limits(gpu="1"))))["response"]["allowed"] is True


def test_health_and_metrics(client: Client) -> None:
    client.review(review_of(base_pod(limits(gpumem="10"))))
    client.request("POST", "/mutate", b"junk")
    assert client.request("GET", "/livez")[:2] == (200, b"ok\n")
    assert client.request("GET", "/readyz")[:2] == (200, b"ok\n")
    status, text, headers = client.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    body = text.decode()
    for line in ['kube_vgpu_webhook_requests_total{outcome="patched"}',
                 'kube_vgpu_webhook_requests_total{outcome="bad-request"}',
                 "kube_vgpu_webhook_request_duration_seconds_bucket",
                 'kube_vgpu_webhook_cert_reloads_total{result="ok"} 1.0',
                 "kube_vgpu_webhook_cert_expiry_timestamp_seconds"]:
        assert line in body, line


def test_server_timing_header(client: Client) -> None:
    status, _, headers = client.request("POST", "/mutate", json.dumps(review_of(base_pod())).encode())
    assert status == 200
    timing = dict(part.strip().split(";dur=") for part in headers["Server-Timing"].split(","))
    assert set(timing) == {"handler", "read", "cpu"} and all(float(v) >= 0 for v in timing.values())


def test_unexpected_error_is_500_and_counted(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(server_mod, "answer", boom)
    status, text, _ = client.request("POST", "/mutate", json.dumps(review_of(base_pod())).encode())
    assert status == 500 and b"boom" not in text
    monkeypatch.undo()
    assert client.review(review_of(base_pod()))["response"]["allowed"] is True
    assert 'outcome="error"' in client.request("GET", "/metrics")[1].decode()


def test_untrusted_client_fails_handshake(server: BackgroundServer, tmp_path: Path) -> None:
    other = pki.create_bundle(["x"])
    store.write_files(tmp_path, other)
    c = Client(server.port, tmp_path / "ca.crt")
    try:
        with pytest.raises(Exception) as ei:
            c.request("GET", "/livez")
        assert "certificate" in str(ei.value).lower() or isinstance(ei.value.__cause__, ssl.SSLError)
    finally:
        c.close()


def _issuer_of_peer(port: int, ca_files: list[Path]) -> str:
    ctx = ssl.create_default_context()
    for f in ca_files:
        ctx.load_verify_locations(cafile=str(f))
    with socket.create_connection(("127.0.0.1", port)) as s, ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
        der = t.getpeercert(binary_form=True)
    from cryptography import x509
    return x509.load_der_x509_certificate(der).issuer.rfc4514_string()


def test_certificate_reload_without_dropping_requests(tmp_path: Path) -> None:
    d1, d2 = tmp_path / "old", tmp_path / "new"
    names = pki.service_dns_names("wh", "ns")
    store.write_files(d1, pki.create_bundle(names, ["127.0.0.1"], ca_name="ca-one"))
    new = pki.create_bundle(names, ["127.0.0.1"], ca_name="ca-two")
    store.write_files(d2, new)
    live = tmp_path / "live"
    store.write_files(live, store.read_files(d1))  # type: ignore[arg-type]
    srv = WebhookServer(Config(), str(live / "tls.crt"), str(live / "tls.key"), host="127.0.0.1", port=0,
                        reload_interval=0.05)
    with BackgroundServer(srv) as bg:
        both = tmp_path / "both.pem"
        both.write_bytes((d1 / "ca.crt").read_bytes() + new.ca_crt)
        results: list[int] = []
        stop = threading.Event()

        def hammer() -> None:  # keep-alive connection made before the swap, plus new ones
            c = Client(bg.port, both)
            try:
                while not stop.is_set():
                    results.append(c.request("POST", "/mutate", json.dumps(review_of(base_pod(limits(gpu="1"))))
                                             .encode())[0])
            finally:
                c.close()

        t = threading.Thread(target=hammer)
        t.start()
        time.sleep(0.3)
        assert _issuer_of_peer(bg.port, [d1 / "ca.crt"]) == "CN=ca-one"
        # rotate as a Secret volume would: new key, then new cert
        store.write_files(live, new)
        deadline = time.time() + 5
        while srv.tls is not None and srv.tls.reloads == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert srv.tls is not None and srv.tls.reloads == 1
        assert _issuer_of_peer(bg.port, [d2 / "ca.crt"]) == "CN=ca-two"
        with pytest.raises(ssl.SSLError):
            _issuer_of_peer(bg.port, [d1 / "ca.crt"])
        time.sleep(0.2)
        stop.set()
        t.join()
        assert results and set(results) == {200}
        # a broken pair is not loaded; the good one keeps serving
        (live / "tls.key").write_bytes(b"garbage")
        time.sleep(0.3)
        assert srv.tls.reloads == 1
        assert _issuer_of_peer(bg.port, [d2 / "ca.crt"]) == "CN=ca-two"
        metrics = Client(bg.port, d2 / "ca.crt")
        try:
            text = metrics.request("GET", "/metrics")[1].decode()
        finally:
            metrics.close()
        assert 'kube_vgpu_webhook_cert_reloads_total{result="error"}' in text


def test_cli_serves_and_stops_on_sigterm(tls_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("apiVersion: kube-vgpu.io/v1\nschedulerName: other-sched\n")
    proc = subprocess.Popen([sys.executable, "-m", "kube_vgpu_cli", "webhook", "--config", str(cfg),
                             "--bind-address", "127.0.0.1", "--port", str(port),
                             "--tls-cert-file", str(tls_dir / "tls.crt"), "--tls-key-file", str(tls_dir / "tls.key")],
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        c = None
        deadline = time.time() + 15
        while time.time() < deadline:
            try:
                c = Client(port, tls_dir / "ca.crt")
                if c.request("GET", "/readyz")[0] == 200:
                    break
            except Exception:
                pass
            if c:
                c.close()
                c = None
            time.sleep(0.1)
        assert c is not None, "webhook did not become ready"
        resp = c.review(review_of(base_pod(limits(gpu="1"))))
        assert {"op": "replace", "path": "/spec/schedulerName", "value": "other-sched"} in decode_patch(resp)
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    assert any(x["msg"] == "webhook listening" and x["port"] == port for x in lines)


def test_cli_errors(tmp_path: Path, tls_dir: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("webhook: {privileged: maybe}\n")
    base = ["--tls-cert-file", str(tls_dir / "tls.crt"), "--tls-key-file", str(tls_dir / "tls.key"),
            "--bind-address", "127.0.0.1", "--port", "0"]
    assert server_mod.main(base + ["--config", str(bad)]) == 1
    assert server_mod.main(["--tls-cert-file", str(tmp_path / "nope"), "--tls-key-file", str(tmp_path / "nope"),
                            "--port", "0"]) == 1
    with pytest.raises(SystemExit) as ei:  # a usage error, refused when parsed (tests/test_cli.py)
        server_mod.main(base + ["--max-body-bytes", "0"])
    assert ei.value.code == 2
