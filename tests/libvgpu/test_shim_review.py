"""Review of the shim's CUDA graph accounting against the driver's ABI (docs/shim.md "CUDA graphs").

The shim walks a graph's nodes (``cuGraphGetNodes``, ``cuGraphNodeGetType``) to find its allocation nodes and
kernels, child graphs included. ``cuGraphNodeGetType`` answers with cuda.h's ``CUgraphNodeType`` numbers: a
memcpy node is 1 and a child graph node is 4. A shim that took 1 for a child graph read every graph holding a
copy (as nearly every captured PyTorch graph does) as unreadable: each such graph was checked at every launch
under the graph-memory lock with two driver queries, a warning was logged per instantiation, and an allocation
node inside a real child graph (4) was never counted, so its launch was let past the limit. The fake driver
reports cuda.h's numbers (tests/fakes/fakecuda.c asserts them at build time).

By default a graph's launch is checked against the sum of its allocation nodes, sound whatever the driver reserves
(it may, not must, reuse memory between allocations that are never live together). Where the admin chose it
(limits file ``graph_memory=peak``, config ``devices.graphMemoryBound``; without a limits file the development knob
``LIBVGPU_GRAPH_MEMORY_BOUND=peak``), it is checked against the most its allocation nodes can hold at once over the
graph's dependency order (``cuGraphGetEdges``): the attacks below build graphs whose allocations can be live
together (parallel branches, frees that order nothing, child graphs, allocations the graph does not free) and must
be charged together, and random graphs are checked against a brute-force peak. A tenant cannot choose the peak
inside a container whose limits come from the file.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_vgpu import envcontract
from kube_vgpu.model import DeviceBooking
from tests.libvgpu.shim_helpers import Toolchain, limits_path, parse, program_fixtures

SRC = Path(__file__).resolve().parent / "progs" / "review_graphs.c"
HEADER = Path(__file__).resolve().parents[2] / "libvgpu" / "src" / "cuda_abi.h"
MIB = 1024 * 1024
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY

#: cuda.h's values of the constants the shim's header declares for its graph hooks
CUDA_H = {
    "CU_GRAPH_NODE_TYPE_KERNEL": 0,
    "CU_GRAPH_NODE_TYPE_MEMCPY": 1,
    "CU_GRAPH_NODE_TYPE_GRAPH": 4,
    "CU_GRAPH_NODE_TYPE_MEM_ALLOC": 10,
    "CU_GRAPH_NODE_TYPE_MEM_FREE": 11,
    "CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT": 0,
    "CU_GRAPH_MEM_ATTR_USED_MEM_HIGH": 1,
    "CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT": 2,
    "CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH": 3,
    "CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD": 2,
    "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE": 910,
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": 1,
    "CU_MEM_LOCATION_TYPE_DEVICE": 1,
}

built, built_asan, any_build = program_fixtures(SRC, "review")


def test_graph_constants_are_cuda_h_values() -> None:
    text = HEADER.read_text()
    found = {m.group(1): int(m.group(2), 0) for m in re.finditer(r"^#define (\w+) (0x[0-9a-fA-F]+|\d+)\b", text, re.M)}
    assert {k: found.get(k) for k in CUDA_H} == CUDA_H


def test_a_graph_with_a_copy_and_an_allocating_child_graph_is_checked(any_build: tuple[Toolchain, Path]) -> None:
    # 600 MiB held, then a graph of a memcpy node and a child graph allocating 600 MiB: under the 1 GiB limit
    # the launch is refused before the driver is called, nothing more is charged, and the graph was read.
    tc, prog = any_build
    n = 600 * MIB
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="2")
    proc = subprocess.run([str(prog), "copychild", str(n)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = parse(proc.stdout)
    steps = {k: tuple(int(x) for x in v.split(":")) for k, v in out.items()}
    for name in ("pre", "create", "alloc_node", "memcpy_node", "child_node", "instantiate"):
        assert steps[name][0] == 0, (name, proc.stdout)
    assert steps["pre"] == (0, n)
    assert steps["launch"] == (OOM, n), proc.stdout
    assert "cannot read the nodes of a graph" not in proc.stderr


def _steps(build: tuple[Toolchain, Path], *args: object, limit: str | None = "1g", bound: str | None = "peak",
           **extra: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """Run the graph program with ``args`` under ``limit`` (None: not set): each step's (rc, charged bytes), and
    its stdout and stderr. bound: ``LIBVGPU_GRAPH_MEMORY_BOUND`` (the development knob, read only without a limits file; the
    peak tests set it), None: not set; extra: more variables."""
    tc, prog = build
    names = {"LIBVGPU_CONTEXT_COST": "0", "LIBVGPU_LOG_LEVEL": "1"}
    if limit is not None:
        names["CUDA_DEVICE_MEMORY_LIMIT"] = limit
    if bound is not None:
        names["LIBVGPU_GRAPH_MEMORY_BOUND"] = bound
    env = tc.env(**{**names, **extra})
    proc = subprocess.run([str(prog), *map(str, args)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    steps = {k: tuple(int(x) for x in v.split(":")) for k, v in parse(proc.stdout).items()}
    return steps, proc.stdout + proc.stderr


def _constant(path: Path, name: str) -> int:
    match = re.search(rf"^#define {name} (\d+)\b", path.read_text(), re.M)
    assert match, name
    return int(match.group(1))


@pytest.mark.parametrize("bound", [None, "sum", "bogus"])
def test_by_default_a_graph_is_charged_the_sum_of_its_allocations(
    any_build: tuple[Toolchain, Path], bound: str | None
) -> None:
    # Four 600 MiB allocations each freed in the graph before the next is made: 2.4 GiB summed. Unless the admin
    # chose the peak, the launch is checked against the sum and refused under 1 GiB before the driver is called:
    # a driver that reserved more than the peak for the graph could not take the tenant past its limit. An
    # unknown value of the knob is the sum too.
    for mode in ("sequence", "capture"):
        steps, out = _steps(any_build, mode, 600 * MIB, 4, bound=bound)
        assert steps["launch"] == (OOM, 0), out


def _limits_file(tc: Toolchain, tmp: Path, **policy: str) -> Path:
    """A 1 GiB limits file for the fake GPU 0 (the device plugin's writer, ``policy`` its admin options)."""
    path = limits_path(tc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(envcontract.limits_file([DeviceBooking("GPU-00000000-0000-4000-8000-000000000000", 1024, 0)],
                                            str(tmp / "vgpu.cache"), **policy))
    return path


def test_the_limits_file_chooses_the_peak(tc_limits: Toolchain, built: tuple[Toolchain, Path],
                                          tmp_path: Path) -> None:
    # The admin's devices.graphMemoryBound: peak reaches the shim through the container's limits file: the
    # sequence of four 600 MiB allocations fits 1 GiB, with no knob in the environment.
    path = _limits_file(tc_limits, tmp_path, graph_memory="peak")
    try:
        steps, out = _steps((tc_limits, built[1]), "sequence", 600 * MIB, 4, limit=None, bound=None)
        assert steps["launch"] == (0, 600 * MIB), out
        assert steps["relaunch"] == (0, 600 * MIB), out
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("policy", [{}, {"graph_memory": "sum"}])
def test_a_tenant_cannot_choose_the_peak_under_a_limits_file(tc_limits: Toolchain, built: tuple[Toolchain, Path],
                                                             tmp_path: Path, policy: dict[str, str]) -> None:
    # Attack: the tenant sets LIBVGPU_GRAPH_MEMORY_BOUND=peak in a container whose limits file (the admin's
    # policy) says sum, or says nothing: the file decides, the launch is checked against the sum and refused,
    # and the shim names the variable it ignored.
    path = _limits_file(tc_limits, tmp_path, **policy)
    try:
        steps, out = _steps((tc_limits, built[1]), "sequence", 600 * MIB, 4, limit=None, bound="peak",
                            LIBVGPU_LOG_LEVEL="2")
        assert steps["launch"] == (OOM, 0), out
        assert "LIBVGPU_GRAPH_MEMORY_BOUND=peak) differs from the container's limits file" in out, out
    finally:
        path.unlink(missing_ok=True)


def test_a_graph_reusing_memory_in_sequence_is_not_refused(any_build: tuple[Toolchain, Path]) -> None:
    # With the peak chosen: four 600 MiB allocations each freed in the graph before the next is made: the driver
    # reuses the memory within the graph (the fake reserves the peak, 600 MiB), so under a 1 GiB limit both
    # launches fit. Against the sum (2.4 GiB) the launch is refused: a false out-of-memory for graphs captured
    # with cudaMallocAsync (PyTorch's cudaMallocAsync backend frees its temporaries in the graph), the price of
    # the default, which holds whatever the driver reserves.
    steps, out = _steps(any_build, "sequence", 600 * MIB, 4)
    assert steps["instantiate"][0] == 0
    assert steps["launch"] == (0, 600 * MIB), out
    assert steps["relaunch"] == (0, 600 * MIB), out


def test_allocations_captured_from_a_stream_in_sequence_are_charged_their_peak(
    any_build: tuple[Toolchain, Path]
) -> None:
    # cuMemAllocAsync / cuMemFreeAsync captured from one stream: each captured node follows the one before it.
    steps, out = _steps(any_build, "capture", 600 * MIB, 4)
    assert steps["nodes"][0] == 0 and steps["end"][0] == 0
    assert steps["launch"] == (0, 600 * MIB), out
    assert steps["relaunch"] == (0, 600 * MIB), out


@pytest.mark.parametrize(
    "mode",
    [
        "parallel",  # two branches, each freeing its own allocation: both live at once
        "unordered",  # B made after A, not after A's free: both live at once
        "early",  # A's free does not follow A's allocation: it orders nothing
        "childpar",  # a child graph's allocation and a parent's not ordered after the child graph node
        "unfreed",  # A not freed in the graph: live when B is made
    ],
)
def test_allocations_that_can_be_live_together_are_charged_together(
    any_build: tuple[Toolchain, Path], mode: str
) -> None:
    # Two 600 MiB allocations that the graph's order lets be live at the same time: 1.2 GiB under the 1 GiB
    # limit, so the launch is refused before the driver is called and nothing is charged.
    steps, out = _steps(any_build, mode, 600 * MIB, 2)
    assert steps["nodes"][0] == 0 and steps["instantiate"][0] == 0, out
    assert steps["launch"] == (OOM, 0), out


def test_branches_after_a_free_are_charged_their_peak_not_their_sum(any_build: tuple[Toolchain, Path]) -> None:
    # A (1000 MiB) is freed, then two branches of 500 MiB each: both branches can be live together (1000 MiB),
    # never with A. The sum (2000 MiB) would refuse the launch under the 1 GiB limit; the peak is 1000 MiB.
    steps, out = _steps(any_build, "diamond", 1000 * MIB)
    assert steps["launch"] == (0, 1000 * MIB), out


UNIT_MIB = 64


@st.composite
def _graphs(draw: st.DrawFn) -> list[str]:
    """A graph for the program's ``spec`` mode: allocations (of 1-8 units), frees of some of them, memcpy
    nodes, each after a few earlier nodes."""
    tokens: list[str] = []
    unfreed: list[int] = []
    for i in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["a", "a", "k", "f"] if unfreed else ["a", "k"]))
        deps = ",".join(map(str, sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else [])))
        if kind == "a":
            tokens.append(f"a{draw(st.integers(1, 8))}:{deps}")
            unfreed.append(i)
        elif kind == "f":
            target = draw(st.sampled_from(unfreed))
            unfreed.remove(target)
            tokens.append(f"f{target}:{deps}")
        else:
            tokens.append(f"k:{deps}")
    return tokens


