"""gRPC serving of the DRA plugin: the ``v1.DRAPlugin`` service and kubelet plugin registration.

Two unix sockets:

* the service socket ``<plugin-dir>/dra.sock`` (``/var/lib/kubelet/plugins/vgpu.kube-vgpu.io/dra.sock``
  by default): ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (NodePrepareResources,
  NodeUnprepareResources);
* the registration socket ``<registry-dir>/vgpu.kube-vgpu.io-reg.sock``
  (``/var/lib/kubelet/plugins_registry``): ``pluginregistration.Registration``. kubelet's plugin
  watcher finds the socket, calls ``GetInfo`` (answer: type ``DRAPlugin``, name = the driver name,
  endpoint = the service socket's path, supported versions ``["v1.DRAPlugin"]``, the service name
  kubelet 1.34+ picks the v1 API by) and reports the outcome with ``NotifyRegistrationStatus``.

A supervisor thread recreates a socket that vanished (a kubelet restart may clean the registry
directory); kubelet then registers the plugin again.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from typing import Any

import grpc

from kube_vgpu.dra import DRIVER_NAME

from .api import dra_pb2, dra_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from .plugin import DRAPlugin

log = logging.getLogger("kube_vgpu.deviceplugin.dra")

#: plugin type kubelet's DRA handler registers (pluginregistration/v1 constants)
PLUGIN_TYPE = "DRAPlugin"
#: the gRPC service we implement, as kubelet names it in supported versions (dra/v1 DRAPluginService)
SUPPORTED_SERVICES = ("v1.DRAPlugin",)
SERVICE_SOCKET = "dra.sock"
REGISTRATION_SOCKET = f"{DRIVER_NAME}-reg.sock"


class DRAServicer(dra_pb2_grpc.DRAPluginServicer):
    """``v1.DRAPlugin`` over :class:`deviceplugin.dra.plugin.DRAPlugin` (per-claim errors are in the
    answer; an unexpected exception becomes INTERNAL, and kubelet retries)."""

    def __init__(self, plugin: DRAPlugin) -> None:
        self.p = plugin

    def NodePrepareResources(self, request: Any, context: Any) -> dra_pb2.NodePrepareResourcesResponse:
        return self.p.prepare(request)

    def NodeUnprepareResources(self, request: Any, context: Any) -> dra_pb2.NodeUnprepareResourcesResponse:
        return self.p.unprepare(request)


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    """``pluginregistration.Registration``: what kubelet's plugin watcher asks."""

    def __init__(self, plugin: DRAPlugin, endpoint: str) -> None:
        self.p = plugin
        self.endpoint = endpoint
        #: set on every NotifyRegistrationStatus (tests wait on it)
        self.notified = threading.Event()

    def GetInfo(self, request: Any, context: Any) -> pluginregistration_pb2.PluginInfo:
        return pluginregistration_pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER_NAME, endpoint=self.endpoint,
                                                 supported_versions=list(SUPPORTED_SERVICES))

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> pluginregistration_pb2.RegistrationStatusResponse:
        self.p.status.registered = bool(request.plugin_registered)
        self.p.status.registration_error = str(request.error)
        if request.plugin_registered:
            log.info("registered with kubelet", extra={"driver": DRIVER_NAME, "socket": self.endpoint})
        else:
            log.error("kubelet refused the registration", extra={"error": request.error})
        self.notified.set()
        return pluginregistration_pb2.RegistrationStatusResponse()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Server:
    """Serves ``plugin`` on its two sockets. :meth:`start`, later :meth:`stop`."""

    def __init__(self, plugin: DRAPlugin, watch_interval: float | None = None) -> None:
        self.plugin = plugin
        self.service_socket = os.path.join(plugin.opts.plugin_dir, SERVICE_SOCKET)
        self.registration_socket = os.path.join(plugin.opts.registry_dir, REGISTRATION_SOCKET)
        self.registration = RegistrationServicer(plugin, self.service_socket)
        self.watch_interval = plugin.opts.watch_interval if watch_interval is None else watch_interval
        self._servers: dict[str, grpc.Server] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _serve(self, path: str) -> None:
        old = self._servers.pop(path, None)
        if old is not None:
            old.stop(grace=0.2).wait()
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        _unlink(path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dra-grpc"))
        if path == self.service_socket:
            dra_pb2_grpc.add_DRAPluginServicer_to_server(DRAServicer(self.plugin), server)
        else:
            pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.registration, server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._servers[path] = server
        log.info("serving", extra={"socket": path})

    def start(self) -> None:
        """Serve the DRA service first, then the registration socket (kubelet may call GetInfo at
        once and then the service), and start the supervisor."""
        self._serve(self.service_socket)
        self._serve(self.registration_socket)
        self._thread = threading.Thread(target=self._supervise, name="dra-supervisor", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _supervise(self) -> None:
        while not self._stop.wait(self.watch_interval):
            for path in (self.service_socket, self.registration_socket):
                if not os.path.exists(path):
                    log.warning("socket vanished; serving it again", extra={"socket": path})
                    try:
                        self._serve(path)
                    except Exception as e:  # noqa: BLE001 - keep supervising
                        log.error("cannot serve the socket", extra={"socket": path, "error": str(e)})

    def stop(self) -> None:
        """Stop serving and remove both sockets (the registration socket first: kubelet then
        deregisters the plugin)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for path in (self.registration_socket, self.service_socket):
            srv = self._servers.pop(path, None)
            if srv is not None:
                srv.stop(grace=0.5).wait()
            _unlink(path)
