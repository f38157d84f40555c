"""Builders for the scheduler tests: Node/Pod JSON, ExtenderArgs shaped like the captures, and a
running extender over real HTTP."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp.test_utils import TestServer

from kube_vgpu.codec import encode_inventory
from kube_vgpu.config import Config
from kube_vgpu.model import GPUDevice, NodeInventory
from kube_vgpu.resources import ANN_NODE_INVENTORY, DEFAULT_SCHEDULER_NAME
from kube_vgpu.signing import KeyRing
from scheduler.service import Options, SchedulerService

CAPTURES = Path("/work/shared/reference/captures")
#: the signing keys the scheduler tests run with (shared by a restarted extender and the fake device plugin)
KEYS = KeyRing("test-1", {"test-1": b"kube-vgpu scheduler test key 000001"})
T = TypeVar("T")


def write_keys(d: Path, keys: KeyRing = KEYS) -> Path:
    """Write ``keys`` as a signing key directory (``active`` + ``key.<kid>``) for --signing-keys-dir."""
    d.mkdir(parents=True, exist_ok=True)
    for kid, key in keys.keys.items():
        (d / f"key.{kid}").write_bytes(key)
    (d / "active").write_text(keys.active + "\n")
    return d


def capture(name: str) -> dict[str, Any]:
    """A captured kube-scheduler payload (scheduler_filter | scheduler_prioritize | scheduler_bind)."""
    return json.loads((CAPTURES / f"{name}.json").read_text())


def gpus(node: str, n: int, mem: int = 24576, split: int = 10, model: str = "NVIDIA A10",
         cores: int = 100) -> tuple[GPUDevice, ...]:
    return tuple(GPUDevice(uuid=f"GPU-{node}-{i:02d}", index=i, model=model, memory_mib=mem, cores=cores,
                           split=split) for i in range(n))


def node_obj(name: str, n_gpus: int = 2, mem: int = 24576, split: int = 10, heartbeat: float | None = None,
             allocatable: int | None = None, model: str = "NVIDIA A10", inventory: bool = True) -> dict[str, Any]:
    """A core/v1 Node like the capture's, with our inventory annotation and allocatable slots."""
    tmpl = copy.deepcopy(capture("scheduler_filter")["Nodes"]["items"][0])
    tmpl["metadata"]["name"] = name
    tmpl["metadata"]["labels"]["kubernetes.io/hostname"] = name
    tmpl["metadata"].pop("managedFields", None)
    tmpl["metadata"].pop("resourceVersion", None)
    tmpl["metadata"].pop("uid", None)
    tmpl["metadata"].pop("creationTimestamp", None)
    if inventory:
        inv = NodeInventory(gpus(name, n_gpus, mem, split, model), time.time() if heartbeat is None else heartbeat)
        tmpl["metadata"]["annotations"][ANN_NODE_INVENTORY] = encode_inventory(inv)
    slots = n_gpus * split if allocatable is None else allocatable
    for k in ("capacity", "allocatable"):
        tmpl["status"][k].pop("example.com/gpu-mem", None)
        tmpl["status"][k]["nvidia.com/gpu"] = str(slots)
    return tmpl


def pod_obj(name: str, containers: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None,
            ns: str = "default", uid: str | None = None, annotations: dict[str, str] | None = None,
            limits: dict[str, Any] | None = None, scheduler: str = DEFAULT_SCHEDULER_NAME) -> dict[str, Any]:
    """A core/v1 Pod shaped like the capture's, for ``scheduler`` (ours by default, as the webhook
    routes vGPU pods); ``limits`` gives a single container ``c``."""
    p = copy.deepcopy(capture("scheduler_filter")["Pod"])
    p["spec"]["schedulerName"] = scheduler
    p["metadata"]["name"] = name
    p["metadata"]["namespace"] = ns
    p["metadata"]["uid"] = uid or f"uid-{ns}-{name}"
    p["metadata"]["annotations"] = dict(annotations or {})
    if containers is None:
        lim = {k: str(v) for k, v in (limits or {}).items()}
        containers = [{"name": "c", "image": "busybox", "resources": {"limits": lim}}]
    p["spec"]["containers"] = containers
    if init:
        p["spec"]["initContainers"] = init
    return p


