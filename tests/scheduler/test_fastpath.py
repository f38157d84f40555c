"""The extender's vectorised evaluation gives exactly the engine's answers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, PodAllocation
from kube_vgpu.placement import ClusterState, Engine, normalise_scores
from kube_vgpu.placement.fastpath import ExtenderEngine, normalise_array
from kube_vgpu.podspec import parse_pod

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=60))
@settings(max_examples=300, deadline=None)
def test_normalise_array_equals_normalise_scores(values: list[float]) -> None:
    want = normalise_scores({f"n{i}": v for i, v in enumerate(values)})
    got = normalise_array(np.array(values, dtype=np.float64)).tolist()
    assert got == [want[f"n{i}"] for i in range(len(values))]


def _cluster(seed: int, n_nodes: int) -> list[tuple[str, tuple[GPUDevice, ...], list[PodAllocation]]]:
    rnd = np.random.default_rng(seed)
    out = []
    for k in range(n_nodes):
        name = f"n{k}"
        gpus = int(rnd.integers(1, 5))
        devs = tuple(GPUDevice(f"GPU-{seed:04d}{k:04d}-{g:04d}", g, "NVIDIA A100", 40960, 100, 4) for g in range(gpus))
        allocs = []
        for _ in range(int(rnd.integers(0, 4))):
            g = devs[int(rnd.integers(0, gpus))]
            allocs.append(PodAllocation(name, (ContainerAllocation("c", False, (
                DeviceBooking(g.uuid, int(rnd.integers(1, 16)) * 1024, int(rnd.integers(0, 4)) * 10),)),)))
        out.append((name, devs, allocs))
    return out


@given(st.integers(0, 10_000), st.integers(1, 12), st.sampled_from([
    {"nvidia.com/gpumem": "8000"}, {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "30000"}, {"nvidia.com/gpu": "1"},
    {"nvidia.com/gpu": "3"}, {"nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "40"}]),
    st.sampled_from(["binpack", "spread"]))
@settings(max_examples=80, deadline=None)
def test_evaluate_names_equals_engine_evaluate(seed: int, n_nodes: int, limits: dict[str, str], policy: str) -> None:
    states = (ClusterState(), ClusterState())
    ref = Engine(states[0], policy, "spread")
    fast = ExtenderEngine(states[1], policy, "spread", vector_min=0)  # every changed node vectorised
    for name, devs, allocs in _cluster(seed, n_nodes):
        for s in states:
            s.set_node(name, devs)
            for i, a in enumerate(allocs):
                s.book(f"{name}/p{i}", a, check=False)
    pod = parse_pod({"metadata": {"name": "p", "namespace": "d"},
                     "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}})
    names = [f"n{k}" for k in range(n_nodes)][::-1] + ["unknown"]
    for _ in range(2):  # second round hits the caches
        assert fast.evaluate_names(pod, names) == ref.evaluate(pod, names)
        sc = fast.score_array(pod, names)
        _ok, _failed, scores = ref.evaluate(pod, names)
        assert [scores.get(n, -np.inf) for n in names] == sc.tolist()


@given(st.lists(st.sampled_from(["a", "b", "a\x00b", "b\x00a", "", "\x00", "zz"]), min_size=0, max_size=6),
       st.lists(st.sampled_from(["a", "b", "a\x00b", "b\x00a", "", "\x00", "zz"]), min_size=0, max_size=6))
@settings(max_examples=300, deadline=None)
def test_remembered_lists_never_confuse_names_that_join_alike(first: list[str], second: list[str]) -> None:
    """Candidate lists are remembered by their NUL-joined names; a name holding a NUL (never a
    real node name, but a client can send one) must not make one list answer for another."""
    st_ = ClusterState()
    for name in ("a", "b", "zz"):
        st_.set_node(name, (GPUDevice(f"GPU-{name}", 0, "NVIDIA A100", 40960, 100, 4),))
    fast = ExtenderEngine(st_, "binpack", "spread")
    want = {n.name: n.idx for n in st_.node_list}
    for names in (first, second, first):
        assert fast._lookup(names)[0].idx.tolist() == [want.get(n, -1) for n in names]


def test_the_fast_path_uses_only_the_engines_public_api() -> None:
    """ExtenderEngine reaches the engine through public methods only: no private attribute of
    Engine is read or called from kube_vgpu/placement/fastpath.py."""
    import ast
    import inspect

    from kube_vgpu.placement import fastpath

    private = {n for n in vars(Engine) if n.startswith("_") and not n.startswith("__")}
    probe = Engine(ClusterState())
    private |= {n for n in vars(probe) if n.startswith("_")} if hasattr(probe, "__dict__") else set()
    used = {node.attr for node in ast.walk(ast.parse(inspect.getsource(fastpath)))
            if isinstance(node, ast.Attribute)}
    assert private and not (used & private), used & private
