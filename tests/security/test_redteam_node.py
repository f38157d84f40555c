# ruff: noqa: F811 - fixtures imported from the device plugin tests are parameters here
"""A hostile tenant against the node components through the one place on the host it can write: its
read-write cache directory (``<cache-host-dir>/alloc-<key>`` for the device plugin, ``dra-<claim uid>``
for the DRA plugin, mounted at ``/usr/local/vgpu/cache``). Played against the real device plugin over
the fake kubelet's v1beta1 gRPC and against the real DRA kubelet plugin; the tenant's writes are made
directly in the host directory, as its container would make them through the mount."""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_DP_TESTS = str(Path(__file__).resolve().parents[1] / "deviceplugin")
if _DP_TESTS not in sys.path:  # the device plugin tests' helpers and fixtures (fake kubelet, fake NVML)
    sys.path.insert(0, _DP_TESTS)

from dp_helpers import FakeKubelet, bound_pod, create_signed, write_region  # noqa: E402

from deviceplugin.response import alloc_key  # noqa: E402
from deviceplugin.server import TRASH_PREFIX, DevicePlugin, _empty_trash  # noqa: E402
from deviceplugin.shimcache import read_container, remove_tree  # noqa: E402
from kube_vgpu.dra import DRIVER_NAME  # noqa: E402
from tests.deviceplugin.conftest import fake_nvml_lib, gpus, kube_api, kubelet, sockdir  # noqa: E402,F401
from tests.deviceplugin.test_dp_daemon import U, start_plugin  # noqa: E402,F401
from tests.dra.dra_node_helpers import NS, Node, result, running_node  # noqa: E402

#: deeper than Python's recursion limit (1000): shutil.rmtree raised RecursionError on such a tree
DEPTH = 3000


@pytest.fixture
def deep_trees() -> Iterator[list[Path]]:
    """Directories a test filled with :func:`deep_tree`: whatever the plugin left of them is removed
    afterwards (pytest's own cleanup, shutil.rmtree, fails on them)."""
    tops: list[Path] = []
    yield tops
    for top in tops:
        for cand in [top, *top.parent.glob(f".removing-*-{top.name}")]:
            if cand.is_dir() and not cand.is_symlink():
                remove_tree(str(cand))


def deep_tree(top: Path, depth: int = DEPTH) -> None:
    """Nest ``depth`` directories under ``top`` as a container does (mkdir + chdir, one level at a
    time: no path is ever longer than one name), with a file at the bottom."""
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=cur)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        fd = os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cur)
        os.close(fd)
    finally:
        os.close(cur)


def cache_dir(resp: Any) -> Path:
    return Path(next(m.host_path for m in resp.mounts if m.container_path == "/usr/local/vgpu/cache"))


def test_the_next_holder_of_the_same_device_ids_gets_an_empty_cache_directory(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any) -> None:
    """The directory's name is a hash of the device IDs only, so the next container kubelet hands the
    same slots (after the first pod finished: a completed Job pod stays in the API, so its directory
    is not cleaned up) mounts the same directory. The first tenant leaves a forged accounting file
    (usage its neighbour's shim would join and the metrics would report as the neighbour's) and a
    file of its own there: the next holder must find the directory empty."""
    plugin = start_plugin(heartbeat_seconds=3600)
    ids = [f"{U[0]}::0"]
    create_signed(kube_api, bound_pod("first", [("c", False, [(U[0], 2000, 20)], {})], bind_time=1))
    (a,) = kubelet.admit("first", [("c", ids)])
    first = cache_dir(a.response)
    assert first.name == alloc_key(ids)
    write_region(first / "vgpu.cache", {0: 7 * 1024**3}, oom_refusals=99)
    (first / "left-for-the-next-tenant").write_text("hello neighbour")
    (first / "sub").mkdir()
    kube_api.patch_object("pods", "first", {"status": {"phase": "Succeeded"}}, "default", subresource="status")
    kubelet.remove("first")  # kubelet frees the slots of a finished pod; the pod object stays

    create_signed(kube_api, bound_pod("second", [("c", False, [(U[0], 1000, 10)], {})], bind_time=2))
    (b,) = kubelet.admit("second", [("c", ids)])
    second = cache_dir(b.response)
    assert second == first and second.is_dir()
    assert sorted(os.listdir(second)) == []
    assert os.stat(second).st_mode & 0o777 == 0o777
    uid = kube_api.get_object("pods", "second", "default")["metadata"]["uid"]
    assert read_container(plugin.opts.cache_host_dir, uid, "c", second.name) is None


