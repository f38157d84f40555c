"""``kube-vgpu certs`` end to end: files, and a Secret + caBundle against the in-process fake
kube-apiserver (tests/fakeapi) through the official kubernetes client and a kubeconfig."""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from certs import main as certs_main
from certs import pki, store

NS, SVC, SECRET, MWC = "kube-system", "kube-vgpu-webhook", "kube-vgpu-webhook-tls", "kube-vgpu-webhook"
NAMES = pki.service_dns_names(SVC, NS)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    rc = certs_main.main(["--namespace", NS, "--service", SVC, *argv])
    out = capsys.readouterr().out.strip()
    return rc, (json.loads(out.splitlines()[-1]) if rc == 0 else {})


# --- files -------------------------------------------------------------------------------------

def test_files_create_reuse_renew(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "tls"
    rc, s = cli(capsys, "--out-dir", str(d), "--ip", "127.0.0.1")
    assert rc == 0 and s["action"] == "created" and s["filesChanged"] is True
    assert oct((d / "tls.key").stat().st_mode & 0o777) == "0o600"
    first = store.read_files(d)
    assert first is not None and pki.why_renew(first, NAMES, ["127.0.0.1"]) is None
    mtime = (d / "tls.crt").stat().st_mtime_ns
    # idempotent: same bytes, files not rewritten
    rc, s = cli(capsys, "--out-dir", str(d), "--ip", "127.0.0.1")
    assert rc == 0 and s["action"] == "reused" and s["filesChanged"] is False and s["reason"] is None
    assert store.read_files(d) == first and (d / "tls.crt").stat().st_mtime_ns == mtime
    # a new SAN is needed -> renewed
    rc, s = cli(capsys, "--out-dir", str(d), "--ip", "127.0.0.1", "--ip", "10.96.0.10")
    assert rc == 0 and s["action"] == "renewed" and "10.96.0.10" in s["reason"]
    # near expiry -> renewed, new cert valid --days
    store.write_files(d, pki.create_bundle(NAMES, days=20))
    rc, s = cli(capsys, "--out-dir", str(d), "--days", "400", "--renew-before-days", "30")
    assert rc == 0 and s["action"] == "renewed" and "within --renew-before-days=30" in s["reason"]
    cert = x509.load_pem_x509_certificate((d / "tls.crt").read_bytes())
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=399) < left <= dt.timedelta(days=400)


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert certs_main.main(["--service", SVC]) == 2
    assert certs_main.main(["--service", SVC, "--out-dir", str(tmp_path), "--ip", "nope"]) == 2
    assert certs_main.main(["--service", SVC, "--out-dir", str(tmp_path), "--days", "10"]) == 2
    with pytest.raises(SystemExit):
        certs_main.main(["--out-dir", str(tmp_path)])  # --service is required


