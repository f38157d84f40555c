"""``migStrategy: mixed``: MIG devices advertised per profile as ``nvidia.com/mig-<profile>``, as
NVIDIA's device plugin does (docs/mig.md).

One v1beta1 ``DevicePlugin`` gRPC server per profile resource, on ``<device-plugin-dir>/kube-vgpu-mig-<profile>.sock``,
registered with kubelet beside the vGPU resource. The device IDs are the MIG devices' ``MIG-...``
uuids; kube-scheduler counts them like any extended resource. ``Allocate`` answers
``NVIDIA_VISIBLE_DEVICES`` (:data:`kube_vgpu.envcontract.VISIBLE_DEVICES`) with exactly the MIG
devices kubelet chose, after checking each is one this resource advertises now; a MIG device is
isolated by the hardware, so no shim, limits file or PreStartContainer is involved.

What a tenant can write cannot widen that: the webhook denies ``NVIDIA_VISIBLE_DEVICES`` (and every
``NVIDIA_*`` runtime knob) in containers that ask for a MIG resource, as in vGPU containers
(webhook/isolation.py), so the only MIG devices a container gets are those kubelet allocated to it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from kube_vgpu.envcontract import VISIBLE_DEVICES
from kube_vgpu.resources import mig_resource

from .api import API_VERSION, HEALTHY, UNHEALTHY, api_pb2, api_pb2_grpc
from .nvml import MigDevice

log = logging.getLogger("kube_vgpu.deviceplugin.mig")


def socket_name(profile: str) -> str:
    """The socket file of a profile's resource (``kube-vgpu-mig-1g.10gb.sock``; ``+`` becomes ``-me``)."""
    return f"kube-vgpu-mig-{profile.replace('+', '-')}.sock"


def no_preference(request: Any) -> api_pb2.PreferredAllocationResponse:
    """A ``GetPreferredAllocation`` answer without a preference: per container request, the IDs it
    must include, then the first available ones up to its allocation size (kubelet's own choice)."""
    resp = api_pb2.PreferredAllocationResponse()
    for creq in request.container_requests:
        ids = list(creq.must_include_deviceIDs)
        ids += [i for i in creq.available_deviceIDs if i not in ids][: max(0, creq.allocation_size - len(ids))]
        resp.container_responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
    return resp


@dataclass(frozen=True, slots=True)
class MigSlot:
    """One advertised MIG device: uuid (the device ID), health, NUMA node."""

    uuid: str
    healthy: bool
    numa: int


def by_resource(gpu_name: str, migs: Iterable[MigDevice], health: dict[str, bool], numa: dict[str, int]
                ) -> dict[str, list[MigSlot]]:
    """resource name -> its MIG devices (health and NUMA node of the parent GPU), profile by profile."""
    out: dict[str, list[MigSlot]] = {}
    for m in migs:
        out.setdefault(mig_resource(gpu_name, m.profile), []).append(
            MigSlot(m.uuid, health.get(m.parent, True), numa.get(m.parent, 0)))
    return out


