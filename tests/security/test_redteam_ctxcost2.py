"""Red team, second round: the context cost (docs/shim.md "Context cost") under threads, loops, driver
failures and forks.

The shim charges every context a process holds on a GPU one measured context cost, serialises context
creations on a GPU within the process and reserves a further context before the driver's call. These
tests play a legitimate program (threads retaining the primary context together near the limit, as
CUDA runtimes do; a context per task for many tasks) that must never be refused falsely nor leave a
charge behind, and a tenant that makes the driver fail a creation or forks while another thread is
inside one, on the fake driver and NVML (tests/fakes), with the plain and the sanitised builds. Each
process waits for events (the fake's gate message, a thread asleep on a lock), never for time.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kube_vgpu.shimregion import read_region
from tests.libvgpu.shim_helpers import MIB, Toolchain, program_fixtures
from tests.security.test_redteam_hostpid_probe import Node, Proc

SRC = Path(__file__).resolve().parent / "ctxcost2_redteam.c"
CTX = 300  # MiB a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
GATE = "fake cuda: context creation waits at the gate"


built, built_asan, any_build = program_fixtures(SRC, "ctxcost2")


def tenant(node: Node, limit: str = "1g", name: str = "tenant", **env: str) -> Proc:
    return node.start(name, "steps", CUDA_DEVICE_MEMORY_LIMIT=limit, **env)


def charged(node: Node, name: str = "tenant", dev: int = 0) -> int:
    """The container's charge on ``dev`` as its accounting file holds it, bytes."""
    return read_region(node.tmp / f"{name}.cache").used[dev]


def used(p: Proc) -> int:
    """What the shim charges the tenant's container (cuMemGetInfo in the current context), bytes."""
    m = re.fullmatch(r"ok meminfo rc=0 used=(\d+) total=\d+", p.cmd("meminfo"))
    assert m, p.log()
    return int(m.group(1))


def test_threads_retaining_the_primary_context_together_near_the_limit_are_not_refused(node: Node) -> None:
    # A runtime's threads retain the primary context at once. Both saw it not yet retained, so each
    # reserved a whole context before the driver's call; the second reserved it once the first had
    # been charged, and 300 (a context) + 400 (allocations) + 300 (the primary) + 300 (its reservation)
    # is past 1 GiB: the second retain was refused with CUDA_ERROR_OUT_OF_MEMORY although the context
    # it retains existed and cost nothing more.
    t = tenant(node)
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd(f"alloc {400 * MIB}") == "ok alloc rc=0"
    t.cmd(f"env FAKE_CUDA_CTX_GATE {node.tmp / 'gate'}")
    assert t.cmd("bg 0 primary 0") == "ok bg"
    t.wait_err(GATE)  # the first retain is creating the primary context in the driver
    assert t.cmd("bg 1 primary 0") == "ok bg"
    assert t.cmd("blocked 1") == "ok blocked"  # the second waits for it inside the shim
    (node.tmp / "gate").touch()
    assert t.cmd("join 0") == "ok join rc=0 i=-1", t.log()
    assert t.cmd("join 1") == "ok join rc=0 i=-1", t.log()
    assert charged(node) == (2 * CTX + 400) * MIB  # one primary context, charged once
    assert t.cmd("release 0") == "ok release rc=0"
    assert charged(node) == (2 * CTX + 400) * MIB  # still retained once
    assert t.cmd("release 0") == "ok release rc=0"
    assert charged(node) == (CTX + 400) * MIB
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    assert charged(node) == 0
    t.close()


def test_primary_retain_and_release_churn_from_threads_is_never_refused_and_leaves_no_charge(node: Node) -> None:
    # cudart/PyTorch style: threads retain and release the primary context in a loop next to a created
    # context, with room for exactly the two. A retain racing a release, or another retain, must neither
    # be refused nor charge the primary twice; at the end exactly the created context is charged.
    t = tenant(node, limit=f"{2 * CTX + 100}m")
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd("churn 0 4 150") == "ok churn fails=0", t.log()
    assert charged(node) == CTX * MIB
    assert t.cmd("churn 0 1 50") == "ok churn fails=0", t.log()
    assert charged(node) == CTX * MIB
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    assert charged(node) == 0
    t.close()


def test_a_context_per_task_for_many_tasks_does_not_drift(node: Node) -> None:
    # A worker creates a context per task, allocates in it and destroys it, for hours: the charge must
    # come back to exactly what is held after each (a drift of one context would refuse it in the end).
    t = tenant(node, limit=f"{2 * CTX + 2}m")
    assert t.cmd("primary 0") == "ok primary rc=0"
    assert t.cmd("loop 0 300") == "ok loop fails=0", t.log()
    assert charged(node) == CTX * MIB
    assert used(t) == CTX * MIB
    assert t.cmd("reset 0") == "ok reset rc=0"
    assert charged(node) == 0
    assert t.cmd("loop 0 20") == "ok loop fails=0", t.log()  # the unit is kept: measured once
    assert charged(node) == 0
    t.close()


