"""No booking is released on an unknown outcome, and a relist releases every booking whose pod is
gone. Fault injection against the fake kube-apiserver (real HTTP, the official client): a Binding
that commits on the server and then times out, answers 504 or loses its connection, or that may
still be in flight after its answer was lost; a read-back that fails too and recovers; a watch that expires (410 Gone) while pods
are deleted. Each test ends with 0 overcommitted GPUs and 0 leaked bookings (``check_books``:
booked MiB per GPU equal to what the live, bound pods' records say)."""

from __future__ import annotations

import pytest
from bind_support import bind, check_books, create_nodes, create_pod, extender, node_obj, pod_obj, writes
from vgpu_sched_util import KEYS, filter_args, run, wait_until

from kube_vgpu.config import Config
from kube_vgpu.podspec import parse_pod
from kube_vgpu.resources import ANN_ALLOCATION, LABEL_NODE
from scheduler.bindstate import BindCache, compare_resource_versions
from tests.fakeapi import FakeKubeAPI

GPU_MIB = 24576


def pod(fake: FakeKubeAPI, name: str, mib: int = 20000) -> dict:
    """A pod asking for ``mib`` of one GPU: two of them never fit one 24576 MiB GPU."""
    return create_pod(fake, pod_obj(name, limits={"nvidia.com/gpumem": mib}))


def bound_to(fake: FakeKubeAPI, name: str) -> str | None:
    p = fake.get_object("pods", name, "default")
    return None if p is None else p["spec"].get("nodeName")


def record(fake: FakeKubeAPI, name: str) -> str | None:
    p = fake.get_object("pods", name, "default")
    return None if p is None else (p["metadata"].get("annotations") or {}).get(ANN_ALLOCATION)


def watch_down(fake: FakeKubeAPI) -> None:
    """Take the extender's pod watch down: the open one is closed, new ones fail (500)."""
    fake.fail_next("watch", "pods", 500, count=None)
    fake.close_watches("pods")


# -- the ambiguous Binding ----------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["timeout", 504, "reset"])
def test_binding_that_commits_but_is_not_answered_keeps_its_booking(fake: FakeKubeAPI, fault: object) -> None:
    """The Binding commits, then times out / answers 504 / loses its connection: the bind reads
    the pod back, finds it bound to its node with its record, and keeps the booking (the attack:
    release it, place a second 20000 MiB pod on the same 24576 MiB GPU)."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")

    async def go() -> None:
        async with extender(fake, timeout=1.0) as ext:
            svc = ext.svc
            fake.fail_after_commit("create", "pods/binding", fault)  # type: ignore[arg-type]
            assert await bind(ext, a) == ""
            assert bound_to(fake, "a") == "node-0"
            assert "default/a" in svc.cache.state.bookings
            err = await bind(ext, b)
            assert "cannot place default/b on node-0" in err and bound_to(fake, "b") is None
            await wait_until(lambda: "default/a" in svc.cache.pods)
            assert check_books(fake, svc) == {"GPU-node-0-00": 20000}
    run(go)


def test_binding_that_does_not_commit_and_answers_504_releases(fake: FakeKubeAPI) -> None:
    """The Binding answers 504 without committing: the read-back shows the pod unbound, so the
    record comes off the pod, the booking is released and the error names the 504; the GPU is free
    for the next pod."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            fake.fail_next("create", "pods/binding", 504)
            err = await bind(ext, a)
            assert "binding default/a to node-0: API 504" in err
            assert bound_to(fake, "a") is None and record(fake, "a") is None
            labels = fake.get_object("pods", "a", "default")["metadata"].get("labels") or {}  # type: ignore[index]
            assert LABEL_NODE not in labels
            assert svc.cache.state.bookings == {}
            assert await bind(ext, b) == ""
            await wait_until(lambda: "default/b" in svc.cache.pods)
            assert check_books(fake, svc) == {"GPU-node-0-00": 20000}
    run(go)


