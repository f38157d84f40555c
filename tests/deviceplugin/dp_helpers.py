"""Helpers for the device plugin tests (imported by conftest.py and the tests as ``dp_helpers``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin.api import api_pb2, api_pb2_grpc, podresources_pb2, podresources_pb2_grpc
from kube_vgpu.codec import decode_allocation, encode_allocation
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    LABEL_NODE,
)
from kube_vgpu.signing import KeyRing, sign_allocation, sign_progress

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"


def build_fake_nvml(out_dir: Path) -> Path:
    """``out_dir/libnvidia-ml.so.1`` built from tests/fakes/fakenvml.c: with tests/fakes/build.py
    (``build_fakes``) when it is there, else with the C compiler directly."""
    try:
        from tests.fakes.build import build_fakes  # type: ignore[import-not-found]
    except ImportError:
        build_fakes = None
    if build_fakes is not None:
        return Path(build_fakes(out_dir)[1])
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake NVML")
    out = out_dir / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libnvidia-ml.so.1", f"-I{FAKES}",
                    f"-I{ROOT / 'libvgpu' / 'src'}", "-o", str(out), str(FAKES / "fakenvml.c"), "-lpthread"],
                   check=True)
    return out


class FakeGPUs:
    """Writes FAKE_NVML_CONFIG / FAKE_NVML_EVENTS files and points this process at them."""

    def __init__(self, d: Path) -> None:
        self.config = d / "nvml.conf"
        self.events = d / "nvml.events"
        self.events.write_text("")
        self.lines: list[str] = []

    def set(self, gpus: list[dict[str, Any]]) -> None:
        lines = []
        for i, g in enumerate(gpus):
            toks = [f"index={i}"]
            for k, v in g.items():
                toks.append(f'{k}="{v}"' if isinstance(v, str) and " " in v else f"{k}={v}")
            lines.append("gpu " + " ".join(toks))
        self.lines = lines
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.config)
        # the fake reloads on mtime change; make sure the mtime moves even within one tick
        t = time.time_ns() + 1_000_000
        os.utime(self.config, ns=(t, t))

    def xid(self, index: int, xid: int) -> None:
        with open(self.events, "a") as f:
            f.write(f"{index} {xid}\n")




@dataclass
class Admitted:
    """One container as the fake kubelet admitted and started it: its device IDs, kubelet's stored
    Allocate answer, and the PreStartContainer outcome (``error``/``code`` set when it failed and the
    container did not start). ``limits``: the limits file the container would see (parsed key=value),
    None when there is none."""

    namespace: str
    pod: str
    container: str
    ids: list[str]
    response: api_pb2.ContainerAllocateResponse
    started: bool = False
    error: str | None = None
    code: grpc.StatusCode | None = None

    @property
    def envs(self) -> dict[str, str]:
        return dict(self.response.envs)

    def mounts(self) -> dict[str, api_pb2.Mount]:
        return {m.container_path: m for m in self.response.mounts}

    @property
    def limits(self) -> dict[str, str] | None:
        return read_limits(self.response)


def read_limits(resp: api_pb2.ContainerAllocateResponse) -> dict[str, str] | None:
    """The limits file behind the container's read-only limits mount, parsed (``key=value`` lines,
    comments dropped), or None when the answer has no limits mount or the file is absent."""
    m = next((m for m in resp.mounts if m.container_path == "/usr/local/vgpu/limits"), None)
    if m is None:
        return None
    try:
        text = Path(m.host_path, "vgpu.limits").read_text()
    except FileNotFoundError:
        return None
    return dict(ln.split("=", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))


class FakeKubelet:
    """Plays kubelet's device manager and PodResources API.

    Serves Registration on ``kubelet.sock``; on Register connects to the plugin's endpoint, asks for
    options and keeps the latest ListAndWatch list. Serves ``v1.PodResourcesLister`` (List, Get) on
    ``pod-resources.sock`` (:attr:`podresources_socket`) from what it allocated. Admits pods like
    kubelet (:meth:`admit`): per container GetPreferredAllocation (when there is a choice), then
    Allocate, the result recorded (PodResources now lists it); then starts the containers in order,
    each after PreStartContainer when the plugin's options require it (:meth:`start_container`).
    """

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.registrations: list[api_pb2.RegisterRequest] = []
        self.options: api_pb2.DevicePluginOptions | None = None
        self.devices: list[api_pb2.Device] = []
        self.updates = 0
        self.used: set[str] = set()
        self._cv = threading.Condition()
        self._server: grpc.Server | None = None
        self._podres: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self.stub: api_pb2_grpc.DevicePluginStub | None = None
        self.use_preferred = True
        self.resource = "nvidia.com/gpu"
        #: (namespace, pod) -> container -> Admitted, in admission order (what PodResources lists)
        self.pods: dict[tuple[str, str], dict[str, Admitted]] = {}

    @property
    def socket(self) -> str:
        return os.path.join(self.dir, "kubelet.sock")

    @property
    def podresources_socket(self) -> str:
        return os.path.join(self.dir, "pod-resources.sock")

    def start(self) -> None:
        kubelet = self

        class Reg(api_pb2_grpc.RegistrationServicer):
            def Register(self, request: Any, context: Any) -> api_pb2.Empty:
                kubelet._on_register(request)
                return api_pb2.Empty()

        class Lister(podresources_pb2_grpc.PodResourcesListerServicer):
            def List(self, request: Any, context: Any) -> podresources_pb2.ListPodResourcesResponse:
                return podresources_pb2.ListPodResourcesResponse(pod_resources=kubelet._pod_resources())

            def Get(self, request: Any, context: Any) -> podresources_pb2.GetPodResourcesResponse:
                for pr in kubelet._pod_resources():
                    if (pr.namespace, pr.name) == (request.pod_namespace, request.pod_name):
                        return podresources_pb2.GetPodResourcesResponse(pod_resources=pr)
                context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(Reg(), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        if self._podres is None:
            pr = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), pr)
            pr.add_insecure_port(f"unix://{self.podresources_socket}")
            pr.start()
            self._podres = pr

    def _pod_resources(self) -> list[podresources_pb2.PodResources]:
        with self._cv:
            pods = {k: dict(v) for k, v in self.pods.items()}
        return [podresources_pb2.PodResources(namespace=ns, name=name, containers=[
            podresources_pb2.ContainerResources(name=c, devices=[podresources_pb2.ContainerDevices(
                resource_name=self.resource, device_ids=a.ids)]) for c, a in ctrs.items()])
            for (ns, name), ctrs in pods.items()]

    def _on_register(self, req: api_pb2.RegisterRequest) -> None:
        with self._cv:
            self.registrations.append(req)
            self._cv.notify_all()
        if self._channel is not None:
            self._channel.close()
        ch = grpc.insecure_channel(f"unix://{os.path.join(self.dir, req.endpoint)}")
        self._channel = ch
        self.stub = api_pb2_grpc.DevicePluginStub(ch)

        def watch() -> None:
            try:
                stub = api_pb2_grpc.DevicePluginStub(ch)
                self.options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
                for resp in stub.ListAndWatch(api_pb2.Empty()):
                    with self._cv:
                        self.devices = list(resp.devices)
                        self.updates += 1
                        self._cv.notify_all()
            except (grpc.RpcError, ValueError):  # ValueError: closed by a newer registration (MIG resources)
                pass

        threading.Thread(target=watch, daemon=True).start()

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._podres is not None:
            self._podres.stop(0).wait()
            self._podres = None

    def restart(self) -> None:
        """Like a kubelet restart: the socket goes away, every plugin socket is removed, a new
        kubelet.sock appears (the PodResources server and what it lists are kept: kubelet's
        checkpoint)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        for name in os.listdir(self.dir):
            if name.endswith(".sock") and name != "pod-resources.sock":
                os.unlink(os.path.join(self.dir, name))
        time.sleep(0.05)
        self.start()

    def wait(self, pred: Callable[[FakeKubelet], bool], timeout: float = 10.0, what: str = "condition") -> None:
        """Wait for ``pred``; ``timeout`` is a safety net, stretched 6x for loaded machines."""
        deadline = time.monotonic() + timeout * 6
        with self._cv:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}")
                self._cv.wait(min(left, 0.1))

    def health(self) -> dict[str, str]:
        with self._cv:
            return {d.ID: d.health for d in self.devices}

    def choose(self, n: int) -> list[str]:
        """The device IDs kubelet's device manager takes for a container of ``n`` devices: the plugin's
        preference when there is a choice (and :attr:`use_preferred`), else the first free ones."""
        assert self.stub is not None
        with self._cv:
            avail = sorted(d.ID for d in self.devices if d.health == "Healthy" and d.ID not in self.used)
        if self.use_preferred and len(avail) > n:
            pref = self.stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=avail, allocation_size=n)]),
                timeout=5)
            return list(pref.container_responses[0].deviceIDs)
        return avail[:n]

    def admit(self, pod: str, containers: Sequence[tuple[str, int | Sequence[str]]], *, namespace: str = "default",
              start: bool = True) -> list[Admitted]:
        """Admit pod ``namespace/pod`` whose GPU containers are ``containers`` (name, device count or
        explicit device IDs), in kubelet's order (init containers first, then spec order).

        For each container: device IDs (:meth:`choose`, or the given ones), Allocate, the answer
        recorded (PodResources lists it from then on). An Allocate error fails the admission: the
        pod's devices are released and the grpc.RpcError raised. Then, with ``start``, each
        container is started in order (:meth:`start_container`); a failed PreStartContainer is
        recorded on its :class:`Admitted` (the container does not start), not raised."""
        assert self.stub is not None
        key = (namespace, pod)
        out: list[Admitted] = []
        try:
            for name, want in containers:
                ids = self.choose(want) if isinstance(want, int) else list(want)
                resp = self.stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=ids)]), timeout=10)
                a = Admitted(namespace, pod, name, ids, resp.container_responses[0])
                with self._cv:
                    self.used.update(ids)
                    self.pods.setdefault(key, {})[name] = a
                out.append(a)
        except grpc.RpcError:
            self.remove(pod, namespace=namespace)
            raise
        if start:
            for a in out:
                self.start_container(pod, a.container, namespace=namespace)
        return out

    def start_container(self, pod: str, container: str, *, namespace: str = "default") -> Admitted:
        """Start (or restart) an admitted container: PreStartContainer with its device IDs when the
        plugin requires it. Returns its :class:`Admitted` with ``started``/``error`` updated."""
        assert self.stub is not None
        a = self.pods[(namespace, pod)][container]
        if self.options is None or self.options.pre_start_required:
            try:
                self.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=a.ids), timeout=10)
            except grpc.RpcError as e:
                a.started, a.error, a.code = False, e.details(), e.code()
                return a
        a.started, a.error, a.code = True, None, None
        return a

    def remove(self, pod: str, *, namespace: str = "default") -> None:
        """The pod is gone: its devices are free again and PodResources no longer lists it."""
        with self._cv:
            for a in self.pods.pop((namespace, pod), {}).values():
                self.used.difference_update(a.ids)