@pytest.mark.parametrize("how", ["ctx 0", "primary 0"])
def test_a_context_the_driver_refuses_gives_its_reservation_back(any_build: tuple[Toolchain, Path],
                                                                  tmp_path: Path, how: str) -> None:
    # The shim reserves a further context before the driver's call; the driver then refuses it (the GPU
    # is full with a neighbour's memory): the reservation must come back, and the creation lock with it.
    node = Node(any_build, tmp_path, memory_mib=1024)
    try:
        n1 = tenant(node, name="n1")
        assert n1.cmd("ctx 0") == "ok ctx rc=0 i=0"
        assert n1.cmd(f"alloc {CTX * MIB}") == "ok alloc rc=0"
        t = tenant(node)
        assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"  # 900 of the GPU's 1024 MiB now used
        for _ in range(3):
            reply = t.cmd(how)
            assert reply.startswith("fail") and "rc=2" in reply, (reply, t.log())
            assert charged(node) == CTX * MIB
        n1.close()
        assert t.cmd(how).startswith("ok"), t.log()  # the lock is free: the next creation goes through
        assert charged(node) == 2 * CTX * MIB
        t.close()
        assert charged(node) == 0
    finally:
        node.stop()


@pytest.mark.parametrize("first", [True, False], ids=["first", "further"])
def test_fork_while_a_thread_is_inside_a_context_creation(node: Node, first: bool) -> None:
    # A thread is inside the driver's context creation (the shim's creation lock held, and for the
    # process's first context the host-pid learning's too) when another forks: the child must create its
    # own context (the locks are free in it) and be charged only that, and the parent's creation end
    # with the charge it reserved.
    t = tenant(node, limit="2g")
    if not first:
        assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    t.cmd(f"env FAKE_CUDA_CTX_GATE {node.tmp / 'gate'}")
    assert t.cmd("bg 0 ctx 0") == "ok bg"
    t.wait_err(GATE)
    held = 0 if first else CTX * MIB
    # the child's own context only (and the parent's, but for the first one not yet charged)
    assert t.cmd("fork 0") == f"child used={held + held + CTX * MIB} rc=0", t.log()
    assert t.reply() == "ok fork exited=1 status=0", t.log()
    (node.tmp / "gate").touch()
    assert t.cmd("join 0").startswith("ok join rc=0"), t.log()
    assert charged(node) == held + CTX * MIB
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    if not first:
        assert t.cmd("destroy 1") == "ok destroy rc=0"
    assert charged(node) == 0
    t.close()


def test_more_processes_do_not_hold_contexts_past_the_limit(node: Node) -> None:
    # A process's first context on a device was never refused (its cost is measured once it exists):
    # a tenant that filled its limit started more processes, each holding a context past the limit
    # (300 MiB of the GPU each, charged but never refused). Once a process of the container has measured
    # what a context costs, every process's first context there is reserved at that cost before the
    # driver's call and refused past the limit, as the driver refuses one on a full GPU.
    first = tenant(node)
    assert first.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert first.cmd(f"alloc {600 * MIB}") == "ok alloc rc=0"
    for how in ("ctx 0", "primary 0"):
        other = tenant(node)
        reply = other.cmd(how)
        assert reply.startswith("fail") and "rc=2" in reply, (reply, other.log())
        other.wait_err(f"out of memory on device 0: request {CTX * MIB} bytes")
        assert charged(node) == (CTX + 600) * MIB
        other.close()
    assert first.cmd("destroy 0") == "ok destroy rc=0"  # room again: a second process's context fits
    second = tenant(node)
    assert second.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert charged(node) == CTX * MIB
    second.close()
    first.close()
    assert charged(node) == 0


def test_a_process_alone_under_a_limit_below_a_context_still_gets_its_first_context(node: Node) -> None:
    # The reservation of a first context at the container's known cost must not take from a process
    # what it had before: a process alone in its container, with a limit below one context, still gets
    # its first context (charged once it exists), and a later process of the container after it exited.
    t = tenant(node, limit="256m")
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert charged(node) == CTX * MIB
    t.close()
    t2 = tenant(node, limit="256m")
    assert t2.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert charged(node) == CTX * MIB
    t2.close()


def test_retains_and_releases_waiting_on_a_first_creation_neither_hang_nor_leak(node: Node) -> None:
    # The process's first context is in the driver, holding the host-pid learning's lock and the GPU's
    # creation lock, while one thread retains the primary context there (it waits for the learning) and
    # another releases it (it waits for the creation lock). Once the creation ends every call returns
    # (no lock order inversion), and what is charged is exactly the contexts left: the release either
    # came first (nothing to release) or dropped the retained primary context.
    t = tenant(node, limit="2g")
    t.cmd(f"env FAKE_CUDA_CTX_GATE {node.tmp / 'gate'}")
    assert t.cmd("bg 0 ctx 0") == "ok bg"
    t.wait_err(GATE)
    assert t.cmd("bg 1 primary 0") == "ok bg"
    assert t.cmd("blocked 1") == "ok blocked"
    assert t.cmd("bg 2 release 0") == "ok bg"
    assert t.cmd("blocked 2") == "ok blocked"
    (node.tmp / "gate").touch()
    assert t.cmd("join 0") == "ok join rc=0 i=0", t.log()
    assert t.cmd("join 1") == "ok join rc=0 i=-1", t.log()
    released = t.cmd("join 2").startswith("ok")
    assert charged(node) == (1 if released else 2) * CTX * MIB, t.log()
    if not released:
        assert t.cmd("release 0") == "ok release rc=0"
    assert charged(node) == CTX * MIB
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    assert charged(node) == 0
    t.close()
