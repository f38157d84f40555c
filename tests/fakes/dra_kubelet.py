"""A fake kubelet for DRA drivers, speaking kubelet's real gRPC protocols on unix sockets.

* Plugin registration (``pluginregistration.Registration``, as kubelet's plugin watcher): a watch
  thread finds new ``*.sock`` files in the registry directory, dials each, calls ``GetInfo``,
  validates the answer as kubelet's DRA handler does (type ``DRAPlugin``, a known driver-name shape,
  a supported service among ``v1.DRAPlugin`` / ``v1beta1.DRAPlugin``, an existing endpoint) and
  reports the outcome with ``NotifyRegistrationStatus``.
* ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` client: :meth:`FakeDRAKubelet.prepare` /
  :meth:`FakeDRAKubelet.unprepare` call the registered driver's endpoint and check, as kubelet
  does, that the answer has an entry for every claim asked and for no other.

Use::

    k = FakeDRAKubelet(registry_dir); k.start()
    k.wait_registered("vgpu.kube-vgpu.io")
    resp = k.prepare("vgpu.kube-vgpu.io", [("ns", uid, "name")])
    k.stop()
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from deviceplugin.dra.api import dra_pb2, dra_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc

#: the services kubelet 1.36 speaks, most preferred first (k8s.io/kubelet dra v1 / v1beta1)
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass
class Registered:
    """A plugin kubelet accepted: driver name, endpoint, the service chosen, its registration socket."""

    name: str
    endpoint: str
    service: str
    socket: str


@dataclass
class FakeDRAKubelet:
    registry_dir: str
    poll_interval: float = 0.05
    plugins: dict[str, Registered] = field(default_factory=dict)
    #: (socket, error) of registrations refused
    refused: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._seen: dict[str, int] = {}  # socket path -> inode registered
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        os.makedirs(self.registry_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="fake-dra-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def restart(self) -> None:
        """Forget every registration (a kubelet restart): the watch registers the sockets again."""
        with self._cond:
            self.plugins.clear()
            self._seen.clear()

    # ---------------------------------------------------------------- registration

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                names = sorted(os.listdir(self.registry_dir))
            except OSError:
                names = []
            for n in names:
                path = os.path.join(self.registry_dir, n)
                if not n.endswith(".sock"):
                    continue
                try:
                    ino = os.stat(path).st_ino
                except OSError:
                    continue
                if self._seen.get(path) == ino:
                    continue
                self._seen[path] = ino
                self.register(path)
            self._stop.wait(self.poll_interval)

    def register(self, socket: str) -> None:
        """kubelet's plugin watcher on one registration socket."""
        with grpc.insecure_channel(f"unix://{socket}") as ch:
            stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
            try:
                info = stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            except grpc.RpcError as e:
                self._refuse(socket, f"GetInfo failed: {e}")
                return
            error = self._validate(info)
            if error:
                stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(
                    plugin_registered=False, error=error), timeout=5)
                self._refuse(socket, error)
                return
            service = next(s for s in info.supported_versions if s in KUBELET_SERVICES)
            with self._cond:
                self.plugins[info.name] = Registered(info.name, info.endpoint or socket, service, socket)
                self._cond.notify_all()
            stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True),
                                          timeout=5)

    def _validate(self, info: pluginregistration_pb2.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"RegisterPlugin error -- no handler registered for plugin type: {info.type}"
        if not _DNS_SUBDOMAIN.match(info.name) or len(info.name) > 63:
            return f"invalid driver name {info.name!r}"
        if not info.supported_versions:
            return "empty list of supported gRPC services (aka supported versions)"
        if not any(s in KUBELET_SERVICES for s in info.supported_versions):
            return (f"none of services supported by the plugin ({list(info.supported_versions)}) are supported "
                    f"by the kubelet ({list(KUBELET_SERVICES)})")
        if info.endpoint and not os.path.exists(info.endpoint):
            return f"endpoint {info.endpoint} does not exist"
        return ""

    def _refuse(self, socket: str, error: str) -> None:
        with self._cond:
            self.refused.append((socket, error))
            self._cond.notify_all()

    def wait_registered(self, name: str, timeout: float = 10.0) -> Registered:
        with self._cond:
            if not self._cond.wait_for(lambda: name in self.plugins, timeout):
                raise AssertionError(f"plugin {name} not registered within {timeout}s; refused: {self.refused}")
            return self.plugins[name]

    # ---------------------------------------------------------------- DRAPlugin client

    def _stub(self, name: str) -> tuple[grpc.Channel, dra_pb2_grpc.DRAPluginStub]:
        p = self.plugins.get(name)
        if p is None:
            raise AssertionError(f"no plugin {name} registered")
        assert p.service == "v1.DRAPlugin", p.service
        ch = grpc.insecure_channel(f"unix://{p.endpoint}")
        return ch, dra_pb2_grpc.DRAPluginStub(ch)

    def prepare(self, name: str, claims: Sequence[tuple[str, str, str]],
                timeout: float = 10.0) -> dra_pb2.NodePrepareResourcesResponse:
        """NodePrepareResources for (namespace, uid, name) claims; asserts one entry per claim."""
        ch, stub = self._stub(name)
        with ch:
            resp = stub.NodePrepareResources(dra_pb2.NodePrepareResourcesRequest(
                claims=[dra_pb2.Claim(namespace=ns, uid=uid, name=n) for ns, uid, n in claims]), timeout=timeout)
        assert set(resp.claims) == {uid for _, uid, _ in claims}, (set(resp.claims), claims)
        return resp

    def unprepare(self, name: str, claims: Sequence[tuple[str, str, str]],
                  timeout: float = 10.0) -> dra_pb2.NodeUnprepareResourcesResponse:
        """NodeUnprepareResources for (namespace, uid, name) claims; asserts one entry per claim."""
        ch, stub = self._stub(name)
        with ch:
            resp = stub.NodeUnprepareResources(dra_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_pb2.Claim(namespace=ns, uid=uid, name=n) for ns, uid, n in claims]), timeout=timeout)
        assert set(resp.claims) == {uid for _, uid, _ in claims}, (set(resp.claims), claims)
        return resp