def _peak_units(tokens: list[str]) -> int:
    """The most the graph's allocations can hold at once, by brute force: the heaviest set of allocations no
    two of which are ordered (A before B: A's free follows A's allocation and precedes B's allocation)."""
    succ: dict[int, set[int]] = {i: set() for i in range(len(tokens))}
    for i, tok in enumerate(tokens):
        for d in filter(None, tok.split(":")[1].split(",")):
            succ[int(d)].add(i)

    def reach(u: int) -> set[int]:
        seen, todo = {u}, [u]
        while todo:
            for w in succ[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    size = {i: int(t[1:].split(":")[0]) for i, t in enumerate(tokens) if t[0] == "a"}
    free = {int(t[1:].split(":")[0]): i for i, t in enumerate(tokens) if t[0] == "f"}
    before = {(a, b) for a in size for b in size
              if a != b and a in free and free[a] in reach(a) and b in reach(free[a])}
    best = 0
    for r in range(1, len(size) + 1):
        for group in itertools.combinations(size, r):
            if not any((a, b) in before for a in group for b in group):
                best = max(best, sum(size[a] for a in group))
    return best


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=_graphs())
def test_a_graph_is_charged_exactly_the_most_its_allocations_can_hold_at_once(
    any_build: tuple[Toolchain, Path], tokens: list[str]
) -> None:
    # Random graphs of allocations, frees and other nodes: the launch fits a limit of exactly the most that can
    # be live at once (brute force over the graph's order) and is refused one byte below it: never less (an
    # undercount would let it past the lower limit), and no more for what the order keeps apart.
    peak = _peak_units(tokens) * UNIT_MIB * MIB
    if not peak:
        return
    steps, out = _steps(any_build, "spec", UNIT_MIB * MIB, *tokens, limit=str(peak))
    assert steps["nodes"][0] == 0 and steps["instantiate"][0] == 0, out
    assert steps["launch"][0] == 0, (tokens, out)
    steps, out = _steps(any_build, "spec", UNIT_MIB * MIB, *tokens, limit=str(peak - 1))
    assert steps["launch"] == (OOM, 0), (tokens, out)


