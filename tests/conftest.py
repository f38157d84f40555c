"""Shared pytest configuration. Keep it small: put fixtures in their own module and import them here."""

from fakeapi.fixtures import fake_core_v1, fake_kube_api, fake_kube_client, fake_kubeconfig  # noqa: F401