class GetOutage:
    """While ``on``, every GET of the named pods answers 503 once a Binding (or, with
    ``after="pods"``, a patch) of one of them has been requested: the bind's own first read
    works, the read-backs fail."""

    def __init__(self, fake: FakeKubeAPI, names: set[str], after: str = "pods/binding"):
        self.names, self.after = names, after
        self.on = True
        self.armed = False
        fake.add_hook(self)

    def __call__(self, info: object) -> int | None:
        verb, res, name = info.verb, info.resource, info.name  # type: ignore[attr-defined]
        if name in self.names and res == self.after and verb in ("create", "patch"):
            self.armed = True
        if self.on and self.armed and verb == "get" and res == "pods" and name in self.names:
            return 503
        return None


@pytest.mark.parametrize("committed", [True, False])
def test_read_back_failing_too_keeps_the_booking_until_it_recovers(fake: FakeKubeAPI, committed: bool) -> None:
    """The Binding answers 504 (committed or not) and the read-back fails too (503; the watch is
    down): the outcome is unknown, so the booking is kept (the next pod does not fit) and the bind
    says so. Read back in the background with backoff; once the API answers: committed -> the pod
    is bound and stays booked; not committed -> the record comes off the pod and the GPUs are
    released, and the next pod binds."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            watch_down(fake)
            outage = GetOutage(fake, {"a"})
            if committed:
                fake.fail_after_commit("create", "pods/binding", 504)
            else:
                fake.fail_next("create", "pods/binding", 504)
            err = await bind(ext, a)
            assert "API 504" in err and "outcome is unknown" in err, err
            assert svc.cache.unresolved == {"default/a": a["metadata"]["uid"]}
            assert "cannot place default/b on node-0" in await bind(ext, b)  # still booked
            await wait_until(lambda: svc.unknown_retries >= 2)  # the read-back goes on failing
            assert "default/a" in svc.cache.state.bookings
            outage.on = False
            fake.clear_failures()  # the watch comes back too
            await wait_until(lambda: not svc.cache.unresolved, timeout=10)
            if committed:
                assert bound_to(fake, "a") == "node-0" and record(fake, "a")
                await wait_until(lambda: "default/a" in svc.cache.pods, timeout=10)
            else:
                assert bound_to(fake, "a") is None and record(fake, "a") is None
                await wait_until(lambda: not svc.cache.state.bookings, timeout=10)
                assert await bind(ext, b) == ""
                await wait_until(lambda: "default/b" in svc.cache.pods, timeout=10)
            assert check_books(fake, svc) == {"GPU-node-0-00": 20000}
    run(go)


def test_unknown_outcome_settled_by_the_watch_when_the_pod_is_deleted(fake: FakeKubeAPI) -> None:
    """While the read-back keeps failing, the pod is deleted: the watch's DELETED releases the
    booking and ends the read-back (the watch resolving it counts)."""
    create_nodes(fake, 1)
    a = pod(fake, "a")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            GetOutage(fake, {"a"})
            fake.fail_after_commit("create", "pods/binding", 504)
            assert "outcome is unknown" in await bind(ext, a)
            assert "default/a" in svc.cache.state.bookings
            fake.delete_object("pods", "a", "default")
            await wait_until(lambda: not svc.cache.unresolved and not svc.cache.state.bookings, timeout=10)
            assert check_books(fake, svc) == {}
    run(go)


# -- a Binding that may still be in flight --------------------------------------------------------

def _late_binding(fake: FakeKubeAPI, name: str, rv: str, node: str = "node-0") -> int:
    """Post the Binding a slow API server could still be holding from the failed attempt: the
    same preconditions (uid, resourceVersion ``rv``) and a record. Returns the HTTP status."""
    import json
    import urllib.request

    p = fake.get_object("pods", name, "default")
    assert p is not None
    body = {"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "namespace": "default", "uid": p["metadata"]["uid"],
                         "resourceVersion": rv, "annotations": {ANN_ALLOCATION: '{"v":1}'}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    req = urllib.request.Request(f"{fake.base_url}/api/v1/namespaces/default/pods/{name}/binding",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:  # noqa: S310 - the test's own fake API server
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_binding_unknown_and_pod_unchanged_is_fenced_before_release(fake: FakeKubeAPI) -> None:
    """The Binding answers 504 without committing, and the pod reads back unchanged (same
    resourceVersion): that Binding could still be in flight inside the API server and land after
    the GPUs are given to another pod. The bind first fences it (a patch guarded by that
    resourceVersion marks the pod bind-phase failed), then releases. The attack: the late Binding
    arrives afterwards and must be refused (409), leaving the pod unbound without a record."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            await wait_until(lambda: "default/a" in svc.cache.unbound)
            rv = svc.cache.unbound["default/a"]["metadata"]["resourceVersion"]
            fake.fail_next("create", "pods/binding", 504)
            fake.clear_requests()
            err = await bind(ext, a)
            assert "binding default/a to node-0: API 504" in err, err
            assert [m for m, path in writes(fake) if path.endswith("/pods/a")] == ["PATCH"]  # the fence
            assert svc.cache.state.bookings == {}
            assert _late_binding(fake, "a", rv) == 409
            assert bound_to(fake, "a") is None and record(fake, "a") is None
            assert await bind(ext, b) == ""
            await wait_until(lambda: "default/b" in svc.cache.pods)
            assert check_books(fake, svc) == {"GPU-node-0-00": 20000}
    run(go)


