"""``kube-vgpu certs``: create or renew the webhook's CA and serving certificate (Helm hook Job).

Idempotent, like kube-webhook-certgen's create+patch: run it any number of times.

1. Read the current bundle from the Secret (``--secret-name``), else from ``--out-dir``.
2. Reuse it when :func:`certs.pki.why_renew` finds nothing wrong (chain, key match, SANs cover the
   Service names ``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.cluster.local`` and every ``--ip``,
   more than ``--renew-before-days`` left); otherwise make a new CA + serving certificate valid
   ``--days``.
3. Write the Secret (``kubernetes.io/tls``: ``tls.crt``, ``tls.key``, ``ca.crt``) and/or the files,
   only where they differ.
4. Patch ``caBundle`` into every webhook of ``--webhook-config-name``. On a rotation the bundle is
   the new CA followed by the previous CA (while it is unexpired), so webhook pods still serving the
   old certificate keep being trusted until they reload the new one. When reusing, a caBundle that
   already contains the CA is left as it is.

``kube-vgpu certs signing-keys ensure ...`` manages the allocation signing keys instead (see
:mod:`certs.signing_keys`).

Exit codes: 0 done, 1 Kubernetes/IO error, 2 usage error. One JSON summary line on stdout
(``{"action": "created"|"renewed"|"reused", "reason": ..., "notAfter": ...}``), logs on stderr.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import sys
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kube_vgpu import jsonlog
from kube_vgpu.cliflags import add_kubeconfig_flag, add_level_flag

from . import pki, store
from .job import run_job

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*")
log = logging.getLogger("kube_vgpu.certs")


def _setup_logging(level: str) -> None:
    jsonlog.setup(level)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kube-vgpu certs", description="create/renew the webhook CA and serving certificate",
        epilog="kube-vgpu certs signing-keys ensure --help: create and rotate the allocation signing keys (a Secret "
               "of HMAC keys the extender and device plugin mount)")
    p.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE") or "kube-system",
                   help="namespace of the Service and the Secret (default: env POD_NAMESPACE or kube-system)")
    p.add_argument("--service", required=True, help="webhook Service name (SANs are derived from it)")
    p.add_argument("--secret-name", help="write a kubernetes.io/tls Secret with tls.crt, tls.key, ca.crt")
    p.add_argument("--webhook-config-name", help="MutatingWebhookConfiguration whose caBundle is patched")
    p.add_argument("--out-dir", help="write ca.crt, tls.crt, tls.key into this directory")
    p.add_argument("--ip", action="append", default=[], help="extra IP SAN (repeatable)")
    p.add_argument("--cluster-domain", default="cluster.local")
    p.add_argument("--days", type=int, default=3650, help="validity of new certificates, days")
    p.add_argument("--renew-before-days", type=int, default=30,
                   help="renew when fewer than this many days are left")
    add_kubeconfig_flag(p)
    add_level_flag(p)
    return p


def api_client(kubeconfig: str | None) -> Any:
    """An official ``kubernetes.client.ApiClient``: ``kubeconfig`` if given, else in-cluster, else
    the default kubeconfig (:func:`kube_vgpu.kubeapi.load_api_client`). Raises
    kubernetes.config.ConfigException when none works."""
    from kube_vgpu.kubeapi import load_api_client

    return load_api_client(kubeconfig)


def _not_after(pem: bytes) -> str:
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc.isoformat()


def _same_ca(a: bytes, b: bytes) -> bool:
    der = serialization.Encoding.DER
    try:
        return x509.load_pem_x509_certificate(a).public_bytes(der) == x509.load_pem_x509_certificate(b).public_bytes(der)
    except ValueError:
        return False


def _ca_in(bundle_pem: bytes, ca_pem: bytes) -> bool:
    try:
        certs = x509.load_pem_x509_certificates(bundle_pem)
    except ValueError:
        return False
    der = serialization.Encoding.DER
    want = x509.load_pem_x509_certificate(ca_pem).public_bytes(der)
    return any(c.public_bytes(der) == want for c in certs)


def run(args: argparse.Namespace, api: Any = None) -> dict[str, Any]:
    """Do steps 1-4 (module docstring). ``api``: an ApiClient (built from --kubeconfig when None and
    the Secret or caBundle is asked for). Returns the summary dict.
    Raises: kubernetes ApiException, OSError, ValueError (bad --ip)."""
    dns = pki.service_dns_names(args.service, args.namespace, args.cluster_domain)
    ips = [str(ipaddress.ip_address(i)) for i in args.ip]
    need_api = bool(args.secret_name or args.webhook_config_name)
    core: Any = None
    adm: Any = None
    if need_api:
        from kubernetes import client
        api = api or api_client(args.kubeconfig)
        core, adm = client.CoreV1Api(api), client.AdmissionregistrationV1Api(api)

    for _ in range(3):  # a concurrent job may create the Secret between our read and create
        existing: pki.Bundle | None = None
        secret_exists = False
        if args.secret_name:
            existing, secret_exists = store.read_secret(core, args.namespace, args.secret_name)
        elif args.out_dir:
            existing = store.read_files(args.out_dir)
        reason = (pki.why_renew(existing, dns, ips, args.renew_before_days) if existing
                  else "no existing certificate")
        if reason is None and existing is not None:
            bundle, action = existing, "reused"
        else:
            bundle = pki.create_bundle(dns, ips, days=args.days)
            action = "renewed" if existing else "created"
            log.info("issuing a new certificate", extra={"reason": reason})
        if args.secret_name and action != "reused":
            if secret_exists:
                store.replace_secret(core, args.namespace, args.secret_name, bundle)
            elif not store.create_secret(core, args.namespace, args.secret_name, bundle):
                log.info("secret appeared meanwhile; re-reading it")
                continue
        break
    else:
        raise RuntimeError("the Secret kept changing under us")

    files_changed = store.write_files(args.out_dir, bundle) if args.out_dir else False
    ca_patched = False
    if args.webhook_config_name:
        current = store.read_ca_bundle(adm, args.webhook_config_name)
        if action == "reused" and current and all(_ca_in(c, bundle.ca_crt) for c in current):
            pass
        else:
            want = bundle.ca_crt
            if existing is not None and action == "renewed" and not _same_ca(existing.ca_crt, bundle.ca_crt):
                for old in pki.still_valid_cas(existing.ca_crt):
                    want += old
            ca_patched = store.patch_ca_bundle(adm, args.webhook_config_name, want)
    return {"action": action, "reason": reason, "notAfter": _not_after(bundle.tls_crt), "dnsNames": dns,
            "ips": ips, "filesChanged": files_changed, "caBundlePatched": ca_patched}


def main(argv: list[str] | None = None) -> int:
    """CLI entry. Returns 0 on success, 1 on errors, 2 on usage errors. ``kube-vgpu certs
    signing-keys ...`` runs :mod:`certs.signing_keys` (the allocation signing keys) instead."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["signing-keys"]:
        from . import signing_keys
        return signing_keys.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    if not (args.secret_name or args.out_dir):
        parser.print_usage(sys.stderr)
        print("kube-vgpu certs: give --secret-name and/or --out-dir", file=sys.stderr)
        return 2
    if args.days < 1 or args.renew_before_days < 0 or args.renew_before_days >= args.days:
        print(f"kube-vgpu certs: --days={args.days} --renew-before-days={args.renew_before_days}: not allowed; "
              "allowed: --days >= 1 and 0 <= --renew-before-days < --days", file=sys.stderr)
        return 2
    for flag, value, rule, allowed in (
            ("--service", args.service, _DNS_LABEL, "a Service name: a DNS label (lowercase letters, digits, '-', "
                                                    "at most 63)"),
            ("--namespace", args.namespace, _DNS_LABEL, "a namespace name: a DNS label (lowercase letters, digits, "
                                                        "'-', at most 63)"),
            ("--cluster-domain", args.cluster_domain, _DNS_SUBDOMAIN, "a DNS domain such as cluster.local")):
        if not rule.fullmatch(value):  # it would become a certificate name no client asks for
            print(f"kube-vgpu certs: {flag}={value!r} is not allowed; allowed: {allowed}", file=sys.stderr)
            return 2
    try:
        for i in args.ip:
            ipaddress.ip_address(i)
    except ValueError as e:
        print(f"kube-vgpu certs: --ip: {e}", file=sys.stderr)
        return 2
    return run_job(run, args, log, "certs failed")  # ApiException, OSError, ConfigException


if __name__ == "__main__":
    raise SystemExit(main())
