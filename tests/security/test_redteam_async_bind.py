"""Red-team tests of the extender's Binding sent from its event loop
(:class:`kube_vgpu.kubeapi.AsyncJSONClient`, :meth:`scheduler.bindcycle.BindCycle.write`), against
the fake kube-apiserver over real HTTP. The attacker can call ``/bind`` directly (the port has no
caller authentication) and the API server's answers can be lost. Every test ends with the books
equal to the cluster (``check_books``) and checks that no Binding of one attempt was sent twice.

Requests are held inside the fake API server with threading events (its hooks run on its own
thread); the tests wait on those events and on the bind calls, never on wall-clock sleeps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from aiohttp import web
from bind_support import bind, bind_args, check_books, create_nodes, create_pod, extender, pod_obj
from vgpu_sched_util import wait_until

from kube_vgpu.eventloop import new_event_loop
from kube_vgpu.kubeapi import AsyncJSONClient
from kube_vgpu.resources import ANN_ALLOCATION
from tests.fakeapi import FakeKubeAPI

GPU_MIB = 24576
PROXIED_HOST = "http://kube.invalid"  #: the API server's address when the fake is reached as a proxy
WAIT = 30.0  #: the longest a test waits for an event before failing (a bound, not a sleep)
T = TypeVar("T")


def run_on(loop: str, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a new event loop of kind ``loop``: ``asyncio``, or ``uvloop``, the loop
    ``kube-vgpu scheduler`` serves on (:mod:`kube_vgpu.eventloop`)."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
        factory = new_event_loop
    else:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def pod(fake: FakeKubeAPI, name: str, mib: int = 16000) -> dict[str, Any]:
    """A pod asking for ``mib`` of one GPU: two of them never fit one 24576 MiB GPU."""
    return create_pod(fake, pod_obj(name, limits={"nvidia.com/gpumem": mib}))


async def watched(svc: Any, p: dict[str, Any]) -> None:
    """Until the extender's pod watch has delivered pod ``p`` (a bind then takes it from the cache)."""
    key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
    await wait_until(lambda: svc.cache.pod_to_bind(key, p["metadata"]["uid"]) is not None)


def bindings(fake: FakeKubeAPI, name: str) -> int:
    """How many Bindings of pod ``name`` the fake received."""
    return sum(1 for r in fake.request_log if r.method == "POST" and r.path.endswith(f"/pods/{name}/binding"))


class Gates:
    """Holds the Bindings of one pod inside the fake API server (before they are applied): the
    ``n``-th (from 1) until :meth:`open` ``(n)``; :meth:`wait` ``(n)`` returns once it got there."""

    def __init__(self, fake: FakeKubeAPI, name: str, count: int = 2):
        self.name, self.seen = name, 0
        self.arrived = [threading.Event() for _ in range(count)]
        self.release = [threading.Event() for _ in range(count)]
        fake.add_hook(self.hook)

    async def hook(self, info: Any) -> None:
        if info.verb != "create" or info.resource != "pods/binding" or info.name != self.name:
            return
        self.seen += 1
        n = self.seen - 1
        if n < len(self.arrived):
            self.arrived[n].set()
            await asyncio.get_running_loop().run_in_executor(None, self.release[n].wait, WAIT)

    async def wait(self, n: int) -> None:
        assert await asyncio.to_thread(self.arrived[n - 1].wait, WAIT), f"Binding {n} of {self.name} never came"

    def open(self, n: int) -> None:
        self.release[n - 1].set()

    def open_all(self) -> None:
        for e in self.release:
            e.set()


