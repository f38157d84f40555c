""":class:`kube_vgpu.kubeapi.AsyncReflector` (the extender's list+watch on its event loop) against
the fake kube-apiserver over TLS: the list, then every change in order as it happens, with the
callbacks on the loop; a watch that expires (410) relists; API and connection errors back off and
carry on; the server ending a watch resumes from the last resourceVersion without a relist; a
resync relists; a watch event larger than the line limit is an error, not a stall; stopping ends
it at once with its watch open and silent. All waits are on events."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from vgpu_sched_util import node_obj

from kube_vgpu.kubeapi import AsyncReflector
from scheduler.kube import KubeAPI
from tests.fakeapi import FakeKubeAPI


class Seen:
    """What the reflector called back with, recorded on the loop (and the thread each ran on)."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        self.list_starts = 0
        self.changed = asyncio.Event()

    def replace(self, items: list[dict[str, Any]], _rv: str) -> None:
        self.threads.add(threading.current_thread().name)
        self.lists.append(sorted(i["metadata"]["name"] for i in items))
        self.changed.set()

    def event(self, typ: str, obj: dict[str, Any]) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append((typ, obj["metadata"]["name"]))
        self.changed.set()

    def list_start(self) -> None:
        self.list_starts += 1

    async def until(self, pred: Callable[[], bool], timeout: float = 30.0) -> None:
        """Until ``pred()``: checked at every callback, and every 50 ms for what changes without one
        (the reflector's counters)."""
        async def wait() -> None:
            while not pred():
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), 0.05)
                except TimeoutError:
                    pass
        await asyncio.wait_for(wait(), timeout)


def _run(fake: FakeKubeAPI, body: Callable[[AsyncReflector, Seen], Coroutine[Any, Any, None]], **kw: Any) -> Seen:
    seen = Seen()

    async def go() -> None:
        api = KubeAPI(fake.api_client())
        r = AsyncReflector(api, "nodes", seen.replace, seen.event, on_list_start=seen.list_start,
                           backoff=(0.01, 0.05), **kw)
        r.start()
        try:
            await seen.until(lambda: bool(seen.lists))
            await body(r, seen)
        finally:
            await r.astop()
            await api.aclose()
        assert not r.alive()
    asyncio.run(go())
    return seen


@pytest.fixture
def fake() -> Any:
    with FakeKubeAPI(tls=True, bookmark_interval=3600) as api:
        yield api


def test_lists_then_streams_every_change_in_order_on_the_loop(fake: FakeKubeAPI) -> None:
    fake.create_object("nodes", node_obj("n-0"))

    async def body(r: AsyncReflector, seen: Seen) -> None:
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
        fake.create_object("nodes", node_obj("n-1"))
        n0 = fake.get_object("nodes", "n-0")
        assert n0 is not None
        n0["metadata"].setdefault("labels", {})["x"] = "y"
        fake.update_object("nodes", n0)
        fake.delete_object("nodes", "n-1")
        await seen.until(lambda: len(seen.events) >= 3)
        assert seen.events == [("ADDED", "n-1"), ("MODIFIED", "n-0"), ("DELETED", "n-1")]
        assert r.relists == 1 and r.errors == 0 and r.resource_version
    seen = _run(fake, body)
    assert seen.lists == [["n-0"]] and seen.list_starts == 1
    assert seen.threads == {"MainThread"}  # every callback on the event loop's thread


def test_expired_watch_relists_and_carries_on(fake: FakeKubeAPI) -> None:
    async def body(r: AsyncReflector, seen: Seen) -> None:
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
        fake.expire_watches()  # every resourceVersion issued so far is too old: 410
        fake.create_object("nodes", node_obj("after-410"))
        await seen.until(lambda: any("after-410" in lst for lst in seen.lists)
                         or ("ADDED", "after-410") in seen.events)
        await seen.until(lambda: r.relists >= 2)
    seen = _run(fake, body)
    assert seen.list_starts >= 2


def test_server_ending_the_watch_resumes_without_a_relist(fake: FakeKubeAPI) -> None:
    async def body(r: AsyncReflector, seen: Seen) -> None:
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
        assert fake.close_watches("nodes") == 1
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)  # a new watch from the last resourceVersion
        fake.create_object("nodes", node_obj("resumed"))
        await seen.until(lambda: ("ADDED", "resumed") in seen.events)
        assert r.relists == 1 and r.errors == 0
    _run(fake, body)


