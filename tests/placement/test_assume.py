"""Promises ("assume"): capacity held for a pod between its decision and its bind."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.placement import Code, FitFailure, Plan

from .helpers import engine, gpu_used, gpus, pod, req


def test_a_promise_is_taken_by_the_next_decision_and_ends_with_the_booking() -> None:
    e = engine({"n1": gpus("n1", [10000]), "n2": gpus("n2", [10000])})
    a, b = req(pod("a", {"gpumem": 6000})), req(pod("b", {"gpumem": 6000}))
    d = e.choose(a)
    assert d is not None and e.assume_on(a, "uid-a", d.node, expires=30.0) is not None
    assert gpu_used(e, d.node) == [(6000, 0, 1)]
    ok, failed, _ = e.evaluate(b)  # the promised capacity is taken for b
    assert ok == [n for n in ("n1", "n2") if n != d.node]
    assert (failed[d.node].code, failed[d.node].have) == (Code.INSUFFICIENT_MEMORY, 4000)
    # a's bind: plan_for releases a's own promise first, then the booking replaces it
    plan = e.plan_for(a, d.node)
    assert isinstance(plan, Plan) and not e.state.assumed
    e.book(a, e.allocation(a, d.node, plan))
    assert gpu_used(e, d.node) == [(6000, 0, 1)] and not e.state.assumed


def test_bind_elsewhere_releases_the_promise_and_plans_on_the_chosen_node() -> None:
    e = engine({"n1": gpus("n1", [10000]), "n2": gpus("n2", [10000])})
    a = req(pod("a", {"gpumem": 6000}))
    assert e.assume_on(a, "uid-a", "n1", expires=30.0) is not None
    plan = e.plan_for(a, "n2")  # kube-scheduler chose n2
    assert isinstance(plan, Plan)
    e.book(a, e.allocation(a, "n2", plan))
    assert gpu_used(e, "n1") == [(0, 0, 0)] and gpu_used(e, "n2") == [(6000, 0, 1)]


def test_promises_expire_and_leave_nothing_behind() -> None:
    e = engine({"n1": gpus("n1", [10000] * 2)})
    before = e.state.nodes["n1"].signature()
    for i, t in enumerate((10.0, 20.0, 30.0)):
        assert e.assume_on(req(pod(f"p{i}", {"gpumem": 3000})), f"u{i}", "n1", expires=t) is not None
    assert e.state.expire_assumed(9.9) == 0 and len(e.state.assumed) == 3
    assert e.state.expire_assumed(20.0) == 2 and list(e.state.assumed) == ["ns/p2"]
    assert e.state.expire_assumed(1e9) == 1
    assert e.state.nodes["n1"].signature() == before


def test_a_promise_never_overcommits_and_a_newer_one_replaces_the_old() -> None:
    e = engine({"n1": gpus("n1", [10000]), "n2": gpus("n2", [10000])})
    a, b = req(pod("a", {"gpumem": 6000})), req(pod("b", {"gpumem": 6000}))
    assert e.assume_on(a, "uid-a", "n1", 30.0) is not None
    assert e.assume_on(b, "uid-b", "n1", 30.0) is None  # does not fit beside a's promise
    assert e.assume_on(a, "uid-a", "n2", 30.0) is not None  # a's new cycle: one promise per pod
    assert gpu_used(e, "n1") == [(0, 0, 0)] and gpu_used(e, "n2") == [(6000, 0, 1)]
    assert e.assume_on(b, "uid-b", "n1", 30.0) is not None


def test_no_promise_for_a_booked_pod_and_release_ends_a_promise() -> None:
    e = engine({"n1": gpus("n1", [10000])})
    a = req(pod("a", {"gpumem": 2000}))
    plan = e.plan_for(a, "n1")
    assert isinstance(plan, Plan)
    e.book(a, e.allocation(a, "n1", plan))
    assert e.assume_on(a, "uid-a", "n1", 30.0) is None and not e.state.assumed
    b = req(pod("b", {"gpumem": 2000}))
    assert e.assume_on(b, "uid-b", "n1", 30.0) is not None
    assert e.release(b.key) is None and not e.state.assumed  # deleted before its bind
    assert gpu_used(e, "n1") == [(2000, 0, 1)]


def test_inventory_change_or_node_removal_ends_its_promises() -> None:
    e = engine({"n1": gpus("n1", [10000]), "n2": gpus("n2", [10000])})
    assert e.assume_on(req(pod("a", {"gpumem": 2000})), "ua", "n1", 30.0) is not None
    assert e.assume_on(req(pod("b", {"gpumem": 2000})), "ub", "n2", 30.0) is not None
    e.state.set_node("n1", gpus("n1", [20000]))
    e.state.remove_node("n2")
    assert not e.state.assumed and gpu_used(e, "n1") == [(0, 0, 0)]


def test_the_number_of_promises_is_bounded() -> None:
    e = engine({"n1": gpus("n1", [100000], split=1000)})
    e.state.max_assumed = 5
    for i in range(12):
        assert e.assume_on(req(pod(f"p{i}", {"gpumem": 10})), f"u{i}", "n1", 30.0) is not None
    assert list(e.state.assumed) == [f"ns/p{i}" for i in range(7, 12)]
    assert gpu_used(e, "n1") == [(50, 0, 5)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["assume", "book", "release", "expire"]), st.integers(0, 5),
                          st.sampled_from([1000, 3000, 7000]), st.sampled_from(["n1", "n2"])), max_size=40))
def test_promises_and_bookings_never_overcommit_and_leave_no_trace(ops: list[tuple[str, int, int, str]]) -> None:
    e = engine({"n1": gpus("n1", [10000, 8000], split=2), "n2": gpus("n2", [12000], split=3)})
    empty = {n: e.state.nodes[n].signature() for n in ("n1", "n2")}
    t = 0.0
    for op, k, mib, node in ops:
        r = req(pod(f"p{k}", {"gpumem": mib}))
        t += 1.0
        if op == "assume":
            e.assume_on(r, f"u{k}", node, t + 3.0)
        elif op == "book" and r.key not in e.state.bookings:
            plan = e.plan_for(r, node)
            if isinstance(plan, Plan):
                e.book(r, e.allocation(r, node, plan))
            else:
                assert isinstance(plan, FitFailure)
        elif op == "release":
            e.release(r.key)
        else:
            e.state.expire_assumed(t)
        for n in e.state.node_list:
            assert all(x >= 0 for x in n.free_mem + n.free_cores + n.free_slots)
    for key in list(e.state.bookings):
        e.release(key)
    e.state.expire_assumed(1e18)
    assert {n: e.state.nodes[n].signature() for n in ("n1", "n2")} == empty
