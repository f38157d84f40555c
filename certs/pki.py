"""A private CA and a webhook serving certificate (``cryptography``; X.509 v3, PEM).

Keys are ECDSA P-256 (accepted by kube-apiserver's Go TLS client, fast to make). The CA is
``CA:TRUE, pathlen 0`` with keyCertSign; the serving certificate is ``CA:FALSE``, digitalSignature,
extendedKeyUsage serverAuth, subjectAltName = the Service DNS names plus any IPs.
Times are timezone-aware UTC ``datetime``; durations in days.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: backdating of notBefore, against clock skew between the job and the API server
SKEW = dt.timedelta(minutes=5)


def service_dns_names(service: str, namespace: str, cluster_domain: str = "cluster.local") -> list[str]:
    """``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.<cluster_domain>``."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.{cluster_domain}"]


@dataclass(frozen=True, slots=True)
class Bundle:
    """PEM bytes of a serving pair and the CA that signed it (the Secret's tls.crt/tls.key/ca.crt)."""

    ca_crt: bytes
    tls_crt: bytes
    tls_key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def create_bundle(dns_names: Sequence[str], ips: Sequence[str] = (), days: int = 3650,
                  now: dt.datetime | None = None, ca_name: str = "kube-vgpu-webhook-ca") -> Bundle:
    """A fresh CA and a serving certificate for ``dns_names`` (first = CN) and ``ips``.

    days: validity of both (the CA is not kept; renewal makes a new CA, see certs.main).
    Raises: ValueError for an invalid IP or no DNS name.
    """
    if not dns_names:
        raise ValueError("at least one DNS name is needed")
    now = now or _now()
    start, end = now - SKEW, now + dt.timedelta(days=days)
    ca_key = _key()
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder()
          .subject_name(ca_subject).issuer_name(ca_subject)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
            .issuer_name(ca_subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    enc = serialization.Encoding.PEM
    return Bundle(ca_crt=ca.public_bytes(enc), tls_crt=cert.public_bytes(enc), tls_key=_key_pem(key))


def cert_sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    """(DNS names, IP addresses as strings) of a certificate's subjectAltName (empty if none)."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), set()
    return set(ext.get_values_for_type(x509.DNSName)), {str(i) for i in ext.get_values_for_type(x509.IPAddress)}


def why_renew(bundle: Bundle, dns_names: Sequence[str], ips: Sequence[str] = (),
              renew_before_days: int = 30, now: dt.datetime | None = None) -> str | None:
    """Why ``bundle`` cannot be reused, or None when it is still good.

    Good means: all three PEMs parse; the key matches tls.crt; tls.crt is signed by ca.crt; the CA
    is a CA; both are valid now and for more than ``renew_before_days``; the SANs cover ``dns_names``
    and ``ips``.
    """
    now = now or _now()
    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_crt)
        cert = x509.load_pem_x509_certificate(bundle.tls_crt)
        key = serialization.load_pem_private_key(bundle.tls_key, password=None)
    except (ValueError, TypeError) as e:
        return f"unreadable PEM: {e}"
    pub = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    if pub != cert.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo):
        return "tls.key does not match tls.crt"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "tls.crt is not signed by ca.crt"
    try:
        if not ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return "ca.crt is not a CA"
    except x509.ExtensionNotFound:
        return "ca.crt is not a CA"
    horizon = now + dt.timedelta(days=renew_before_days)
    for what, c in (("ca.crt", ca), ("tls.crt", cert)):
        if c.not_valid_before_utc > now:
            return f"{what} is not valid yet (notBefore {c.not_valid_before_utc.isoformat()})"
        if c.not_valid_after_utc <= horizon:
            return (f"{what} expires {c.not_valid_after_utc.isoformat()}, within "
                    f"--renew-before-days={renew_before_days}")
    dns, ipset = cert_sans(cert)
    missing = [n for n in dns_names if n not in dns] + [i for i in ips if str(ipaddress.ip_address(i)) not in ipset]
    if missing:
        return f"SANs do not cover {', '.join(missing)}"
    return None


def still_valid_cas(pem: bytes, now: dt.datetime | None = None) -> list[bytes]:
    """The certificates in a PEM bundle (e.g. an old caBundle) that are not expired, as PEM."""
    now = now or _now()
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []
    return [c.public_bytes(serialization.Encoding.PEM) for c in certs if c.not_valid_after_utc > now]