@LOOPS
def test_second_bind_of_a_pod_while_its_binding_is_in_flight_is_refused(fake: FakeKubeAPI, loop: str) -> None:
    """Attack: while the extender's Binding of pod ``a`` is in flight, POST /bind for ``a`` again
    (a replayed or forged request). Before the fix the second bind dropped the first one's booking
    and booked again; the first Binding then landed, the second got 409 and released its booking,
    and the events of the pod, seen while a bind was writing, were ignored: ``a`` ran with a signed
    record that nothing booked, so a second 16000 MiB pod fit the same 24576 MiB GPU. Now the
    second bind is refused without writing anything, and the books match the cluster."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")
    gates = Gates(fake, "a")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            await watched(svc, a)
            first = asyncio.create_task(bind(ext, a))
            await gates.wait(1)
            replay = asyncio.create_task(bind(ext, a))  # while the first Binding is held in the server
            # the replay is answered, or its own Binding is held too (then the first lands first)
            await wait_until(lambda: replay.done() or gates.arrived[1].is_set())
            gates.open(1)
            assert await first == ""
            gates.open(2)
            second = await replay
            assert second != "" and "in progress" in second, second
            assert bindings(fake, "a") == 1  # the replay wrote nothing
            assert "default/a" in svc.cache.state.bookings
            # the GPU is taken: the second pod must not fit
            err = await bind(ext, b)
            assert err != "", "a second 16000 MiB pod was placed on the 24576 MiB GPU"
            await wait_until(lambda: (svc.cache.pods.get("default/a") is not None
                                      and svc.cache.pods["default/a"].bound))
            check_books(fake, svc)

    run_on(loop, go())
    got = fake.get_object("pods", "a", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-0" and ANN_ALLOCATION in got["metadata"]["annotations"]


@LOOPS
def test_bind_cancelled_while_its_applied_binding_loses_its_answer_keeps_the_booking(fake: FakeKubeAPI, loop: str) -> None:
    """Attack: the bind call is cancelled (the service stopping it, a caller gone) while its
    Binding is in the server; the server applies it and drops the connection. The writes go on
    (shielded): the lost answer is settled by reading the pod back (bound: booking kept), a replayed
    /bind meanwhile is refused, the Binding is sent once, and the books match the cluster."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")
    gates = Gates(fake, "a", count=1)

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            await watched(svc, a)
            call = asyncio.create_task(svc.binds.bind(bind_args(a, "node-0")))
            await gates.wait(1)
            fake.fail_after_commit("create", "pods/binding", "reset", name="a")
            call.cancel()
            try:
                await call
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the bind call was not cancelled")
            assert svc.cache.unresolved.get("default/a") == a["metadata"]["uid"]  # its writes go on
            replay = await bind(ext, a)
            assert "in progress" in replay, replay
            gates.open(1)
            await wait_until(lambda: not svc.cache.unresolved)
            assert "default/a" in svc.cache.state.bookings  # applied: kept
            assert await bind(ext, b) != ""  # the GPU is taken
            assert bindings(fake, "a") == 1
            await wait_until(lambda: (svc.cache.pods.get("default/a") is not None
                                      and svc.cache.pods["default/a"].bound))
            check_books(fake, svc)

    run_on(loop, go())
    got = fake.get_object("pods", "a", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-0"


@pytest.mark.parametrize("committed", [True, False])
def test_conflict_on_the_loop_then_5xx_on_the_retry(fake: FakeKubeAPI, committed: bool) -> None:
    """The event loop's Binding gets 409 (the pod changed: a label written meanwhile), the worker
    thread's retry at the new resourceVersion gets 500, applied (``committed``) or not. Applied: the
    read-back finds the pod bound with the record, the booking is kept. Not applied: the pod is
    fenced at that resourceVersion and the booking released. Each attempt's Binding is sent once
    (two in all), and the books match the cluster."""
    create_nodes(fake, 1)
    a = pod(fake, "a")

    async def go() -> str:
        async with extender(fake, timeout=2.0) as ext:
            svc = ext.svc
            await watched(svc, a)
            fake.fail_next("create", "pods/binding", status=409, name="a")
            if committed:
                fake.fail_after_commit("create", "pods/binding", 500, name="a")
            else:
                fake.fail_next("create", "pods/binding", status=500, name="a")
            err = await bind(ext, a)
            await wait_until(lambda: not svc.cache.unresolved)
            if committed:
                await wait_until(lambda: (svc.cache.pods.get("default/a") is not None
                                          and svc.cache.pods["default/a"].bound))
            check_books(fake, svc)
            return err

    err = asyncio.run(go())
    got = fake.get_object("pods", "a", "default")
    assert got is not None
    assert bindings(fake, "a") == 2
    if committed:
        assert err == "" and got["spec"]["nodeName"] == "node-0"
    else:
        assert "500" in err and not got["spec"].get("nodeName")
        assert ANN_ALLOCATION not in (got["metadata"].get("annotations") or {})


class OddFake(FakeKubeAPI):
    """The fake API server answering the next Binding oddly: ``odd = (applied, status, body,
    headers)``: the Binding is applied first (``applied``) or not at all, then answered with that
    status, body and headers (garbage, a non-JSON 200, a redirect, a huge body)."""

    def __init__(self) -> None:
        super().__init__(bookmark_interval=0.5)
        #: (applied, status, body, headers); status 0: the connection is dropped instead of answered
        self.odd: tuple[bool, int, bytes, dict[str, str]] | None = None
        self.odd_hits = 0
        self.as_proxy = False  #: clients reach it as their HTTP proxy, for an API server "kube.invalid"

    def configuration(self) -> Any:
        cfg = super().configuration()
        if self.as_proxy:
            cfg.proxy, cfg.host = self.base_url, PROXIED_HOST
        return cfg

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        odd = self.odd
        if odd is None or request.method != "POST" or not request.path.endswith("/binding"):
            return await super()._handle(request)
        self.odd = None
        self.odd_hits += 1
        applied, status, body, headers = odd
        if applied:
            resp = await super()._handle(request)
            assert resp.status < 300, resp.status
        if status == 0:
            assert request.transport is not None
            request.transport.abort()
        return web.Response(status=status or 500, body=body, headers=headers)


@pytest.fixture
def odd() -> Iterator[OddFake]:
    with OddFake() as api:
        yield api


@pytest.mark.parametrize("case", ["html-200", "truncated-json-201", "huge-garbage-200", "redirect-after-apply"])
def test_applied_binding_answered_with_garbage_keeps_its_booking(odd: OddFake, case: str) -> None:
    """Attack on the answer: the Binding is applied, then answered with something that is not a
    Status (HTML, cut-off JSON, 4 MiB of garbage, a redirect). The bind never takes that as a
    refusal: it reads the pod back (or takes the 2xx/3xx as sent), keeps the booking of the
    applied Binding, sends it once, and the books match the cluster."""
    answers = {"html-200": (200, b"<html><body>proxy says hi</body></html>", {"Content-Type": "text/html"}),
               "truncated-json-201": (201, b'{"kind":"Status","status":"Succ', {"Content-Type": "application/json"}),
               "huge-garbage-200": (200, b"\xff" * (4 << 20), {"Content-Type": "application/json"}),
               "redirect-after-apply": (307, b"", {"Location": "/elsewhere"})}
    create_nodes(odd, 1)
    a, b = pod(odd, "a"), pod(odd, "b")

    async def go() -> str:
        async with extender(odd, timeout=2.0) as ext:
            svc = ext.svc
            await watched(svc, a)
            odd.odd = (True, *answers[case])
            err = await bind(ext, a)
            await wait_until(lambda: not svc.cache.unresolved)
            assert "default/a" in svc.cache.state.bookings
            assert await bind(ext, b) != ""  # the GPU is taken
            await wait_until(lambda: (svc.cache.pods.get("default/a") is not None
                                      and svc.cache.pods["default/a"].bound))
            check_books(odd, svc)
            return err

    err = asyncio.run(go())
    assert err == "", err
    assert odd.odd_hits == 1 and bindings(odd, "a") == 1
    got = odd.get_object("pods", "a", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-0"


@pytest.mark.parametrize("status", [307, 302, 304])
def test_binding_answered_with_a_redirect_and_not_applied_is_not_taken_as_bound(odd: OddFake, status: int) -> None:
    """Attack on the answer: something between the extender and the API server answers the
    Binding with a redirect and never forwards it. The client follows no redirect (it would send
    the write twice); the bind must not take the 3xx for success either: the pod is not bound, so
    the books must not hold it as bound (``check_books``)."""
    create_nodes(odd, 1)
    a = pod(odd, "a")

    async def go() -> str:
        async with extender(odd, timeout=2.0) as ext:
            svc = ext.svc
            await watched(svc, a)
            odd.odd = (False, status, b"", {"Location": f"{odd.base_url}/api/v1/namespaces/default/pods/a/binding"})
            err = await bind(ext, a)
            await wait_until(lambda: not svc.cache.unresolved)
            check_books(odd, svc)
            return err

    err = asyncio.run(go())
    assert err != ""
    assert odd.odd_hits == 1 and bindings(odd, "a") == 0  # never followed, never resent
    got = odd.get_object("pods", "a", "default")
    assert got is not None and not got["spec"].get("nodeName")


@pytest.mark.parametrize("proxy", [False, True])
def test_binding_redirected_is_never_followed_nor_taken_as_bound(odd: OddFake, proxy: bool) -> None:
    """Attack on the answer, through the whole bind: the Binding is answered 307 to the same URL
    and not applied, the extender reaching the API server directly (the Binding from the event
    loop) or through a proxy configuration (from a worker thread, urllib3). Before the fix urllib3
    followed the 307 and sent the Binding a second time, and a 3xx that was not followed was
    taken as bound. Now it is an unknown outcome: the pod is read back, found unbound and fenced,
    the booking released; the Binding went out once."""
    create_nodes(odd, 1)
    a = pod(odd, "a")
    odd.as_proxy = proxy

    async def go() -> str:
        async with extender(odd, timeout=2.0) as ext:
            svc = ext.svc
            assert (svc.api.aio is None) == proxy
            await watched(svc, a)
            base = PROXIED_HOST if proxy else odd.base_url
            odd.odd = (False, 307, b"", {"Location": f"{base}/api/v1/namespaces/default/pods/a/binding"})
            err = await bind(ext, a)
            await wait_until(lambda: not svc.cache.unresolved)
            check_books(odd, svc)
            return err

    err = asyncio.run(go())
    assert "not the API server's Success Status" in err, err
    assert odd.odd_hits == 1 and bindings(odd, "a") == 0  # sent once, never followed
    got = odd.get_object("pods", "a", "default")
    assert got is not None and not got["spec"].get("nodeName")
    assert ANN_ALLOCATION not in (got["metadata"].get("annotations") or {})


@LOOPS
@pytest.mark.parametrize("applied", [False, True])
def test_kept_alive_connection_dropped_under_a_binding_is_never_resent(odd: OddFake, applied: bool, loop: str) -> None:
    """Attack on the connection: the event loop's Binding goes out on a kept-alive connection
    (a first bind opened it) and the server drops that connection on receiving it, applied or not.
    aiohttp resends a request whose reused connection broke only for idempotent methods: the
    Binding (POST) goes out once, the outcome is unknown and read back: bound with the record (booking
    kept) or unbound and fenced (released)."""
    create_nodes(odd, 1)
    w, a = pod(odd, "w", mib=4000), pod(odd, "a", mib=4000)

    async def go() -> str:
        async with extender(odd, timeout=2.0) as ext:
            svc = ext.svc
            await wait_until(lambda: all(svc.cache.pod_to_bind(f"default/{p['metadata']['name']}",
                                                               p["metadata"]["uid"]) is not None for p in (w, a)))
            assert await bind(ext, w) == ""  # its connection stays open for the next Binding
            odd.odd = (applied, 0, b"", {})
            err = await bind(ext, a)
            await wait_until(lambda: not svc.cache.unresolved)
            await wait_until(lambda: all(svc.cache.pods.get(k) is not None and svc.cache.pods[k].bound
                                         for k in (["default/w", "default/a"] if applied else ["default/w"])))
            check_books(odd, svc)
            return err

    err = run_on(loop, go())
    assert odd.odd_hits == 1 and bindings(odd, "a") == (1 if applied else 0)  # the odd one, once
    got = odd.get_object("pods", "a", "default")
    assert got is not None
    if applied:
        assert err == "" and got["spec"]["nodeName"] == "node-0"
    else:
        assert err != "" and not got["spec"].get("nodeName")


def test_bind_flood_beyond_the_connection_limit(fake: FakeKubeAPI) -> None:
    """Attack: more binds at once than the event loop's client has connections (limit 2 here),
    with the server holding every Binding it gets. The two sent time out unanswered, the four
    others time out waiting for a connection (sent nothing): all six are unknown outcomes, read
    back and fenced, their bookings released. When the server then goes on with the two held
    Bindings, the fence has moved the pods' resourceVersion: both are refused (409), no pod is
    bound, no Binding went out twice, and the books match the cluster (nothing booked)."""
    create_nodes(fake, 1)
    pods = [pod(fake, f"f{i}", mib=4000) for i in range(6)]
    held = {"n": 0}
    arrived, release = threading.Event(), threading.Event()

    async def hook(info: Any) -> None:
        if info.verb != "create" or info.resource != "pods/binding":
            return
        held["n"] += 1
        if held["n"] == 2:
            arrived.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, WAIT)
    fake.add_hook(hook)

    async def go() -> list[str]:
        async with extender(fake, timeout=1.0) as ext:
            svc = ext.svc
            own = svc.api.aio
            assert own is not None and svc.api.http is not None
            svc.api.aio = AsyncJSONClient(svc.api.http, max_connections=2)  # the Bindings' client here
            try:
                return await flood(ext)
            finally:
                await svc.api.aio.close()
                svc.api.aio = own

    async def flood(ext: Any) -> list[str]:
        svc = ext.svc
        await wait_until(lambda: all(svc.cache.pod_to_bind(f"default/{p['metadata']['name']}",
                                                           p["metadata"]["uid"]) is not None for p in pods))
        calls = [asyncio.create_task(bind(ext, p)) for p in pods]
        assert await asyncio.to_thread(arrived.wait, WAIT)
        errs = list(await asyncio.gather(*calls))  # all end on their own: timeouts, read back, fenced
        assert held["n"] == 2, held  # the limit: the other four never reached the server
        await wait_until(lambda: not svc.cache.unresolved)
        release.set()
        await wait_until(lambda: all(r.status is not None for r in fake.request_log
                                     if r.method == "POST" and r.path.endswith("/binding")))
        assert sorted(r.status for r in fake.request_log
                      if r.method == "POST" and r.path.endswith("/binding")) == [409, 409]
        check_books(fake, svc)
        return errs

    errs = asyncio.run(go())
    assert all(e != "" for e in errs), errs
    for p in pods:
        name = p["metadata"]["name"]
        got = fake.get_object("pods", name, "default")
        assert got is not None and not got["spec"].get("nodeName"), name
        assert bindings(fake, name) <= 1, name


def test_ca_rotated_to_one_the_server_does_not_match_keeps_the_booking_until_read_back(tmp_path: Any) -> None:
    """Attack on TLS: the CA file the extender trusts is replaced by another CA (a rotation gone
    wrong, or a man in the middle the new CA would accept), and the kept-alive connections are
    gone. The event loop's next Binding fails its TLS handshake (nothing sent) and the
    read-back fails too: the outcome is unknown, so the booking is kept, the pod marked unresolved.
    Once the right CA is back, the pod is read back, found unbound and fenced, the booking
    released; no Binding reached the server, and the books match the cluster."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
    from test_jsonclient_pool import _Fake

    ca = tmp_path / "ca.crt"

    class CAFake(_Fake):
        def configuration(self) -> Any:
            cfg = super().configuration()
            cfg.ssl_ca_cert = str(ca)
            return cfg

    other = FakeKubeAPI(tls=True)
    other._make_tls()  # another CA, which did not sign the server's certificate
    assert other.ca_cert_path is not None
    with CAFake() as fake:
        assert fake.ca_cert_path is not None
        shutil.copyfile(fake.ca_cert_path, ca)
        create_nodes(fake, 1)
        w, a = pod(fake, "w", mib=4000), pod(fake, "a", mib=4000)

        async def go() -> str:
            async with extender(fake, timeout=2.0) as ext:
                svc = ext.svc
                assert svc.api.aio is not None
                # the CA file is looked at for every new connection (not once a second), from now on
                svc.api.aio.context_ttl, svc.api.aio._tls = 0.0, (0.0, None)
                await wait_until(lambda: all(svc.cache.pod_to_bind(f"default/{p['metadata']['name']}",
                                                                   p["metadata"]["uid"]) is not None for p in (w, a)))
                assert await bind(ext, w) == ""
                shutil.copyfile(other.ca_cert_path, str(ca))
                await svc.api.aio.close()  # its kept-alive connections keep their TLS: start anew
                err = await bind(ext, a)
                assert "unknown" in err, err
                assert svc.cache.unresolved.get("default/a") == a["metadata"]["uid"]
                assert "default/a" in svc.cache.state.bookings  # kept until read back
                shutil.copyfile(fake.ca_cert_path, str(ca))
                await wait_until(lambda: not svc.cache.unresolved, timeout=10)
                await wait_until(lambda: (svc.cache.pods.get("default/w") is not None
                                          and svc.cache.pods["default/w"].bound))
                check_books(fake, svc)
                return err

        asyncio.run(go())
        assert bindings(fake, "a") == 0
        got = fake.get_object("pods", "a", "default")
        assert got is not None and not got["spec"].get("nodeName")