def ctr(name: str, **limits: Any) -> dict[str, Any]:
    """A container with ``nvidia.com/<k>`` limits (``gpu=1, gpumem=4000``)."""
    return {"name": name, "image": "busybox",
            "resources": {"limits": {f"nvidia.com/{k.replace('_', '-')}": str(v) for k, v in limits.items()}}}


def filter_args(pod: dict[str, Any], nodes: list[dict[str, Any]], cache_capable: bool = True) -> dict[str, Any]:
    """ExtenderArgs exactly as kube-scheduler sends them: NodeNames with nodeCacheCapable, else a
    NodeList in Nodes (keys Pod, Nodes, NodeNames)."""
    args = capture("scheduler_filter")
    args["Pod"] = pod
    if cache_capable:
        args["Nodes"] = None
        args["NodeNames"] = [n["metadata"]["name"] for n in nodes]
    else:
        args["Nodes"] = {"metadata": {}, "items": nodes}
        args["NodeNames"] = None
    return args


def bind_args(pod: dict[str, Any], node: str) -> dict[str, Any]:
    args = capture("scheduler_bind")
    m = pod["metadata"]
    args.update({"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node})
    return args


class Extender:
    """A SchedulerService served over real HTTP on 127.0.0.1 (aiohttp TestServer)."""

    def __init__(self, svc: SchedulerService):
        self.svc = svc
        self.server: TestServer | None = None
        self.session: aiohttp.ClientSession | None = None
        self.device_plugin: Any = None  #: a FakeDevicePlugin when the test runs one

    async def __aenter__(self) -> Extender:
        self.server = TestServer(self.svc.app())
        await self.server.start_server()
        self.session = aiohttp.ClientSession(base_url=str(self.server.make_url("/")))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.session is not None and self.server is not None
        await self.session.close()
        await self.server.close()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.post(path, data=json.dumps(body),
                                     headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()

    async def get(self, path: str) -> tuple[int, str]:
        assert self.session is not None
        async with self.session.get(path) as r:
            return r.status, await r.text()


@asynccontextmanager
async def api_extender(fake: Any, config: Config | None = None, **opts: Any) -> AsyncIterator[Extender]:
    """A SchedulerService against the fake kube-apiserver ``fake`` (the official client over real
    HTTP), served over HTTP, its caches synced. ``opts``: Options fields."""
    from scheduler.kube import KubeAPI

    svc = SchedulerService(config or Config(), KubeAPI(fake.api_client()), Options(sync_wait=5.0, **opts), keys=KEYS)
    async with Extender(svc) as ext:
        await asyncio.wait_for(svc.synced.wait(), 10 * SAFETY_SCALE)
        yield ext


def quota_obj(hard: dict[str, str], name: str, ns: str) -> dict[str, Any]:
    """A core/v1 ResourceQuota with ``spec.hard``."""
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": ns},
            "spec": {"hard": hard}}


def create_pod(fake: Any, pod: dict[str, Any]) -> dict[str, Any]:
    """Create ``pod`` in the fake API server as a client would (the server assigns uid and
    resourceVersion)."""
    pod["metadata"] = {k: v for k, v in pod["metadata"].items() if k not in ("uid", "resourceVersion")}
    return fake.create_object("pods", pod, namespace=pod["metadata"]["namespace"])


def offline_service(nodes: list[dict[str, Any]] = (), config: Config | None = None,  # type: ignore[assignment]
                    **opts: Any) -> SchedulerService:
    """A service without an API server, its cache fed with ``nodes`` and marked synced."""
    svc = SchedulerService(config or Config(), None, Options(sync_wait=0.05, **opts))
    for n in nodes:
        svc.cache.on_node("ADDED", n)
    svc.mark_synced()
    return svc


def run(fn: Callable[[], Awaitable[T]], timeout: float = 30.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(fn(), timeout * SAFETY_SCALE)
    return asyncio.run(main())


#: every timeout in these helpers is a safety net against a hang, never what a test measures: on a
#: loaded machine (CI under load) waits take longer, so each is stretched by this factor
SAFETY_SCALE = 6.0


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> None:
    """Wait for ``cond`` (polled every ``step`` s) for up to ``timeout`` x SAFETY_SCALE seconds."""
    deadline = time.monotonic() + timeout * SAFETY_SCALE
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)
