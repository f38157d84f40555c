""":class:`kube_vgpu.kubeapi.AsyncJSONClient` (the extender's Binding sent from its event loop) over
real TLS against the fake kube-apiserver: the same requests, answers and errors as the blocking
:class:`~kube_vgpu.kubeapi.JSONClient` (so the bind judges them alike), one kept-alive connection,
a write never sent twice (an idle connection the server closed, a write whose answer was lost), the
token and TLS names of the configuration; and the bind cycle: a Binding that goes through is sent
from the event loop with no worker thread, and every failure of it is carried on by the blocking
steps exactly as before (a conflict re-read and retried, a lost answer settled by reading back)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_jsonclient_pool import TOKEN, _binding, _count, _Fake, _kubeconfig, _path, _pod
from test_jsonclient_pool import fake as fake  # noqa: F401 - its module-scoped fake API server fixture

from kube_vgpu.kubeapi import (
    AsyncJSONClient,
    JSONClient,
    is_conflict,
    is_not_found,
    load_api_client,
    outcome_unknown,
)
from scheduler.kube import KubeAPI
from tests.fakeapi import FakeKubeAPI

T = TypeVar("T")


def _run(make: Callable[[AsyncJSONClient], Coroutine[Any, Any, T]], ac: AsyncJSONClient) -> T:
    """Run ``make(ac)`` on a new event loop, closing the client's session on it afterwards."""

    async def go() -> T:
        try:
            return await make(ac)
        finally:
            await ac.close()
    return asyncio.run(go())


def _client(fake: _Fake, **kw: Any) -> AsyncJSONClient:
    return AsyncJSONClient(JSONClient(fake.api_client(), **kw))


def test_posts_share_one_kept_alive_connection_and_bind(fake: _Fake) -> None:
    pods = [_pod(fake, f"a-keep-{i}") for i in range(5)]
    before = fake.connection_count

    async def go(ac: AsyncJSONClient) -> list[Any]:
        return [await ac.post(_path(p["metadata"]["name"], "/binding"), _binding(p, "node-1")) for p in pods]
    answers = _run(go, _client(fake))
    assert all(a.get("kind") == "Status" and a.get("status") == "Success" for a in answers), answers
    assert fake.connection_count == before + 1
    for p in pods:
        got = fake.get_object("pods", p["metadata"]["name"], "default")
        assert got is not None and got["spec"]["nodeName"] == "node-1"
        assert got["metadata"]["annotations"]["kube-vgpu.io/t"] == "x"  # the Binding's annotations copied


def test_at_most_max_connections_in_flight(fake: _Fake) -> None:
    """Five Bindings at once with ``max_connections=2``: two connections carry them all (the
    others wait for a free one); the server holds the first requests until two are in flight."""
    pods = [_pod(fake, f"a-limit-{i}") for i in range(5)]
    seen: list[int] = []
    state = {"in": 0}
    gate: list[asyncio.Event] = []

    async def hook(info: Any) -> None:
        if not info.path.endswith("/binding") or "a-limit-" not in info.path:
            return
        if not gate:
            gate.append(asyncio.Event())
        state["in"] += 1
        seen.append(state["in"])
        if state["in"] >= 2:
            gate[0].set()
        await gate[0].wait()
        state["in"] -= 1
    fake.add_hook(hook)
    before = fake.connection_count
    try:
        async def go(ac: AsyncJSONClient) -> None:
            await asyncio.gather(*(ac.post(_path(p["metadata"]["name"], "/binding"), _binding(p, "node-6"))
                                   for p in pods))
        _run(go, AsyncJSONClient(JSONClient(fake.api_client()), max_connections=2))
    finally:
        fake._hooks.remove(hook)
    assert fake.connection_count - before == 2 and max(seen) == 2, (fake.connection_count - before, seen)
    for p in pods:
        got = fake.get_object("pods", p["metadata"]["name"], "default")
        assert got is not None and got["spec"]["nodeName"] == "node-6"


