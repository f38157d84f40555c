"""The replay's models of kube-scheduler's DRA path (kube_vgpu/placement/draalloc.py, replay/dra.py):
first fit in the allocator's order, GPU-blind node scores, the scan window, the mitigations, their
registration, and their ordering on a subset of the Alibaba trace."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kube_vgpu import config, podspec
from kube_vgpu.errors import RequestError
from kube_vgpu.model import Constraints, PodAllocation, PodRequest
from kube_vgpu.placement import ClusterState, Engine, FitFailure, Plan
from kube_vgpu.placement.draalloc import balanced_allocation, least_allocated, nodes_to_find
from kube_vgpu.policyregistry import DRA_MODEL_SPECS, DRA_MODELS, NODE_POLICIES, node_policy, replay_policies
from kube_vgpu.resources import ANN_NODE_POLICY
from replay import main as sim
from replay.dra import ScanWindow, placer, window_of
from replay.trace import TraceNode, TracePod, load_nodes, load_pods, make_devices, make_request

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"


def trace_pod(name: str, milli: int, num: int = 1, cpu: int = 4000, mem: int = 8192) -> PodRequest:
    return make_request(name, cpu, mem, num, milli, ())


def cluster(*nodes: tuple[str, int, int, int]) -> ClusterState:
    """Nodes (name, GPUs, CPU millicores, host MiB) of T4 GPUs."""
    st = ClusterState()
    for name, n, cpu, mem in nodes:
        st.set_node(name, make_devices(name, n, "T4"), cpu, mem)
    return st


def engine(st: ClusterState, policy: str) -> Engine:
    return Engine(st, policy, "spread", shapes=sim.shapes_of([TracePod("s", 4000, 8192, 1, 500, (), trace_pod("s", 500))]))


def book(e: Engine, pod: PodRequest, node: str, gpus: list[int]) -> None:
    """Book ``pod`` on ``node``'s GPUs ``gpus`` (set up a state by hand)."""
    n = e.state.nodes[node]
    req = pod.app[0]
    plan = Plan((tuple((i, req.memory_on(n.devices[i]), req.cores_on(n.devices[i])) for i in gpus),))
    e.book(pod, e.allocation(pod, node, plan, 0.0))


def gpus_of(a: PodAllocation | None) -> tuple[str, list[int]]:
    assert a is not None
    return a.node, [int(b.uuid.rsplit("-", 1)[1]) for c in a.containers for b in c.devices]


# -- the allocator's first fit -----------------------------------------------------------------

def test_devices_are_first_fit_in_index_order() -> None:
    e = engine(cluster(("n", 3, 64000, 262144)), "dra-allocator")
    place = placer(e, "dra-allocator")
    assert gpus_of(place(trace_pod("a", 400))) == ("n", [0])
    assert gpus_of(place(trace_pod("b", 400))) == ("n", [0])
    assert gpus_of(place(trace_pod("c", 400))) == ("n", [1])   # GPU 0 has 200 left
    assert gpus_of(place(trace_pod("d", 200))) == ("n", [0])   # the first that fits, not the emptiest
    assert gpus_of(place(trace_pod("e", 500, num=2))) == ("n", [1, 2])  # the first two that fit
    whole = trace_pod("w", 1000)
    assert isinstance(e.policy(whole).evaluate(e.state.nodes["n"], whole), FitFailure)


def test_uuid_selectors_are_not_shared_between_nodes_in_the_same_state() -> None:
    # the model's GPU fit is memoised on a node's GPU state; a pod that names a GPU by uuid must
    # not inherit another node's answer (two idle nodes, the pod allows only node-b's GPU 1)
    e = engine(cluster(("node-a", 2, 64000, 262144), ("node-b", 2, 64000, 262144)), "dra-allocator")
    pol = e.policy(trace_pod("p", 100))
    a, b = e.state.nodes["node-a"], e.state.nodes["node-b"]
    assert not isinstance(pol.evaluate(b, trace_pod("p", 100)), FitFailure)  # memo warm for this state
    pinned = replace(trace_pod("p", 100), constraints=Constraints(use_uuids=("GPU-node-b-1",)))
    assert isinstance(pol.evaluate(a, pinned), FitFailure)
    got = pol.evaluate(b, pinned)
    assert not isinstance(got, FitFailure) and got[1].containers == (((1, 1510, 10),),)