@pytest.mark.parametrize(("flags", "message"), [
    (["--days", "10"], "--days=10 --renew-before-days=30: not allowed; allowed: --days >= 1 and 0 <= "
                       "--renew-before-days < --days"),
    (["--cluster-domain", "..bad"], "--cluster-domain='..bad' is not allowed; allowed: a DNS domain"),
    (["--namespace", "Team_A"], "--namespace='Team_A' is not allowed; allowed: a namespace name"),
    (["--service", "Web_hook"], "--service='Web_hook' is not allowed; allowed: a Service name"),
])
def test_usage_errors_name_the_flag_the_value_and_what_is_allowed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    """A name that is no DNS name would become a certificate name no client asks for."""
    assert certs_main.main(["--service", SVC, "--out-dir", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


# --- Secret + caBundle against the fake API server ---------------------------------------------

def _mwc(api: Any, webhooks: int = 2) -> None:
    api.create_object("mutatingwebhookconfigurations", {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": MWC},
        "webhooks": [{"name": f"w{i}.kube-vgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                      "clientConfig": {"service": {"name": SVC, "namespace": NS, "path": "/mutate"}},
                      "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                 "resources": ["pods"]}]} for i in range(webhooks)]})


def _secret(api: Any) -> dict[str, bytes]:
    s = api.get_object("secrets", SECRET, NS)
    assert s is not None and s["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in s["data"].items()}


def _ca_bundles(api: Any) -> list[bytes]:
    return [base64.b64decode(w["clientConfig"]["caBundle"])
            for w in api.get_object("mutatingwebhookconfigurations", MWC)["webhooks"]]


def _writes(api: Any) -> list[tuple[str, str]]:
    return [(m, p) for m, p in api.requests if m in ("POST", "PUT", "PATCH", "DELETE")]


def test_secret_and_ca_bundle_lifecycle(fake_kube_api: Any, fake_kubeconfig: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    api = fake_kube_api
    _mwc(api)
    args = ["--kubeconfig", fake_kubeconfig, "--secret-name", SECRET, "--webhook-config-name", MWC]

    rc, s = cli(capsys, *args)
    assert rc == 0 and s["action"] == "created" and s["caBundlePatched"] is True
    # only the verbs the chart's RBAC grants (secrets: get/create/update; webhook config: get/patch)
    verbs = {(r.resource.split(".")[0], r.verb) for r in api.request_log}
    assert verbs <= {("secrets", "get"), ("secrets", "create"), ("secrets", "update"),
                     ("mutatingwebhookconfigurations", "get"), ("mutatingwebhookconfigurations", "patch")}, verbs
    assert ("mutatingwebhookconfigurations", "patch") in verbs
    data = _secret(api)
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
    bundle = pki.Bundle(data["ca.crt"], data["tls.crt"], data["tls.key"])
    assert pki.why_renew(bundle, NAMES) is None
    assert _ca_bundles(api) == [data["ca.crt"], data["ca.crt"]]

    # run again: nothing written at all
    api.clear_requests()
    rv = api.resource_version
    rc, s = cli(capsys, *args)
    assert rc == 0 and s["action"] == "reused" and s["caBundlePatched"] is False
    assert _writes(api) == [] and api.resource_version == rv

    # near expiry: renewed; caBundle = new CA + old CA so not-yet-reloaded pods stay trusted
    old = pki.create_bundle(NAMES, days=10)
    store.replace_secret(_core(api), NS, SECRET, old)
    store.patch_ca_bundle(_adm(api), MWC, old.ca_crt)
    rc, s = cli(capsys, *args)
    assert rc == 0 and s["action"] == "renewed" and s["caBundlePatched"] is True
    new = _secret(api)
    assert new["ca.crt"] != old.ca_crt and new["tls.crt"] != old.tls_crt
    assert _ca_bundles(api) == [new["ca.crt"] + old.ca_crt] * 2
    # and once more: reused, the overlap bundle is left alone
    api.clear_requests()
    rc, s = cli(capsys, *args)
    assert rc == 0 and s["action"] == "reused" and _writes(api) == []

    # someone reset the caBundle: repaired without a new certificate
    store.patch_ca_bundle(_adm(api), MWC, b"")
    rc, s = cli(capsys, *args)
    assert rc == 0 and s["action"] == "reused" and _ca_bundles(api) == [new["ca.crt"]] * 2


def _core(api: Any) -> Any:
    from kubernetes import client
    return client.CoreV1Api(api.api_client())


def _adm(api: Any) -> Any:
    from kubernetes import client
    return client.AdmissionregistrationV1Api(api.api_client())


def test_secret_plus_files_and_conflicts(fake_kube_api: Any, fake_kubeconfig: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    api = fake_kube_api
    # a garbage Secret already there (e.g. created empty by a chart) is overwritten, keeping its type
    api.create_object("secrets", {"metadata": {"name": SECRET, "namespace": NS}, "type": "kubernetes.io/tls",
                                  "data": {"tls.crt": base64.b64encode(b"x").decode(),
                                           "tls.key": base64.b64encode(b"y").decode()}})
    api.fail_next("update", "secrets", status=409, count=1)
    rc, s = cli(capsys, "--kubeconfig", fake_kubeconfig, "--secret-name", SECRET, "--out-dir", str(tmp_path))
    assert rc == 0 and s["action"] == "created" and s["reason"] == "no existing certificate"
    assert [r.status for r in api.request_log if r.verb == "update"] == [409, 200]
    data = _secret(api)
    assert store.read_files(tmp_path) == pki.Bundle(data["ca.crt"], data["tls.crt"], data["tls.key"])


def test_create_race_rereads(fake_kube_api: Any, fake_kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> None:
    api = fake_kube_api
    api.fail_next("create", "secrets", status=409, count=1)
    rc, s = cli(capsys, "--kubeconfig", fake_kubeconfig, "--secret-name", SECRET)
    assert rc == 0 and s["action"] == "created"
    assert [r.status for r in api.request_log if r.verb == "create"] == [409, 201]
    assert _secret(api)["ca.crt"]


def test_ca_bundle_patch_retried_on_conflict(fake_kube_api: Any, fake_kubeconfig: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _mwc(fake_kube_api)
    fake_kube_api.fail_next("patch", "mutatingwebhookconfigurations", status=422, count=1)
    rc, s = cli(capsys, "--kubeconfig", fake_kubeconfig, "--secret-name", SECRET, "--webhook-config-name", MWC)
    assert rc == 0 and s["caBundlePatched"] is True
    assert [r.status for r in fake_kube_api.request_log if r.verb == "patch"] == [422, 200]
    assert _ca_bundles(fake_kube_api) == [_secret(fake_kube_api)["ca.crt"]] * 2


def test_missing_webhook_config_fails(fake_kube_api: Any, fake_kubeconfig: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = cli(capsys, "--kubeconfig", fake_kubeconfig, "--secret-name", SECRET, "--webhook-config-name", "nope")
    assert rc == 1
    # the Secret is there, so the Job's retry only has the patch left to do
    _mwc(fake_kube_api, webhooks=1)
    fake_kube_api.clear_requests()
    rc, s = cli(capsys, "--kubeconfig", fake_kubeconfig, "--secret-name", SECRET, "--webhook-config-name", MWC)
    assert rc == 0 and s["action"] == "reused" and s["caBundlePatched"] is True
    assert [p for _, p in _writes(fake_kube_api)] == [
        f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{MWC}"]