def test_http_errors_map_as_the_blocking_client_maps_them(fake: _Fake) -> None:
    pod = _pod(fake, "a-errs")

    async def go(ac: AsyncJSONClient) -> list[BaseException]:
        out: list[BaseException] = []
        stale = dict(_binding(pod, "node-1"))
        stale["metadata"] = {**stale["metadata"], "resourceVersion": "1"}  # an old resourceVersion: 409
        ghost = {"metadata": {"name": "a-no-such", "uid": "u-ghost", "resourceVersion": "1"}}
        for path, body in ((_path("a-no-such", "/binding"), _binding(ghost, "node-1")),
                           (_path("a-errs", "/binding"), stale)):
            try:
                await ac.post(path, body)
            except BaseException as e:  # noqa: BLE001 - inspected below
                out.append(e)
        for status in (500, 429):
            fake.fail_next("create", "pods/binding", status=status, name="a-errs")
            try:
                await ac.post(_path("a-errs", "/binding"), _binding(pod, "node-1"))
            except BaseException as e:  # noqa: BLE001
                out.append(e)
        return out
    nf, conflict, e500, e429 = _run(go, _client(fake))
    assert isinstance(nf, ApiException) and is_not_found(nf) and not outcome_unknown(nf)
    assert '"reason":"NotFound"' in (nf.body or "").replace(" ", "")
    assert isinstance(conflict, ApiException) and is_conflict(conflict) and not outcome_unknown(conflict)
    assert isinstance(e500, ApiException) and e500.status == 500 and outcome_unknown(e500)
    assert isinstance(e429, ApiException) and e429.status == 429 and outcome_unknown(e429)
    assert e429.headers is not None and e429.headers.get("Retry-After") == "1"
    got = fake.get_object("pods", "a-errs", "default")
    assert got is not None and not got["spec"].get("nodeName")


