"""Known failures of other GPU-sharing systems (shared/reference/known-failures.md), scheduler side."""

from __future__ import annotations

import pytest

from kube_vgpu import codec
from kube_vgpu.errors import RequestError
from kube_vgpu.placement import Code

from .helpers import engine, gpu_used, gpus, place, pod, req


def test_kf01_bare_gpu_books_whole_card_no_sentinel() -> None:
    e = engine({"n1": gpus("n1", [24576], split=10)})
    alloc = place(e, pod("p", {"gpu": 1}))
    assert alloc is not None
    (c,) = alloc.containers
    assert [(d.memory_mib, d.cores) for d in c.devices] == [(24576, 100)]
    assert gpu_used(e, "n1") == [(24576, 100, 1)]
    text = codec.encode_allocation(alloc)
    assert "101" not in text and "-1" not in text
    assert codec.decode_allocation(text) == alloc


def test_kf02_unsatisfiable_requests_give_reasons_and_keep_serving() -> None:
    e = engine({"n1": gpus("n1", [24576, 24576])})
    ok, failed, _ = e.evaluate(req(pod("p4", {"gpu": 4})))
    assert ok == []
    f = failed["n1"]
    assert (f.code, f.container, f.count, f.need, f.have, f.resolvable) == (Code.TOO_FEW_GPUS, "c0", 4, 4, 2, False)
    ok, failed, _ = e.evaluate(req(pod("pbig", {"gpu": 1, "gpumem": 999999})))
    assert ok == []
    f = failed["n1"]
    assert (f.code, f.need, f.have, f.gpu, f.resolvable) == (Code.INSUFFICIENT_MEMORY, 999999, 24576, 0, True)
    # still serving: a fitting pod is placed afterwards
    assert place(e, pod("small", {"gpu": 1, "gpumem": 1000})) is not None


def test_kf03_gpu_counts_physical_gpus_not_slices() -> None:
    e = engine({"n1": gpus("n1", [16384, 16384], split=16)})
    ok, failed, _ = e.evaluate(req(pod("p", {"gpu": 5, "gpumem": 1000})))
    assert ok == []
    assert (failed["n1"].code, failed["n1"].need, failed["n1"].have) == (Code.TOO_FEW_GPUS, 5, 2)


def test_kf04_two_containers_never_overbook_one_gpu() -> None:
    e = engine({"n1": gpus("n1", [10240, 10240])})
    alloc = place(e, pod("p", {"gpu": 1, "gpumem": 10240}, {"gpu": 1, "gpumem": 1024}))
    assert alloc is not None
    u0 = alloc.containers[0].devices[0].uuid
    u1 = alloc.containers[1].devices[0].uuid
    assert u0 != u1
    assert sorted(m for m, _, _ in gpu_used(e, "n1")) == [1024, 10240]
    assert all(m <= 10240 for m, _, _ in gpu_used(e, "n1"))


def test_kf05_init_containers_book_their_peak_not_sum() -> None:
    e = engine({"n1": gpus("n1", [16384])})
    p = pod("p", {"gpu": 1, "gpumem": 4096}, init=[{"gpu": 1, "gpumem": 10240}] * 3)
    alloc = place(e, p)
    assert alloc is not None
    assert gpu_used(e, "n1") == [(10240, 0, 1)]
    assert [c.init for c in alloc.containers] == [True, True, True, False]
    # after it, 6144 MiB are free: a 6144 pod fits, a 6145 one does not
    ok, _, _ = e.evaluate(req(pod("q", {"gpu": 1, "gpumem": 6145})))
    assert ok == []
    assert place(e, pod("r", {"gpu": 1, "gpumem": 6144})) is not None


def test_kf06_allocation_is_recorded_by_container_name() -> None:
    e = engine({"n1": gpus("n1", [16384])})
    p = pod("p", {"gpu": 1, "gpumem": 4000})
    p["spec"]["initContainers"] = [{"name": "setup", "image": "busybox"}]
    p["spec"]["containers"][0]["name"] = "app"
    alloc = place(e, p)
    assert alloc is not None
    assert alloc.container("setup", init=True) is None
    app = alloc.container("app")
    assert app is not None and app.devices[0].memory_mib == 4000
    decoded = codec.decode_allocation(codec.encode_allocation(alloc))
    assert decoded.container("app") == app


