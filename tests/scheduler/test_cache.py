"""The watched cache: restart recovery, releases, node availability (pure, no I/O)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from vgpu_sched_util import node_obj, offline_service, pod_obj, run, wait_until

from kube_vgpu.codec import encode_allocation
from kube_vgpu.config import Config
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.placement import Code, FitFailure
from kube_vgpu.placement.liveshapes import default_shapes, shapes_from_state
from kube_vgpu.placement.render import aggregate, summaries
from kube_vgpu.podspec import parse_pod
from kube_vgpu.resources import ANN_ALLOCATION, ANN_NODE_INVENTORY
from scheduler import jsonlog
from scheduler.bindstate import BindCache
from scheduler.service import Options, SchedulerService


def alloc(node: str, uuid: str, mem: int, cores: int = 0) -> PodAllocation:
    return PodAllocation(node, (ContainerAllocation("c", False, (DeviceBooking(uuid, mem, cores),)),))


def annotated(name: str, a: PodAllocation, uid: str | None = None, bound: bool = True, **status: str) -> dict:
    p = pod_obj(name, limits={"nvidia.com/gpumem": a.containers[0].devices[0].memory_mib}, uid=uid,
                annotations={ANN_ALLOCATION: encode_allocation(a)})
    if bound:
        p["spec"]["nodeName"] = a.node
    p["status"].update(status)
    return p


def test_restart_recovery_books_annotations_without_checks_even_before_the_node() -> None:
    c = BindCache(Config())
    # pods arrive before their node: booked as soon as the node appears
    c.on_pod("ADDED", annotated("a", alloc("n1", "GPU-n1-00", 20000)))
    c.on_pod("ADDED", annotated("b", alloc("n1", "GPU-n1-00", 20000)))  # together over capacity
    assert c.state.bookings == {}
    c.on_node("ADDED", node_obj("n1", 1, mem=24576))
    assert set(c.state.bookings) == {"default/a", "default/b"}
    assert c.state.nodes["n1"].free_mem == [24576 - 40000]  # a record the cluster runs is never lost
    # the same event again changes nothing; a MODIFIED with another allocation re-books
    c.on_pod("MODIFIED", annotated("a", alloc("n1", "GPU-n1-00", 20000)))
    assert c.state.nodes["n1"].free_mem == [24576 - 40000]
    c.on_pod("MODIFIED", annotated("a", alloc("n1", "GPU-n1-00", 1000)))
    assert c.state.nodes["n1"].free_mem == [24576 - 21000]
    # node replaced (inventory change) keeps the bookings; node deleted and re-added re-books them
    c.on_node("DELETED", node_obj("n1", 1))
    assert c.state.bookings == {}
    c.on_node("ADDED", node_obj("n1", 1, mem=24576))
    assert set(c.state.bookings) == {"default/a", "default/b"}


def test_releases_finished_deleted_and_recreated_but_not_terminating() -> None:
    c = BindCache(Config())
    c.on_node("ADDED", node_obj("n1", 2))
    a = annotated("a", alloc("n1", "GPU-n1-00", 1000))
    c.on_pod("ADDED", a)
    a["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    c.on_pod("MODIFIED", a)
    assert "default/a" in c.state.bookings  # terminating: kept until gone
    c.on_pod("DELETED", annotated("a", alloc("n1", "GPU-n1-00", 1000), uid="other-uid"))
    assert "default/a" in c.state.bookings  # a DELETED of another pod with that name
    c.on_pod("DELETED", a)
    assert c.state.bookings == {}
    for phase in ("Succeeded", "Failed"):
        b = annotated("b", alloc("n1", "GPU-n1-01", 1000))
        c.on_pod("ADDED", b)
        assert "default/b" in c.state.bookings
        c.on_pod("MODIFIED", annotated("b", alloc("n1", "GPU-n1-01", 1000), phase=phase))
        assert c.state.bookings == {} and c.state.nodes["n1"].free_mem == [24576, 24576]
    # a new pod with the same name replaces the old booking even if the DELETED was missed
    c.on_pod("ADDED", annotated("d", alloc("n1", "GPU-n1-00", 1000), uid="u1"))
    c.on_pod("ADDED", annotated("d", alloc("n1", "GPU-n1-01", 2000), uid="u2"))
    assert c.booked_uid["default/d"] == "u2" and c.state.nodes["n1"].free_mem == [24576, 22576]
    # relist: pods that vanished are released
    c.replace_pods([])
    assert c.state.bookings == {} and c.pods == {}


def test_failed_bind_annotation_is_ignored_until_the_pod_is_bound() -> None:
    c = BindCache(Config())
    c.on_node("ADDED", node_obj("n1", 1))
    req = parse_pod(pod_obj("p", limits={"nvidia.com/gpumem": 1000}))
    r = c.reserve(req, "uid-p", "n1")
    assert not isinstance(r, str)
    booking, a = r
    assert c.release_if("default/p", booking, failed_uid="uid-p")
    assert not c.release_if("default/p", booking)
    c.on_pod("MODIFIED", annotated("p", a, uid="uid-p", bound=False))
    assert c.state.bookings == {}
    c.on_pod("MODIFIED", annotated("p", a, uid="uid-p", bound=True))
    assert "default/p" in c.state.bookings
    assert "already bound" in str(c.reserve(req, "uid-p", "n1"))


def test_node_availability_reasons() -> None:
    now = [1000.0]
    cfg = Config()
    c = BindCache(cfg, clock=lambda: now[0])
    c.on_node("ADDED", node_obj("n1", 1, heartbeat=1000.0))
    assert c.unavailable == {}
    now[0] = 1000.0 + cfg.scheduling.inventory_stale_seconds + 1
    c.refresh_availability()
    assert c.unavailable["n1"] == FitFailure(Code.STALE_INVENTORY, need=int(cfg.scheduling.inventory_stale_seconds))
    c.on_node("MODIFIED", node_obj("n1", 1, heartbeat=now[0]))
    assert c.unavailable == {}
    bad = node_obj("n1", 1, heartbeat=now[0])
    bad["metadata"]["annotations"][ANN_NODE_INVENTORY] = "{not json"
    c.on_node("MODIFIED", bad)
    assert c.unavailable["n1"].code is Code.BAD_INVENTORY and c.unavailable["n1"].detail
    gone = node_obj("n1", 1, heartbeat=now[0], inventory=False)
    c.on_node("MODIFIED", gone)
    assert c.unavailable["n1"].code is Code.NO_INVENTORY and not c.unavailable["n1"].resolvable
    req = parse_pod(pod_obj("p", limits={"nvidia.com/gpumem": 1000}))
    assert "no vGPU inventory" in str(c.reserve(req, "u", "n1"))
    ok, failed, _ = c.evaluate(req, ["n1", "nope"])
    assert ok == [] and {n: f.code for n, f in failed.items()} == {"n1": Code.NO_INVENTORY, "nope": Code.NO_INVENTORY}
    c.on_node("MODIFIED", node_obj("n1", 1, heartbeat=now[0], allocatable=0))
    assert c.unavailable["n1"] == FitFailure(Code.NO_ALLOCATABLE, detail="nvidia.com/gpu")


def test_policy_file_reload_keeps_last_good_config(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: binpack}\n")

    async def go() -> None:
        svc = SchedulerService(Config(), None, Options(config_path=str(path), config_poll=0.05))
        await svc.start()
        try:
            path.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: spread, gpuPolicy: binpack}\n")
            await wait_until(lambda: svc.cache.engine.node_policy == "spread", timeout=5)
            assert svc.config.scheduling.gpu_policy == "binpack" and svc.cache.engine.gpu_policy == "binpack"
            path.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: nope}\n")
            await wait_until(lambda: svc.metrics.config_ok._value.get() == 0, timeout=5)
            errs = svc.metrics.config_reload_errors.labels(key="scheduling.nodePolicy")._value.get()
            assert errs == 1
            assert svc.cache.engine.node_policy == "spread" and svc.config.scheduling.node_policy == "spread"
            path.write_text("apiVersion: kube-vgpu.io/v1\nscheduling: {nodePolicy: fgd}\n")
            await wait_until(lambda: svc.cache.engine.node_policy == "fgd", timeout=5)
            assert svc.metrics.config_ok._value.get() == 1
        finally:
            await svc.stop()
    run(go)


def test_fgd_shapes_from_live_pods_with_default_fallback() -> None:
    svc = offline_service([node_obj("n1", 4, mem=40000)])
    st = svc.cache.state
    assert shapes_from_state(st) == default_shapes()
    for i in range(30):
        st.book(f"default/p{i}", alloc("n1", f"GPU-n1-0{i % 4}", 10000 if i % 3 else 20000, 0), check=False)
    shapes = shapes_from_state(st)
    assert {(s.milli, s.num) for s in shapes} == {(250, 1), (500, 1)}
    assert abs(sum(s.p for s in shapes) - 1) < 1e-9
    assert not svc.refresh_shapes()  # binpack: shapes unused
    svc.cache.apply_config(Config(scheduling=type(Config().scheduling)(node_policy="fgd")))
    assert svc.refresh_shapes() and svc.cache.engine.shapes == shapes


def test_json_logs_carry_pod_node_gpu(capsys: object) -> None:
    rec = logging.LogRecord("kube_vgpu.scheduler", logging.INFO, __file__, 1, "bound", None, None)
    rec.__dict__.update(pod="default/p", node="n1", gpu="GPU-1")
    out = json.loads(jsonlog.JSONFormatter().format(rec))
    assert out["msg"] == "bound" and out["pod"] == "default/p" and out["node"] == "n1" and out["gpu"] == "GPU-1"
    assert out["level"] == "info" and out["ts"].endswith("Z")


def test_reasons_aggregate_like_kube_scheduler() -> None:
    msg = aggregate(["needs 8192 MiB", "needs 8192 MiB", "needs 4 GPUs, node has 2"], 5)
    assert msg == "2/5 nodes are available: 2 needs 8192 MiB; 1 needs 4 GPUs, node has 2."


def test_relist_that_predates_our_patch_keeps_the_booking() -> None:
    now = [100.0]
    c = BindCache(Config(), clock=lambda: now[0])
    c.on_node("ADDED", node_obj("n1", 1, heartbeat=100.0))
    req = parse_pod(pod_obj("p", limits={"nvidia.com/gpumem": 1000}))
    r = c.reserve(req, "uid-p", "n1")
    assert not isinstance(r, str)
    c.record_bound("default/p", "uid-p", r[0])
    c.replace_pods([])  # snapshot taken before our patch landed
    assert "default/p" in c.state.bookings
    now[0] += 60
    c.replace_pods([])  # still absent a minute later: really gone
    assert c.state.bookings == {}


def test_annotation_is_checked_against_the_pods_request(caplog: object) -> None:
    import pytest
    assert isinstance(caplog, pytest.LogCaptureFixture)
    caplog.set_level(logging.WARNING, logger="kube_vgpu.cluster")
    c = BindCache(Config())
    c.on_node("ADDED", node_obj("n1", 2, mem=24576))

    def pod(name: str, text: str, **limits: object) -> dict:
        p = pod_obj(name, limits=limits, annotations={ANN_ALLOCATION: text})
        p["spec"]["nodeName"] = "n1"
        return p

    def raw(mem: object, cores: object = 0, uuid: str = "GPU-n1-00", node: str = "n1") -> str:
        return json.dumps({"v": 1, "node": node, "t": 1.0, "containers": [
            {"name": "c", "init": False, "devices": [{"uuid": uuid, "mem": mem, "cores": cores}]}]})

    def usage(key: str) -> dict[str, tuple[int, int, int]]:
        return c.state.bookings[key].allocation.usage()

    # honest: booked as annotated, no warning
    c.on_pod("ADDED", pod("ok", encode_allocation(alloc("n1", "GPU-n1-00", 8000, 20)), **{
        "nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 20}))
    assert usage("default/ok") == {"GPU-n1-00": (8000, 20, 1)} and not caplog.records
    # mem 1 / cores 0 against a request of 8000 MiB / 20 %: the request is booked, with a warning
    c.on_pod("ADDED", pod("a", raw(1), **{"nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 20}))
    assert usage("default/a") == {"GPU-n1-00": (8000, 20, 1)}
    assert any(getattr(r, "pod", "") == "default/a" and getattr(r, "node", "") == "n1" for r in caplog.records)
    # more than the request is kept (never less than either says)
    c.on_pod("ADDED", pod("big", raw(9000, 50), **{"nvidia.com/gpumem": 8000}))
    assert usage("default/big") == {"GPU-n1-00": (9000, 50, 1)}
    # refused by the codec (negative): nothing is read from it, nothing booked
    c.on_pod("ADDED", pod("neg", raw(-50000), **{"nvidia.com/gpumem": 4000}))
    assert "default/neg" not in c.state.bookings
    # unknown GPU, fewer GPUs than requested, another node: completed with the node's GPUs
    c.on_pod("ADDED", pod("gone", raw(4000, uuid="GPU-other"), **{"nvidia.com/gpu": 2, "nvidia.com/gpumem": 4000}))
    assert usage("default/gone") == {"GPU-n1-00": (4000, 0, 1), "GPU-n1-01": (4000, 0, 1)}
    c.on_pod("ADDED", pod("moved", raw(4000, node="n2"), **{"nvidia.com/gpumem": 4000}))
    assert c.state.bookings["default/moved"].node == "n1"
    # a request that cannot be parsed: the annotation's values, never below zero
    c.on_pod("ADDED", pod("odd", raw(500, 10), **{"nvidia.com/gpumem": "lots"}))
    assert usage("default/odd") == {"GPU-n1-00": (500, 10, 1)}
    c.on_pod("ADDED", pod("odd2", raw(-500, "x"), **{"nvidia.com/gpumem": "lots"}))
    assert "default/odd2" not in c.state.bookings
    # a live booking whose annotation turns invalid keeps its booking
    c.on_pod("MODIFIED", pod("ok", raw(-1), **{"nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 20}))
    assert usage("default/ok") == {"GPU-n1-00": (8000, 20, 1)}
    n = c.state.nodes["n1"]
    assert n.free_mem[0] == 24576 - sum(usage(k).get("GPU-n1-00", (0, 0, 0))[0] for k in c.state.bookings)


def test_json_log_handler_follows_sys_stderr(monkeypatch: object) -> None:
    """jsonlog.setup in-process (the CLI under test) must not keep a stream that is swapped out
    and closed later (pytest's capture): it writes to whatever sys.stderr is at each record."""
    import io
    import sys

    import pytest
    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    jsonlog.setup("info")
    logging.getLogger("kube_vgpu.scheduler").info("one", extra={"port": 1})
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    errors: list[str] = []
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(record.getMessage()))
    logging.getLogger("kube_vgpu.scheduler").info("two", extra={"port": 2})
    assert errors == []
    out = json.loads(second.getvalue())
    assert out["msg"] == "two" and out["port"] == 2


_FAILURES = [FitFailure(Code.NO_INVENTORY), FitFailure(Code.INSUFFICIENT_MEMORY, "c", count=1, need=20000, have=1155),
             FitFailure(Code.TOO_FEW_GPUS, "c", count=3, need=3, have=2), FitFailure(Code.COMPUTE_FULL, "c", have=2),
             FitFailure(Code.STALE_INVENTORY, need=120)]


@given(st.dictionaries(st.sampled_from([f"n{i}" for i in range(12)]), st.sampled_from(_FAILURES)))
def test_summaries_partition_failures_by_resolvability(failed: dict[str, FitFailure]) -> None:
    res, unres = summaries(failed)
    assert set(res) | set(unres) == set(failed) and not set(res) & set(unres)
    assert all(failed[n].resolvable for n in res) and not any(failed[n].resolvable for n in unres)
    assert {n: failed[n].code for n in unres} == {n: f.code for n, f in failed.items()
                                                  if f.code in (Code.NO_INVENTORY, Code.TOO_FEW_GPUS,
                                                                Code.STALE_INVENTORY)}
