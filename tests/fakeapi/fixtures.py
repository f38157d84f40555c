"""pytest fixtures for the fake Kubernetes API (imported by tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import FakeKubeAPI


@pytest.fixture
def fake_kube_api() -> Iterator[FakeKubeAPI]:
    """A started FakeKubeAPI (plain HTTP, no auth), stopped after the test."""
    api = FakeKubeAPI()
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def fake() -> Iterator[FakeKubeAPI]:
    """A started FakeKubeAPI sending watch bookmarks every 0.5 s (the extender's and device
    plugin's reflectors follow them), stopped after the test."""
    api = FakeKubeAPI(bookmark_interval=0.5)
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def fake_kube_client(fake_kube_api: FakeKubeAPI):
    """A `kubernetes.client.ApiClient` talking to `fake_kube_api`."""
    client = fake_kube_api.api_client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def fake_core_v1(fake_kube_client):
    """A `kubernetes.client.CoreV1Api` talking to `fake_kube_api`."""
    from kubernetes import client

    return client.CoreV1Api(fake_kube_client)


@pytest.fixture
def fake_kubeconfig(fake_kube_api: FakeKubeAPI, tmp_path) -> str:
    """Path of a kubeconfig file pointing at `fake_kube_api`."""
    return fake_kube_api.kubeconfig(tmp_path / "kubeconfig")
