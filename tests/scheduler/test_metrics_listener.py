"""The --metrics-port listener: observability only (/metrics, /livez, /readyz), never the extender
API, so the chart can expose it while filter/prioritize/bind stay on loopback."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from vgpu_sched_util import bind_args, node_obj, offline_service, pod_obj, run, write_keys

from scheduler.server import MetricsListenError, add_metrics_listener, build_parser, main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_flags_and_defaults() -> None:
    ns = build_parser().parse_args(["--signing-keys-dir=/etc/kube-vgpu/signing"])
    # the unauthenticated extender API listens on loopback unless told otherwise
    assert (ns.bind_address, ns.port, ns.metrics_bind_address, ns.metrics_port) == ("127.0.0.1", 8888, "0.0.0.0", 0)
    ns = build_parser().parse_args(["--signing-keys-dir=/k", "--bind-address=0.0.0.0", "--metrics-port=8889",
                                    "--metrics-bind-address=10.0.0.1"])
    assert (ns.bind_address, ns.metrics_bind_address, ns.metrics_port) == ("0.0.0.0", "10.0.0.1", 8889)


def test_metrics_port_equal_to_port_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["--port=9000", "--metrics-port=9000", "--signing-keys-dir", str(write_keys(tmp_path / "keys"))]) == 2


def test_metrics_port_out_of_range_is_refused_by_the_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--metrics-port=70000", "--signing-keys-dir", str(write_keys(tmp_path / "keys"))])
    assert ei.value.code == 2
    assert "argument --metrics-port: '70000' is not allowed; allowed: a port 0..65535" in capsys.readouterr().err


async def _status(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, str]:
    async with session.request(method, url, **kw) as r:
        return r.status, await r.text()


def test_metrics_listener_serves_observability_only() -> None:
    async def go() -> None:
        svc = offline_service([node_obj("n1")])
        app = svc.app(serve_metrics=False)
        mport, aport = free_port(), free_port()
        add_metrics_listener(app, svc, "127.0.0.1", mport)
        runner = web.AppRunner(app)
        await runner.setup()  # runs on_startup: the service, then the metrics listener
        await web.TCPSite(runner, "127.0.0.1", aport).start()
        m, a = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{aport}"
        body = bind_args(pod_obj("p1"), "n1")
        try:
            async with aiohttp.ClientSession() as s:
                status, text = await _status(s, "GET", f"{m}/metrics")
                assert status == 200 and "kube_vgpu" in text
                assert await _status(s, "GET", f"{m}/livez") == (200, "ok")
                assert await _status(s, "GET", f"{m}/readyz") == (200, "ok")
                # the extender API is not on the metrics listener, whatever the method
                for path in ("/bind", "/filter", "/prioritize"):
                    assert (await _status(s, "POST", f"{m}{path}", json=body))[0] == 404, path
                    assert (await _status(s, "GET", f"{m}{path}"))[0] == 404, path
                # the main port keeps the API and the probes, and no longer serves /metrics
                assert await _status(s, "GET", f"{a}/livez") == (200, "ok")
                assert await _status(s, "GET", f"{a}/readyz") == (200, "ok")
                assert (await _status(s, "GET", f"{a}/metrics"))[0] == 404
                status, _ = await _status(s, "POST", f"{a}/filter", json={"Pod": pod_obj("p2"),
                                                                          "NodeNames": ["n1"]})
                assert status == 200
        finally:
            await runner.cleanup()
        # both listeners are closed after cleanup
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", mport))
    run(go)


def test_without_metrics_port_main_port_serves_metrics() -> None:
    async def go() -> None:
        from aiohttp.test_utils import TestServer
        svc = offline_service([node_obj("n1")])
        server = TestServer(svc.app())
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                status, text = await _status(s, "GET", str(server.make_url("/metrics")))
                assert status == 200 and "kube_vgpu" in text
        finally:
            await server.close()
    run(go)


def test_metrics_port_in_use_fails_startup() -> None:
    async def go() -> None:
        svc = offline_service()
        app = svc.app(serve_metrics=False)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            add_metrics_listener(app, svc, "127.0.0.1", port)
            runner = web.AppRunner(app)
            with pytest.raises(MetricsListenError) as ei:
                await runner.setup()
            assert (ei.value.address, ei.value.port) == ("127.0.0.1", port)
            await runner.cleanup()
    run(go)