NODE = "gpu-node-1"

#: the signing keys the device plugin tests run with (the plugin verifies what the scheduler signed)
KEYS = KeyRing("test-1", {"test-1": b"kube-vgpu device plugin test key 0001"})


def signed_annotations(pod: dict[str, Any], keys: KeyRing = KEYS) -> dict[str, str]:
    """What the scheduler extender (allocation signature) and, for a pod whose bind-phase or
    allocated-containers is set beyond the bind's, the device plugin (progress signature) would have
    signed on ``pod`` (its uid, its node or, unbound, its record's node)."""
    m = pod["metadata"]
    ann = m.get("annotations") or {}
    text = ann[ANN_ALLOCATION]
    node = (pod.get("spec") or {}).get("nodeName") or decode_allocation(text).node
    sig = sign_allocation(keys, m["uid"], node, ann.get(ANN_BIND_TIME, ""), text)
    out = {ANN_ALLOCATION_SIGNATURE: sig}
    if ann.get(ANN_BIND_PHASE) != BIND_ALLOCATING or ANN_ALLOCATED_CONTAINERS in ann:
        out[ANN_PROGRESS_SIGNATURE] = sign_progress(keys, m["uid"], sig, ann.get(ANN_BIND_PHASE, ""),
                                                    ann.get(ANN_ALLOCATED_CONTAINERS, ""))
    return out