def test_api_errors_back_off_and_recover(fake: FakeKubeAPI) -> None:
    async def body(r: AsyncReflector, seen: Seen) -> None:
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
        fake.fail_next("watch", "nodes", status=500, count=3)
        fake.close_watches("nodes")
        fake.create_object("nodes", node_obj("after-errors"))
        await seen.until(lambda: ("ADDED", "after-errors") in seen.events
                         or any("after-errors" in lst for lst in seen.lists))
        assert r.errors == 3
    _run(fake, body)


def test_resync_relists(fake: FakeKubeAPI) -> None:
    async def body(r: AsyncReflector, seen: Seen) -> None:
        await seen.until(lambda: r.relists >= 3)
    seen = _run(fake, body, resync_seconds=0.05)
    assert len(seen.lists) >= 3


def test_an_event_longer_than_the_line_limit_is_an_error_not_a_stall(fake: FakeKubeAPI) -> None:
    """A watch line longer than the limit fails the watch (counted, backed off) and the reflector
    relists (a list has no line limit), so the object arrives and later changes still do."""
    api = KubeAPI(fake.api_client())
    assert api.aio is not None
    real = api.aio.lines

    def small(path: str, read_timeout: float, max_line: int = 0) -> Any:
        return real(path, read_timeout, max_line=4096)
    api.aio.lines = small  # type: ignore[method-assign]
    seen = Seen()

    async def go() -> None:
        r = AsyncReflector(api, "nodes", seen.replace, seen.event, backoff=(0.01, 0.05))
        r.start()
        try:
            await seen.until(lambda: bool(seen.lists))
            await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
            big = node_obj("big")
            big["metadata"]["annotations"] = {**big["metadata"].get("annotations", {}), "pad": "x" * 20000}
            fake.create_object("nodes", big)
            await seen.until(lambda: r.errors >= 1 and any("big" in lst for lst in seen.lists))
            assert ("ADDED", "big") not in seen.events
            fake.create_object("nodes", node_obj("small-after"))
            await seen.until(lambda: ("ADDED", "small-after") in seen.events)
        finally:
            await r.astop()
            await api.aclose()
    asyncio.run(go())


def test_stop_ends_it_at_once_with_a_silent_watch_open(fake: FakeKubeAPI) -> None:
    async def body(r: AsyncReflector, seen: Seen) -> None:
        await asyncio.to_thread(fake.wait_for_watch, "nodes", 1, 10)
        await asyncio.wait_for(r.astop(), 5)
        assert not r.alive()
    _run(fake, body)


@pytest.mark.parametrize("generated", [False, True], ids=["event-loop", "threads"])
def test_the_extender_watches_on_its_loop_unless_its_client_cannot(fake: FakeKubeAPI, generated: bool) -> None:
    """The extender's nodes, pods and quota watches run on its event loop with the lean client;
    with the generated client (as with a proxy configuration) they run in threads. Either way the
    cache syncs, follows a new pod, and stopping ends every watch."""
    from vgpu_sched_util import KEYS, Extender, create_pod, pod_obj

    from kube_vgpu.config import Config
    from kube_vgpu.kubeapi import Reflector
    from scheduler.service import Options, SchedulerService

    fake.create_object("nodes", node_obj("node-0", 1))

    async def go() -> None:
        svc = SchedulerService(Config(), KubeAPI(fake.api_client(), generated_client=generated),
                               Options(sync_wait=5.0), keys=KEYS)
        async with Extender(svc):
            await asyncio.wait_for(svc.synced.wait(), 30)
            kinds = [type(r) for r in svc._reflectors]
            assert kinds == ([Reflector] * 3 if generated else [AsyncReflector] * 3), kinds
            uid = create_pod(fake, pod_obj("watched", limits={"nvidia.com/gpu": "1"}))["metadata"]["uid"]
            for _ in range(600):  # the watch shows it: a bind would take it from there
                if svc.cache.pod_to_bind("default/watched", uid) is not None:
                    break
                await asyncio.sleep(0.05)
            assert svc.cache.pod_to_bind("default/watched", uid) is not None
        assert not any(r.alive() for r in svc._reflectors)
    asyncio.run(go())