def test_connection_closed_by_the_server_while_idle_never_sends_a_write_twice(fake: _Fake) -> None:
    """The server closes the kept-alive connection (its idle timeout): the next Binding goes out
    once, on a new connection, and binds."""
    first, second = _pod(fake, "a-idle-1"), _pod(fake, "a-idle-2")

    async def go(ac: AsyncJSONClient) -> None:
        await ac.post(_path("a-idle-1", "/binding"), _binding(first, "node-2"))
        assert fake.close_connections() >= 1
        session = ac._sessions["requests"]

        def idle() -> int:  # kept-alive connections still open on the client's side
            return sum(1 for conns in session.connector._conns.values()  # type: ignore[union-attr]
                       for proto, _ in conns if proto.is_connected())
        for _ in range(1000):  # until the client's side has seen the close
            if not idle():
                break
            await asyncio.sleep(0.01)
        assert not idle(), "the client never saw the server close its idle connection"
        fake.clear_requests()
        await ac.post(_path("a-idle-2", "/binding"), _binding(second, "node-2"))
    _run(go, _client(fake))
    assert _count(fake, "POST", _path("a-idle-2", "/binding")) == 1
    got = fake.get_object("pods", "a-idle-2", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-2"


@pytest.mark.parametrize("action", ["reset", "timeout"])
def test_a_binding_whose_answer_is_lost_is_unknown_and_sent_once(fake: _Fake, action: str) -> None:
    """The server applies the Binding, then drops the connection or never answers: the error is an
    unknown outcome (so the bind keeps its booking and reads the pod back) and the Binding is
    never sent again."""
    name = f"a-lost-{action}"
    pod = _pod(fake, name)
    fake.clear_requests()
    fake.fail_after_commit("create", "pods/binding", action, name=name)

    async def go(ac: AsyncJSONClient) -> BaseException:
        try:
            await ac.post(_path(name, "/binding"), _binding(pod, "node-3"))
        except BaseException as e:  # noqa: BLE001
            return e
        raise AssertionError("no error")
    err = _run(go, _client(fake, timeout=0.5))
    assert outcome_unknown(err), repr(err)
    want = urllib3.exceptions.ReadTimeoutError if action == "timeout" else urllib3.exceptions.ProtocolError
    assert isinstance(err, want), repr(err)
    assert _count(fake, "POST", _path(name, "/binding")) == 1
    got = fake.get_object("pods", name, "default")
    assert got is not None and got["spec"]["nodeName"] == "node-3"  # applied: only the answer was lost


def test_no_connection_is_unknown(fake: _Fake) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = fake.configuration()
    cfg.host = f"https://127.0.0.1:{port}"

    async def go(ac: AsyncJSONClient) -> BaseException:
        try:
            await ac.post(_path("x", "/binding"), {})
        except BaseException as e:  # noqa: BLE001
            return e
        raise AssertionError("no error")
    err = _run(go, AsyncJSONClient(JSONClient(client.ApiClient(cfg))))
    assert isinstance(err, urllib3.exceptions.MaxRetryError) and outcome_unknown(err)


def test_token_refreshed_after_a_401() -> None:
    with _Fake(token="t1") as fake:
        pod = _pod(fake, "a-tok")
        current = ["t1"]
        cfg = fake.configuration()

        def hook(c: client.Configuration) -> None:
            c.api_key = {"authorization": current[0]}
        cfg.refresh_api_key_hook = hook
        ac = AsyncJSONClient(JSONClient(client.ApiClient(cfg), token_ttl=3600))

        async def go(ac: AsyncJSONClient) -> int:
            fake.token = current[0] = "t2"  # before the first request, so the client reads t2
            stale = _binding(pod, "node-1")
            stale["metadata"] = {**stale["metadata"], "resourceVersion": "1"}
            with pytest.raises(ApiException) as ei:
                await ac.post(_path("a-tok", "/binding"), stale)  # 409: the token was accepted
            assert ei.value.status == 409
            fake.token = current[0] = "t3"  # rotated: the cached token is refused once
            with pytest.raises(ApiException) as ei:
                await ac.post(_path("a-tok", "/binding"), _binding(pod, "node-1"))
            assert ei.value.status == 401 and not outcome_unknown(ei.value)
            await ac.post(_path("a-tok", "/binding"), _binding(pod, "node-1"))
            return 0
        _run(go, ac)
        got = fake.get_object("pods", "a-tok", "default")
        assert got is not None and got["spec"]["nodeName"] == "node-1"


def test_tls_names_and_verification(fake: _Fake, tmp_path: Path) -> None:
    """``tls-server-name`` is the name the certificate must carry; a name it does not carry, or
    another server's certificate, is a TLS error (status 0, unknown)."""
    ok_pod, bad_pod = _pod(fake, "a-names-ok"), _pod(fake, "a-names-bad")

    def client_for(cluster: dict[str, Any], name: str) -> AsyncJSONClient:
        return AsyncJSONClient(JSONClient(load_api_client(_kubeconfig(fake, tmp_path / name, {"token": TOKEN},
                                                                      cluster))))

    async def post(ac: AsyncJSONClient, pod: dict[str, Any]) -> BaseException | None:
        try:
            await ac.post(_path(pod["metadata"]["name"], "/binding"), _binding(pod, "node-5"))
        except BaseException as e:  # noqa: BLE001
            return e
        return None
    assert _run(lambda ac: post(ac, ok_pod), client_for({"tls-server-name": "localhost"}, "a")) is None
    err = _run(lambda ac: post(ac, bad_pod), client_for({"tls-server-name": "other.example"}, "b"))
    assert isinstance(err, ApiException) and err.status == 0 and outcome_unknown(err)
    with _Fake() as other:  # trusts only `fake`'s CA
        cfg = fake.configuration()
        cfg.host = other.base_url
        err = _run(lambda ac: post(ac, bad_pod), AsyncJSONClient(JSONClient(client.ApiClient(cfg))))
        assert isinstance(err, ApiException) and err.status == 0
    got = fake.get_object("pods", "a-names-bad", "default")
    assert got is not None and not got["spec"].get("nodeName")


def test_a_proxy_configuration_has_no_event_loop_client(fake: _Fake) -> None:
    cfg = fake.configuration()
    cfg.proxy = "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="proxy"):
        AsyncJSONClient(JSONClient(client.ApiClient(cfg)))
    api = KubeAPI(client.ApiClient(cfg))
    assert api.http is not None and api.http.via_urllib3 and api.aio is None  # binds from a worker thread
    assert KubeAPI(fake.api_client(), generated_client=True).aio is None


# -- the bind cycle -------------------------------------------------------------------------------
def _bind_support() -> Any:
    import importlib
    import sys
    sec = str(Path(__file__).resolve().parents[1] / "security")
    if sec not in sys.path:
        sys.path.insert(0, sec)
    return importlib.import_module("bind_support")


def test_a_bind_that_goes_through_uses_no_worker_thread() -> None:
    """The Binding is sent from the event loop: the blocking Binding and the API worker threads are
    never used; the pod is bound with its record, and the books match the cluster."""
    bs = _bind_support()
    with FakeKubeAPI(tls=True, token=TOKEN) as fake:
        bs.create_nodes(fake, 1)
        pod = bs.create_pod(fake, bs.pod_obj("p-loop", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}))

        async def go() -> None:
            async with bs.extender(fake) as ext:
                svc = ext.svc
                assert svc.api.aio is not None

                def no_thread(*_a: Any, **_k: Any) -> None:
                    raise AssertionError("the blocking Binding was used")
                svc.api.create_binding = no_thread
                used: list[Any] = []
                real = svc.run_blocking

                async def counted(fn: Any, *a: Any) -> Any:
                    used.append(fn)
                    return await real(fn, *a)
                svc.run_blocking = counted  # type: ignore[method-assign]
                for _ in range(3000):  # the watch shows the pod (no GET needed), as live
                    if svc.cache.pod_to_bind("default/p-loop", pod["metadata"]["uid"]) is not None:
                        break
                    await asyncio.sleep(0.01)
                assert svc.cache.pod_to_bind("default/p-loop", pod["metadata"]["uid"]) is not None
                assert await bs.bind(ext, pod) == ""
                assert used == [], used
                bs.check_books(fake, svc)
        asyncio.run(go())
        got = fake.get_object("pods", "p-loop", "default")
        assert got is not None and got["spec"]["nodeName"] == "node-0"


