""":class:`kube_vgpu.kubeapi.JSONClient`'s own connections (kept-alive ``http.client`` connections
built from the kubeconfig configuration) over real TLS against the fake kube-apiserver: one
connection reused for many requests, a connection the server closed while idle replaced before a
request is sent on it, a write whose connection broke after the server read it raised as an
unknown outcome and never sent twice, HTTP errors mapped as the generated client maps them, the
bearer token refreshed through ``Configuration.auth_settings()``, client-certificate
authentication, and the TLS name checks (``tls_server_name``, ``verify_ssl``)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import select
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kube_vgpu.kubeapi import JSONClient, is_conflict, is_not_found, load_api_client, outcome_unknown
from tests.fakeapi import FakeKubeAPI

TOKEN = "pool-token"


class _Fake(FakeKubeAPI):
    """The fake API server, remembering the server side of every connection so a test can close
    them (a server closing idle kept-alive connections), and optionally requiring a client
    certificate signed by ``client_ca``."""

    def __init__(self, client_ca: str | None = None, **kw: Any):
        super().__init__(tls=True, bookmark_interval=3600, **kw)
        self.client_ca = client_ca
        self.transports: list[Any] = []

    def _make_tls(self) -> ssl.SSLContext:
        ctx = super()._make_tls()
        if self.client_ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(self.client_ca)
        return ctx

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.transport is not None and request.transport not in self.transports:
            self.transports.append(request.transport)
        return await super()._handle(request)

    def close_connections(self) -> int:
        """Close every client connection from the server's side (as an idle timeout does)."""

        async def close() -> int:
            n = 0
            for t in self.transports:
                if not t.is_closing():
                    t.close()
                    n += 1
            self.transports.clear()
            return n

        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)


@pytest.fixture(scope="module")
def fake() -> Iterator[_Fake]:
    api = _Fake(token=TOKEN)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _pod(fake: FakeKubeAPI, name: str) -> dict[str, Any]:
    return fake.create_object("pods", {"metadata": {"name": name, "namespace": "default"},
                                       "spec": {"containers": [{"name": "c", "image": "busybox"}]}})


def _path(name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/default/pods/{name}{sub}"


def _binding(pod: dict[str, Any], node: str) -> dict[str, Any]:
    m = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Binding", "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            "metadata": {"name": m["name"], "namespace": "default", "uid": m["uid"],
                         "resourceVersion": m["resourceVersion"], "annotations": {"kube-vgpu.io/t": "x"}}}


def _idle_readable(jc: JSONClient) -> None:
    """Wait (on the socket, no sleep) until the client's idle connection sees the server's close."""
    assert len(jc._idle) == 1
    assert select.select([jc._idle[0].sock], [], [], 10)[0], "the server's close never arrived"


def _count(fake: FakeKubeAPI, method: str, path: str) -> int:
    return sum(1 for r in fake.request_log if r.method == method and r.path == path)


def test_one_kept_alive_connection_for_many_requests(fake: _Fake) -> None:
    jc = JSONClient(fake.api_client())
    assert not jc.via_urllib3 and jc.context is not None
    pods = [_pod(fake, f"keep-{i}") for i in range(6)]
    before = fake.connection_count
    for p in pods:
        assert jc.request("GET", _path(p["metadata"]["name"]))["metadata"]["uid"] == p["metadata"]["uid"]
        jc.request("PATCH", _path(p["metadata"]["name"]), {"metadata": {"labels": {"a": "b"}}},
                   "application/merge-patch+json")
        jc.request("POST", _path(p["metadata"]["name"], "/binding"), _binding(
            fake.get_object("pods", p["metadata"]["name"], "default") or {}, "node-1"))
    assert jc.dials == 1 and fake.connection_count == before + 1


def test_concurrent_threads_each_take_their_own_connection_and_keep_it(fake: _Fake) -> None:
    jc = JSONClient(fake.api_client())
    _pod(fake, "threads")
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait(10)
            for _ in range(15):
                jc.request("GET", _path("threads"))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    before = fake.connection_count
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert 1 <= jc.dials <= 4 and fake.connection_count == before + jc.dials
    assert len(jc._idle) == jc.dials  # every connection kept for the next request


def test_connection_closed_by_the_server_while_idle_is_replaced_before_sending(fake: _Fake) -> None:
    """The server closes kept-alive connections (its idle timeout): the next GET and the next
    write (a Binding) go out on a new connection without an error, each sent exactly once."""
    jc = JSONClient(fake.api_client())
    pod = _pod(fake, "idle-closed")
    jc.request("GET", _path("idle-closed"))
    assert fake.close_connections() >= 1
    _idle_readable(jc)
    fake.clear_requests()
    assert jc.request("GET", _path("idle-closed"))["metadata"]["uid"] == pod["metadata"]["uid"]
    assert jc.dials == 2 and _count(fake, "GET", _path("idle-closed")) == 1
    assert fake.close_connections() >= 1
    _idle_readable(jc)
    jc.request("POST", _path("idle-closed", "/binding"), _binding(pod, "node-2"))
    assert jc.dials == 3 and _count(fake, "POST", _path("idle-closed", "/binding")) == 1
    bound = fake.get_object("pods", "idle-closed", "default")
    assert bound is not None and bound["spec"]["nodeName"] == "node-2"


