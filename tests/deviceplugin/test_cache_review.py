# ruff: noqa: F811 - the device plugin tests' start_plugin fixture is imported and used as a parameter
"""Review of the cache-directory emptying and removal (device plugin Allocate, DRA Unprepare): what a
legitimate container keeps, and that one tenant's slow removal never holds up another pod's calls.

kubelet calls Allocate once per container at the pod's admission and never again for a running
container (a restart, a kubelet restart or the plugin's re-registration only calls PreStartContainer),
so a live container's directory is only ever rewritten by PreStart, never emptied."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dp_helpers import NODE, FakeKubelet, bound_pod, create_signed, write_region

from deviceplugin import server
from deviceplugin.server import TRASH_PREFIX, DevicePlugin
from deviceplugin.shimcache import read_container
from kube_vgpu.dra import DRIVER_NAME
from tests.deviceplugin.test_dp_daemon import U, start_plugin  # noqa: F401 - fixture
from tests.dra.dra_node_helpers import NS, Node, result, running_node

#: safety net of every wait below (the waits are on events; this only bounds a failing test)
WAIT = 60.0


def _cache_dir(resp: Any) -> Path:
    return Path(next(m.host_path for m in resp.mounts if m.container_path == "/usr/local/vgpu/cache"))


def _blocking_remove_tree(monkeypatch: pytest.MonkeyPatch, marker: str) -> tuple[threading.Event, threading.Event,
                                                                                    threading.Event]:
    """Make the removal of a directory whose path contains ``marker`` wait (as a tenant's millions of
    files do). Returns (entered, release, done): set when it starts, set by the test to let it go on,
    set when the real removal finished."""
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real = server.remove_tree

    def slow(path: str) -> None:
        if marker in path:
            entered.set()
            assert release.wait(WAIT), "the test never released the removal"
            real(path)
            done.set()
            return
        real(path)

    monkeypatch.setattr(server, "remove_tree", slow)
    return entered, release, done


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
    """Run ``fn`` on a thread; returns (finished, [its result or exception])."""
    finished, out = threading.Event(), []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    return finished, out


def test_a_live_containers_accounting_file_survives_restarts_and_cleanups(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """A running container's shared accounting file (vgpu.cache) stays in place, same inode, through
    a container restart (PreStart again), the heartbeat's cleanup, a kubelet restart (re-registration)
    and a device plugin restart; the metrics read it (through the O_PATH check) all along."""
    plugin = start_plugin(heartbeat_seconds=3600)
    create_signed(kube_api, bound_pod("live", [("c", False, [(U[0], 2000, 20)], {})], bind_time=1))
    (a,) = kubelet.admit("live", [("c", [f"{U[0]}::0"])])
    assert a.started, a.error
    cache = _cache_dir(a.response)
    write_region(cache / "vgpu.cache", {0: 512 * 1024**2})
    ino = os.stat(cache / "vgpu.cache").st_ino
    uid = kube_api.get_object("pods", "live", "default")["metadata"]["uid"]

    def still_there(p: DevicePlugin) -> None:
        assert os.stat(cache / "vgpu.cache").st_ino == ino
        usage = read_container(p.opts.cache_host_dir, uid, "c", cache.name)
        assert usage is not None and usage.used[0] == 512 * 1024**2

    assert kubelet.start_container("live", "c").started  # a restart: PreStart again, no Allocate
    still_there(plugin)
    assert plugin.clean_cache_dirs(plugin.kube.list_node_pods(NODE)) == []
    still_there(plugin)

    regs = plugin.status.registrations
    kubelet.restart()
    kubelet.wait(lambda _k: plugin.status.registrations > regs, what="re-registration after a kubelet restart")
    assert kubelet.start_container("live", "c").started
    still_there(plugin)

    plugin.stop()
    again = start_plugin(heartbeat_seconds=3600)
    assert again.clean_cache_dirs(again.kube.list_node_pods(NODE)) == []
    assert kubelet.start_container("live", "c").started
    still_there(again)


def test_reallocating_a_key_while_its_old_directory_is_being_removed_keeps_the_new_one(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same device IDs are allocated again while the previous holder's directory (renamed aside)
    is still being removed on the trash thread: the new directory is a different one and survives
    that removal; the trash is gone afterwards."""
    plugin = start_plugin(heartbeat_seconds=3600)
    ids = [f"{U[0]}::0"]
    entered, release, done = _blocking_remove_tree(monkeypatch, TRASH_PREFIX)
    create_signed(kube_api, bound_pod("one", [("c", False, [(U[0], 2000, 20)], {})], bind_time=1))
    (a,) = kubelet.admit("one", [("c", ids)])
    first = _cache_dir(a.response)
    (first / "old-file").write_text("x")
    kubelet.remove("one")
    kube_api.delete_object("pods", "one", "default")

    create_signed(kube_api, bound_pod("two", [("c", False, [(U[0], 1000, 10)], {})], bind_time=2))
    (b,) = kubelet.admit("two", [("c", ids)])
    assert b.started, b.error
    assert entered.wait(WAIT), "the trash thread never started removing the old directory"
    second = _cache_dir(b.response)
    assert second == first and os.listdir(second) == []
    write_region(second / "vgpu.cache", {0: 1024**2})
    ino = os.stat(second / "vgpu.cache").st_ino
    release.set()
    assert done.wait(WAIT)
    assert os.stat(second / "vgpu.cache").st_ino == ino
    root = Path(plugin.opts.cache_host_dir)
    assert [n for n in os.listdir(root) if n.startswith(TRASH_PREFIX)] == []


