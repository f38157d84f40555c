"""CA + serving certificate: SANs, chain, usages, reuse and renewal rules (certs.pki)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs import pki, store

NAMES = pki.service_dns_names("kube-vgpu-webhook", "gpu-system")


def test_service_dns_names() -> None:
    assert NAMES == ["kube-vgpu-webhook", "kube-vgpu-webhook.gpu-system", "kube-vgpu-webhook.gpu-system.svc",
                     "kube-vgpu-webhook.gpu-system.svc.cluster.local"]
    assert pki.service_dns_names("a", "b", "corp.local")[-1] == "a.b.svc.corp.local"


def test_sans_usages_and_chain() -> None:
    b = pki.create_bundle(NAMES, ["10.0.0.7", "::1"], days=365)
    ca = x509.load_pem_x509_certificate(b.ca_crt)
    cert = x509.load_pem_x509_certificate(b.tls_crt)
    dns, ips = pki.cert_sans(cert)
    assert dns == set(NAMES) and ips == {"10.0.0.7", "::1"}
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=365) <= life <= dt.timedelta(days=365, minutes=6)
    assert pki.why_renew(b, NAMES, ["10.0.0.7"]) is None


def test_openssl_verifies_every_service_name(tmp_path: Path) -> None:
    """A TLS client that trusts only ca.crt accepts the certificate for each SAN (hostname check)."""
    b = pki.create_bundle(NAMES, ["127.0.0.1"])
    store.write_files(tmp_path, b)
    srv_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    srv_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(len(NAMES) + 2):
            conn, _ = listener.accept()
            try:
                with srv_ctx.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cli = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    for name in NAMES + ["127.0.0.1"]:
        with socket.create_connection(("127.0.0.1", port)) as s, cli.wrap_socket(s, server_hostname=name) as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError), socket.create_connection(("127.0.0.1", port)) as s:
        cli.wrap_socket(s, server_hostname="evil.example")
    t.join(timeout=5)
    listener.close()


def test_renewal_reasons() -> None:
    now = dt.datetime.now(dt.UTC)
    b = pki.create_bundle(NAMES, days=100)
    assert pki.why_renew(b, NAMES, renew_before_days=30, now=now) is None
    # 75 days later, 25 left < 30
    r = pki.why_renew(b, NAMES, renew_before_days=30, now=now + dt.timedelta(days=75))
    assert r is not None and "renew-before-days=30" in r and "expires" in r
    assert "not valid yet" in (pki.why_renew(b, NAMES, now=now - dt.timedelta(days=1)) or "")
    assert "SANs do not cover other" in (pki.why_renew(b, NAMES + ["other"]) or "")
    assert "10.1.1.1" in (pki.why_renew(b, NAMES, ["10.1.1.1"]) or "")
    other = pki.create_bundle(NAMES)
    assert pki.why_renew(pki.Bundle(b.ca_crt, b.tls_crt, other.tls_key), NAMES) == "tls.key does not match tls.crt"
    assert pki.why_renew(pki.Bundle(other.ca_crt, b.tls_crt, b.tls_key), NAMES) == "tls.crt is not signed by ca.crt"
    assert (pki.why_renew(pki.Bundle(b.tls_crt, b.tls_crt, b.tls_key), NAMES) or "").startswith("tls.crt is not")
    assert "unreadable" in (pki.why_renew(pki.Bundle(b"x", b.tls_crt, b.tls_key), NAMES) or "")


def test_ipv6_and_bad_ip() -> None:
    b = pki.create_bundle(["a"], ["fd00::1"])
    assert pki.why_renew(b, ["a"], [str(ipaddress.ip_address("fd00:0::1"))]) is None
    with pytest.raises(ValueError):
        pki.create_bundle(["a"], ["300.1.1.1"])
    with pytest.raises(ValueError):
        pki.create_bundle([])


def test_still_valid_cas() -> None:
    old = pki.create_bundle(["a"], days=1, now=dt.datetime.now(dt.UTC) - dt.timedelta(days=2))
    cur = pki.create_bundle(["a"])
    assert pki.still_valid_cas(old.ca_crt + cur.ca_crt) == [cur.ca_crt]
    assert pki.still_valid_cas(b"junk") == []
