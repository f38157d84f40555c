"""The cache and bind path against the in-process fake kube-apiserver (real HTTP, official client)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fake_device_plugin import FakeDevicePlugin
from vgpu_sched_util import (
    KEYS,
    Extender,
    bind_args,
    filter_args,
    node_obj,
    pod_obj,
    run,
    wait_until,
    write_keys,
)

from kube_vgpu.codec import decode_allocation
from kube_vgpu.config import Config
from kube_vgpu.podspec import parse_pod
from kube_vgpu.resources import ANN_ALLOCATION, ANN_BIND_PHASE, ANN_BIND_TIME, LABEL_NODE
from scheduler.kube import KubeAPI
from scheduler.service import Options, SchedulerService
from tests.fakeapi import FakeKubeAPI


@asynccontextmanager
async def extender(fake: FakeKubeAPI, device_plugin: bool = False, keys: Any = None,
                   **opts: Any) -> AsyncIterator[Extender]:
    """A service against ``fake``; ``device_plugin``: a FakeDevicePlugin marks each bound pod
    allocated shortly after its Binding (binds never wait for it)."""
    cfg = opts.pop("config", None) or Config()
    o = Options(sync_wait=5.0, resync_seconds=opts.pop("resync_seconds", 300.0), **opts)
    svc = SchedulerService(cfg, KubeAPI(fake.api_client()), o, keys=keys or KEYS)
    with contextlib.ExitStack() as stack:
        dp = stack.enter_context(FakeDevicePlugin(fake)) if device_plugin else None
        async with Extender(svc) as ext:
            ext.device_plugin = dp
            await asyncio.wait_for(svc.synced.wait(), 10)
            yield ext


def create_nodes(fake: FakeKubeAPI, n: int, gpus: int = 2, **kw: Any) -> list[dict[str, Any]]:
    return [fake.create_object("nodes", node_obj(f"node-{i}", gpus, **kw)) for i in range(n)]


def create_pod(fake: FakeKubeAPI, pod: dict[str, Any]) -> dict[str, Any]:
    pod = dict(pod)
    pod["metadata"] = {k: v for k, v in pod["metadata"].items() if k not in ("uid", "resourceVersion")}
    return fake.create_object("pods", pod)


async def schedule(ext: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str | None, str]:
    """What kube-scheduler does: filter, prioritize, pick the best, bind. Returns (node, error)."""
    _, res = await ext.post("/filter", filter_args(pod, nodes))
    if not res["NodeNames"]:
        return None, "unschedulable"
    _, prio = await ext.post("/prioritize", filter_args(pod, [n for n in nodes
                                                              if n["metadata"]["name"] in res["NodeNames"]]))
    best = max(prio, key=lambda p: (p["Score"], random.random()))["Host"]
    _, b = await ext.post("/bind", bind_args(pod, best))
    return (best if not b["Error"] else None), b["Error"]


def check_no_overcommit(fake: FakeKubeAPI, nodes: list[dict[str, Any]], mem: int, split: int) -> dict[str, Any]:
    """Sum the allocation annotations of all live pods per GPU; assert capacity holds."""
    used: dict[str, list[int]] = {}
    allocs = {}
    for p in fake.objects("pods"):
        text = (p["metadata"].get("annotations") or {}).get(ANN_ALLOCATION)
        if not text or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        a = decode_allocation(text)
        allocs[f"{p['metadata']['namespace']}/{p['metadata']['name']}"] = a
        for uuid, (m, c, s) in a.usage().items():
            u = used.setdefault(uuid, [0, 0, 0])
            u[0] += m
            u[1] += c
            u[2] += s
    for uuid, (m, c, s) in used.items():
        assert m <= mem and c <= 100 and s <= split, f"GPU {uuid} overcommitted: {m} MiB {c}% {s} slots"
    return allocs


def test_bind_is_one_binding_carrying_the_allocation(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1)
    pod = create_pod(fake, pod_obj("p1", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000,
                                                  "nvidia.com/gpucores": 30}))

    async def go() -> None:
        async with extender(fake) as ext:
            fake.clear_requests()
            node, err = await schedule(ext, pod, nodes)
            assert (node, err) == ("node-0", "")
            p = fake.get_object("pods", "p1", "default")
            assert p is not None
            ann = p["metadata"]["annotations"]
            a = decode_allocation(ann[ANN_ALLOCATION])
            assert a.node == "node-0" and a.containers[0].name == "c"
            assert [(d.memory_mib, d.cores) for d in a.containers[0].devices] == [(4000, 30)]
            assert ann[ANN_BIND_PHASE] == "allocating" and abs(int(ann[ANN_BIND_TIME]) - time.time()) < 5
            assert LABEL_NODE not in (p["metadata"].get("labels") or {})
            assert p["spec"]["nodeName"] == "node-0"
            # the pod came from the watch: the bind is one request, the Binding with the record
            calls = [r for r in fake.requests if r[0] in ("GET", "PATCH", "POST") and "/pods/p1" in r[1]]
            assert [(c[0], c[1].rsplit("/", 1)[-1]) for c in calls] == [("POST", "binding")], calls
            svc = ext.svc
            assert svc.cache.state.bookings["default/p1"].allocation == a
            await wait_until(lambda: "default/p1" in svc.cache.pods)
    run(go)


def test_failed_binding_releases_reservation_and_conflict_is_retried(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1, gpus=1)
    pod = create_pod(fake, pod_obj("p1", limits={"nvidia.com/gpu": 1}))  # whole card

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            fake.fail_next("create", "pods/binding", 500)
            node, err = await schedule(ext, pod, nodes)
            assert node is None and "500" in err
            assert svc.cache.state.bookings == {}
            await asyncio.sleep(0.2)  # the annotation of the failed bind arrives: must not re-book
            assert svc.cache.state.bookings == {}
            # the pod changes after the extender's watch showed it (watch lag, played by putting the
            # older copy back): the Binding's resourceVersion precondition answers 409, the bind
            # re-reads the pod and retries at the new resourceVersion
            await wait_until(lambda: "default/p1" in svc.cache.unbound)
            stale = svc.cache.unbound["default/p1"]
            fake.patch_object("pods", "p1", {"metadata": {"labels": {"x": "y"}}}, "default")
            await wait_until(lambda: svc.cache.unbound["default/p1"] is not stale)
            svc.cache.unbound["default/p1"] = stale
            fake.clear_requests()
            node, err = await schedule(ext, pod, nodes)
            assert (node, err) == ("node-0", "")
            assert svc.metrics.binds.labels(outcome="api_error")._value.get() == 1
            assert any(r[0] == "GET" and r[1].endswith("/pods/p1") for r in fake.requests)
    run(go)


def test_stress_200_concurrent_binds_and_restart_without_double_booking(fake: FakeKubeAPI) -> None:
    mem, split = 24576, 10
    nodes = create_nodes(fake, 10, gpus=4, mem=mem, split=split)
    rnd = random.Random(7)
    pods = []
    for i in range(200):
        lim = {"nvidia.com/gpumem": rnd.choice([2000, 4000, 6000, 8000]), "nvidia.com/gpucores": rnd.choice([0, 10, 20])}
        if i % 25 == 0:
            lim = {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 12000}
        pods.append(create_pod(fake, pod_obj(f"s{i:03d}", limits=lim)))

    async def go() -> None:
        results: dict[str, str | None] = {}
        half = asyncio.Event()  # set by the 100th successful bind (an event, not a deadline)
        # phase 1: all 200 concurrently, no device plugin (binds never wait for one); kill the
        # service once ~100 are bound
        async with extender(fake) as ext:
            async def one(p: dict[str, Any]) -> None:
                node, _ = await schedule(ext, p, nodes)
                results[p["metadata"]["name"]] = node
                if sum(1 for v in results.values() if v) >= 100:
                    half.set()
            tasks = [asyncio.create_task(one(p)) for p in pods]
            await half.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            before = dict(ext.svc.cache.state.bookings)
        check_no_overcommit(fake, nodes, mem, split)
        # phase 2: a fresh replica rebuilds the bookings from annotations, binds the rest
        async with extender(fake, device_plugin=True) as ext:
            svc = ext.svc
            rebuilt = {k: b.allocation for k, b in svc.cache.state.bookings.items()}
            bound_before = {k: b.allocation for k, b in before.items()
                            if (fake.get_object("pods", k.split("/")[1], "default") or {}).get("spec", {}).get("nodeName")}
            for k, a in bound_before.items():
                assert rebuilt[k] == a
            def unbound() -> list[dict[str, Any]]:
                live = [fake.get_object("pods", p["metadata"]["name"], "default") for p in pods]
                return [p for p in live if p is not None and not p["spec"].get("nodeName")]

            # kube-scheduler retries pods whose bind lost a race: concurrent rounds while they make
            # progress; a round that binds nothing is followed by one pod at a time (no races), and
            # only a sequential pass that binds nothing ends it
            for _ in range(60):
                todo = unbound()
                if not todo:
                    break
                got = await asyncio.gather(*(schedule(ext, p, nodes) for p in todo))
                if any(n for n, _ in got):
                    continue
                if not any([(await schedule(ext, p, nodes))[0] for p in unbound()]):
                    break
            else:
                pytest.fail("binding did not converge in 60 rounds")
            def caught_up() -> bool:  # the watch has delivered every bound pod (with its record)
                live = [p for p in fake.objects("pods") if p["spec"].get("nodeName")]
                return all((i := svc.cache.pods.get(f"default/{p['metadata']['name']}")) is not None and i.bound
                           for p in live)
            await wait_until(caught_up, timeout=120)
            allocs = check_no_overcommit(fake, nodes, mem, split)
            for key, a in allocs.items():  # every annotation matches the cache
                assert svc.cache.state.bookings[key].allocation == a, key
            bound = [p for p in fake.objects("pods") if p["spec"].get("nodeName")]
            assert set(svc.cache.state.bookings) == {f"default/{p['metadata']['name']}" for p in bound}
            assert len(bound) >= 100 and len(bound) + len(unbound()) == 200
            # every pod left over is unschedulable per the cache: the filter finds no node, and no
            # node has enough GPUs with the free memory, cores and slots it asks for (fit rules)
            for p in unbound():
                _, res = await ext.post("/filter", filter_args(p, nodes))
                assert res["NodeNames"] == [], p["metadata"]["name"]
                (r,) = parse_pod(p, svc.config).app
                for n in svc.cache.state.node_list:
                    fits = sum(1 for i, d in enumerate(n.devices)
                               if n.free_mem[i] >= r.memory_on(d) and n.free_cores[i] >= r.cores_on(d)
                               and n.free_slots[i] >= 1
                               # a GPU whose compute is fully booked takes no request with cores 0
                               and not (n.free_cores[i] <= 0 and r.cores_on(d) == 0))
                    assert fits < r.count, (p["metadata"]["name"], n.name, res, n.free_mem, n.free_cores,
                                            n.free_slots, svc.cache.unavailable)
            # bound capacity: what the cache holds per GPU is what the bound pods ask for
            asked: dict[str, int] = {}
            for p in bound:
                (r,) = parse_pod(p, svc.config).app
                a = allocs[f"default/{p['metadata']['name']}"]
                assert len(a.containers[0].devices) == r.count
                for d in a.containers[0].devices:
                    assert d.memory_mib == r.memory_mib
                    asked[d.uuid] = asked.get(d.uuid, 0) + d.memory_mib
            # per-GPU free memory in the cache equals capacity minus the annotations
            for n in svc.cache.state.node_list:
                for i, d in enumerate(n.devices):
                    want = mem - sum(a.usage().get(d.uuid, (0, 0, 0))[0] for a in allocs.values())
                    assert n.free_mem[i] == want == mem - asked.get(d.uuid, 0)
    run(go, timeout=150)  # a safety net only (stretched by SAFETY_SCALE): every wait above is on an event


def test_kf12_deleted_pod_frees_its_gpus(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1, gpus=8)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 8}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpu": 8}))
    c = create_pod(fake, pod_obj("c", limits={"nvidia.com/gpu": 8}))

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            assert (await schedule(ext, a, nodes)) == ("node-0", "")
            assert (await schedule(ext, b, nodes))[0] is None
            fake.delete_object("pods", "a", "default")
            await wait_until(lambda: "default/a" not in svc.cache.state.bookings)
            assert (await schedule(ext, b, nodes)) == ("node-0", "")
            # deleted before its bind completed: the reservation does not outlive the pod
            fake.delete_object("pods", "b", "default")
            await wait_until(lambda: not svc.cache.state.bookings)
            fake.add_latency(0.3, "create", "pods/binding")
            bind = asyncio.create_task(schedule(ext, c, nodes))
            await wait_until(lambda: "default/c" in svc.cache.state.bookings)
            fake.delete_object("pods", "c", "default")
            node, err = await bind
            assert node is None and err
            await wait_until(lambda: not svc.cache.state.bookings)
            fake.clear_latency()
            d = create_pod(fake, pod_obj("d", limits={"nvidia.com/gpu": 8}))
            assert (await schedule(ext, d, nodes)) == ("node-0", "")
    run(go)


def test_kf14_failed_or_deleted_pod_does_not_hold_up_the_node(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1, gpus=1)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}))
    c = create_pod(fake, pod_obj("c", limits={"nvidia.com/gpu": 1}))

    async def go() -> None:
        async with extender(fake, device_plugin=True) as ext:
            svc = ext.svc
            # no per-node lock: b (same GPU count) binds to the same node as soon as the device
            # plugin has allocated big (the hand-over), well under a second
            big = create_pod(fake, pod_obj("big", limits={"nvidia.com/gpumem": 2000}))
            assert (await schedule(ext, big, nodes)) == ("node-0", "")
            t0 = time.monotonic()
            assert (await schedule(ext, b, nodes)) == ("node-0", "")
            assert time.monotonic() - t0 < 1.0
            fake.delete_object("pods", "big", "default")
            fake.delete_object("pods", "b", "default")
            await wait_until(lambda: not svc.cache.state.bookings)
            # a (whole card) is bound, then fails before the device plugin allocates
            assert (await schedule(ext, a, nodes)) == ("node-0", "")
            assert (await schedule(ext, c, nodes))[0] is None
            fake.set_pod_phase("a", "Failed")
            await wait_until(lambda: "default/a" not in svc.cache.state.bookings)
            t0 = time.monotonic()
            assert (await schedule(ext, c, nodes)) == ("node-0", "")
            assert time.monotonic() - t0 < 1.0
    run(go)


def test_terminating_pod_keeps_reservation_until_gone(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1, gpus=1)
    p = pod_obj("a", limits={"nvidia.com/gpu": 1})
    p["metadata"]["finalizers"] = ["test.kube-vgpu.io/hold"]
    a = create_pod(fake, p)

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            assert (await schedule(ext, a, nodes)) == ("node-0", "")
            fake.delete_object("pods", "a", "default")
            await wait_until(lambda: (fake.get_object("pods", "a", "default") or {})
                             .get("metadata", {}).get("deletionTimestamp") is not None)
            await asyncio.sleep(0.2)
            assert "default/a" in svc.cache.state.bookings
            fake.patch_object("pods", "a", {"metadata": {"finalizers": None}}, "default")
            await wait_until(lambda: "default/a" not in svc.cache.state.bookings)
    run(go)


def test_watch_expiry_relists_and_rejections_are_counted_without_own_events(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 2, gpus=2)
    big = create_pod(fake, pod_obj("big", limits={"nvidia.com/gpu": 4}))

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            _, res = await ext.post("/filter", filter_args(big, nodes))
            # unresolvable (preemption cannot add GPUs), one identical text per node: kube-scheduler
            # groups them into its own single FailedScheduling event
            assert not res["NodeNames"] and not res["FailedNodes"]
            assert set(res["FailedAndUnresolvableNodes"]) == {"node-0", "node-1"}
            assert len(set(res["FailedAndUnresolvableNodes"].values())) == 1
            await wait_until(lambda: svc.metrics.registry.get_sample_value(
                "kube_vgpu_scheduler_filter_rejections_total", {"reason": "too_few_gpus"}) == 2.0, timeout=5)
            assert fake.objects("events", "default") == []  # the extender posts no event of its own
            # watch expiry (410): the reflector relists and keeps following changes
            relists = [r.relists for r in svc._reflectors]
            fake.expire_watches()
            n3 = fake.create_object("nodes", node_obj("node-9", 4))
            await wait_until(lambda: "node-9" in svc.cache.state.nodes, timeout=10)
            assert [r.relists for r in svc._reflectors] > relists
            assert (await schedule(ext, big, nodes + [n3])) == ("node-9", "")
    run(go)


def test_leader_election_only_leader_binds(fake: FakeKubeAPI) -> None:
    nodes = create_nodes(fake, 1)
    pod = create_pod(fake, pod_obj("p", limits={"nvidia.com/gpumem": 1000}))

    async def go() -> None:
        async with extender(fake, leader_elect=True, identity="one", lease_namespace="default") as e1, \
                extender(fake, leader_elect=True, identity="two", lease_namespace="default") as e2:
            await wait_until(lambda: e1.svc.is_leader or e2.svc.is_leader, timeout=5)
            await asyncio.sleep(0.3)
            assert e1.svc.is_leader != e2.svc.is_leader
            leader, follower = (e1, e2) if e1.svc.is_leader else (e2, e1)
            lease = fake.get_object("leases", "kube-vgpu-scheduler", "default")
            assert lease is not None and lease["spec"]["holderIdentity"] == leader.svc.opts.identity
            st, _ = await follower.get("/readyz")
            assert st == 503
            _, res = await follower.post("/bind", bind_args(pod, "node-0"))
            assert "not the leader" in res["Error"]
            assert (await schedule(leader, pod, nodes)) == ("node-0", "")
    run(go)


def test_cli_serves_against_a_kubeconfig(fake: FakeKubeAPI, tmp_path: Any) -> None:
    """`kube-vgpu scheduler` end to end: flags, kubeconfig, list+watch, /readyz, /filter, JSON logs."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    create_nodes(fake, 1)
    kc = fake.kubeconfig(tmp_path / "kubeconfig")
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: spread}\n")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "kube_vgpu_cli", "scheduler", "--kubeconfig", kc, "--port", str(port),
                             "--bind-address", "127.0.0.1", "--config", str(cfg), "--log-level", "info",
                             "--signing-keys-dir", str(write_keys(tmp_path / "keys"))],
                            cwd=root, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "scheduler did not become ready"
            time.sleep(0.1)
        body = json.dumps(filter_args(pod_obj("p", limits={"nvidia.com/gpumem": 100}), [node_obj("node-0")])).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/filter", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["NodeNames"] == ["node-0"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    assert any(x["msg"] == "caches synced" for x in lines)
    assert proc.returncode == 0


