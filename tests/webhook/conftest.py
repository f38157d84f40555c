"""Fixtures: a CA + serving certificate made by ``certs``, a webhook server on 127.0.0.1 over real
TLS (module scope), and a client that trusts only that CA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from wh_helpers import Client

from certs import pki, store
from kube_vgpu.config import Config
from webhook.server import BackgroundServer, WebhookServer


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    bundle = pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-system"), ["127.0.0.1"])
    store.write_files(d, bundle)
    return d


@pytest.fixture(scope="module")
def server(tls_dir: Path) -> Iterator[BackgroundServer]:
    srv = WebhookServer(Config(), str(tls_dir / "tls.crt"), str(tls_dir / "tls.key"), host="127.0.0.1", port=0,
                        max_body_bytes=64 * 1024, reload_interval=0.1)
    with BackgroundServer(srv) as bg:
        yield bg


@pytest.fixture(scope="module")
def client(server: BackgroundServer, tls_dir: Path) -> Iterator[Client]:
    c = Client(server.port, tls_dir / "ca.crt")
    yield c
    c.close()