@pytest.fixture
def dra_node() -> Iterator[Node]:
    with running_node() as n:
        yield n


def test_dra_unprepare_never_waits_for_a_tenants_slow_removal(
        dra_node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's claim directory takes long to remove (millions of files). Its own Unprepare, other
    claims' Unprepare and Prepare answer while that removal runs: it ran inside the Unprepare call,
    under a lock every other Unprepare then waited on, each holding one of the server's 8 threads,
    so kubelet's calls timed out and, the threads used up, no pod on the node could get its claim
    prepared."""
    k = dra_node.kubelet
    assert k is not None
    a = dra_node.claim("slow", [result("gpu-0")])
    b = dra_node.claim("other", [result("gpu-1")])
    ua, ub = a["metadata"]["uid"], b["metadata"]["uid"]
    for uid, name in ((ua, "slow"), (ub, "other")):
        assert k.prepare(DRIVER_NAME, [(NS, uid, name)]).claims[uid].error == ""
    entered, release, done = _blocking_remove_tree(monkeypatch, f"dra-{ua}")
    try:
        fin_a, out_a = _in_thread(lambda: k.unprepare(DRIVER_NAME, [(NS, ua, "slow")]))
        assert entered.wait(WAIT), "the slow claim's directory was never removed"
        assert fin_a.wait(WAIT), "the tenant's own Unprepare waited for its directory's removal"
        assert out_a[0].claims[ua].error == ""
        fin_b, out_b = _in_thread(lambda: k.unprepare(DRIVER_NAME, [(NS, ub, "other")]))
        assert fin_b.wait(WAIT), "another claim's Unprepare waited for the tenant's removal"
        assert out_b[0].claims[ub].error == ""
        c = dra_node.claim("next", [result("gpu-0")])
        uc = c["metadata"]["uid"]
        fin_c, out_c = _in_thread(lambda: k.prepare(DRIVER_NAME, [(NS, uc, "next")]))
        assert fin_c.wait(WAIT), "a Prepare waited for the tenant's removal"
        assert out_c[0].claims[uc].error == ""
        assert not done.is_set()  # all of it while the removal still ran
    finally:
        release.set()
    assert done.wait(WAIT), "the slow claim's directory was never removed"
    root = Path(dra_node.opts.cache_host_dir)
    assert not (root / f"dra-{ua}").exists() and not (root / f"dra-{ub}").exists()


def test_the_trash_threads_end_at_stop(start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet,
                                       kube_api: Any, dra_node: Node) -> None:
    """stop() wakes both plugins' trash threads (they wait a whole period otherwise) and they end."""
    plugin = start_plugin(heartbeat_seconds=3600)
    (t,) = [t for t in plugin._threads if t.name == "deviceplugin-trash"]
    assert t.is_alive()
    plugin.stop()
    t.join(WAIT)
    assert not t.is_alive()
    dra_node.stop_plugin()
    dra_node.resync_seconds = 3600  # the trash thread's period: only stop() can wake it in time
    dra = dra_node.start_plugin()
    (d,) = [t for t in dra._threads if t.name == "dra-trash"]
    assert d.is_alive()
    dra_node.stop_plugin()
    d.join(WAIT)
    assert not d.is_alive()
