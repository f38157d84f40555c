"""Red team: the peak of a graph's allocations (docs/shim.md "Sum or peak: the admin's choice").

Where the admin chose the peak (the limits file's ``graph_memory=peak``; here the development knob
``LIBVGPU_GRAPH_MEMORY_BOUND=peak``, read only without a limits file), the shim reads a tenant's graph at
instantiation, its nodes, edges and child graphs, into fixed arrays and computes the heaviest set of allocations
that can be live at once by a maximum flow. A hostile tenant shapes that graph. Each run is a process on the fake
driver (tests/fakes) with the plain and the sanitised (ASan + UBSan: any finding fails the process) builds.

- ``grow``: another thread grows the graph between the shim's count query of its nodes (or edges) and the
  listing. The driver's documentation says what a listing writes when the buffer is larger than the graph, not
  what count it answers when the buffer is smaller; a driver that answers the graph's total there
  (``FAKE_CUDA_GRAPH_COUNT_TOTAL=1``) made the shim read and write past its node arrays (both the walk of the
  allocation nodes and the order's). Fixed: a listing is taken as at most the buffer, and a graph that grew is
  read as incomplete (the order: the sum).
- ``flow``: 128 allocations (the bound) in a dense order with mixed sizes, padded with nodes and edges to the
  order's bounds: instantiation stays fast (the max flow is small by construction).
- ``clones``, ``deep``: the same child graph embedded many times, and nesting past the walk's depth, under the
  sanitisers: the peak where the order is in bounds, the sum beyond.
- ``pair``: an edge listed with data (a programmatic dependency or port, ``FAKE_CUDA_EDGE_PROGRAMMATIC`` /
  ``FAKE_CUDA_EDGE_PORT``) orders nothing; ``update``: an executable updated to an unordered graph is charged
  the sum.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, program_fixtures

SRC = Path(__file__).resolve().parent / "graphpeak_redteam.c"
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

built, built_asan, any_build = program_fixtures(SRC, "graphpeak")


def steps(build: tuple[Toolchain, Path], *args: object, bound: str | None = "peak", limit: str = "1g",
          **extra: str) -> tuple[dict[str, tuple[int, int]], dict[str, str], str]:
    """Run the program under ``limit`` (1 GiB): each step's (rc, charged bytes), every line's value, and the
    output."""
    tc, prog = build
    names = {"LIBVGPU_CONTEXT_COST": "0", "LIBVGPU_LOG_LEVEL": "1", "CUDA_DEVICE_MEMORY_LIMIT": limit}
    if bound is not None:
        names["LIBVGPU_GRAPH_MEMORY_BOUND"] = bound
    proc = subprocess.run([str(prog), *map(str, args)], env=tc.env(**{**names, **extra}), capture_output=True,
                          text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{text}"
    out = parse(proc.stdout)
    got = {k: (int(v.split(":")[0]), int(v.split(":")[1])) for k, v in out.items() if v.count(":") == 1}
    return got, out, text


@pytest.mark.parametrize("query", range(6))
@pytest.mark.parametrize("total", ["0", "1"], ids=["written", "total"])
def test_a_graph_grown_during_instantiation_is_read_within_the_buffers(
    any_build: tuple[Toolchain, Path], tmp_path: Path, query: int, total: str
) -> None:
    # Two 600 MiB allocations in sequence (peak 600 MiB, sum 1.2 GiB); 64 memcpy nodes and edges are added while
    # one of the shim's count queries of the graph (query: which, in order: the allocation walk's, the order's
    # nodes and edges, their second looks) is held in the driver. Before the fix, a driver answering the total
    # count made the shim read and write past its node arrays (a crash, or the sanitisers' heap-buffer-overflow in
    # graph.c walk and dag_level). Now nothing is read past a buffer, and the nodes added only add order: the peak.
    gate = tmp_path / "gate"
    got, out, text = steps(any_build, "grow", 600 * MIB, 64, gate, FAKE_CUDA_GRAPH_GATE=str(gate),
                         FAKE_CUDA_GRAPH_GATE_SKIP=str(query), FAKE_CUDA_GRAPH_COUNT_TOTAL=total)
    assert out["raced"] == "1", text
    assert got["grown"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == (0, 600 * MIB), text


@pytest.mark.parametrize("query", range(3))
def test_by_default_a_graph_grown_during_instantiation_is_read_within_the_buffers(
    any_build: tuple[Toolchain, Path], tmp_path: Path, query: int
) -> None:
    # The same race where the admin left the sum (the default): the walks of the allocation nodes and kernels after
    # the driver's instantiation list the graph too (they read past the node array before the fix). The sum of the
    # two 600 MiB allocations is refused under 1 GiB.
    gate = tmp_path / "gate"
    got, out, text = steps(any_build, "grow", 600 * MIB, 64, gate, bound=None, FAKE_CUDA_GRAPH_GATE=str(gate),
                           FAKE_CUDA_GRAPH_GATE_SKIP=str(query), FAKE_CUDA_GRAPH_COUNT_TOTAL="1")
    assert out["raced"] == "1", text
    assert got["grown"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == (OOM, 0), text


@pytest.mark.parametrize("query", range(5))
def test_an_allocation_added_during_instantiation_is_charged(
    any_build: tuple[Toolchain, Path], tmp_path: Path, query: int
) -> None:
    # The same race, the other thread adding a 600 MiB allocation ordered with nothing and never freed: the
    # executable holds it with one of the others (1.2 GiB), and the launch is refused under 1 GiB whichever of the
    # queries before the driver's instantiation it raced (the count and listing checks of the allocation walk and
    # of the order's nodes, the order's edges): the peak is used only for the allocation nodes it was computed
    # for.
    gate = tmp_path / "gate"
    got, out, text = steps(any_build, "grow", 600 * MIB, -1, gate, FAKE_CUDA_GRAPH_GATE=str(gate),
                         FAKE_CUDA_GRAPH_GATE_SKIP=str(query), FAKE_CUDA_GRAPH_COUNT_TOTAL="1")
    assert out["raced"] == "1", text
    assert got["grown"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == (OOM, 0), text


@pytest.mark.parametrize("ordered", [0, 1], ids=["branches", "sequence"])
@pytest.mark.parametrize("total", ["0", "1"], ids=["written", "total"])
def test_a_graph_that_keeps_growing_is_checked_before_its_launch(any_build: tuple[Toolchain, Path], ordered: int,
                                                                 total: str) -> None:
    # Another thread adds a node between every count query and the next call (FAKE_CUDA_GRAPH_GROW): no listing of
    # the graph's nodes is ever complete. The order is not read (the sum), and the allocation walk still counts
    # the allocation nodes it listed, so the launch of two 600 MiB allocations is refused under 1 GiB before the
    # driver runs it (a walk that gave up on the graph left the launch unchecked, charged only after it).
    got, _, text = steps(any_build, "pair", 600 * MIB, ordered, FAKE_CUDA_GRAPH_GROW="1",
                         FAKE_CUDA_GRAPH_COUNT_TOTAL=total)
    assert got["nodes"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == (OOM, 0), text


@pytest.mark.parametrize("knob", ["FAKE_CUDA_EDGE_PROGRAMMATIC", "FAKE_CUDA_EDGE_PORT", None])
def test_an_edge_that_lets_its_node_start_early_orders_nothing(any_build: tuple[Toolchain, Path],
                                                              knob: str | None) -> None:
    # Two 600 MiB allocations, the second made after the first's free: that edge (the graph's second) listed as a
    # programmatic dependency, or from a kernel's programmatic port, lets the second allocation start before the
    # free completes: both can be live, the launch is refused under 1 GiB. An ordinary edge (None): the peak fits.
    extra = {knob: "1"} if knob else {}
    got, _, text = steps(any_build, "pair", 600 * MIB, 1, **extra)
    assert got["nodes"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == ((OOM, 0) if knob else (0, 600 * MIB)), text


def test_an_update_cannot_drop_the_order_the_peak_relied_on(any_build: tuple[Toolchain, Path]) -> None:
    # Instantiated from two 600 MiB allocations in sequence (the peak, 600 MiB, recorded), the executable is updated
    # to the same nodes unordered (both live at once): the update is charged the sum, the launch refused.
    got, _, text = steps(any_build, "update", 600 * MIB)
    assert got["instantiate"][0] == 0 and got["update"][0] == 0, text
    assert got["launch"] == (OOM, 0), text


def test_every_instantiation_entry_point_records_the_bound(any_build: tuple[Toolchain, Path]) -> None:
    # Two 600 MiB allocations that can be live together, instantiated through each instantiation entry point
    # cuGetProcAddress_v2 hands out (cuGraphInstantiate at 10.0, 11.0 and 12.0, cuGraphInstantiateWithFlags,
    # cuGraphInstantiateWithParams and its per-thread form): every launch is refused under 1 GiB before it runs.
    got, out, text = steps(any_build, "procaddr", 600 * MIB)
    launches = {k: v for k, v in got.items() if k.startswith("cuGraphInstantiate") and not k.endswith("_inst")}
    assert len(launches) == 6, text
    for name, step in launches.items():
        assert got[f"{name}_inst"][0] == 0, (name, text)
        assert step == (OOM, 0), (name, text)


def test_a_dense_order_at_the_bounds_is_analysed_quickly(any_build: tuple[Toolchain, Path]) -> None:
    # CPU: 128 allocations (the most the order is computed for) of mixed sizes, each freed before all but the next
    # one is made (8,000 ordered pairs: the flow network's arcs), padded with memcpy nodes and edges to the order's
    # bounds (2,048 vertices, ~7,400 edges). The bound is exact (the heaviest two neighbours: 13/8 x 256 MiB; it
    # fits at that limit and is refused one byte below) and instantiation stays well under a second, sanitisers
    # included (about a millisecond here).
    peak = 13 * 32 * MIB
    for limit, launch in ((peak, 0), (peak - 1, OOM)):
        got, out, text = steps(any_build, "flow", 256 * MIB, 128, 1790, limit=str(limit))
        assert got["instantiate"][0] == 0 and got["launch"][0] == launch, text
        assert float(out["instantiate_ms"]) < 1000, text


@pytest.mark.parametrize(("copies", "nodes", "deps", "fits"),
                         [(14, 100, 1, True), (14, 150, 1, False), (14, 60, 4, True), (14, 140, 4, False)])
def test_one_child_graph_embedded_many_times(any_build: tuple[Toolchain, Path], copies: int, nodes: int, deps: int,
                                             fits: bool) -> None:
    # A child graph of memcpy nodes (each after the 1 or 4 before it) cloned into the parent 14 times between two
    # 600 MiB allocations in sequence: within the order's bounds the peak (600 MiB) fits; past its 2,048 vertices
    # (14 x 150 nodes), or its 8,192 edges (14 x 140 nodes of 4 edges each, plus the two that tie each node to its
    # child graph node's entry and exit: ~11,600) the sum is refused.
    got, _, text = steps(any_build, "clones", 600 * MIB, copies, nodes, deps)
    assert got["nodes"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == ((0, 600 * MIB) if fits else (OOM, 0)), text


@pytest.mark.parametrize(("levels", "fits"), [(8, True), (9, False)])
def test_child_graphs_nested_past_the_walk_depth(any_build: tuple[Toolchain, Path], levels: int, fits: bool) -> None:
    # A memcpy node nested 8 child graph levels down (the walk's depth) orders nothing that matters: the peak; 9
    # levels down, the graph cannot be read in full and the sum of what was read is refused.
    got, _, text = steps(any_build, "deep", 600 * MIB, levels)
    assert got["nodes"][0] == 0 and got["instantiate"][0] == 0, text
    assert got["launch"] == ((0, 600 * MIB) if fits else (OOM, 0)), text
