"""Shutdown of the device plugin: SIGTERM ends ``kube-vgpu device-plugin`` promptly, and its pod
watch is closed by the watch thread itself (closing it from the stopping thread waits for the
reader's buffer lock, i.e. for the next event: on a quiet node the process outlived its grace period).

The fake API server sends no bookmarks here (``bookmark_interval=3600``): a watch with nothing to
report stays silent, as a real API server's does between its (about one a minute) bookmarks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dp_helpers import NODE, FakeGPUs, FakeKubelet, make_node, write_keys

from deviceplugin.kube import ApiKubeClient
from deviceplugin.podwatch import ArrivalBook, PodWatcher
from tests.fakeapi import FakeKubeAPI
from tests.sigterm import EXIT_BOUND, sigterm_and_wait

#: generous bound for "it exited" on a loaded machine; the time measured is printed, not asserted
GPU = {"uuid": "GPU-00000000-2222-4000-8000-000000000000", "name": "NVIDIA H200", "memory_mib": 143771, "numa": 0}


@pytest.fixture
def quiet_api() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI(bookmark_interval=3600)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def test_pod_watcher_stop_wakes_its_thread_which_closes_the_watch(quiet_api: FakeKubeAPI) -> None:
    """stop() returns with the watch thread ended; the stream was closed by that thread."""
    kube = ApiKubeClient(api_client=quiet_api.api_client())
    closed_by: list[str] = []
    real_watch = kube.watch_objects

    def watch_objects(*a: Any, **kw: Any) -> Any:
        resp = real_watch(*a, **kw)
        real_close = resp.close

        def close() -> None:
            closed_by.append(threading.current_thread().name)
            real_close()
        resp.close = close
        return resp
    kube.watch_objects = watch_objects  # type: ignore[method-assign]
    w = PodWatcher(kube, ArrivalBook(NODE))
    w.start()
    assert w.synced.wait(10)
    quiet_api.wait_for_watch("pods", timeout=10)
    deadline = time.monotonic() + 10
    while w.reflector._resp is None:
        assert time.monotonic() < deadline, "watch never noted"
        time.sleep(0.01)
    t0 = time.monotonic()
    stopper = threading.Thread(target=w.stop, kwargs={"join": EXIT_BOUND}, daemon=True)
    stopper.start()
    stopper.join(EXIT_BOUND)
    took = time.monotonic() - t0
    assert not stopper.is_alive(), "stop() blocked"
    assert not w.alive(), "watch thread still blocked in its read"
    assert closed_by and set(closed_by) == {"deviceplugin-podwatch"}, closed_by
    print(f"\npod watch stop: {took * 1000:.0f} ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_exits_0_soon_after_sigterm_with_a_quiet_watch(gpus: FakeGPUs, fake_nvml_lib: Path, kubelet: FakeKubelet,
                                                           quiet_api: FakeKubeAPI, sockdir: str,
                                                           tmp_path: Path) -> None:
    """``kube-vgpu device-plugin`` registered, its pod watch open and silent: SIGTERM -> exit code 0.
    The time is printed (docs/CONTRACTS.md: within 2 s); the assertion only bounds it generously."""
    make_node(quiet_api)
    gpus.set([GPU])
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_lib.parent), "NODE_NAME": NODE}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kube_vgpu_cli", "device-plugin", "--kubeconfig",
         quiet_api.kubeconfig(tmp_path / "kubeconfig"), "--device-plugin-dir", sockdir,
         "--pod-resources-socket", kubelet.podresources_socket,
         "--shim-host-path", str(tmp_path / "vgpu" / "libvgpu.so"), "--cache-host-dir", str(tmp_path / "containers"),
         "--metrics-port", str(_free_port()), "--metrics-bind-address", "127.0.0.1",
         "--signing-keys-dir", str(write_keys(tmp_path / "keys"))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kubelet.wait(lambda k: k.updates > 0, timeout=EXIT_BOUND, what="registration by the CLI process")
        quiet_api.wait_for_watch("pods", timeout=EXIT_BOUND)
        err, took = sigterm_and_wait(proc, "device plugin")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "background thread died" not in err, err[-3000:]
    print(f"\nSHUTDOWN device-plugin: exit 0 {took:.2f} s after SIGTERM")