def test_bestfit_order_packs_the_least_free_gpu_where_first_fit_does_not() -> None:
    for policy, want in (("dra-allocator", [0]), ("dra-bestfit-order", [1])):
        e = engine(cluster(("n", 3, 64000, 262144)), policy)
        book(e, trace_pod("x", 500), "n", [0])
        book(e, trace_pod("y", 800), "n", [1])
        assert gpus_of(placer(e, policy)(trace_pod("p", 200))) == ("n", want), policy


# -- GPU-blind node choice and the mitigations -------------------------------------------------

def _two_nodes(policy: str, busy_cpu: int) -> Engine:
    """node-a: one GPU half used and ``busy_cpu`` of its 64 cores used by a CPU-only pod;
    node-b: idle."""
    e = engine(cluster(("node-a", 2, 64000, 262144), ("node-b", 2, 64000, 262144)), policy)
    book(e, trace_pod("half", 500, cpu=1000, mem=1024), "node-a", [0])
    cpu_only = make_request("cpu", busy_cpu, 1024, 0, 0, ())
    e.book(cpu_only, PodAllocation(node="node-a", containers=(), time=0.0))
    return e


def test_kube_scheduler_scores_are_gpu_blind() -> None:
    e = _two_nodes("dra-allocator", 8000)
    pod = trace_pod("p", 500)
    a, b = e.state.nodes["node-a"], e.state.nodes["node-b"]
    assert least_allocated(a, pod) < least_allocated(b, pod)
    assert balanced_allocation(a, pod) <= balanced_allocation(b, pod)
    # kube-scheduler's node: the idle one (less CPU used), opening a second GPU...
    assert gpus_of(placer(e, "dra-allocator")(pod)) == ("node-b", [0])
    # ...where FGD (extender path) and the extender on the DRA path fill the half-used GPU
    for policy in ("fgd-bestfit", "dra-extender-fgd"):
        e = _two_nodes(policy, 8000)
        assert gpus_of(placer(e, policy)(trace_pod("p", 500))) == ("node-a", [0]), policy


def test_prefer_in_use_moves_devices_and_nodes_within_its_weight() -> None:
    # on one node: the in-use GPU 1 rather than the first fit GPU 0
    for policy, want in (("dra-allocator", [0]), ("dra-prefer-in-use", [1])):
        e = engine(cluster(("n", 2, 64000, 262144)), policy)
        book(e, trace_pod("x", 300), "n", [1])
        assert gpus_of(placer(e, policy)(trace_pod("p", 200))) == ("n", want), policy
    # across nodes: the DynamicResources score (2 x (100 - 87) = 26 points) outweighs a small
    # CPU difference, not a large one
    assert gpus_of(placer(_two_nodes("dra-prefer-in-use", 8000), "dra-prefer-in-use")(
        trace_pod("p", 500))) == ("node-a", [0])
    assert gpus_of(placer(_two_nodes("dra-prefer-in-use", 48000), "dra-prefer-in-use")(
        trace_pod("p", 500))) == ("node-b", [0])
    assert gpus_of(placer(_two_nodes("dra-allocator", 8000), "dra-allocator")(
        trace_pod("p", 500))) == ("node-b", [0])


