"""Red team, third round: the context cost a container's processes share (docs/shim.md "Context cost").

A process's first context on a GPU is reserved, before the driver's call, at the cost another process of
the container measured there (kept in the shared accounting file's header) and refused past the limit.
These tests play a legitimate user with GPUs of different models in one container (their contexts cost
differently) and a container restarted on the same accounting file after a driver change, who must not
be refused a context that fits; and a neighbour container on the same GPU that tries to raise the cost
the victim's processes reserve (it allocates while the victim's first context comes up, and an NVML
twin hides the victim's pid), and a program that releases the primary context in an atexit handler
while another thread creates a context, on the fake driver and NVML (tests/fakes), with the plain and the
sanitised builds. Each process waits for events (the fake's gate message), never for time.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_vgpu.shimregion import read_region
from tests.libvgpu.shim_helpers import MIB, Toolchain, program_fixtures
from tests.security.test_redteam_hostpid_probe import Node, Proc

SRC = Path(__file__).resolve().parent / "ctxcost3_redteam.c"
GATE = "fake cuda: context creation waits at the gate"
CTX_COST_MIB = struct.Struct("<16H")  # the header's ctx_cost_mib, at 432 (libvgpu/src/region.h)
CTX_COST_OFFSET = 432


built, built_asan, any_build = program_fixtures(SRC, "ctxcost3")


@pytest.fixture
def node2(any_build: tuple[Toolchain, Path], tmp_path: Path) -> Iterator[Node]:
    """A two-GPU node, with the plain and with the sanitised build."""
    n = Node(any_build, tmp_path, gpus=2)
    yield n
    n.stop()


def tenant(node: Node, limit: str, name: str = "tenant", **env: str) -> Proc:
    return node.start(name, "steps", CUDA_DEVICE_MEMORY_LIMIT=limit, **env)


def charged(node: Node, name: str = "tenant", dev: int = 0) -> int:
    """The container's charge on ``dev`` as its accounting file holds it, bytes."""
    return read_region(node.tmp / f"{name}.cache").used[dev]


def ctx_cost_mib(node: Node, name: str = "tenant") -> tuple[int, ...]:
    """The context cost per container GPU the container's accounting file keeps, MiB (0: none)."""
    data = (node.tmp / f"{name}.cache").read_bytes()
    return CTX_COST_MIB.unpack_from(data, CTX_COST_OFFSET)


def test_a_first_context_on_a_gpu_with_cheaper_contexts_is_reserved_at_that_gpu_s_cost(node2: Node) -> None:
    # One cost for every GPU of the container (the largest measured) reserved a process's first context
    # on a GPU whose contexts are cheaper at the dearer GPU's cost: a context that fitted under the limit
    # was refused CUDA_ERROR_OUT_OF_MEMORY. Each GPU keeps its own.
    env = {"FAKE_CUDA_CTX_MIB": "300,100"}
    first = tenant(node2, "1g", **env)
    assert first.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert first.cmd("ctx 1") == "ok ctx rc=0 i=1"
    assert ctx_cost_mib(node2)[:2] == (300, 100)
    assert first.cmd(f"alloc {800 * MIB}") == "ok alloc rc=0"  # on GPU 1: 900 MiB of 1024 charged
    second = tenant(node2, "1g", **env)
    assert second.cmd("ctx 1") == "ok ctx rc=0 i=0", second.log()  # 100 MiB: fits
    assert charged(node2, dev=1) == 1000 * MIB  # the reservation became the measured cost exactly
    assert charged(node2, dev=0) == 300 * MIB
    third = tenant(node2, "1g", **env)
    reply = third.cmd("ctx 1")  # one more does not fit: refused at GPU 1's cost
    assert reply.startswith("fail") and "rc=2" in reply, (reply, third.log())
    third.wait_err(f"out of memory on device 1: request {100 * MIB} bytes")
    third.close()
    second.close()
    first.close()
    assert charged(node2, dev=0) == charged(node2, dev=1) == 0


def test_a_restarted_container_does_not_reserve_the_context_cost_of_its_former_driver(node: Node) -> None:
    # The accounting file outlives the container's processes (a restarted container reuses it). A cost
    # measured under a former driver whose contexts were dearer never fell: every later first context
    # was reserved at it and refused though it fitted. Opened with no process of the container alive,
    # the file forgets it (nothing is charged then, so a first context is let through and measured).
    old = tenant(node, "4g", FAKE_CUDA_CTX_MIB="900")
    assert old.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert ctx_cost_mib(node)[0] == 900
    old.close()
    first = tenant(node, "1g", FAKE_CUDA_CTX_MIB="300")
    assert first.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert ctx_cost_mib(node)[0] == 300
    assert first.cmd(f"alloc {400 * MIB}") == "ok alloc rc=0"
    second = tenant(node, "1g", FAKE_CUDA_CTX_MIB="300")
    assert second.cmd("ctx 0") == "ok ctx rc=0 i=0", second.log()  # 700 + 300 MiB: fits
    assert charged(node) == 1000 * MIB
    third = tenant(node, "1g", FAKE_CUDA_CTX_MIB="300")  # a live process keeps the cost: still refused
    reply = third.cmd("ctx 0")
    assert reply.startswith("fail") and "rc=2" in reply, (reply, third.log())
    third.close()
    second.close()
    first.close()
    assert charged(node) == 0