def test_a_child_graph_freeing_before_the_parent_allocates_is_charged_its_peak(
    any_build: tuple[Toolchain, Path]
) -> None:
    # The child graph's allocation is freed inside it; the parent's allocation follows the child graph node.
    steps, out = _steps(any_build, "childseq", 600 * MIB)
    assert steps["launch"] == (0, 600 * MIB), out


def test_an_allocation_the_graph_does_not_free_stays_charged(any_build: tuple[Toolchain, Path]) -> None:
    # A (400 MiB) is not freed by the graph; B (400 MiB) is made and freed after it: 800 MiB at the peak, within
    # the limit. After the launch A stays allocated: a trim of the graph pool keeps it charged.
    n = 400 * MIB
    steps, out = _steps(any_build, "unfreed", n)
    assert steps["launch"] == (0, 2 * n), out
    assert steps["trim"] == (0, n), out


def test_a_graph_over_the_order_bounds_is_charged_the_sum(any_build: tuple[Toolchain, Path]) -> None:
    # The order is read for at most GRAPH_DAG_NODES nodes and GMEM_ORDER_ALLOCS allocation nodes; beyond either,
    # the bound is the sum of the allocations (two 600 MiB in sequence: refused under 1 GiB; within the bounds the
    # same graph fits).
    nodes = _constant(HEADER.parent / "vgpu.h", "GRAPH_DAG_NODES")
    allocs = _constant(HEADER.parent / "memory.c", "GMEM_ORDER_ALLOCS")
    steps, out = _steps(any_build, "long", 600 * MIB, 16)
    assert steps["launch"] == (0, 600 * MIB), out
    steps, out = _steps(any_build, "long", 600 * MIB, nodes)
    assert steps["nodes"][0] == 0 and steps["instantiate"][0] == 0, out
    assert steps["launch"] == (OOM, 0), out
    small = 8 * MIB  # allocs + 1 of them sum to more than 1 GiB
    assert (allocs + 1) * small > 1024 * MIB >= allocs * small
    steps, out = _steps(any_build, "sequence", small, allocs)
    assert steps["launch"] == (0, small), out
    steps, out = _steps(any_build, "sequence", small, allocs + 1)
    assert steps["launch"] == (OOM, 0), out