@pytest.mark.parametrize("verb", ["create", "patch"])
def test_write_whose_connection_drops_after_the_server_read_it_is_unknown_and_not_resent(
        fake: _Fake, verb: str) -> None:
    """The server reads (and applies) a write on a kept-alive connection, then drops the connection
    without an answer: the client raises an error :func:`outcome_unknown` calls unknown and never
    sends the write again; the next request dials a new connection."""
    jc = JSONClient(fake.api_client())
    name = f"dropped-{verb}"
    pod = _pod(fake, name)
    jc.request("GET", _path(name))  # the connection is kept alive from here
    fake.clear_requests()
    fake.fail_after_commit(verb, "pods/binding" if verb == "create" else "pods", "reset", name=name)
    with pytest.raises(Exception) as ei:
        if verb == "create":
            jc.request("POST", _path(name, "/binding"), _binding(pod, "node-3"))
        else:
            jc.request("PATCH", _path(name), {"metadata": {"labels": {"x": "y"}}}, "application/merge-patch+json")
    assert outcome_unknown(ei.value), repr(ei.value)
    assert not isinstance(ei.value, ApiException) or ei.value.status == 0
    method, path = ("POST", _path(name, "/binding")) if verb == "create" else ("PATCH", _path(name))
    assert _count(fake, method, path) == 1  # sent once, never again
    after = fake.get_object("pods", name, "default")
    assert after is not None  # the write was applied: only its answer was lost
    assert (after["spec"].get("nodeName") == "node-3") if verb == "create" else after["metadata"]["labels"] == {"x": "y"}
    dials = jc.dials
    assert jc.request("GET", _path(name))["metadata"]["name"] == name
    assert jc.dials == dials + 1


def test_get_on_a_connection_dropped_under_it_is_read_again_once(fake: _Fake) -> None:
    """A GET (no side effect) whose kept-alive connection is dropped with no answer is sent once
    more on a new connection; a second drop is an error."""
    jc = JSONClient(fake.api_client())
    _pod(fake, "reread")
    jc.request("GET", _path("reread"))
    fake.clear_requests()
    fake.fail_after_commit("get", "pods", "reset", name="reread")
    assert jc.request("GET", _path("reread"))["metadata"]["name"] == "reread"
    assert _count(fake, "GET", _path("reread")) == 2 and jc.dials == 2
    fake.fail_after_commit("get", "pods", "reset", count=2, name="reread")
    with pytest.raises(urllib3.exceptions.ProtocolError) as ei:
        jc.request("GET", _path("reread"))
    assert outcome_unknown(ei.value)
    fake.clear_failures()


def test_read_timeout_is_unknown(fake: _Fake) -> None:
    jc = JSONClient(fake.api_client(), timeout=0.5)
    pod = _pod(fake, "hung")
    fake.fail_after_commit("create", "pods/binding", "timeout", name="hung")
    with pytest.raises(urllib3.exceptions.ReadTimeoutError) as ei:
        jc.request("POST", _path("hung", "/binding"), _binding(pod, "node-4"))
    assert outcome_unknown(ei.value)
    assert not jc._idle  # the connection with a request still in flight is never reused


def test_http_errors_map_as_the_generated_client_maps_them(fake: _Fake) -> None:
    jc = JSONClient(fake.api_client())
    _pod(fake, "errs")
    with pytest.raises(ApiException) as ei:
        jc.request("GET", _path("no-such"))
    e = ei.value
    assert (e.status, e.reason) == (404, "Not Found") and is_not_found(e) and not outcome_unknown(e)
    assert '"reason":"NotFound"' in (e.body or "").replace(" ", "")
    with pytest.raises(ApiException) as ei:  # AlreadyExists
        jc.request("POST", "/api/v1/namespaces/default/pods",
                   {"metadata": {"name": "errs"}, "spec": {"containers": [{"name": "c", "image": "x"}]}})
    assert ei.value.status == 409 and is_conflict(ei.value) and not outcome_unknown(ei.value)
    fake.fail_next("get", "pods", status=500, name="errs")
    with pytest.raises(ApiException) as ei:
        jc.request("GET", _path("errs"))
    assert ei.value.status == 500 and outcome_unknown(ei.value)
    assert ei.value.headers is not None and "json" in ei.value.headers.get("Content-Type", "")
    fake.fail_next("get", "pods", status=429, name="errs")
    with pytest.raises(ApiException) as ei:
        jc.request("GET", _path("errs"))
    assert ei.value.status == 429 and outcome_unknown(ei.value)
    assert ei.value.headers is not None and ei.value.headers.get("Retry-After") == "1"
    assert jc.request("GET", _path("errs"))["metadata"]["name"] == "errs"  # the connection survives errors
    assert jc.dials == 1