def test_slow_or_failing_api_never_blocks_the_loop_and_watch_recovers(fake: FakeKubeAPI) -> None:
    create_nodes(fake, 1)
    fake.add_latency(1.0, "list", "nodes")

    async def go() -> None:
        svc = SchedulerService(Config(), KubeAPI(fake.api_client()), Options(sync_wait=0.05))
        async with Extender(svc) as ext:
            t0 = time.monotonic()
            st, _ = await ext.get("/livez")
            assert st == 200 and time.monotonic() - t0 < 0.5  # the list runs in its thread
            st, _ = await ext.get("/readyz")
            assert st == 503
            _, res = await ext.post("/filter", filter_args(pod_obj("p", limits={"nvidia.com/gpumem": 1}),
                                                           [node_obj("node-0")]))
            assert "not synced" in res["Error"]
            await asyncio.wait_for(svc.synced.wait(), 10)
            fake.clear_latency()
            # the API fails the next watches (500) and drops the open ones: the reflector backs off,
            # resumes, and keeps delivering changes
            fake.fail_next("watch", "nodes", 500, count=2)
            fake.close_watches("nodes")
            fake.create_object("nodes", node_obj("node-late", 1))
            await wait_until(lambda: "node-late" in svc.cache.state.nodes, timeout=10)
            assert svc._reflectors[0].errors >= 1
    run(go)