def test_extender_must_predict_the_allocators_gpu() -> None:
    # node-a: 600 and 300 milli free, node-b: 300 and 1000; a 300 pod. FGD itself would fill
    # node-a's GPU 1, but the allocator puts it on node-a's GPU 0 (first fit), leaving 300 + 300.
    # The extender that scores the allocator's choice sends it to node-b (fills GPU 0 exactly);
    # one that scores FGD's own choice sends it to node-a, where the allocator fragments it.
    def setup(policy: str) -> Engine:
        e = engine(cluster(("node-a", 2, 64000, 262144), ("node-b", 2, 64000, 262144)), policy)
        book(e, trace_pod("x", 400), "node-a", [0])
        book(e, trace_pod("y", 700), "node-a", [1])
        book(e, trace_pod("z", 700), "node-b", [0])
        return e
    assert gpus_of(placer(setup("dra-extender-fgd"), "dra-extender-fgd")(trace_pod("p", 300))) == ("node-b", [0])
    assert gpus_of(placer(setup("dra-extender-fgd-unaware"), "dra-extender-fgd-unaware")(
        trace_pod("p", 300))) == ("node-a", [0])
    assert gpus_of(placer(setup("fgd-bestfit"), "fgd-bestfit")(trace_pod("p", 300))) == ("node-a", [1])


