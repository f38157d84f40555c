"""Which pod and container kubelet gave a set of device IDs: kubelet's PodResources API (v1).

kubelet serves ``v1.PodResourcesLister`` on ``/var/lib/kubelet/pod-resources/kubelet.sock``
(``--pod-resources-socket``). Its ``List`` reports, for every pod kubelet runs, each container's
device IDs per resource name, as recorded by kubelet's device manager right after our ``Allocate``
answered. kubelet calls ``PreStartContainer`` only after that record exists, so at PreStart the
listing names exactly the container that holds the IDs: no guessing (docs/device-plugin.md).

The stubs are ``deviceplugin/api/podresources_pb2*.py``, generated from ``podresources.proto``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from .api import podresources_pb2, podresources_pb2_grpc

#: kubelet's default PodResources socket
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(Exception):
    """kubelet's PodResources API could not be asked (socket missing, kubelet down, timeout)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A container holding devices of one resource: pod namespace and name, container name, and its
    device IDs (sorted)."""

    namespace: str
    pod: str
    container: str
    device_ids: tuple[str, ...]

    @property
    def key(self) -> str:
        """``namespace/pod/container``."""
        return f"{self.namespace}/{self.pod}/{self.container}"


def holders(resp: podresources_pb2.ListPodResourcesResponse, resource: str) -> list[Holder]:
    """The containers in a ``List`` answer that hold devices of ``resource`` (pure). A container
    listed with several device entries for the resource holds their union."""
    out = []
    for pod in resp.pod_resources:
        for ctr in pod.containers:
            ids = sorted({i for d in ctr.devices if d.resource_name == resource for i in d.device_ids})
            if ids:
                out.append(Holder(pod.namespace, pod.name, ctr.name, tuple(ids)))
    return out


def holders_of(listing: Iterable[Holder], device_ids: Iterable[str]) -> list[Holder]:
    """The holders whose device IDs are exactly ``device_ids`` (as a set; pure)."""
    want = tuple(sorted(set(device_ids)))
    return [h for h in listing if h.device_ids == want]


class PodResourcesClient:
    """Client for kubelet's ``v1.PodResourcesLister`` on the unix socket ``socket_path``.

    One channel, opened on first use and kept (grpc reconnects by itself when kubelet restarts).
    ``timeout``: seconds per call.
    """

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: podresources_pb2_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> podresources_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._stub = podresources_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def list(self, resource: str, timeout: float | None = None) -> list[Holder]:
        """Every container kubelet lists as holding devices of ``resource``. timeout: seconds for
        this call (default: the client's).

        Raises PodResourcesError when kubelet cannot be asked (the message names the socket)."""
        try:
            resp = self._lister().List(podresources_pb2.ListPodResourcesRequest(),
                                       timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            raise PodResourcesError(f"kubelet PodResources List on {self.socket_path} failed: {code}: "
                                    f"{details}") from e
        return holders(resp, resource)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None