def test_follow_mode_binds_only_where_kube_scheduler_leads(fake: FakeKubeAPI) -> None:
    """--leader-elect-mode follow: the sidecar leads while the kube-scheduler of its pod (identity
    ``<hostname>_<uuid>``) holds the kube-scheduler Lease, and stays Ready either way."""
    import datetime as dt

    nodes = create_nodes(fake, 1)
    pod = create_pod(fake, pod_obj("p", limits={"nvidia.com/gpumem": 1000}))

    def lease(holder: str, age: float = 0.0) -> None:
        t = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "ks-lease", "namespace": "default"},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": t, "acquireTime": t}}
        if fake.get_object("leases", "ks-lease", "default") is None:
            fake.create_object("leases", body)
        else:
            fake.update_object("leases", body)

    lease("pod-b_0123abcd")

    async def go() -> None:
        async with extender(fake, leader_elect=True, leader_mode="follow", hostname="pod-a",
                            lease_name="ks-lease", lease_namespace="default") as a, \
                extender(fake, leader_elect=True, leader_mode="follow", hostname="pod-b",
                         lease_name="ks-lease", lease_namespace="default") as b:
            a.svc.elector.retry_period = b.svc.elector.retry_period = 0.1  # type: ignore[union-attr]
            await wait_until(lambda: b.svc.is_leader, timeout=5)
            assert not a.svc.is_leader
            assert (await a.get("/readyz"))[0] == 200  # followers stay Ready
            _, res = await a.post("/bind", bind_args(pod, "node-0"))
            assert "not the leader" in res["Error"]
            lease("pod-a_89abcdef")  # kube-scheduler leadership moves to pod-a
            await wait_until(lambda: a.svc.is_leader and not b.svc.is_leader, timeout=5)
            assert (await schedule(a, pod, nodes)) == ("node-0", "")
            lease("pod-a_89abcdef", age=60)  # expired: nobody leads
            await wait_until(lambda: not a.svc.is_leader, timeout=5)
    run(go)