@pytest.mark.parametrize("fault", ["conflict", "lost-answer", "refused"])
def test_a_failed_binding_from_the_loop_is_carried_on_by_the_blocking_steps(fault: str) -> None:
    """The event loop's Binding fails: a conflict (the pod changed since it was read) is re-read
    and retried in a worker thread and binds; a Binding applied whose answer was lost is settled by
    reading the pod back (bound, books kept); a definite refusal releases the booking. The books
    match the cluster every time."""
    bs = _bind_support()
    with FakeKubeAPI(tls=True, token=TOKEN) as fake:
        bs.create_nodes(fake, 1)
        pod = bs.create_pod(fake, bs.pod_obj("p-fail", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}))

        async def go() -> str:
            async with bs.extender(fake, timeout=1.0) as ext:
                if fault == "conflict":  # a label written after the extender read the pod
                    fake.fail_next("create", "pods/binding", status=409, name="p-fail")
                elif fault == "lost-answer":
                    fake.fail_after_commit("create", "pods/binding", "reset", name="p-fail")
                else:
                    fake.fail_next("create", "pods/binding", status=403, name="p-fail")
                err = await bs.bind(ext, pod)
                bs.check_books(fake, ext.svc)
                return err
        err = asyncio.run(go())
        got = fake.get_object("pods", "p-fail", "default")
        assert got is not None
        if fault == "refused":
            assert "403" in err and not got["spec"].get("nodeName")
        else:
            assert err == "" and got["spec"]["nodeName"] == "node-0"
        bindings = [r for r in fake.request_log if r.method == "POST" and r.path.endswith("/p-fail/binding")]
        assert len(bindings) == (2 if fault == "conflict" else 1)


def test_a_watch_never_waits_for_the_requests_connections(fake: _Fake) -> None:
    """``max_connections=1`` and the server holding a Binding on it: a watch still connects (its
    own session) and streams the change that follows."""
    import contextlib
    import threading

    pod = _pod(fake, "a-held")
    gate = threading.Event()
    held = threading.Event()

    async def hook(info: Any) -> None:
        if info.path.endswith("/a-held/binding"):
            held.set()
            await asyncio.to_thread(gate.wait, 30)
    fake.add_hook(hook)
    listed = JSONClient(fake.api_client()).request("GET", "/api/v1/nodes")
    start = listed["metadata"]["resourceVersion"]
    try:
        async def go(ac: AsyncJSONClient) -> bytes:
            post = asyncio.ensure_future(ac.post(_path("a-held", "/binding"), _binding(pod, "node-7")))
            assert await asyncio.to_thread(held.wait, 30)
            try:
                async with contextlib.aclosing(ac.lines(
                        f"/api/v1/nodes?watch=true&resourceVersion={start}&timeoutSeconds=30", 40)) as lines:
                    fake.create_object("nodes", {"metadata": {"name": "w-after-held"}})
                    async for line in lines:
                        if b"w-after-held" in line:
                            return line
                raise AssertionError("the watch ended without the change")
            finally:
                gate.set()
                await post
        line = _run(go, AsyncJSONClient(JSONClient(fake.api_client()), max_connections=1))
    finally:
        gate.set()
        fake._hooks.remove(hook)
    assert b'"ADDED"' in line
    got = fake.get_object("pods", "a-held", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-7"
