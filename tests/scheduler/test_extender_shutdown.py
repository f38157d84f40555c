"""Shutdown of the extender: SIGTERM ends ``kube-vgpu scheduler`` promptly, and a reflector's
watch is closed by the reflector's own thread (closing it from the stopping thread waits for the
reader's buffer lock, i.e. for the next watch event: on a quiet cluster the process outlived its
grace period).

The fake API server here sends no bookmarks (``bookmark_interval=3600``): a watch with nothing to
report stays silent, as a real API server's does between its (about one a minute) bookmarks.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from vgpu_sched_util import node_obj, write_keys

from certs import pki, store
from kube_vgpu.eventloop import ENV_LOOP
from kube_vgpu.kubeapi import Reflector
from scheduler.kube import KubeAPI
from tests.fakeapi import FakeKubeAPI
from tests.sigterm import EXIT_BOUND, sigterm_and_wait

ROOT = Path(__file__).resolve().parents[2]
#: generous bound for "it exited" on a loaded machine; the time measured is printed, not asserted


@pytest.fixture(params=[False, True], ids=["http", "tls"])
def quiet_api(request: pytest.FixtureRequest) -> Any:
    api = FakeKubeAPI(bookmark_interval=3600, tls=request.param)
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def quiet_http_api() -> Any:
    api = FakeKubeAPI(bookmark_interval=3600)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_reflector_stop_wakes_its_thread_which_closes_the_watch(quiet_api: FakeKubeAPI) -> None:
    """stop() returns with the thread ended, and the watch response was closed by the reflector
    thread itself, never by the thread calling stop()."""
    quiet_api.create_object("nodes", node_obj("node-0"))
    api = KubeAPI(quiet_api.api_client())
    watches: list[Any] = []
    closed_by: list[str] = []
    real_watch = api.watch_objects

    def watch_objects(*a: Any, **kw: Any) -> Any:
        resp = real_watch(*a, **kw)
        real_close = resp.close

        def close() -> None:
            closed_by.append(threading.current_thread().name)
            real_close()
        resp.close = close
        watches.append(resp)
        return resp
    api.watch_objects = watch_objects  # type: ignore[method-assign]
    synced = threading.Event()
    r = Reflector(api, "nodes", lambda _i, _rv: None, lambda _t, _o: None, on_synced=synced.set)
    r.start()
    assert synced.wait(10)
    quiet_api.wait_for_watch("nodes", timeout=10)
    _wait(lambda: r._resp is not None, 10, "the reflector reading its watch")
    t0 = time.monotonic()
    stopper = threading.Thread(target=r.stop, kwargs={"join": EXIT_BOUND}, name="stopper", daemon=True)
    stopper.start()
    stopper.join(EXIT_BOUND)
    took = time.monotonic() - t0
    assert not stopper.is_alive(), "stop() blocked"
    assert r._thread is not None and not r._thread.is_alive(), "reflector thread still blocked in its watch"
    assert len(watches) == 1 and watches[0].closed
    assert closed_by and set(closed_by) == {"reflector-nodes"}, closed_by
    print(f"\nreflector stop ({'tls' if quiet_api.tls else 'http'}): {took * 1000:.0f} ms")


def test_reflector_stopped_before_its_watch_opens_does_not_read_it(quiet_api: FakeKubeAPI) -> None:
    """stop() between the watch request and the reflector noting the response: the reflector wakes
    its own response and ends."""
    api = KubeAPI(quiet_api.api_client())
    holder: dict[str, Reflector] = {}
    real_watch = api.watch_objects

    def watch_objects(*a: Any, **kw: Any) -> Any:
        resp = real_watch(*a, **kw)
        holder["r"]._stop.set()  # what stop() does first; its wake finds no response yet
        return resp
    api.watch_objects = watch_objects  # type: ignore[method-assign]
    r = holder["r"] = Reflector(api, "nodes", lambda _i, _rv: None, lambda _t, _o: None)
    r.start()
    assert r._thread is not None
    r._thread.join(EXIT_BOUND)
    assert not r._thread.is_alive(), "reflector read a watch after stop"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_cli_exits_0_soon_after_sigterm_with_quiet_watches(quiet_http_api: FakeKubeAPI, tmp_path: Path,
                                                           loop: str) -> None:
    """``kube-vgpu scheduler`` serving TLS, with both watches open and silent and a client stuck in
    its TLS handshake: SIGTERM -> exit code 0. The time is printed (docs/CONTRACTS.md: within 2 s);
    the assertion only bounds it generously. On uvloop's loop (the default where it is installed)
    and on asyncio's (``KUBE_VGPU_EVENT_LOOP=asyncio``); the startup line names the loop."""
    quiet_api = quiet_http_api
    quiet_api.create_object("nodes", node_obj("node-0"))
    kc = quiet_api.kubeconfig(tmp_path / "kubeconfig")
    bundle = pki.create_bundle(["localhost"], ["127.0.0.1"])
    store.write_files(tmp_path / "tls", bundle)
    trust = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.crt"))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu_cli", "scheduler", "--kubeconfig", kc, "--port", str(port),
         "--bind-address", "127.0.0.1", "--leader-elect=false", "--log-level", "info",
         "--tls-cert-file", str(tmp_path / "tls" / "tls.crt"), "--tls-key-file", str(tmp_path / "tls" / "tls.key"),
         "--signing-keys-dir", str(write_keys(tmp_path / "keys"))],
        cwd=ROOT, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT), ENV_LOOP: loop})
    half = socket.socket()
    try:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", timeout=1, context=trust) as r:
                    return bool(r.status == 200)
            except OSError:
                assert proc.poll() is None, "scheduler exited before it was ready"
                return False
        _wait(ready, 60, "scheduler /readyz")
        quiet_api.wait_for_watch("nodes", timeout=30)
        quiet_api.wait_for_watch("pods", timeout=30)
        half.connect(("127.0.0.1", port))  # a connection that never finishes its TLS handshake
        err, took = sigterm_and_wait(proc, "scheduler")
    finally:
        half.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    assert proc.returncode == 0, err.decode()[-3000:]
    assert not [x for x in lines if x["level"] == "error"], lines
    assert [x["event_loop"] for x in lines if x["msg"] == "starting"] == [loop], lines
    print(f"\nSHUTDOWN scheduler ({loop}): exit 0 {took:.2f} s after SIGTERM (TLS, a half-open handshake)")