def test_binding_unknown_and_fence_failing_too_keeps_the_booking(fake: FakeKubeAPI) -> None:
    """The Binding answers 504 and the fence patch answers 503: nothing says the Binding
    cannot still land, so the booking is kept (the next pod does not fit) until a later read-back
    fences the pod; then the GPUs are released and the next pod binds."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            fake.fail_next("create", "pods/binding", 504)
            fake.fail_next("patch", "pods", 503, count=None, name="a")  # every fence fails until cleared
            err = await bind(ext, a)
            assert "fencing the unbound pod failed too" in err and "outcome is unknown" in err, err
            assert "default/a" in svc.cache.state.bookings
            assert "cannot place default/b on node-0" in await bind(ext, b)
            await wait_until(lambda: svc.unknown_retries >= 1)  # the read-back fences again, and fails
            assert "default/a" in svc.cache.state.bookings
            fake.clear_failures()
            await wait_until(lambda: not svc.cache.unresolved, timeout=10)
            await wait_until(lambda: not svc.cache.state.bookings, timeout=10)
            assert bound_to(fake, "a") is None and record(fake, "a") is None
            assert await bind(ext, b) == ""
            await wait_until(lambda: "default/b" in svc.cache.pods)
            assert check_books(fake, svc) == {"GPU-node-0-00": 20000}
    run(go)


def test_pod_recreated_after_the_watch_showed_it_gets_no_record(fake: FakeKubeAPI) -> None:
    """The bind checks the pod the watch showed, and the Binding carries that pod's uid and
    resourceVersion: a pod deleted and created again under the same name before the watch caught
    up (played by keeping the old copy in the cache) answers 409 to the Binding, the re-read shows
    another uid, and nothing is written to the new pod."""
    create_nodes(fake, 1)
    a = pod(fake, "a")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            await wait_until(lambda: "default/a" in svc.cache.unbound)
            old = svc.cache.unbound["default/a"]
            fake.delete_object("pods", "a", "default")
            pod(fake, "a")
            await wait_until(lambda: svc.cache.unbound.get("default/a") not in (None, old))
            svc.cache.unbound["default/a"] = old  # watch lag
            fake.clear_requests()
            err = await bind(ext, a)
            assert "changed while binding" in err, err
            assert bound_to(fake, "a") is None and record(fake, "a") is None
            assert svc.cache.state.bookings == {}
    run(go)


# -- relists ------------------------------------------------------------------------------------

def test_relist_after_410_releases_pods_deleted_while_the_watch_was_down(fake: FakeKubeAPI) -> None:
    """The pod watch is down; meanwhile pods are deleted, one of them bound by this extender a
    moment ago (its patch answered at resourceVersion R; the cache never saw it come back). The
    watch then answers 410 Gone: the relist (at a resourceVersion >= R) releases every booking
    whose pod is absent, our own recent bind included; a pod still there keeps its booking."""
    create_nodes(fake, 3)
    old, keep, new = pod(fake, "old"), pod(fake, "keep"), pod(fake, "new")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            assert await bind(ext, old, "node-0") == ""
            assert await bind(ext, keep, "node-1") == ""
            await wait_until(lambda: {"default/old", "default/keep"} <= set(svc.cache.pods))
            # the watch showed them after our writes: no relist protection needed any more
            await wait_until(lambda: not svc.cache.own_binds)
            watch_down(fake)
            assert await bind(ext, new, "node-2") == ""  # our own bind; the watch never shows it
            assert "default/new" in svc.cache.own_binds
            fake.delete_object("pods", "old", "default")
            fake.delete_object("pods", "new", "default")
            pods = svc._reflectors[1]
            relists = pods.relists
            fake.expire_watches()  # every resourceVersion issued so far is too old now: 410
            fake.clear_failures()
            await wait_until(lambda: pods.relists > relists, timeout=30)
            assert set(svc.cache.state.bookings) == {"default/keep"}
            assert check_books(fake, svc) == {"GPU-node-1-00": 20000}
    run(go, timeout=60)


def _cache_with_own_bind(rv: str) -> tuple[BindCache, list[float]]:
    now = [100.0]
    c = BindCache(Config(), clock=lambda: now[0])
    c.on_node("ADDED", node_obj("n1", 1, heartbeat=100.0))
    req = parse_pod(pod_obj("p", limits={"nvidia.com/gpumem": 1000}))
    r = c.reserve(req, "uid-p", "n1")
    assert not isinstance(r, str)
    c.record_bound("default/p", "uid-p", r[0], req, rv)
    return c, now


def test_relist_tells_a_deleted_own_bind_from_a_not_yet_visible_one() -> None:
    """Our bind's write was seen at resourceVersion 50. A list at 49 predates it (the pod is not
    visible yet): kept. A list at 50 or later lacks it: it was deleted, released at once (no grace
    period)."""
    c, _ = _cache_with_own_bind("50")
    c.replace_pods([], "49")
    assert "default/p" in c.state.bookings
    c.replace_pods([], "50")
    assert c.state.bookings == {} and c.own_binds == {}
    c, _ = _cache_with_own_bind("50")
    c.replace_pods([], "1000")
    assert c.state.bookings == {}


def test_own_bind_entry_goes_once_the_watch_shows_the_pod_at_or_after_the_write() -> None:
    c, _ = _cache_with_own_bind("50")
    c.own_bind_seen("default/p", "49")  # an older event (before our patch): still protected
    assert "default/p" in c.own_binds
    c.own_bind_seen("default/p", "x")  # not comparable: kept (the grace rule applies)
    assert "default/p" in c.own_binds
    c.own_bind_seen("default/p", "50")
    assert c.own_binds == {}
    c.replace_pods([], "10")  # absent from any list now: released
    assert c.state.bookings == {}


def test_relist_with_opaque_resource_versions_keeps_an_own_bind_for_the_grace_period() -> None:
    """resourceVersions that are not integers cannot be ordered: an own bind absent from the list
    is kept for ``own_bind_grace`` seconds, then released."""
    c, now = _cache_with_own_bind("abc")
    c.replace_pods([], "xyz")
    assert "default/p" in c.state.bookings
    now[0] += c.own_bind_grace + 1
    c.replace_pods([], "xyz")
    assert c.state.bookings == {}


def test_relist_keeps_unresolved_binds() -> None:
    """A bind whose outcome is unknown is not released by a relist: its pod may exist without our
    label (the patch's outcome is unknown). The read-back settles it."""
    c, _ = _cache_with_own_bind("")
    c.own_binds.clear()
    c.unresolved["default/p"] = "uid-p"
    c.replace_pods([], "100")
    assert "default/p" in c.state.bookings


def test_compare_resource_versions() -> None:
    assert compare_resource_versions("9", "10") == -1  # as integers, not as strings
    assert compare_resource_versions("10", "10") == 0
    assert compare_resource_versions("11", "10") == 1
    for a, b in [("", "1"), ("1", ""), ("a1", "2"), ("1.5", "2"), ("-1", "2"), ("\u0661", "2")]:
        assert compare_resource_versions(a, b) is None, (a, b)


# -- connections --------------------------------------------------------------------------------

def test_binds_reuse_their_api_connections(fake: FakeKubeAPI) -> None:
    """Every response is read and its connection returned to the pool: after the first binds,
    further binds open no new connection to the API server (a Binding response left unread costs
    one new connection, a TLS handshake on a real cluster, per bind)."""
    create_nodes(fake, 1, gpus=8)
    pods = [pod(fake, f"p{i}", 1000) for i in range(8)]

    async def go() -> None:
        async with extender(fake) as ext:
            for p in pods[:2]:
                assert await bind(ext, p) == ""
            before = fake.connection_count
            for p in pods[2:]:
                assert await bind(ext, p) == ""
            assert fake.connection_count == before, "binds opened new API connections"
            await wait_until(lambda: len(ext.svc.cache.pods) == 8)
            check_books(fake, ext.svc)
    run(go)


def test_record_without_a_binding_after_a_restart_still_places_its_pod(fake_kube_api: FakeKubeAPI) -> None:
    """An extender stopped between writing a pod's signed record and posting its Binding: the next
    extender books the record (it cannot know the bind will not come), and that booking is the pod's
    own capacity. On a full node the pod must still pass filter there and bind, booking its request
    once; another pod still finds the capacity taken."""
    fake = fake_kube_api
    nodes = create_nodes(fake, 1, gpus=1)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000}))
    other = pod_obj("b", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10000})

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:  # the first extender writes the record, then "dies"
            req = parse_pod(a, ext.svc.config)
            plan = ext.svc.cache.reserve(req, a["metadata"]["uid"], "node-0")
            assert not isinstance(plan, str)
            ann = ext.svc.bind_annotations(a["metadata"]["uid"], "node-0", plan[1])
        fake.patch_object("pods", "a", {"metadata": {"annotations": ann, "labels": {LABEL_NODE: "node-0"}}},
                          "default")
        async with extender(fake, keys=KEYS) as ext:
            assert set(ext.svc.cache.state.bookings) == {"default/a"}
            _, res = await ext.post("/filter", filter_args(fake.get_object("pods", "a", "default"), nodes))
            assert res["NodeNames"] == ["node-0"] and not res["FailedNodes"], res
            _, pri = await ext.post("/prioritize", filter_args(fake.get_object("pods", "a", "default"), nodes))
            assert pri == [{"Host": "node-0", "Score": 10}]
            _, res = await ext.post("/filter", filter_args(other, nodes))
            assert res["NodeNames"] == [] and set(res["FailedNodes"]) == {"node-0"}
            assert await bind(ext, fake.get_object("pods", "a", "default")) == ""
            assert fake.get_object("pods", "a", "default")["spec"]["nodeName"] == "node-0"
            await wait_until(lambda: check_books(fake, ext.svc) == {"GPU-node-0-00": 20000}, timeout=30)
    run(go)
