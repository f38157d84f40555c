"""kubelet's PodResources answer read by the device plugin (pure), and the client against a real
gRPC server on a unix socket (the fake kubelet's)."""

from __future__ import annotations

import os

import pytest
from dp_helpers import FakeKubelet

from deviceplugin.api import podresources_pb2 as pr
from deviceplugin.podresources import Holder, PodResourcesClient, PodResourcesError, holders, holders_of

GPU = "nvidia.com/gpu"


def _resp() -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(pod_resources=[
        pr.PodResources(namespace="ns", name="a", containers=[
            pr.ContainerResources(name="c", devices=[
                pr.ContainerDevices(resource_name=GPU, device_ids=["G1::1"]),
                pr.ContainerDevices(resource_name=GPU, device_ids=["G0::0"]),
                pr.ContainerDevices(resource_name="example.com/nic", device_ids=["nic0"])]),
            pr.ContainerResources(name="cpu-only", cpu_ids=[1, 2])]),
        pr.PodResources(namespace="ns", name="b", containers=[
            pr.ContainerResources(name="c", devices=[pr.ContainerDevices(resource_name=GPU, device_ids=["G0::1"])])]),
    ])


def test_holders_union_of_entries_other_resources_ignored() -> None:
    got = holders(_resp(), GPU)
    assert got == [Holder("ns", "a", "c", ("G0::0", "G1::1")), Holder("ns", "b", "c", ("G0::1",))]
    assert holders_of(got, ["G1::1", "G0::0"]) == [got[0]]  # order-independent
    assert holders_of(got, ["G0::0"]) == []  # exactly, not a subset
    assert holders_of(got, ["G0::1", "G0::0", "G1::1"]) == []


def test_client_lists_over_the_socket_and_names_the_socket_on_failure(kubelet: FakeKubelet, sockdir: str) -> None:
    c = PodResourcesClient(kubelet.podresources_socket)
    try:
        assert c.list(GPU) == []
    finally:
        c.close()
    missing = PodResourcesClient(os.path.join(sockdir, "none.sock"), timeout=0.5)
    with pytest.raises(PodResourcesError, match="none.sock"):
        missing.list(GPU)
    missing.close()
