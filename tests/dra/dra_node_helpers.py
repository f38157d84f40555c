"""Shared setup of the DRA kubelet-plugin tests: a fake API server holding ResourceClaims, the plugin
on simulated GPUs serving its real gRPC sockets, and the fake DRA kubelet (tests/fakes/dra_kubelet.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid as uuidlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deviceplugin.dra.grpcserver import Server
from deviceplugin.dra.kube import ApiClaimClient
from deviceplugin.dra.plugin import DRAPlugin, Options
from deviceplugin.simgpu import SimulatedGPUs
from kube_vgpu.config import Config
from kube_vgpu.dra import DRIVER_NAME
from tests.fakeapi import FakeKubeAPI
from tests.fakes.dra_kubelet import FakeDRAKubelet

NODE = "node-1"
NS = "team-a"


def result(device: str = "gpu-0", memory: str | None = "3000Mi", cores: str | None = "30", *, request: str = "gpu",
           driver: str = DRIVER_NAME, pool: str = NODE, share: bool = True, **extra: Any) -> dict[str, Any]:
    """One allocation result as kube-scheduler writes it (consumedCapacity None: allocated whole)."""
    r: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if memory is not None or cores is not None:
        r["consumedCapacity"] = {k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None}
    if share:
        r["shareID"] = str(uuidlib.uuid4())
    r.update(extra)
    return r


def read_limits(path: str | Path) -> dict[str, str]:
    """key=value lines of a limits file (comments skipped)."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


@dataclass
class Node:
    """One node's DRA side under test: directories, plugin, server, fake kubelet, fake API."""

    api: FakeKubeAPI
    root: str
    gpus: str = "2x24576"
    minors: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 1})
    resync_seconds: float = 60.0
    plugin: DRAPlugin | None = None
    server: Server | None = None
    kubelet: FakeDRAKubelet | None = None

    @property
    def opts(self) -> Options:
        r = self.root
        return Options(node_name=NODE, plugin_dir=f"{r}/p", registry_dir=f"{r}/reg", cdi_dir=f"{r}/cdi",
                       shim_host_path=f"{r}/shim/libvgpu.so", cache_host_dir=f"{r}/cache", dev_root=f"{r}/dev",
                       watch_interval=0.05, health_poll_ms=50, probe_interval=0.2,
                       resync_seconds=self.resync_seconds)

    def start_plugin(self, publisher: Any = None) -> DRAPlugin:
        sim = SimulatedGPUs(self.gpus, NODE)
        by_uuid = {g.uuid: g.index for g in sim.gpus}
        self.plugin = DRAPlugin(Config(), self.opts, ApiClaimClient(self.api.api_client()), nvml=sim,
                                publisher=publisher, minor_of=lambda u: self.minors.get(by_uuid[u]))
        self.plugin.start()
        self.server = Server(self.plugin)
        self.server.start()
        return self.plugin

    def stop_plugin(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.plugin is not None:
            self.plugin.stop()
        self.server = self.plugin = None

    def gpu_uuid(self, index: int) -> str:
        assert self.plugin is not None
        return next(d.uuid for d in self.plugin.devices() if d.index == index)

    # ------------------------------------------------------------ claims in the fake API server

    def claim(self, name: str, results: list[dict[str, Any]], *, reserved: bool = True,
              spec_memory: str = "3000Mi") -> dict[str, Any]:
        """Create a claim (spec as a tenant writes it) and give it an allocated status (as
        kube-scheduler does). Returns the stored claim."""
        spec = {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER_NAME, "capacity": {"requests": {"memory": spec_memory, "cores": "30"}}}}]}}
        self.api.create_object("resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                      "metadata": {"name": name, "namespace": NS}, "spec": spec},
                                   namespace=NS)
        status: dict[str, Any] = {"allocation": {"devices": {"results": results}}}
        if reserved:
            status["reservedFor"] = [{"resource": "pods", "name": f"pod-{name}", "uid": str(uuidlib.uuid4())}]
        return self.api.patch_object("resourceclaims", name, {"status": status}, namespace=NS, patch_type="merge",
                                     subresource="status")

    # ------------------------------------------------------------ what the node holds

    def cdi_spec(self, uid: str) -> dict[str, Any] | None:
        p = Path(self.opts.cdi_dir) / f"kube-vgpu.io-vgpu_{uid}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def limits(self, uid: str) -> dict[str, str] | None:
        p = Path(self.opts.cache_host_dir) / f"dra-{uid}.limits" / "vgpu.limits"
        return read_limits(p) if p.exists() else None

    def checkpoint(self) -> dict[str, Any]:
        return json.loads((Path(self.opts.plugin_dir) / "checkpoint.json").read_text())


def make_root() -> str:
    """A short directory (unix socket paths are limited to 107 bytes) with the shim and a /dev."""
    root = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    os.makedirs(f"{root}/shim")
    Path(f"{root}/shim/libvgpu.so").write_bytes(b"\x7fELF")
    os.makedirs(f"{root}/dev")
    for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        Path(f"{root}/dev/{n}").write_text("")
    return root


def remove_root(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


@contextmanager
def running_node(check_api_errors: bool = False) -> Iterator[Node]:
    """A fake API server, the plugin on its own root directory and the fake DRA kubelet with the
    plugin registered; all stopped and removed afterwards (``check_api_errors``: then assert the
    fake API server answered no request with an error of its own)."""
    api = FakeKubeAPI(auto_create_namespaces=True)
    api.start()
    root = make_root()
    n = Node(api=api, root=root)
    try:
        n.start_plugin()
        n.kubelet = FakeDRAKubelet(n.opts.registry_dir)
        n.kubelet.start()
        n.kubelet.wait_registered(DRIVER_NAME)
        yield n
    finally:
        if n.kubelet is not None:
            n.kubelet.stop()
        n.stop_plugin()
        api.stop()
        remove_root(root)
    if check_api_errors:
        assert api.errors == []
