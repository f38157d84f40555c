"""Red-team tests of the extender's kept-alive API client (:class:`kube_vgpu.kubeapi.JSONClient`).

The generated client's urllib3 pool reads the CA file (and the client certificate) at every new
connection, so an in-cluster extender follows a rotation of the cluster CA
(``/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`` is updated in place). A JSONClient
that built its TLS context once would keep trusting the old CA only: after the rotation every
bind fails (an unknown outcome each time) until the extender restarts, while its watches go on.
Verification must never be skipped to get there."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kube_vgpu.kubeapi import JSONClient
from tests.fakeapi import FakeKubeAPI

PATH = "/api/v1/namespaces/default/pods"


def _rotate(src: str, dst: str) -> None:
    """Replace ``dst`` by a copy of ``src`` the way kubelet updates a projected file (new inode)."""
    tmp = dst + ".new"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def test_a_rotated_ca_file_is_read_again_for_new_connections(tmp_path: Any) -> None:
    """The CA file first holds another CA: refused. After the file is rotated to the server's CA,
    the next connection verifies against it; rotated back, new connections are refused again
    (the old trust does not linger, and verification is never switched off)."""
    with FakeKubeAPI(tls=True) as server, FakeKubeAPI(tls=True) as other:
        assert server.ca_cert_path and other.ca_cert_path
        ca = str(tmp_path / "ca.crt")
        shutil.copyfile(other.ca_cert_path, ca)
        cfg = server.configuration()
        cfg.ssl_ca_cert = ca
        http = JSONClient(client.ApiClient(cfg))
        with pytest.raises((ApiException, urllib3.exceptions.HTTPError)):
            http.request("GET", PATH)
        assert not any(r.path.startswith(PATH) for r in server.request_log)

        _rotate(server.ca_cert_path, ca)
        assert "items" in http.request("GET", PATH)

        _rotate(other.ca_cert_path, ca)
        http.close()  # drop the kept-alive connection: the next request dials
        with pytest.raises((ApiException, urllib3.exceptions.HTTPError)):
            http.request("GET", PATH)