def test_a_neighbour_cannot_raise_the_context_cost_the_victim_s_processes_reserve(node: Node) -> None:
    # A neighbour container on the same GPU (it cannot write the victim's accounting file) creates its
    # context and allocates 1200 MiB while the victim's first context comes up, and an NVML twin mimics
    # the victim's memory so that it cannot learn its pid: the victim's own cost falls back to the
    # largest rise (the neighbour's 1500 MiB and the twin's copy of the victim's 300, under the 2 GiB
    # bound). That rise must not become the cost
    # every later process of the victim's container reserves for its first context (it would refuse
    # them a context that fits): only a process's own rise, with its pid known, goes into the file.
    n1 = tenant(node, "100g", name="n1")
    victim = tenant(node, "4g", FAKE_NVML_TWIN="1")
    victim.cmd(f"env FAKE_CUDA_CTX_GATE {node.tmp / 'gate'}")
    victim.send("ctx 0")
    victim.wait_err(GATE)
    assert n1.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert n1.cmd(f"alloc {1200 * MIB}") == "ok alloc rc=0"
    (node.tmp / "gate").touch()
    assert victim.reply() == "ok ctx rc=0 i=0", victim.log()
    victim.wait_err("(the largest rise: this process's pid is not known)")
    assert charged(node) == 1800 * MIB  # the victim's own charge: the known cost of an unknown pid
    assert ctx_cost_mib(node)[0] == 0, victim.log()
    assert victim.cmd(f"alloc {1000 * MIB}") == "ok alloc rc=0"
    later = tenant(node, "4g")
    assert later.cmd("ctx 0") == "ok ctx rc=0 i=0", later.log()  # fits next to the victim's 2800 MiB
    assert charged(node) == 3100 * MIB
    assert ctx_cost_mib(node)[0] == 300  # the later process's own rise, its pid known
    later.close()
    victim.close()
    n1.close()
    assert charged(node) == 0


def test_a_process_killed_inside_its_first_context_creation_leaves_no_reservation(node: Node) -> None:
    # A process's first context is reserved at the container's cost before the driver's call. Killed
    # while the driver creates it, its reservation is in its own slot: reclaimed with it, so that the
    # container's other processes are not refused for a context that never was.
    first = tenant(node, "1g")
    assert first.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert first.cmd(f"alloc {400 * MIB}") == "ok alloc rc=0"
    doomed = tenant(node, "1g")
    doomed.cmd(f"env FAKE_CUDA_CTX_GATE {node.tmp / 'gate'}")
    doomed.send("ctx 0")
    doomed.wait_err(GATE)
    assert charged(node) == 1000 * MIB  # 300 + 400 + the reservation
    doomed.p.kill()
    doomed.p.wait()
    # the room it held is free again: another process's first context fits (the dead slot is reclaimed)
    later = tenant(node, "1g")
    assert later.cmd("ctx 0") == "ok ctx rc=0 i=0", later.log()
    assert charged(node) == 1000 * MIB
    later.close()
    first.close()
    assert charged(node) == 0


def test_a_primary_release_in_an_atexit_handler_waits_for_a_creation_and_the_process_exits(node: Node) -> None:
    # The program exits while another thread is inside a context creation (the GPU's creation lock
    # held, the driver at the fake's gate), and its atexit handler releases the primary context, which
    # takes that lock: it must wait for the creation, not deadlock with it, and leave no charge behind.
    gate = node.tmp / "gate"
    p = node.start("tenant", "atexit", "0", str(gate), CUDA_DEVICE_MEMORY_LIMIT="1g")
    assert p.reply() == "ready", p.log()
    p.wait_err(GATE)
    p.send("go")
    assert p.reply() == "atexit release", p.log()
    gate.touch()
    assert p.reply() == "atexit released rc=0", p.log()
    assert p.reply() == "atexit done rc=0", p.log()
    assert p.p.wait() == 0, p.log()
    later = tenant(node, "1g")  # the exited process's charge is reclaimed: a whole limit's context fits
    assert later.cmd("ctx 0") == "ok ctx rc=0 i=0", later.log()
    assert later.cmd(f"alloc {700 * MIB}") == "ok alloc rc=0", later.log()
    assert charged(node) == 1000 * MIB
    later.close()
    assert charged(node) == 0