def test_a_cache_tree_thousands_of_levels_deep_with_symlinks_is_removed_and_the_cleanup_goes_on(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any, tmp_path: Path,
        deep_trees: list[Path]) -> None:
    """A gone pod's tenant nested 3,000 directories in its cache directory and planted symlinks to a
    host directory (at the top and at the bottom), a directory named like the remover's own
    temporary names, names that are not UTF-8 and a FIFO. The cleanup removes the whole tree without following a link (the host's files
    stay), and goes on to the other gone pods' directories (``shutil.rmtree`` raised RecursionError,
    which stopped the cleanup of every directory after it and left the tree for the slots' next holder)."""
    plugin = start_plugin(heartbeat_seconds=3600)
    host = tmp_path / "host-etc"
    host.mkdir()
    (host / "shadow").write_text("keep")
    uids = {create_signed(kube_api, bound_pod("deep", [("c", False, [(U[0], 1000, 10)], {})], bind_time=1))
            ["metadata"]["uid"],
            create_signed(kube_api, bound_pod("other", [("c", False, [(U[1], 1000, 10)], {})], bind_time=2))
            ["metadata"]["uid"]}
    (d,) = kubelet.admit("deep", [("c", [f"{U[0]}::0"])])
    (o,) = kubelet.admit("other", [("c", [f"{U[1]}::0"])])
    deep, other = cache_dir(d.response), cache_dir(o.response)
    deep_trees.append(deep)
    deep_tree(deep)
    (deep / "escape").symlink_to(host, target_is_directory=True)
    (deep / ".kube-vgpu-rm-1").mkdir()
    (deep / ".kube-vgpu-rm-1" / "escape").symlink_to(host / "shadow")
    bottom = deep.joinpath(*["d"] * 10)
    (bottom / "escape").symlink_to(host, target_is_directory=True)
    odd = os.path.join(os.fsencode(deep), b"\xff\xfe\nodd name")  # not UTF-8, a newline: names as bytes
    os.mkdir(odd)
    os.mkfifo(os.path.join(odd, b"fifo\x01"))  # a FIFO is unlinked, never opened
    (other / "f").write_text("x")
    for name in ("deep", "other"):
        kube_api.delete_object("pods", name, "default")
        kubelet.remove(name)
    # the cleanup keeps what the pod watch still knows: wait until it has seen both deletions
    deadline = time.monotonic() + 30
    while uids & set(plugin.arrivals.snapshot()):
        assert time.monotonic() < deadline, "the pod watch never saw the deletions"
        time.sleep(0.02)
    pods = plugin.kube.list_node_pods(plugin.opts.node_name)
    plugin.clean_cache_dirs(pods)  # its answer may miss what the trash thread removed meanwhile
    _empty_trash(plugin.opts.cache_host_dir)  # waits for the trash thread's removal (same lock)
    for path in (deep, other):
        assert not path.exists() and not Path(f"{path}.limits").exists()
    assert [n for n in os.listdir(plugin.opts.cache_host_dir) if n.startswith(TRASH_PREFIX)] == []
    assert sorted(os.listdir(host)) == ["shadow"] and (host / "shadow").read_text() == "keep"