def test_mostallocated_packs_the_busier_node() -> None:
    e = _two_nodes("dra-mostallocated", 8000)
    pod = trace_pod("p", 500)
    a = e.state.nodes["node-a"]  # 9,000 of 64,000 millicores and 2,048 MiB used; the pod adds 4,000 / 8,192
    assert least_allocated(a, pod, most=True) == (13000 * 100 // 64000 + 10240 * 100 // 262144) // 2
    assert least_allocated(a, pod) == ((64000 - 13000) * 100 // 64000 + (262144 - 10240) * 100 // 262144) // 2
    assert gpus_of(placer(e, "dra-mostallocated")(pod)) == ("node-a", [0])


def test_prefer_in_use_takes_the_second_subrequest_whole() -> None:
    # two GPUs wanted, one in use: the first subrequest (in-use GPUs only) cannot hold it, so the
    # second (any GPU) is allocated first fit: GPUs 0 and 1, not "in-use first" 2 and 0
    e = engine(cluster(("n", 3, 64000, 262144)), "dra-prefer-in-use")
    book(e, trace_pod("x", 300), "n", [2])
    assert gpus_of(placer(e, "dra-prefer-in-use")(trace_pod("p", 200, num=2))) == ("n", [0, 1])


# -- kube-scheduler's scan window --------------------------------------------------------------

@pytest.mark.parametrize(("pct", "n", "want"), [
    (0, 50, 50), (0, 150, 100), (0, 1213, 497), (0, 5000, 500), (0, 20000, 1000), (100, 1213, 1213),
    (10, 1213, 121), (1, 1213, 100)])
def test_nodes_to_find_is_kube_schedulers(pct: int, n: int, want: int) -> None:
    assert nodes_to_find(pct, n) == want


def test_nodes_to_find_refuses_a_bad_percentage() -> None:
    with pytest.raises(ValueError, match="percentageOfNodesToScore: 101 is out of range; allowed 0..100"):
        nodes_to_find(101, 10)


def test_scan_window_rotates_and_breaks_ties_in_scan_order() -> None:
    nodes = [(f"n{i:03d}", 1, 64000, 262144) for i in range(150)]
    e = engine(cluster(*nodes), "dra-allocator")
    w = ScanWindow(e, 0)  # 150 nodes: 100 feasible nodes kept per pod
    placed = [gpus_of(w.place(trace_pod(f"p{k}", 100)))[0] for k in range(3)]
    # scan 1 from n000 keeps n000..n099 (ties: the first); scan 2 from n100 keeps n100..n149 and
    # n000..n049, n000 now busier; scan 3 starts at n050
    assert placed == ["n000", "n100", "n050"] and w.start == 0
    e = engine(cluster(*nodes), "dra-allocator")
    full = placer(e, "dra-allocator", 100)
    assert [gpus_of(full(trace_pod(f"p{k}", 100)))[0] for k in range(3)] == ["n000", "n001", "n002"]


def test_scan_window_counts_infeasible_nodes_it_examined() -> None:
    nodes = [(f"n{i:03d}", 1 if i % 2 else 0, 64000, 262144) for i in range(300)]
    e = engine(cluster(*nodes), "dra-allocator")
    w = ScanWindow(e, 0)  # 300 nodes: 48% = 144 feasible kept; only odd nodes have a GPU
    assert gpus_of(w.place(trace_pod("p", 100)))[0] == "n001"
    assert w.start == 288  # the 144th odd node is n287


# -- registration: replay-only, documented -----------------------------------------------------

def test_models_are_replay_policies_but_not_config_values() -> None:
    assert list(DRA_MODELS) == ["dra-allocator", "dra-bestfit-order", "dra-prefer-in-use", "dra-mostallocated",
                                "dra-extender-fgd", "dra-extender-fgd-unaware"]
    rp = replay_policies()
    for name in DRA_MODELS:
        assert rp[name][0] == name and name in sim.POLICIES and name not in sim.DEFAULT_POLICIES
        assert name not in NODE_POLICIES and node_policy(name).name == name
        with pytest.raises(ValueError, match=f"nodePolicy.*{name}"):
            config.load_config_text(f"scheduling: {{nodePolicy: {name}}}")
        with pytest.raises(RequestError):
            podspec.parse_pod({"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                                            "annotations": {ANN_NODE_POLICY: name}},
                               "spec": {"containers": [{"name": "c", "image": "x", "resources": {
                                   "limits": {"nvidia.com/gpumem": 1000}}}]}}, config.Config())
    assert [window_of(n) for n in DRA_MODELS] == [0, 0, 0, 0, None, None]
    # the chart's schema (generated from the registry) offers the node policies only
    schema = json.loads((ROOT / "charts" / "kube-vgpu" / "values.schema.json").read_text())
    enum = schema["properties"]["config"]["properties"]["scheduling"]["properties"]["nodePolicy"]["enum"]
    assert enum == list(NODE_POLICIES) and not set(enum) & set(DRA_MODELS)


def test_docs_describe_every_model() -> None:
    text = (ROOT / "docs" / "dra-placement.md").read_text()
    for spec in DRA_MODEL_SPECS:
        assert f"| `{spec.name}` |" in text, spec.name
    assert "../shared" not in text and "gobuild" not in text


def test_cli_runs_a_model_and_refuses_a_bad_window(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--no-progress", "--seeds", "1", "--jobs", "1", "--policy", "dra-allocator",
                     "--nodes-to-score", "100"]) == 0
    assert "dra-allocator" in capsys.readouterr().out
    assert sim.main(["--no-progress", "--nodes-to-score", "101"]) == 2
    assert "--nodes-to-score 101 is out of range; allowed 0..100" in capsys.readouterr().err


# -- the trace: what the allocator's placement costs -------------------------------------------

def _subset(nodes: list[TraceNode], every: int) -> list[TraceNode]:
    return nodes[::every]


@pytest.mark.skipif(not TRACE.exists(), reason="Alibaba trace not present in ../shared")
def test_trace_subset_dra_allocator_fragments_more_than_fgd() -> None:
    """Every 6th node of the default trace (203 nodes, 1,016 GPUs), its pods, seed 42: the
    allocator's placement leaves more GPU capacity unallocated than FGD from well before the
    cluster fills, and the extender choosing the node (devices still first fit) wins it back
    (figures for the whole trace: docs/dra-placement.md)."""
    nodes = _subset(load_nodes(TRACE / "openb_node_list_gpu_node.csv"), 6)
    pods = load_pods(TRACE / "openb_pod_list_default.csv")
    shapes = sim.shapes_of(pods)
    r = {p: sim.replay(nodes, pods, p, 42, 1.3, shapes).curve
         for p in ("fgd-bestfit", "dra-allocator", "dra-extender-fgd")}
    for x in (80, 95, 100, 110):
        assert r["dra-allocator"][x] < r["fgd-bestfit"][x] - 1.0, x
        assert r["dra-extender-fgd"][x] > r["dra-allocator"][x] + 1.0, x
    assert abs(r["dra-extender-fgd"][100] - r["fgd-bestfit"][100]) < 0.5
    assert np.all(np.isfinite([r[p][130] for p in r]))