def test_bearer_token_is_refreshed_through_auth_settings() -> None:
    """The configuration's refresh hook (a kubeconfig exec/expiring or in-cluster token) is asked
    through ``auth_settings()``: every request with ``token_ttl=0``; otherwise every ``token_ttl``
    seconds and at once after a 401."""
    with _Fake(token="t1") as fake:
        _pod(fake, "tok")
        current = ["t1"]
        asked = [0]
        cfg = fake.configuration()

        def hook(c: client.Configuration) -> None:
            asked[0] += 1
            c.api_key = {"authorization": current[0]}

        cfg.refresh_api_key_hook = hook
        every = JSONClient(client.ApiClient(cfg), token_ttl=0)
        every.request("GET", _path("tok"))
        fake.token = current[0] = "t2"
        assert every.request("GET", _path("tok"))["metadata"]["name"] == "tok"
        cached = JSONClient(client.ApiClient(cfg), token_ttl=3600)
        cached.request("GET", _path("tok"))
        n = asked[0]
        cached.request("GET", _path("tok"))
        assert asked[0] == n  # read once per token_ttl, not per request
        fake.token = current[0] = "t3"  # rotated: the cached token is refused once
        with pytest.raises(ApiException) as ei:
            cached.request("GET", _path("tok"))
        assert ei.value.status == 401 and not outcome_unknown(ei.value)
        assert cached.request("GET", _path("tok"))["metadata"]["name"] == "tok"
        assert asked[0] == n + 1
        assert [r.status for r in fake.request_log if r.path == _path("tok")].count(401) == 1


def _client_ca(tmp: Path) -> tuple[str, bytes, bytes]:
    """A client CA (its PEM path) and a client certificate and key it signed (PEM bytes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "system:kube-vgpu")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path = tmp / "client-ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return (str(ca_path), cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _kubeconfig(fake: FakeKubeAPI, path: Path, user: dict[str, str], cluster: dict[str, Any] | None = None) -> str:
    import yaml

    assert fake.ca_cert_path is not None
    c = {"server": fake.base_url,
         "certificate-authority-data": base64.b64encode(Path(fake.ca_cert_path).read_bytes()).decode(), **(cluster or {})}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": c}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


def test_client_certificate_from_the_kubeconfig_authenticates(tmp_path: Path) -> None:
    """A kubeconfig user with a client certificate: the TLS handshake presents it; without it the
    server refuses the connection and no request reaches it."""
    ca_path, cert, key = _client_ca(tmp_path)
    with _Fake(client_ca=ca_path) as fake:
        _pod(fake, "mtls")
        with_cert = _kubeconfig(fake, tmp_path / "with", {
            "client-certificate-data": base64.b64encode(cert).decode(),
            "client-key-data": base64.b64encode(key).decode()})
        jc = JSONClient(load_api_client(with_cert))
        assert jc.request("GET", _path("mtls"))["metadata"]["name"] == "mtls"
        fake.clear_requests()
        without = JSONClient(load_api_client(_kubeconfig(fake, tmp_path / "without", {"token": "x"})))
        with pytest.raises((ApiException, urllib3.exceptions.HTTPError)) as ei:
            without.request("GET", _path("mtls"))
        assert outcome_unknown(ei.value)
        assert not fake.request_log


def test_tls_names_and_verification(fake: _Fake, tmp_path: Path) -> None:
    """``tls-server-name`` is the name the certificate must carry (the fake's: 127.0.0.1 and
    localhost); a name it does not carry, or another server's certificate, is a TLS error (status
    0, unknown); ``insecure-skip-tls-verify`` connects without checking."""
    _pod(fake, "names")
    ok = JSONClient(load_api_client(_kubeconfig(fake, tmp_path / "a", {"token": TOKEN},
                                                {"tls-server-name": "localhost"})))
    assert ok.server_name == "localhost" and ok.request("GET", _path("names"))["metadata"]["name"] == "names"
    bad = JSONClient(load_api_client(_kubeconfig(fake, tmp_path / "b", {"token": TOKEN},
                                                 {"tls-server-name": "other.example"})))
    with pytest.raises(ApiException) as ei:
        bad.request("GET", _path("names"))
    assert ei.value.status == 0 and outcome_unknown(ei.value)
    with _Fake() as other:  # trusts only `fake`'s CA
        cfg = fake.configuration()
        cfg.host = other.base_url
        with pytest.raises(ApiException) as ei:
            JSONClient(client.ApiClient(cfg)).request("GET", "/api/v1/namespaces/default/pods")
        assert ei.value.status == 0
        cfg.verify_ssl = False
        assert JSONClient(client.ApiClient(cfg)).request("GET", "/api/v1/namespaces/default/pods")["kind"] == "PodList"


def test_a_proxy_keeps_the_generated_clients_pool(fake: _Fake) -> None:
    cfg = fake.configuration()
    cfg.proxy = "http://127.0.0.1:9"
    assert JSONClient(client.ApiClient(cfg)).via_urllib3
    cfg.no_proxy = "127.0.0.1"  # bypassed: direct
    assert not JSONClient(client.ApiClient(cfg)).via_urllib3