def _race(build: tuple[Toolchain, Path], tmp_path: Path, mode: str, gate_var: str,
          n: int) -> tuple[dict[str, tuple[int, ...]], subprocess.CompletedProcess[str]]:
    """Run the two-thread race ``mode`` of ``n`` bytes under a 1 GiB limit, the fake holding thread A in the
    driver on the gate file named by ``gate_var``: each step's (rc, charged bytes) and the process."""
    tc, prog = build
    gate = tmp_path / "gate"
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST="0", LIBVGPU_LOG_LEVEL="1",
                 **{gate_var: str(gate)})
    proc = subprocess.run([str(prog), mode, str(n), str(gate)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return {k: tuple(int(x) for x in v.split(":")) for k, v in parse(proc.stdout).items()}, proc


def test_a_handle_retained_while_another_thread_releases_it_stays_charged(
    any_build: tuple[Toolchain, Path], tmp_path: Path
) -> None:
    # Thread A's cuMemRetainAllocationHandle has taken its reference in the driver (the fake holds it there)
    # when thread B unmaps and releases the handle: the driver keeps the memory for A's reference, so it stays
    # charged until A releases it. The shim counted the retain only after the driver returned, so B's release
    # dropped the handle and uncharged memory the driver still held (for as long as A kept it).
    n = 64 * MIB
    steps, proc = _race(any_build, tmp_path, "retainrace", "FAKE_CUDA_RETAIN_GATE", n)
    assert steps["create"] == (0, n) and steps["map"] == (0, n)
    assert steps["unmap"] == (0, n)
    assert steps["release"] == (0, n), proc.stdout  # A's reference keeps it
    assert steps["retained"] == (0, n)
    assert steps["release_retained"] == (0, 0), proc.stdout


def test_a_handle_mapped_while_another_thread_releases_it_stays_charged(
    any_build: tuple[Toolchain, Path], tmp_path: Path
) -> None:
    # Thread A's cuMemMap has made its mapping in the driver (the fake holds it there) when thread B releases the
    # handle: the mapping keeps the memory, so it stays charged until it is unmapped. The shim counted the
    # mapping only after the driver returned, so B's release dropped the handle: mapped memory went uncharged.
    n = 64 * MIB
    steps, proc = _race(any_build, tmp_path, "maprace", "FAKE_CUDA_MAP_GATE", n)
    assert steps["create"] == (0, n)
    assert steps["release"] == (0, n), proc.stdout  # the mapping keeps it
    assert steps["mapped"] == (0, n)
    assert steps["unmap"] == (0, 0), proc.stdout
