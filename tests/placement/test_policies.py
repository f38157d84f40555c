"""Each policy's choice on small hand-made clusters, the right answer asserted."""

from __future__ import annotations

import pytest

from kube_vgpu.placement import ClusterState, Engine, FragModel, TaskShape, normalise_scores, typical_shapes
from kube_vgpu.placement.policies import fgd_score

from .helpers import engine, gpu_used, gpus, place, pod, req


def _two_nodes(policy: str, gpu_policy: str = "spread") -> Engine:
    e = engine({"a": gpus("a", [16000, 16000]), "b": gpus("b", [16000, 16000])}, policy, gpu_policy)
    assert place(e, pod("seed", {"gpumem": 8000, "gpucores": 50})) is not None  # lands on a (index tie-break)
    assert gpu_used(e, "a")[0][0] + gpu_used(e, "a")[1][0] == 8000
    return e


def test_node_binpack_prefers_the_used_node() -> None:
    e = _two_nodes("binpack")
    d = e.choose(req(pod("p", {"gpumem": 1000})))
    assert d is not None and d.node == "a"


def test_node_spread_prefers_the_empty_node() -> None:
    e = _two_nodes("spread")
    d = e.choose(req(pod("p", {"gpumem": 1000})))
    assert d is not None and d.node == "b"


def test_gpu_binpack_and_spread_choose_the_gpu() -> None:
    e = engine({"a": gpus("a", [16000, 16000])}, "binpack", "binpack")
    place(e, pod("seed", {"gpumem": 4000}))
    alloc = place(e, pod("p", {"gpumem": 1000}))
    assert alloc is not None and alloc.containers[0].devices[0].uuid == "GPU-a-0"
    e = engine({"a": gpus("a", [16000, 16000])}, "binpack", "spread")
    place(e, pod("seed", {"gpumem": 4000}))
    alloc = place(e, pod("p", {"gpumem": 1000}))
    assert alloc is not None and alloc.containers[0].devices[0].uuid == "GPU-a-1"


def test_per_pod_annotation_overrides_policy() -> None:
    e = _two_nodes("binpack")
    p = pod("p", {"gpumem": 1000}, annotations={"hami.io/node-scheduler-policy": "spread"})
    d = e.choose(req(p))
    assert d is not None and d.node == "b"


def test_bestfit_takes_the_smallest_fitting_gpu() -> None:
    e = engine({"a": gpus("a", [16000, 16000])}, "bestfit")
    place(e, pod("x", {"gpumem": 12000, "gpucores": 75}))  # GPU 0 has 25% left
    alloc = place(e, pod("p", {"gpumem-percentage": 20, "gpucores": 20}))
    assert alloc is not None and alloc.containers[0].devices[0].uuid == "GPU-a-0"


def test_dotprod_prefers_less_free_node() -> None:
    e = _two_nodes("dotprod")
    d = e.choose(req(pod("p", {"gpumem": 1000, "gpucores": 10})))
    assert d is not None and d.node == "a"


SHAPES = [TaskShape(0, 500, 1, frozenset(), 0.5), TaskShape(0, 1000, 1, frozenset(), 0.5)]


def test_frag_model_follows_the_rule() -> None:
    fm = FragModel(SHAPES)
    # one GPU with 300 free: too small for both shapes -> all of it is fragment
    assert fm.frag(len(fm.cpu_levels), (300,), "m") == pytest.approx(300)
    # (600, 1000): 500-shape fits both (no fragment); 1000-shape: the 600 GPU is fragment
    assert fm.frag(len(fm.cpu_levels), (600, 1000), "m") == pytest.approx(0.5 * 600)
    # CPU-only shapes count every free milli
    fm2 = FragModel([TaskShape(1000, 0, 0, frozenset(), 1.0)])
    assert fm2.frag(1, (1000, 200), "m") == pytest.approx(1200)
    # model constraint: shape for another model sees only fragment
    fm3 = FragModel([TaskShape(0, 500, 1, frozenset({"V100"}), 1.0)])
    assert fm3.frag(1, (1000,), "T4") == pytest.approx(1000)
    assert fm3.frag(1, (1000,), "V100") == pytest.approx(0)


def test_fgd_puts_a_half_gpu_task_next_to_another_half() -> None:
    st = ClusterState()
    st.set_node("a", gpus("a", [10000, 10000]))
    st.set_node("b", gpus("b", [10000, 10000]))
    e = Engine(st, "fgd", shapes=SHAPES)
    first = place(e, pod("x", {"gpumem-percentage": 50, "gpucores": 50}))
    assert first is not None and first.node == "a"
    # second half-GPU task: FGD fills the half-used GPU (leaves a whole GPU free on a)
    second = place(e, pod("y", {"gpumem-percentage": 50, "gpucores": 50}))
    assert second is not None and second.node == "a"
    assert second.containers[0].devices[0].uuid == first.containers[0].devices[0].uuid
    # a 30% task goes where it creates the least fragment: not onto a fresh GPU of b
    third = place(e, pod("z", {"gpumem-percentage": 30, "gpucores": 30}))
    assert third is not None and third.node == "a"


def test_fgd_score_is_the_artifact_sigmoid() -> None:
    assert fgd_score(1000.0, 1000.0) == 50
    assert fgd_score(1000.0, 0.0) == 73  # sigmoid(1) = 0.731
    assert fgd_score(0.0, 1000.0) == 26
    assert fgd_score(0.0, 1e9) == 0 and fgd_score(1e9, 0.0) == 100


def test_typical_shapes_cover_95_percent() -> None:
    tasks = [(0, 500, 1, ())] * 60 + [(0, 1000, 1, ())] * 36 + [(0, 250, 1, ())] * 4
    shapes = typical_shapes(tasks)
    assert [(s.milli, round(s.p, 4)) for s in shapes] == [(500, round(60 / 96, 4)), (1000, round(36 / 96, 4))]
    with pytest.raises(ValueError):
        typical_shapes([])


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="allowed"):
        engine({}, "worst")
    with pytest.raises(ValueError, match="shapes"):
        engine({}, "fgd")


def test_normalise_scores_maps_to_0_10() -> None:
    assert normalise_scores({"a": -3.0, "b": 1.0, "c": -1.0}) == {"a": 0, "b": 10, "c": 5}
    assert normalise_scores({"a": 2.0, "b": 2.0}) == {"a": 10, "b": 10}
    assert normalise_scores({}) == {}


def test_cache_follows_bookings_incrementally() -> None:
    e = engine({f"n{i}": gpus(f"n{i}", [10000]) for i in range(50)}, "binpack")
    r = req(pod("probe", {"gpumem": 6000}))
    ok, _, _ = e.evaluate(r)
    assert len(ok) == 50
    place(e, pod("big", {"gpumem": 5000}))  # lands on n0
    ok, failed, _ = e.evaluate(r)
    assert len(ok) == 49 and (failed["n0"].need, failed["n0"].have) == (6000, 5000)
    e.release("ns/big")
    assert len(e.evaluate(r)[0]) == 50