def test_removing_a_tenants_huge_directory_never_holds_up_other_pods(
        start_plugin: Callable[..., DevicePlugin], kubelet: FakeKubelet, kube_api: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant fills its cache directory with millions of files (about 1.6 s per 100,000 to remove):
    the removal ran under the Allocate lock (the heartbeat's cleanup, and a new holder's Allocate
    emptying the directory), so every other pod's Allocate and PreStartContainer on the node waited
    for it (kubelet gives PreStart 30 s). Played with a removal that does not end until released:
    other pods are admitted and started meanwhile, the same device IDs' next holder too, and the
    node inventory's heartbeat goes on (it did the removal itself, for minutes on end)."""
    from deviceplugin import server

    plugin = start_plugin()  # heartbeat every 0.5 s
    entered, release = threading.Event(), threading.Event()
    real = server.remove_tree

    key = alloc_key([f"{U[0]}::0"])

    def slow(path: str) -> None:
        if os.path.basename(path).endswith(key):  # the tenant's allocation directory: "millions of files"
            entered.set()
            release.wait(60)
        real(path)

    monkeypatch.setattr(server, "remove_tree", slow)
    try:
        ids = [f"{U[0]}::0"]
        create_signed(kube_api, bound_pod("huge", [("c", False, [(U[0], 1000, 10)], {})], bind_time=1))
        (h,) = kubelet.admit("huge", [("c", ids)])
        (cache_dir(h.response) / "f").write_text("x")
        kube_api.delete_object("pods", "huge", "default")
        kubelet.remove("huge")
        assert entered.wait(30), "the heartbeat never started removing the gone pod's directory"
        # the node inventory's heartbeat goes on (a stale one takes the node out of scheduling)
        since = plugin.status.last_inventory_write
        deadline = time.monotonic() + 30
        while plugin.status.last_inventory_write <= since:
            assert time.monotonic() < deadline, "no inventory heartbeat while the directory was being removed"
            time.sleep(0.05)
        # while that removal runs: another pod, and the next holder of the same device IDs
        create_signed(kube_api, bound_pod("other", [("c", False, [(U[1], 2000, 20)], {})], bind_time=2))
        (o,) = kubelet.admit("other", [("c", [f"{U[1]}::0"])])
        create_signed(kube_api, bound_pod("next", [("c", False, [(U[0], 3000, 30)], {})], bind_time=3))
        (n,) = kubelet.admit("next", [("c", ids)])
        assert o.started and n.started, (o.error, n.error)
        assert os.listdir(cache_dir(n.response)) == []
    finally:
        release.set()
    assert plugin.alive()


def test_a_directory_of_many_names_is_removed_without_listing_it_in_memory(tmp_path: Path) -> None:
    """A tenant puts millions of names in one directory of its cache directory (over 200 bytes of the
    plugin's memory each once listed: a listing of about 1.3 million passes the chart's 256 MiB limit,
    and the plugin, killed, meets the same directory after every restart). Played with 50,000 names of
    100 characters at the top and as many in a subdirectory: the remover's memory stays far below the
    listing's (10 MiB for these)."""
    import tracemalloc

    top = tmp_path / "alloc-00000000000000ab"
    (top / "sub").mkdir(parents=True)
    for where in (top, top / "sub"):
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(50_000):
                os.close(os.open(f"{i:0>100}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        finally:
            os.close(fd)
    tracemalloc.start()
    try:
        remove_tree(str(top))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not top.exists()
    assert peak < 2 * 1024 * 1024, f"{peak} bytes at the peak for 50,000 names of 100 characters"


def test_remove_tree_refuses_a_symlink_at_the_top(tmp_path: Path) -> None:
    """The remover never starts through a link: a symlink in place of the directory is refused and
    what it points to is left whole."""
    target = tmp_path / "host"
    target.mkdir()
    (target / "f").write_text("keep")
    link = tmp_path / "alloc-0000000000000001"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(OSError):
        remove_tree(str(link))
    assert (target / "f").read_text() == "keep" and link.is_symlink()


class OpenWatch:
    """inotify ``IN_OPEN`` on one path: the kernel queues the event while ``open`` runs (an ``O_PATH``
    open, which calls no driver, queues none), so after a call it tells whether the file was opened."""

    IN_OPEN, IN_NONBLOCK, IN_CLOEXEC = 0x20, 0o4000, 0o2000000

    def __init__(self, path: Path) -> None:
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert self.libc.inotify_add_watch(self.fd, bytes(path), self.IN_OPEN) >= 0, os.strerror(ctypes.get_errno())

    def opened(self) -> bool:
        try:
            return len(os.read(self.fd, 4096)) > 0
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.parametrize("kind", ["char device", "fifo"])
def test_the_metrics_never_open_a_device_node_or_fifo_the_tenant_put_in_place_of_its_cache_file(
        tmp_path: Path, kind: str) -> None:
    """``mknod`` is among a container's default capabilities, and the device rules that keep the
    container from opening a device do not bind the device plugin reading the tenant's directory on
    the node: a ``vgpu.cache`` that is the node's watchdog (10:130) would be armed by a mere open (the
    node reboots), a tape rewound, a terminal made the plugin's own. Played with a node of /dev/null's
    numbers (1:3) and a FIFO: the metrics' reader (``read_container``) refuses them without opening
    them (it opened them, non-blocking, and only then checked the type)."""
    root = tmp_path / "containers"
    cache = root / "alloc-00000000000000ab"
    cache.mkdir(parents=True)
    node = cache / "vgpu.cache"
    if kind == "fifo":
        os.mkfifo(node)
    else:
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    watch = OpenWatch(node)
    try:
        assert read_container(str(root), "uid-1", "c", cache.name) is None
        assert not watch.opened(), f"the reader opened the tenant's {kind}"
        os.close(os.open(node, os.O_RDONLY | os.O_NONBLOCK))  # the watch itself sees an open
        assert watch.opened()
    finally:
        watch.close()


@pytest.fixture
def dra_node() -> Iterator[Node]:
    with running_node() as n:
        yield n


def test_a_claims_cache_tree_thousands_of_levels_deep_is_unprepared(dra_node: Node, deep_trees: list[Path]) -> None:
    """The DRA path: the claim's tenant nests 3,000 directories in its cache directory; Unprepare
    still removes the directories (it failed with RecursionError, every retry, so the claim stayed
    prepared on the node for good)."""
    c = dra_node.claim("c1", [result()])
    uid = c["metadata"]["uid"]
    assert dra_node.kubelet is not None
    assert dra_node.kubelet.prepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid].error == ""
    cache = Path(dra_node.opts.cache_host_dir) / f"dra-{uid}"
    deep_trees.append(cache)
    deep_tree(cache)
    assert dra_node.kubelet.unprepare(DRIVER_NAME, [(NS, uid, "c1")]).claims[uid].error == ""
    assert not cache.exists() and not Path(f"{cache}.limits").exists()
    # moved aside at once, removed on the plugin's trash thread: wait for it (same lock), then none is left
    _empty_trash(dra_node.opts.cache_host_dir)
    assert [n for n in os.listdir(dra_node.opts.cache_host_dir) if n.startswith(TRASH_PREFIX)] == []
    assert dra_node.cdi_spec(uid) is None
