"""Red team: a hostile tenant who edits its own pods and reaches the ports the project exposes on
the pod network (the device plugin's and DRA plugin's /livez, /readyz, /metrics listener, the
extender's metrics listener). Each test plays one attack against the real component over its
real protocol; see docs/security.md for the table of threats."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.metrics import HealthServer
from kube_vgpu.scrape import MAX_CONNECTIONS, BoundedListener, SharedRender

_SCHED_TESTS = str(Path(__file__).resolve().parents[1] / "scheduler")
if _SCHED_TESTS not in sys.path:  # the scheduler tests' builders (capture-shaped Node JSON)
    sys.path.insert(0, _SCHED_TESTS)

from bind_support import bind, create_nodes, create_pod, extender  # noqa: E402
from vgpu_sched_util import KEYS, node_obj, offline_service, pod_obj, run  # noqa: E402

from kube_vgpu.resources import ANN_GPU_POLICY, ANN_NODE_POLICY, ANN_NOUSE_GPUUUID, ANN_USE_GPUUUID  # noqa: E402
from scheduler.server import add_metrics_listener  # noqa: E402
from tests.fakeapi import FakeKubeAPI  # noqa: E402
from tests.security.test_signed_allocations import _usage, caught_up  # noqa: E402


class _Probed:
    def alive(self) -> bool:
        return True

    def ready(self) -> tuple[bool, str]:
        return True, "ok"


def _server_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.is_alive() and "process_request_thread" in t.name)


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback test server
        r.read()
        return int(r.status)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _idle(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request line, never the end of the headers
    return s


def test_idle_connections_to_the_device_plugins_metrics_port_hold_no_thread_each(
        sockets: list[socket.socket]) -> None:
    """Attack: open hundreds of connections to the device plugin's metrics port (0.0.0.0 in the
    chart) and never finish a request. The plain threaded server kept a thread per connection for
    as long as the client liked (about 26 KiB each: 10,000 outgrew the plugin's 256 MiB limit).
    Held: at most MAX_CONNECTIONS are open, the longest-waiting one is closed for a new one, and
    kubelet's probe is still answered in the middle of the flood."""
    http = HealthServer(_Probed(), "127.0.0.1", 0, registry=CollectorRegistry())
    http.start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        before = _server_threads()
        for _ in range(3 * MAX_CONNECTIONS):
            sockets.append(_idle(http.port))
        assert _get(base + "/livez") == 200
        deadline = time.monotonic() + 5
        while _server_threads() - before > MAX_CONNECTIONS + 1:
            assert time.monotonic() < deadline, f"{_server_threads() - before} handler threads for idle connections"
            time.sleep(0.01)
        # the evicted connections were closed by the server: the oldest read EOF
        sockets[0].settimeout(5)
        assert sockets[0].recv(1) == b""
    finally:
        http.stop()


def test_an_idle_connection_is_closed_after_the_timeout(sockets: list[socket.socket]) -> None:
    http = HealthServer(_Probed(), "127.0.0.1", 0, registry=CollectorRegistry(), timeout=0.3)
    http.start()
    try:
        s = _idle(http.port)
        sockets.append(s)
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 4
    finally:
        http.stop()


class _Blocking(Collector):
    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.entered.release()
        self.release.wait(10)
        yield GaugeMetricFamily("x", "x", value=1)


def test_connections_being_answered_are_never_evicted_and_a_new_one_beyond_the_cap_is_closed(
        sockets: list[socket.socket]) -> None:
    reg = CollectorRegistry(auto_describe=False)
    col = _Blocking()
    reg.register(col)
    http = HealthServer(_Probed(), "127.0.0.1", 0, registry=reg, max_connections=2)
    http.start()
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", http.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            sockets.append(s)
        assert col.entered.acquire(timeout=5)  # one renders, the other waits for that render
        deadline = time.monotonic() + 5
        while http.httpd.open_connections() != (2, 0):
            assert time.monotonic() < deadline, http.httpd.open_connections()
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        sockets.append(extra)
        extra.sendall(b"GET /livez HTTP/1.0\r\n\r\n")
        assert extra.recv(1) == b""  # closed at once: both slots are answering
        col.release.set()
        for s in sockets[:2]:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.0 200")
    finally:
        col.release.set()
        http.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_flood_of_scrapes_of_the_extenders_metrics_port_renders_one_at_a_time() -> None:
    """Attack: many concurrent scrapes of the extender's metrics listener (0.0.0.0 by default, the
    pod network; the extender's filter and bind run on the same process). Each scrape rendered the
    whole exposition in a thread of its own, so a flood kept several threads rendering and the
    event loop that answers filter and bind waited for the GIL (filter's median went from 0.4 ms
    to 57 ms with 1,000 nodes under two scraping processes). Held: one render at a time, shared by
    every scrape that arrived before it started, and renders spaced so the loop keeps most of the
    time; every scrape still sees the state as of its arrival or later."""
    async def go() -> None:
        svc = offline_service([node_obj(f"n{i}", n_gpus=8) for i in range(20)])
        render = svc.render_metrics
        lock = threading.Lock()
        running = [0, 0, 0]  # now, most at once, renders

        def counted(gpus: object) -> bytes:
            with lock:
                running[0] += 1
                running[1] = max(running[1], running[0])
                running[2] += 1
            try:
                time.sleep(0.02)  # a large cluster's render
                return render(gpus)  # type: ignore[arg-type]
            finally:
                with lock:
                    running[0] -= 1

        svc.render_metrics = counted  # type: ignore[method-assign]
        runner = web.AppRunner(svc.metrics_app())
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                async def scrape() -> str:
                    async with s.get(url) as r:
                        assert r.status == 200
                        return await r.text()

                bodies = await asyncio.gather(*(scrape() for _ in range(100)))
                assert all("kube_vgpu_scheduler_binds_total" in b for b in bodies)
                assert running[1] == 1, f"{running[1]} renders at once"
                assert running[2] <= 3, f"{running[2]} renders for one burst of 100 scrapes"
                # a scrape after a change sees it
                svc.metrics.binds.labels(outcome="success").inc()
                assert 'kube_vgpu_scheduler_binds_total{outcome="success"} 1.0' in await scrape()
                svc.metrics.binds.labels(outcome="success").inc()
                assert 'kube_vgpu_scheduler_binds_total{outcome="success"} 2.0' in await scrape()
        finally:
            await runner.cleanup()

    run(go)


class _Counting(Collector):
    """A collector that takes a while (a node with many pods) and counts renders running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.most = self.renders = 0
        self.value = 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.renders += 1
            value = self.value
        try:
            time.sleep(0.02)
            yield GaugeMetricFamily("probe_value", "x", value=value)
        finally:
            with self.lock:
                self.now -= 1


def test_a_flood_of_scrapes_of_the_device_plugins_metrics_port_renders_one_at_a_time() -> None:
    """Attack: concurrent scrapes of the device plugin's metrics port. Each rendered in its own
    thread (every pod's record verified, every container's cache file read, NVML asked), so the
    plugin's Allocate and PreStartContainer waited for the GIL behind them (a fake kubelet's
    admission took 20 ms idle and 180 ms under two scraping processes, 60 pods on the node). Held:
    one render at a time, shared by the scrapes that arrived before it started (kube_vgpu.scrape);
    a scrape still sees the state as of its arrival."""
    reg = CollectorRegistry(auto_describe=False)
    col = _Counting()
    reg.register(col)
    http = HealthServer(_Probed(), "127.0.0.1", 0, registry=reg)
    http.start()
    url = f"http://127.0.0.1:{http.port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback test server
            return str(r.read().decode())

    try:
        bodies: list[str] = []
        threads = [threading.Thread(target=lambda: bodies.append(scrape())) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(bodies) == 40 and all("probe_value 0.0" in b for b in bodies)
        assert col.most == 1, f"{col.most} renders at once"
        assert col.renders <= 4, f"{col.renders} renders for one burst of 40 scrapes"
        col.value = 1
        assert "probe_value 1.0" in scrape()
        col.value = 2
        assert "probe_value 2.0" in scrape()
    finally:
        http.stop()


def test_a_failed_render_reaches_its_scrapes_and_the_next_scrape_renders_again() -> None:
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("collector broke")
        return b"ok"

    shared = SharedRender(render)
    with pytest.raises(RuntimeError, match="collector broke"):
        shared.get()
    assert shared.get() == b"ok"
    assert len(calls) == 2


def test_idle_connections_to_the_extenders_metrics_port_are_bounded() -> None:
    """Attack: hundreds of connections to the extender's metrics port (0.0.0.0, the pod network)
    that never finish their request headers. aiohttp kept each for ever (no header timeout; about
    5 KiB each), so enough of them outgrew the extender's memory limit and took vGPU scheduling
    down. Held: at most MAX_CONNECTIONS, the longest-waiting idle one closed for a new one, kubelet's
    probe answered in the middle of the flood (kube_vgpu.scrape.BoundedListener)."""
    async def go() -> None:
        svc = offline_service([node_obj("n1")])
        app = svc.app(serve_metrics=False)
        port = _free_port()
        add_metrics_listener(app, svc, "127.0.0.1", port)
        runner = web.AppRunner(app)
        await runner.setup()  # the service, then the metrics listener
        loop = asyncio.get_running_loop()
        held: list[socket.socket] = []
        try:
            for _ in range(3 * MAX_CONNECTIONS):
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", port))
                await loop.sock_sendall(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never end
                held.append(s)
            async with aiohttp.ClientSession() as c, c.get(f"http://127.0.0.1:{port}/livez") as r:
                assert r.status == 200
            # the oldest were closed by the server (read: EOF or reset), the newest are still open
            try:
                first = await asyncio.wait_for(loop.sock_recv(held[0], 1), 5)
            except ConnectionResetError:
                first = b""  # closed with a reset: as good
            assert first == b""
        finally:
            for s in held:
                s.close()
            await runner.cleanup()

    run(go)


def test_the_extenders_listener_times_idle_connections_out_and_never_evicts_one_being_answered() -> None:
    async def go() -> None:
        release = asyncio.Event()
        entered = asyncio.Semaphore(0)

        async def slow(_request: web.Request) -> web.Response:
            entered.release()
            await release.wait()
            return web.Response(text="done")

        app = web.Application()
        app.router.add_get("/slow", slow)
        runner = web.AppRunner(app)
        listener = BoundedListener(runner, max_connections=2, timeout=0.3)
        app.middlewares.append(listener.middleware())
        await runner.setup()
        port = await listener.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()

        async def conn(data: bytes) -> socket.socket:
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, data)
            return s

        async def closed(s: socket.socket) -> bool:
            try:
                return await asyncio.wait_for(loop.sock_recv(s, 1), 5) == b""
            except ConnectionResetError:
                return True

        held: list[socket.socket] = []
        try:
            idle = await conn(b"GET /slow HTTP/1.1\r\n")
            held.append(idle)
            t0 = time.monotonic()
            assert await closed(idle)  # timed out
            assert time.monotonic() - t0 < 4
            for _ in range(2):
                held.append(await conn(b"GET /slow HTTP/1.0\r\n\r\n"))
                await asyncio.wait_for(entered.acquire(), 5)
            extra = await conn(b"GET /slow HTTP/1.0\r\n\r\n")
            held.append(extra)
            assert await closed(extra)  # both slots are being answered: the new one goes
            await asyncio.sleep(0.5)  # past the timeout: a request in its handler has no timer
            release.set()
            for s in held[1:3]:
                data = b""
                while chunk := await asyncio.wait_for(loop.sock_recv(s, 65536), 5):
                    data += chunk
                assert data.startswith(b"HTTP/1.0 200") and data.endswith(b"done")
        finally:
            for s in held:
                s.close()
            await listener.close()
            await runner.cleanup()

    run(go)


def test_tenant_placement_keys_edited_after_bind_move_no_booking(fake_kube_api: FakeKubeAPI) -> None:
    """Attack: after its pod is bound, the tenant rewrites the keys it may write (use-gpuuuid naming
    another GPU, nouse-gpuuuid naming its own, other GPU and node policies), hoping the extender
    re-plans the booking elsewhere (its own GPU then looking free for a second pod) or, after a
    restart, books it where the keys now point. Held: the booking stays where the signed record
    put it, before and after a restart."""
    fake = fake_kube_api
    create_nodes(fake, 1, gpus=4)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000}))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            assert await bind(ext, a) == ""
            booked = _usage(ext)
            assert list(booked.values()) == [20000]
            (mine,) = booked
            other = next(f"GPU-node-0-{i:02d}" for i in range(4) if f"GPU-node-0-{i:02d}" != mine)
            fake.patch_object("pods", "a", {"metadata": {"annotations": {
                ANN_USE_GPUUUID: other, ANN_NOUSE_GPUUUID: mine, ANN_GPU_POLICY: "spread",
                ANN_NODE_POLICY: "spread"}}}, "default")
            await caught_up(ext, fake)
            assert _usage(ext) == booked
        async with extender(fake, keys=KEYS) as ext:
            assert _usage(ext) == booked

    run(go)