class _Resource:
    """The gRPC server of one profile resource."""

    def __init__(self, owner: MixedMig, resource: str, profile: str) -> None:
        self.owner = owner
        self.resource = resource
        self.profile = profile
        self.server: grpc.Server | None = None

    @property
    def socket(self) -> str:
        return os.path.join(self.owner.plugin_dir, socket_name(self.profile))

    def serve(self) -> None:
        self.stop()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="deviceplugin-mig"))
        api_pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0.2).wait()
            self.server = None

    def allocate(self, req: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """NVIDIA_VISIBLE_DEVICES = the chosen MIG devices. Raises ValueError for an ID this
        resource does not advertise now, or one named twice."""
        known = {s.uuid for s in self.owner.slots(self.resource)}
        resp = api_pb2.AllocateResponse()
        for creq in req.container_requests:
            ids = list(creq.devices_ids)
            bad = [i for i in ids if i not in known]
            if bad or not ids:
                raise ValueError(f"{self.resource}: unknown device IDs {', '.join(repr(i) for i in bad) or '(none)'} "
                                 f"(not advertised by this plugin)")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{self.resource}: device IDs requested more than once: {', '.join(ids)}")
            log.info("MIG devices allocated", extra={"resource": self.resource, "ids": ",".join(ids)})
            resp.container_responses.append(api_pb2.ContainerAllocateResponse(envs={VISIBLE_DEVICES: ",".join(ids)}))
        return resp


class _Servicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, r: _Resource) -> None:
        self.r = r

    def GetDevicePluginOptions(self, request: Any, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[api_pb2.ListAndWatchResponse]:
        yield from self.r.owner.watch(self.r.resource, context.is_active)

    def Allocate(self, request: Any, context: Any) -> api_pb2.AllocateResponse:
        try:
            return self.r.allocate(request)
        except ValueError as e:
            log.error("request refused", extra={"call": "Allocate", "resource": self.r.resource, "error": str(e)})
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # not reached: abort raises

    def PreStartContainer(self, request: Any, context: Any) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    def GetPreferredAllocation(self, request: Any, context: Any) -> api_pb2.PreferredAllocationResponse:
        return no_preference(request)


class MixedMig:
    """Every profile resource of a node (``migStrategy: mixed``): set the MIG devices, :meth:`serve`,
    :meth:`register` with kubelet (again after a kubelet restart), :meth:`stop`."""

    def __init__(self, plugin_dir: str, register_timeout: float = 5.0) -> None:
        self.plugin_dir = plugin_dir
        self.register_timeout = register_timeout
        self._cond = threading.Condition()
        self._slots: dict[str, list[MigSlot]] = {}
        self._version = 0
        self._stopped = False
        self._resources: dict[str, _Resource] = {}

    def set(self, slots: dict[str, list[MigSlot]], profiles: dict[str, str]) -> None:
        """The advertised devices per resource (``profiles``: resource -> profile name); a health
        change is pushed to every ListAndWatch stream."""
        with self._cond:
            self._slots = {k: list(v) for k, v in slots.items()}
            for res, prof in profiles.items():
                self._resources.setdefault(res, _Resource(self, res, prof))
            self._version += 1
            self._cond.notify_all()

    def resources(self) -> list[str]:
        with self._cond:
            return sorted(self._resources)

    def slots(self, resource: str) -> list[MigSlot]:
        with self._cond:
            return list(self._slots.get(resource, ()))

    def list_response(self, resource: str) -> api_pb2.ListAndWatchResponse:
        return api_pb2.ListAndWatchResponse(devices=[
            api_pb2.Device(ID=s.uuid, health=HEALTHY if s.healthy else UNHEALTHY,
                           topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=s.numa)]))
            for s in self.slots(resource)])

    def watch(self, resource: str, is_active: Any) -> Iterator[api_pb2.ListAndWatchResponse]:
        seen = -1
        while is_active():
            with self._cond:
                if self._stopped:
                    return
                if self._version == seen:
                    self._cond.wait(timeout=0.5)
                    continue
                seen = self._version
            yield self.list_response(resource)

    def serve(self) -> None:
        """(Re)start every resource's gRPC server on its socket."""
        for r in list(self._resources.values()):
            r.serve()

    def sockets_present(self) -> bool:
        return all(os.path.exists(r.socket) for r in self._resources.values())

    def register(self, kubelet_socket: str) -> None:
        """Register every resource with kubelet. Raises grpc.RpcError."""
        for r in list(self._resources.values()):
            with grpc.insecure_channel(f"unix://{kubelet_socket}") as ch:
                api_pb2_grpc.RegistrationStub(ch).Register(api_pb2.RegisterRequest(
                    version=API_VERSION, endpoint=os.path.basename(r.socket), resource_name=r.resource,
                    options=api_pb2.DevicePluginOptions(pre_start_required=False)),
                    timeout=self.register_timeout)
            log.info("registered with kubelet", extra={"resource": r.resource, "socket": kubelet_socket})

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for r in list(self._resources.values()):
            r.stop()
            try:
                os.unlink(r.socket)
            except FileNotFoundError:
                pass