def test_bind_plans_from_the_api_servers_pod_not_a_forged_filter_body(fake: FakeKubeAPI) -> None:
    """A /filter body is not authenticated: a forged one (same name and uid, a bigger
    nvidia.com/gpumem) must not make /bind write a bigger allocation."""
    import copy

    nodes = create_nodes(fake, 1, gpus=1)
    pod = create_pod(fake, pod_obj("p1", limits={"nvidia.com/gpumem": 1000}))
    forged = copy.deepcopy(pod)
    forged["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "20000"
    forged["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpumem"] = "20000"

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            _, res = await ext.post("/filter", filter_args(forged, nodes))
            assert res["NodeNames"] == ["node-0"]
            # another uid than the API server's pod: refused, nothing booked or written
            wrong = bind_args(pod, "node-0")
            wrong["PodUID"] = "not-" + pod["metadata"]["uid"]
            st, b = await ext.post("/bind", wrong)
            assert st == 200 and "uid" in b["Error"]
            assert svc.cache.state.bookings == {}
            assert ANN_ALLOCATION not in (fake.get_object("pods", "p1", "default") or {})["metadata"].get(
                "annotations", {})
            st, b = await ext.post("/bind", bind_args(pod, "node-0"))
            assert (st, b) == (200, {"Error": ""})
            p = fake.get_object("pods", "p1", "default")
            assert p is not None
            a = decode_allocation(p["metadata"]["annotations"][ANN_ALLOCATION])
            assert [(d.memory_mib, d.cores) for d in a.containers[0].devices] == [(1000, 0)]
            assert svc.cache.state.bookings["default/p1"].allocation == a
            assert svc.cache.state.node_list[0].free_mem[0] == 24576 - 1000
    run(go)


def test_tampered_allocation_annotation_never_frees_capacity(fake: FakeKubeAPI, caplog: Any) -> None:
    """The pod's owner may edit kube-vgpu.io/allocation after binding (mem 1, negative, another
    GPU, another node): the edit does not verify, the cache keeps the booking of the signed record
    live, and after a restart books the running pod's own request, so a pod that would overcommit
    the card is still refused."""
    import logging

    caplog.set_level(logging.WARNING, logger="kube_vgpu.cluster")
    nodes = create_nodes(fake, 1, gpus=1)  # one 24576 MiB card
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 20000,
                                              "nvidia.com/gpucores": 30}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpumem": 10000}))

    def tamper(node: str, uuid: str, mem: Any, cores: Any = 30) -> None:
        text = json.dumps({"v": 1, "node": node, "t": 1.0, "containers": [
            {"name": "c", "init": False, "devices": [{"uuid": uuid, "mem": mem, "cores": cores}]}]})
        fake.patch_object("pods", "a", {"metadata": {"annotations": {ANN_ALLOCATION: text}}}, "default")

    def annotation() -> str:
        return (fake.get_object("pods", "a", "default") or {})["metadata"]["annotations"][ANN_ALLOCATION]

    async def refused(ext: Extender) -> None:
        node, err = await schedule(ext, b, nodes)
        assert (node, err) == (None, "unschedulable")
        free = ext.svc.cache.state.node_list[0]
        assert (free.free_mem[0], free.free_cores[0]) == (24576 - 20000, 70)

    async def go() -> None:
        async with extender(fake) as ext:
            assert (await schedule(ext, a, nodes)) == ("node-0", "")
            await asyncio.sleep(0.3)
            assert not [r for r in caplog.records if "does not match" in r.getMessage()]  # honest bind
            await refused(ext)
            for mem, cores, uuid, node in [(1, 30, "GPU-node-0-00", "node-0"), (-50000, 30, "GPU-node-0-00", "node-0"),
                                           (1, 0, "GPU-bogus", "node-0"), (1, 30, "GPU-node-0-00", "node-9"),
                                           ("x", None, "GPU-node-0-00", "node-0")]:
                tamper(node, uuid, mem, cores)
                before = annotation()
                await wait_until(lambda: fake.get_object("pods", "a", "default") is not None)
                await asyncio.sleep(0.3)  # the watch delivers the edit
                assert annotation() == before
                await refused(ext)
            assert any("not written by the vGPU system" in r.getMessage() and getattr(r, "pod", "") == "default/a"
                       and getattr(r, "node", "") == "node-0" for r in caplog.records)
        # restart with a tampered annotation while the pod runs (kubelet reports its containers):
        # rebuilt from the request, not the annotation
        fake.patch_object("pods", "a", {"status": {"phase": "Running", "containerStatuses": [
            {"name": "c", "ready": True, "restartCount": 0, "image": "busybox", "imageID": "",
             "state": {"running": {}}}]}}, "default", subresource="status")
        for mem in (1, -50000):
            tamper("node-0", "GPU-node-0-00", mem)
            async with extender(fake) as ext:
                await refused(ext)
    run(go)


def test_cli_port_in_use_logs_one_clear_json_line(fake: FakeKubeAPI, tmp_path: Any) -> None:
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    kc = fake.kubeconfig(tmp_path / "kubeconfig")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run([sys.executable, "-m", "kube_vgpu_cli", "scheduler", "--kubeconfig", kc, "--port",
                               str(port), "--bind-address", "127.0.0.1",
                               "--signing-keys-dir", str(write_keys(tmp_path / "keys"))], cwd=root, capture_output=True,
                              timeout=30, env={**os.environ, "PYTHONPATH": str(root)})
    finally:
        s.close()
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    lines = [json.loads(x) for x in err.splitlines() if x.strip()]  # every line is a JSON log line
    bad = [x for x in lines if x["level"] == "error"]
    assert len(bad) == 1, lines
    assert bad[0]["msg"] == f"cannot listen on 127.0.0.1:{port}"
    assert bad[0]["address"] == "127.0.0.1" and bad[0]["port"] == port and "in use" in bad[0]["error"]
