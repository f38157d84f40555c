"""The one API call the DRA plugin makes itself: read a ResourceClaim (``resource.k8s.io/v1``).

``GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`` through the official client
(:func:`kube_vgpu.kubeapi.load_api_client`); the answer is plain API JSON, as
:func:`kube_vgpu.dra.claims.read_claim` reads it. The chart's RBAC: ``get`` resourceclaims.
"""

from __future__ import annotations

from typing import Any

from kube_vgpu.kubeapi import read_json


class ApiClaimClient:
    """:class:`deviceplugin.dra.plugin.ClaimSource` over ``kubernetes.client.ResourceV1Api``.

    api_client: a ``kubernetes.client.ApiClient``; timeout: per-request timeout in seconds.
    """

    def __init__(self, api_client: Any, timeout: float = 10.0) -> None:
        from kubernetes import client

        self.resource = client.ResourceV1Api(api_client)
        self.timeout = timeout

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim as API JSON. Raises ApiException (404 when absent) or a connection error."""
        resp: Any = self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False,
                                                                 _request_timeout=self.timeout)
        return read_json(resp)