def test_kf08_exclusive_holder_blocks_sharers_and_waits_for_idle_card() -> None:
    e = engine({"n1": gpus("n1", [16384], split=3)})
    a = pod("a", {"gpu": 1, "gpumem": 1000, "gpucores": 100})
    b = pod("b", {"gpu": 1, "gpumem": 1000})
    assert place(e, a) is not None
    ok, failed, _ = e.evaluate(req(b))
    assert ok == [] and (failed["n1"].code, failed["n1"].have) == (Code.COMPUTE_FULL, 1)
    # reverse order
    e2 = engine({"n1": gpus("n1", [16384], split=3)})
    assert place(e2, b) is not None
    ok, failed, _ = e2.evaluate(req(a))
    assert ok == [] and (failed["n1"].code, failed["n1"].need, failed["n1"].have) == (Code.EXCLUSIVE_BUSY, 1, 1)


def test_kf12_release_frees_everything_for_the_next_pod() -> None:
    e = engine({"n1": gpus("n1", [16384] * 8)})
    a = req(pod("a", {"gpu": 8}))
    d = e.choose(a)
    assert d is not None
    e.book(a, e.allocation(a, d.node, d.plan))
    b = req(pod("b", {"gpu": 8}))
    assert e.choose(b) is None
    assert e.release(a.key) is not None
    assert gpu_used(e, "n1") == [(0, 0, 0)] * 8
    d2 = e.choose(b)
    assert d2 is not None and d2.node == "n1"
    assert e.release("ns/never-booked") is None  # releasing twice / unknown is a no-op


@pytest.mark.parametrize("value", ["0", 0])
def test_kf17_zero_percentage_is_rejected_never_books_zero(value: object) -> None:
    with pytest.raises(RequestError) as ei:
        req(pod("p", {"gpu": 1, "gpumem-percentage": value}))
    assert ei.value.resource == "nvidia.com/gpumem-percentage"
    assert "1..100" in str(ei.value) and "c0" in str(ei.value)


@pytest.mark.parametrize("value", ["99.1", "50m"])
def test_kf18_fractional_percentages_are_rejected(value: str) -> None:
    with pytest.raises(RequestError) as ei:
        req(pod("p", {"gpu": 1, "gpumem-percentage": value}))
    msg = str(ei.value)
    assert value in msg and "whole number" in msg and "nvidia.com/gpumem-percentage" in msg


def test_kf32_fit_is_per_gpu_never_node_sum() -> None:
    e = engine({"n1": gpus("n1", [7168])})
    ok, failed, _ = e.evaluate(req(pod("p", {"gpumem": 8192})))
    assert ok == []
    assert (failed["n1"].code, failed["n1"].need, failed["n1"].have) == (Code.INSUFFICIENT_MEMORY, 8192, 7168)
    e2 = engine({"n1": gpus("n1", [7168, 7168])})  # 14 GiB in sum, still no single GPU fits
    ok, _, _ = e2.evaluate(req(pod("p", {"gpumem": 8192})))
    assert ok == []


@pytest.mark.parametrize(("value", "fragment"), [("1Gi", "write 3000, not 3Gi"), ("9" * 40, "1..1048576")])
def test_gpumem_in_bytes_or_absurd_is_rejected(value: str, fragment: str) -> None:
    with pytest.raises(RequestError) as ei:
        req(pod("p", {"gpu": 1, "gpumem": value}))
    assert ei.value.resource == "nvidia.com/gpumem" and fragment in str(ei.value)


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda p: p["spec"].__setitem__("containers", ["x"]), "spec.containers[0]"),
    (lambda p: p["spec"]["containers"][0].__setitem__("resources", "x"), "resources"),
    (lambda p: p["spec"]["containers"][0]["resources"].__setitem__("limits", ["a"]), "resources.limits"),
    (lambda p: p["metadata"].__setitem__("annotations", ["a"]), "metadata.annotations"),
    (lambda p: p["metadata"]["annotations"].__setitem__("nvidia.com/use-gputype", ["A100"]),
     "metadata.annotations[nvidia.com/use-gputype]"),
    (lambda p: p["spec"].__setitem__("initContainers", {"a": 1}), "spec.initContainers"),
])
def test_malformed_pod_shapes_raise_request_error(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    from kube_vgpu.podspec import pod_asks
    from kube_vgpu.resources import ResourceNames

    p = pod("p", {"gpu": 1, "gpumem": 1000})
    mutate(p)
    with pytest.raises(RequestError) as ei:
        req(p)
    assert ei.value.resource == field
    assert "allowed" in str(ei.value)
    assert pod_asks(p, ResourceNames()) in (True, False)  # never raises
