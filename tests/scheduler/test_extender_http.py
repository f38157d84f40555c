"""The extender's HTTP protocol, driven with ExtenderArgs shaped exactly like kube-scheduler's."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vgpu_sched_util import (
    Extender,
    bind_args,
    capture,
    ctr,
    filter_args,
    node_obj,
    offline_service,
    pod_obj,
    run,
)

from kube_vgpu.config import Config

FILTER_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


def test_captured_filter_passes_through_a_pod_without_vgpu_requests() -> None:
    args = capture("scheduler_filter")  # verbatim: nodeCacheCapable false, pod asks example.com/gpu-mem

    async def go() -> None:
        async with Extender(offline_service()) as ext:
            st, res = await ext.post("/filter", args)
            assert st == 200
            assert set(res) == FILTER_KEYS
            assert res["Nodes"] == args["Nodes"]
            assert res["NodeNames"] is None
            assert res["FailedNodes"] == {} and res["FailedAndUnresolvableNodes"] == {} and res["Error"] == ""
            pargs = capture("scheduler_prioritize")
            st, prio = await ext.post("/prioritize", pargs)
            assert st == 200
            assert prio == [{"Host": n["metadata"]["name"], "Score": 0} for n in pargs["Nodes"]["items"]]
    run(go)


def test_filter_node_list_and_node_names_shapes() -> None:
    nodes = [node_obj("gpu-a", 2), node_obj("gpu-b", 1, mem=8192), node_obj("cpu-1", inventory=False)]
    pod = pod_obj("p", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 16000})

    async def go() -> None:
        async with Extender(offline_service(nodes[:2])) as ext:
            # nodeCacheCapable: false -> Nodes in, Nodes out (full objects kept), NodeNames null
            st, res = await ext.post("/filter", filter_args(pod, nodes, cache_capable=False))
            assert st == 200 and set(res) == FILTER_KEYS
            assert res["NodeNames"] is None
            assert [n["metadata"]["name"] for n in res["Nodes"]["items"]] == ["gpu-a"]
            assert res["Nodes"]["items"][0] == nodes[0]
            assert "16000 MiB" in res["FailedNodes"]["gpu-b"]
            assert "no vGPU inventory" in res["FailedAndUnresolvableNodes"]["cpu-1"]
            # nodeCacheCapable: true -> NodeNames in, NodeNames out, Nodes null
            st, res = await ext.post("/filter", filter_args(pod, nodes))
            assert res["Nodes"] is None and res["NodeNames"] == ["gpu-a"]
            assert set(res["FailedNodes"]) | set(res["FailedAndUnresolvableNodes"]) == {"gpu-b", "cpu-1"}
            st, prio = await ext.post("/prioritize", filter_args(pod, nodes))
            assert st == 200
            assert all(set(p) == {"Host", "Score"} and 0 <= p["Score"] <= 10 for p in prio)
            assert {p["Host"]: p["Score"] for p in prio} == {"gpu-a": 10, "gpu-b": 0, "cpu-1": 0}
            assert len(prio) == 3
    run(go)


def test_prioritize_prefers_the_used_node_under_binpack() -> None:
    svc = offline_service([node_obj("n1", 2), node_obj("n2", 2)])
    from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
    svc.cache.state.book("default/x", PodAllocation("n2", (ContainerAllocation("c", False, (
        DeviceBooking("GPU-n2-00", 4096, 10),)),)))
    pod = pod_obj("p", limits={"nvidia.com/gpumem": 1000})

    async def go() -> None:
        async with Extender(svc) as ext:
            _, prio = await ext.post("/prioritize", filter_args(pod, [node_obj("n1"), node_obj("n2")]))
            assert prio == [{"Host": "n1", "Score": 0}, {"Host": "n2", "Score": 10}]  # input order
    run(go)


def test_kf02_impossible_requests_get_per_node_reasons_and_service_keeps_serving() -> None:
    nodes = [node_obj("two-gpus", 2, mem=24576)]
    big = pod_obj("four", limits={"nvidia.com/gpu": 4})
    huge = pod_obj("huge", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 999999})
    ok = pod_obj("ok", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})

    from kube_vgpu.placement import Code, FitFailure
    from kube_vgpu.placement.render import summary
    from kube_vgpu.podspec import parse_pod
    svc = offline_service(nodes)

    def failure(p: dict[str, object]) -> FitFailure:
        return svc.cache.evaluate(parse_pod(p), ["two-gpus"])[1]["two-gpus"]

    async def go() -> None:
        async with Extender(svc) as ext:
            _, res = await ext.post("/filter", filter_args(big, nodes))
            assert res["NodeNames"] == [] and res["Error"] == ""
            f = failure(big)
            assert (f.code, f.need, f.have) == (Code.TOO_FEW_GPUS, 4, 2)
            assert res["FailedAndUnresolvableNodes"]["two-gpus"] == summary(f)
            _, res = await ext.post("/filter", filter_args(huge, nodes))
            assert res["NodeNames"] == []
            f = failure(huge)
            assert (f.code, f.need, f.have) == (Code.INSUFFICIENT_MEMORY, 999999, 24576)
            assert res["FailedNodes"]["two-gpus"] == summary(f) and "GPU-" not in summary(f)
            _, res = await ext.post("/filter", filter_args(ok, nodes))
            assert res["NodeNames"] == ["two-gpus"]
            st, _ = await ext.get("/livez")
            assert st == 200
    run(go)


def test_stale_inventory_and_zero_allocatable_are_not_candidates() -> None:
    nodes = [node_obj("fresh", 1), node_obj("stale", 1, heartbeat=time.time() - 3600),
             node_obj("noalloc", 1, allocatable=0)]
    pod = pod_obj("p", limits={"nvidia.com/gpumem": 100})

    async def go() -> None:
        async with Extender(offline_service(nodes)) as ext:
            _, res = await ext.post("/filter", filter_args(pod, nodes))
            assert res["NodeNames"] == ["fresh"]
            failed = res["FailedAndUnresolvableNodes"]
            assert "heartbeat is stale" in failed["stale"]
            assert "allocatable nvidia.com/gpu is 0" in failed["noalloc"]
    run(go)


def test_invalid_request_is_reported_on_every_node() -> None:
    nodes = [node_obj("n1", 1)]
    pod = pod_obj("p", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 0})

    async def go() -> None:
        async with Extender(offline_service(nodes)) as ext:
            _, res = await ext.post("/filter", filter_args(pod, nodes))
            assert res["NodeNames"] == []
            assert "gpumem-percentage" in res["FailedAndUnresolvableNodes"]["n1"]
            _, prio = await ext.post("/prioritize", filter_args(pod, nodes))
            assert prio == [{"Host": "n1", "Score": 0}]
    run(go)


def test_bad_json_and_unsynced_and_bind_without_api() -> None:
    nodes = [node_obj("n1", 1)]
    pod = pod_obj("p", limits={"nvidia.com/gpumem": 100})

    async def go() -> None:
        from scheduler.service import Options, SchedulerService
        svc = SchedulerService(Config(), None, Options(sync_wait=0.01))
        async with Extender(svc) as ext:
            st, body = await ext.get("/readyz")
            assert st == 503
            _, res = await ext.post("/filter", filter_args(pod, nodes))
            assert "not synced" in res["Error"]
            svc.mark_synced()
            st, _ = await ext.get("/readyz")
            assert st == 200
            assert ext.session is not None
            async with ext.session.post("/filter", data=b"{not json") as r:
                assert r.status == 400 and "Error" in await r.json()
            st, res = await ext.post("/bind", bind_args(pod, "n1"))
            assert st == 200 and set(res) == {"Error"} and res["Error"]
    run(go)


def test_metrics_expose_per_gpu_usage_latency_and_rejections() -> None:
    nodes = [node_obj("n1", 2)]
    svc = offline_service(nodes)
    from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
    svc.cache.state.book("default/x", PodAllocation("n1", (ContainerAllocation("c", False, (
        DeviceBooking("GPU-n1-01", 3000, 30),)),)))
    pod = pod_obj("p", limits={"nvidia.com/gpu": 4})

    async def go() -> None:
        async with Extender(svc) as ext:
            await ext.post("/filter", filter_args(pod, nodes))
            await ext.post("/prioritize", filter_args(pod, nodes))
            for _ in range(50):  # let the background worker count the rejection
                if svc.metrics.filter_rejections.labels(reason="too_few_gpus")._value.get():
                    break
                import asyncio
                await asyncio.sleep(0.01)
            st, text = await ext.get("/metrics")
            assert st == 200
            assert 'kube_vgpu_scheduler_memory_allocated_bytes{model="NVIDIA A10"} 3.145728e+09' in text
            assert 'kube_vgpu_scheduler_cores_allocated_percent{model="NVIDIA A10"} 30.0' in text
            assert 'kube_vgpu_scheduler_slots_allocated{model="NVIDIA A10"} 1.0' in text
            assert 'kube_vgpu_scheduler_gpus{model="NVIDIA A10"} 2.0' in text
            assert "kube_vgpu_scheduler_gpu_" not in text  # per-GPU series come from the device plugins only
            assert "kube_vgpu_scheduler_filter_seconds_bucket" in text
            assert "kube_vgpu_scheduler_prioritize_seconds_count 1.0" in text
            assert 'kube_vgpu_scheduler_filter_rejections_total{reason="too_few_gpus"} 1.0' in text
            svc.cache.state.book("default/y", PodAllocation("n1", (ContainerAllocation("c", False, (
                DeviceBooking("GPU-n1-00", 2048, 0),)),)))  # a scrape after a bind sees it
            _, text = await ext.get("/metrics")
            assert 'kube_vgpu_scheduler_slots_allocated{model="NVIDIA A10"} 2.0' in text
            from prometheus_client.parser import text_string_to_metric_families
            got = {(s.name, s.labels.get("model")): s.value for f in text_string_to_metric_families(text)
                   for s in f.samples}
            assert got[("kube_vgpu_scheduler_memory_allocated_bytes", "NVIDIA A10")] == (3000 + 2048) * 1024 * 1024
            assert got[("kube_vgpu_scheduler_memory_capacity_bytes", "NVIDIA A10")] == 2 * 24576 * 1024 * 1024
    run(go)


_ROWS = st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.lists(st.tuples(
    st.sampled_from(["A10", "H200", 'odd "model"\\']), st.lists(st.integers(0, 1 << 24), min_size=6, max_size=6)),
    max_size=3)), max_size=4, unique_by=lambda t: t[0])


@given(_ROWS, _ROWS)
@settings(max_examples=100, deadline=None)
def test_gpu_totals_are_the_sums_per_model_cached_or_not(first: list, second: list) -> None:
    """The cluster totals per model equal a direct sum over every GPU row, on a cold cache and
    after the nodes changed (a node's cached sums are reused only while its rows are the same)."""
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler.metrics import TOTAL_FAMILIES, GpuTotals
    totals = GpuTotals()
    for nodes in (first, second, second):
        snapshot = [(name, tuple((name, f"GPU-{name}-{i}", m, *vals) for i, (m, vals) in enumerate(gpus)))
                    for name, gpus in nodes]
        want: dict[tuple[str, str], float] = {}
        for _, rows in snapshot:
            for r in rows:
                for name, _, idx, scale in TOTAL_FAMILIES:
                    key = (name, r[2])
                    want[key] = want.get(key, 0) + (1 if idx is None else r[idx] * scale)
        text = totals.render(snapshot).decode()
        got = {(s.name, s.labels["model"]): s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
        assert got == want


def test_kf06_allocation_recorded_for_app_container_by_name() -> None:
    """An init container without GPU must not shift the app container's allocation."""
    nodes = [node_obj("n1", 1)]
    svc = offline_service(nodes)
    from kube_vgpu.podspec import parse_pod
    pod = pod_obj("p", containers=[ctr("app", gpu=1, gpumem=4000)],
                  init=[{"name": "setup", "image": "busybox"}])
    req = parse_pod(pod, svc.config)
    r = svc.cache.reserve(req, "u1", "n1")
    assert not isinstance(r, str)
    _, alloc = r
    assert [(c.name, c.init) for c in alloc.containers] == [("app", False)]
    assert alloc.container("app") is not None and alloc.container("app").devices[0].memory_mib == 4000
    assert alloc.container("setup", init=True) is None


def test_host_priority_list_is_the_list_kube_scheduler_expects() -> None:
    import json

    import numpy as np

    from scheduler.hostpriority import HostPriorityEncoder
    enc = HostPriorityEncoder(capacity=2)
    names = [f"node-{i}" for i in range(50)]
    for round_ in range(3):  # built, then served from the template with other scores
        scores = np.array([(i + round_) % 11 for i in range(50)], dtype=np.int64)
        out = json.loads(enc.encode(names, scores))
        assert out == [{"Host": h, "Score": s} for h, s in zip(names, scores.tolist(), strict=True)]
    odd = ['we"ird', "ok"]
    assert json.loads(enc.encode(odd, np.array([3, 4]))) == [{"Host": 'we"ird', "Score": 3},
                                                             {"Host": "ok", "Score": 4}]
    assert enc.encode([], np.zeros(0, dtype=np.int64)) == b"[]"
    assert json.loads(enc.encode(["a\ud800"], np.array([3]))) == [{"Host": "a\ud800", "Score": 3}]  # no UTF-8
    assert json.loads(enc.encode(["a"], np.array([7]))) == [{"Host": "a", "Score": 7}]
    assert json.loads(enc.encode(["a"], np.array([11]))) == [{"Host": "a", "Score": 11}]  # out of range: dumps
    with pytest.raises(ValueError, match="scores: 1 values for 2 names"):
        enc.encode(["a", "b"], np.array([1]))


@given(st.lists(st.lists(st.tuples(st.sampled_from(["n1", "n-2", 'q"', "b\\s", "\x00", "n\x00x", "é", "\t", ""]),
                                   st.integers(0, 10)), max_size=6), min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_host_priority_encoder_matches_json_dumps(calls: list[list[tuple[str, int]]]) -> None:
    """Whatever the names (quotes, backslashes, NULs, control and non-ASCII characters) and
    however lists that join alike follow each other through the template cache, the bytes decode
    to the (Host, Score) pairs in input order."""
    import json

    import numpy as np

    from scheduler.hostpriority import HostPriorityEncoder
    enc = HostPriorityEncoder(capacity=3)
    for pairs in calls + calls:
        names = [h for h, _ in pairs]
        out = json.loads(enc.encode(names, np.array([v for _, v in pairs], dtype=np.int64)))
        assert [(p["Host"], p["Score"]) for p in out] == pairs


MALFORMED_FILTER = [
    ({"Pod": "x", "NodeNames": ["node-1"]}, "Pod"),
    ({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": "x"}}, "Nodes.items"),
    ({"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [5]}}, "Nodes.items[0]"),
    ({"Pod": {"metadata": {"name": "p"}}, "Nodes": "x"}, "Nodes"),
    ({"NodeNames": ["node-1"]}, "Pod"),
    ({"Pod": None, "NodeNames": ["node-1"]}, "Pod"),
    ({"Pod": {"metadata": {"name": "p"}}, "NodeNames": "node-1"}, "NodeNames"),
    ({"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["node-1", 7]}, "NodeNames[1]"),
    ({"Pod": {"metadata": "x"}, "NodeNames": ["node-1"]}, "Pod.metadata"),
    ({"Pod": {"metadata": {"annotations": {"a": 1}}}, "NodeNames": ["node-1"]}, 'Pod.metadata.annotations["a"]'),
    ({"Pod": {"spec": {"containers": "x"}}, "NodeNames": ["node-1"]}, "Pod.spec.containers"),
    ({"Pod": {"spec": {"containers": [{"name": "c", "resources": {"limits": ["nvidia.com/gpu"]}}]}},
      "NodeNames": ["node-1"]}, "Pod.spec.containers[0].resources.limits"),
    ([1, 2], "ExtenderArgs"),
    ("x", "ExtenderArgs"),
]


def test_malformed_extender_args_get_400_naming_the_field() -> None:
    async def go() -> None:
        async with Extender(offline_service([node_obj("node-1", 1)])) as ext:
            for body, field in MALFORMED_FILTER:
                for path in ("/filter", "/prioritize"):
                    st, res = await ext.post(path, body)
                    assert st == 400, (path, body, res)
                    assert res["Error"].startswith(f"invalid ExtenderArgs: {field} must be "), (path, body, res)
                    if path == "/filter":
                        assert set(res) == FILTER_KEYS and res["NodeNames"] == [] and res["Nodes"] is None
            for body, field in [({"PodName": 5, "Node": "node-1"}, "PodName"),
                                ({"PodName": "p", "Node": ["node-1"]}, "Node"),
                                ({"PodName": "p", "PodUID": 1, "Node": "node-1"}, "PodUID"),
                                ({"PodName": "p", "PodNamespace": {}, "Node": "node-1"}, "PodNamespace"),
                                ({"Node": "node-1"}, "PodName"), ({"PodName": "p"}, "Node"),
                                (None, "ExtenderBindingArgs")]:
                st, res = await ext.post("/bind", body)
                assert st == 400 and res == {"Error": res["Error"]}, (body, res)
                assert res["Error"].startswith(f"invalid ExtenderBindingArgs: {field} must be "), (body, res)
            # JSON nested 100,000 levels deep: refused as not JSON, never a RecursionError/500
            deep = b"[" * 100_000 + b"]" * 100_000
            deep_obj = b'{"Pod":' * 100_000 + b"1" + b"}" * 100_000
            assert ext.session is not None
            for path in ("/filter", "/prioritize", "/bind"):
                for data in (deep, deep_obj):
                    async with ext.session.post(path, data=data) as r:
                        assert r.status == 400, path
                        assert "not JSON" in (await r.json())["Error"]
            st, _ = await ext.get("/livez")
            assert st == 200
    run(go)


def test_random_json_junk_never_gets_a_500() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    junk = st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["Pod", "Nodes", "NodeNames", "items", "metadata", "name", "namespace", "uid",
                         "annotations", "spec", "containers", "initContainers", "resources", "limits",
                         "requests", "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "cpu",
                         "PodName", "PodNamespace", "PodUID", "Node", "status", "phase", "x"]),
        kids, max_size=5), max_leaves=30)
    svc = offline_service([node_obj("node-1", 1)])
    bodies: list[tuple[str, object]] = []

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/filter", "/prioritize", "/bind"]), body=junk)
    def collect(path: str, body: object) -> None:
        bodies.append((path, body))

    collect()
    # half of them on a real-looking pod, so the junk reaches the request parser
    pod = pod_obj("p", limits={"nvidia.com/gpumem": 100})
    for i, (path, body) in enumerate(list(bodies)):
        if i % 2 and isinstance(body, dict):
            p = dict(pod)
            p["spec"] = {"containers": [{"name": "c", "resources": {"limits": body}}]}
            bodies.append((path, {"Pod": p, "NodeNames": ["node-1"]}))

    async def go() -> None:
        async with Extender(svc) as ext:
            for path, body in bodies:
                st_, res = await ext.post(path, body)
                assert st_ in (200, 400), (path, body, st_, res)
                if st_ == 400:
                    assert res["Error"], (path, body, res)
    run(go, timeout=120)