def write_keys(d: Path, keys: KeyRing = KEYS) -> Path:
    """Write ``keys`` as a signing key directory (``active`` + ``key.<kid>``) for --signing-keys-dir."""
    d.mkdir(parents=True, exist_ok=True)
    for kid, key in keys.keys.items():
        (d / f"key.{kid}").write_bytes(key)
    (d / "active").write_text(keys.active + "\n")
    return d


def create_signed(api: Any, pod: dict[str, Any], keys: KeyRing = KEYS) -> dict[str, Any]:
    """Create ``pod`` in the fake API server, then sign its allocation record for the uid the
    server gave it (as the scheduler extender does at bind). Returns the stored pod."""
    created: dict[str, Any] = api.create_object("pods", pod)
    if ANN_ALLOCATION not in (created["metadata"].get("annotations") or {}):
        return created
    m = created["metadata"]
    return dict(api.patch_object("pods", m["name"], {"metadata": {"annotations": signed_annotations(created, keys)}},
                                 m["namespace"], patch_type="merge"))


def make_node(api: Any, name: str = NODE) -> None:
    api.create_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})


def bound_pod(name: str, containers: list[tuple[str, bool, list[tuple[str, int, int]] | None, dict[str, Any]]],
              *, node: str = NODE, bind_time: float = 1000.0, namespace: str = "default",
              phase: str = BIND_ALLOCATING) -> dict[str, Any]:
    """A pod as the scheduler leaves it after bind. containers: (name, init, bookings or None for a
    container without GPUs, extra container fields); bookings: (uuid, MiB, cores)."""
    spec_init: list[dict[str, Any]] = []
    spec_app: list[dict[str, Any]] = []
    recs = []
    for cname, init, booking, extra in containers:
        ctr: dict[str, Any] = {"name": cname, "image": "busybox", **extra}
        if booking:
            lim = {"nvidia.com/gpu": str(len(booking)), "nvidia.com/gpumem": str(booking[0][1])}
            ctr.setdefault("resources", {}).setdefault("limits", {}).update(lim)
            recs.append(ContainerAllocation(cname, init, tuple(DeviceBooking(u, m, c) for u, m, c in booking)))
        (spec_init if init else spec_app).append(ctr)
    alloc = PodAllocation(node=node, containers=tuple(recs), time=bind_time)
    spec: dict[str, Any] = {"nodeName": node, "schedulerName": "kube-vgpu-scheduler", "containers": spec_app}
    if spec_init:
        spec["initContainers"] = spec_init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_NODE: node},
                         "annotations": {ANN_ALLOCATION: encode_allocation(alloc), ANN_BIND_PHASE: phase,
                                         ANN_BIND_TIME: str(bind_time)}},
            "spec": spec}


def write_region(path: Path, used: dict[int, int], oom_refusals: int = 0) -> None:
    from kube_vgpu import shimregion as region
    buf = bytearray(region.SIZE)
    u = [used.get(i, 0) for i in range(region.NDEV)]
    region._HEADER.pack_into(buf, 0, region.MAGIC, region.VERSION, region.SIZE, region.NDEV, region.NSLOTS,
                             *([0] * region.NDEV), *([0] * region.NDEV), *u)
    region._OOM_REFUSALS.pack_into(buf, region._OOM_REFUSALS_OFFSET, oom_refusals)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(buf))
