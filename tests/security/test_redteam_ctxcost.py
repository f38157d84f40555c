"""Red team: the context cost the shim charges (docs/shim.md "Context cost").

A CUDA context takes device memory the program never allocates itself (on the fake driver
FAKE_CUDA_CTX_MIB, 300 MiB by default). The shim charges it against the container's memory limit:
measured once per process and device (the rise of the process's own pid in NVML's process list), then
the same for every context the process holds there. These tests play a tenant that wants more memory
than its limit by making its contexts look cheaper than they are (several contexts on one device,
every cuCtxCreate version and the primary context together, a context destroyed while another is
being created, a fork after the first context, a GPU with more processes than one listing holds), and
check that every charge is given back once the contexts are gone, on the fake driver and NVML
(tests/fakes), with the plain and the sanitised builds. Each tenant is its own container (its own
accounting file).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kube_vgpu.shimregion import read_region
from tests.libvgpu.shim_helpers import GIB, MIB, Toolchain, program_fixtures
from tests.security.test_redteam_hostpid_probe import BEFORE, WAIT_S, Node, Proc, learned

SRC = Path(__file__).resolve().parent / "ctxcost_redteam.c"
CTX = 300  # MiB a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
GATE = "fake cuda: context creation waits at the gate"
LIST_GATE = "fake nvml: listing waits at the gate"


built, built_asan, any_build = program_fixtures(SRC, "ctxcost")


def tenant(node: Node, limit: str = "1g", **env: str) -> Proc:
    return node.start("tenant", "steps", CUDA_DEVICE_MEMORY_LIMIT=limit, **env)


def used(p: Proc) -> int:
    """What the shim charges the tenant's container (cuMemGetInfo in the current context), bytes."""
    m = re.fullmatch(r"ok meminfo rc=0 used=(\d+) total=\d+", p.cmd("meminfo"))
    assert m, p.log()
    return int(m.group(1))


def own(p: Proc, dev: int = 0) -> int:
    """What NVML shows the tenant's process using on ``dev``, bytes."""
    m = re.fullmatch(r"ok own bytes=(\d+)", p.cmd(f"own {dev}"))
    assert m, p.log()
    return int(m.group(1))


def whole_log(p: Proc) -> str:
    """The shim's log of an exited process, once all of it has been read."""
    with p.cond:
        assert p.cond.wait_for(lambda: "<eof>" in p.err, timeout=WAIT_S), p.log()
    return p.log()


def charged(node: Node, name: str = "tenant", dev: int = 0) -> int:
    """The container's charge on ``dev`` as its accounting file holds it, bytes."""
    return read_region(node.tmp / f"{name}.cache").used[dev]


@pytest.mark.parametrize("versions", [("v2", "v2", "v2"), ("v1", "v3", "v4"), ("primary", "v2", "v4")])
def test_every_context_on_a_device_is_charged(node: Node, versions: tuple[str, ...]) -> None:
    # Only the process's first context on a device was charged: three contexts (any cuCtxCreate version,
    # and the primary context next to them) took 900 MiB of the GPU under a 1 GiB limit charged 300,
    # and the tenant could then allocate 700 MiB more (1.6 GiB in all).
    t = tenant(node)
    for v in versions:
        reply = t.cmd("primary 0") if v == "primary" else t.cmd(f"ctx 0 {v}")
        assert reply.startswith("ok"), (reply, t.log())
    assert own(t) == 3 * CTX * MIB
    assert used(t) == 3 * CTX * MIB, t.log()
    assert t.cmd(f"alloc {200 * MIB}") == "fail alloc rc=2", t.log()  # 900 + 200 > 1024
    assert t.cmd(f"alloc {100 * MIB}") == "ok alloc rc=0"
    assert own(t) <= GIB
    t.close()


@pytest.mark.parametrize("how", ["ctx 0", "ctx 0 v4", "primary 0"])
def test_a_further_context_past_the_limit_is_refused(node: Node, how: str) -> None:
    # A context never failed because of its cost: a tenant that filled its limit with allocations then
    # created more contexts, each 300 MiB of the GPU past its limit (charged, but held). A context past
    # the limit whose cost is known (every one after the process's first on the device) is refused as
    # the driver refuses one on a full GPU; one that fits still succeeds.
    t = tenant(node)
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd(f"alloc {700 * MIB}") == "ok alloc rc=0"
    reply = t.cmd(how)
    assert reply.startswith("fail") and " rc=2" in reply, (reply, t.log())
    assert own(t) == (CTX + 700) * MIB, t.log()
    assert charged(node) == (CTX + 700) * MIB
    t.wait_err(f"out of memory on device 0: request {CTX * MIB} bytes")
    t.close()
    t2 = tenant(node)  # the same container, now with room: a second context fits
    assert t2.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t2.cmd(how).startswith("ok"), t2.log()
    assert charged(node) == 2 * CTX * MIB
    t2.close()


def test_allocations_while_the_cost_is_settled_fit_next_to_the_largest_rise(any_build: tuple[Toolchain, Path],
                                                                            tmp_path: Path) -> None:
    # Until a process knows its NVML pid, its new context is charged the smallest rise in NVML's list
    # (so that the probe fits), then its own once the pid is learned. Another process of the tenant
    # allocates 2 MiB while the context comes up (the smallest rise, 2 MiB) and a thread allocates
    # 900 MiB on that GPU before the pid is learned: both fitted under 1 GiB next to the 2 MiB charged,
    # and the context's 300 MiB, charged after, put the tenant 200 MiB past its limit for good. Until the
    # cost is settled, other allocations must fit next to the largest rise.
    node = Node(any_build, tmp_path, gpus=2)
    try:
        gate, lgate = node.tmp / "gate", node.tmp / "lgate"
        colluder = node.start("colluder", "steps")
        assert colluder.cmd("ctx 0") == "ok ctx rc=0 i=0"
        t = tenant(node)
        # its context on GPU 1 comes up with a perfect mimic's: the pid stays unknown
        t.cmd("env FAKE_NVML_TWIN 1")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
        t.send("ctx 1")
        t.wait_err(BEFORE, 1)
        node.neighbour("n1", 1, "hold")
        assert t.reply() == "ok ctx rc=0 i=0"
        t.wait_err("could not learn this process's NVML pid")
        t.cmd("env FAKE_NVML_TWIN 0")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 0")
        # its first context on GPU 0, held in the driver; the colluder's 2 MiB meanwhile
        t.cmd(f"env FAKE_CUDA_CTX_GATE {gate}")
        assert t.cmd("bgctx 0") == "ok bgctx"
        t.wait_err(GATE)
        assert colluder.cmd(f"alloc {2 * MIB}") == "ok alloc rc=0"
        t.cmd(f"env FAKE_NVML_LIST_GATE {lgate}")
        gate.touch()
        t.wait_err(LIST_GATE, 1)  # the listing that measures the context
        lgate.touch()
        t.wait_err(LIST_GATE, 2)  # the learning's listing: the context is charged the smallest rise now
        reply = t.cmd(f"vmm 0 {900 * MIB}")  # from its context on GPU 1, located on GPU 0
        lgate.touch()
        assert t.cmd("join") == "ok join rc=0 i=1"
        assert reply == "fail vmm rc=2", (reply, t.log())
        assert charged(node, dev=0) == CTX * MIB, t.log()
        t.close()
        whole_log(t)
        assert learned(t) == [t.pid], t.log()
    finally:
        node.stop()


def test_a_context_larger_than_2_gib_is_charged(node: Node) -> None:
    # A rise of more than 2 GiB was taken for other tenants moving and charged nothing, also when it was
    # the process's own rise in NVML's process list, which no other tenant moves: a tenant whose context
    # takes 2.5 GiB (eager module loading of a large program) held it, and every further context on the
    # device, for free.
    big = 2560
    t = tenant(node, "8g", FAKE_CUDA_CTX_MIB=str(big))
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=1"
    assert own(t) == 2 * big * MIB
    assert used(t) == 2 * big * MIB, t.log()
    assert t.cmd(f"alloc {3 * GIB + 1}") == "fail alloc rc=2", t.log()
    t.close()


def test_a_tenant_near_its_limit_still_learns_its_pid_next_to_a_greedy_neighbour(node: Node) -> None:
    # The tenant's container is 3 MiB below its limit once the new context is charged, and a neighbour
    # starts at the same moment and allocates 1 GiB at once. The probe that tells the two new pids apart
    # was drawn from 2 to 32 MiB and given up when it did not fit: the pid stayed unknown, and the context
    # was charged the largest rise, the neighbour's 1.3 GiB, which starved the whole container. The probe
    # now takes a size that fits the room left (2 MiB here).
    gate = node.tmp / "gate"
    t = tenant(node, f"{CTX + 3}m")
    t.cmd(f"env FAKE_CUDA_CTX_GATE {gate}")
    t.send("ctx 0")
    t.wait_err(GATE)
    greedy = node.start("greedy", "hold", "0", str(GIB))
    assert greedy.reply().startswith("ready rc=0"), greedy.log()
    gate.touch()
    assert t.reply() == "ok ctx rc=0 i=0", t.log()
    assert charged(node) == CTX * MIB, t.log()
    t.close()
    whole_log(t)
    assert learned(t) == [t.pid], t.log()


def test_a_context_destroyed_while_another_is_created_leaves_the_new_one_charged(node: Node) -> None:
    # The tenant's second context is in the driver (the fake holds it at a gate) when another thread
    # destroys the first, the only one the shim counted. The shim had decided "not the first context:
    # nothing to measure" before the creation, and "the first context" after it, with nothing measured:
    # the new context was charged 0 and the tenant got 300 MiB of the GPU for free.
    gate = node.tmp / "gate"
    t = tenant(node)
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert used(t) == CTX * MIB
    t.cmd(f"env FAKE_CUDA_CTX_GATE {gate}")
    assert t.cmd("bgctx 0") == "ok bgctx"
    t.wait_err(GATE)
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    gate.touch()
    assert t.cmd("join") == "ok join rc=0 i=1"
    assert t.cmd("cur 1") == "ok cur rc=0"
    assert own(t) == CTX * MIB
    assert used(t) == CTX * MIB, t.log()
    t.close()


def test_first_contexts_created_at_once_by_two_threads_are_both_charged(node: Node) -> None:
    # Two threads create the process's first contexts on a device at the same moment: the second listed
    # NVML's processes (the measurement's "before") while the first's context was in the driver, over
    # the first's listing, so the first measured against a listing that already held its own context.
    # Creations on a device are serialised: each is measured or charged alone.
    gate = node.tmp / "gate"
    t = tenant(node, "4g")
    t.cmd(f"env FAKE_CUDA_CTX_GATE {gate}")
    assert t.cmd("bgctx 0") == "ok bgctx"
    t.wait_err(GATE)
    t.send("ctx 0")  # waits for the first creation to end
    gate.touch()
    assert t.reply() == "ok ctx rc=0 i=0", t.log()
    assert t.cmd("join") == "ok join rc=0 i=1"
    assert own(t) == 2 * CTX * MIB
    assert used(t) == 2 * CTX * MIB, t.log()
    t.close()
    assert whole_log(t).count("context costs") == 1, t.log()  # measured once


def test_memory_freed_on_the_gpu_during_the_measurement_does_not_lower_the_cost(
        any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # The tenant holds 290 MiB located on GPU 1 (cuMemCreate from its context on GPU 0) and releases it
    # while its first context on GPU 1 is in the driver: its own pid's memory there rose by 10 MiB
    # across the creation, and every context on GPU 1 was charged 10 MiB for its 300. What the process
    # itself gave back meanwhile (its own charge on the GPU fell by as much) is added back.
    node = Node(any_build, tmp_path, gpus=2)
    try:
        gate = node.tmp / "gate"
        t = tenant(node, "4g")
        assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
        assert t.cmd(f"vmm 1 {290 * MIB}") == "ok vmm rc=0"
        t.cmd(f"env FAKE_CUDA_CTX_GATE {gate}")
        assert t.cmd("bgctx 1") == "ok bgctx"
        t.wait_err(GATE)
        assert t.cmd("vmmrelease") == "ok vmmrelease rc=0"
        gate.touch()
        assert t.cmd("join") == "ok join rc=0 i=1"
        assert t.cmd("ctx 1") == "ok ctx rc=0 i=2"
        assert own(t, 1) == 2 * CTX * MIB
        assert charged(node, dev=1) == 2 * CTX * MIB, t.log()
        t.close()
    finally:
        node.stop()


def test_a_forked_child_is_charged_its_own_context(node: Node) -> None:
    # fork() after the first context: the child inherited the parent's count of contexts, so its own
    # first context (a new process: the driver gives it new memory) was never charged. Each forked child
    # held 300 MiB of the GPU for free.
    t = tenant(node)
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    t.send("fork 0")
    child = t.reply()
    assert t.reply() == "ok fork exited=1 status=0", t.log()
    # the container's file is shared: the child sees the parent's context and its own
    assert child == f"child used={2 * CTX * MIB} total={GIB}", (child, t.log())
    assert used(t) == CTX * MIB  # the child's charge went with it
    t.close()


def test_a_gpu_with_more_processes_than_one_listing_holds_does_not_make_the_cost_device_wide(node: Node) -> None:
    # 300 processes of other containers on the GPU (FAKE_NVML_EXTRA_PROCS) overflowed the shim's
    # 256-entry listing: NVML refused it, and the context cost fell back to the rise of the device's
    # used memory, which counts a neighbour's context created at the same moment (600 MiB for 300).
    t = tenant(node, "4g", FAKE_NVML_EXTRA_PROCS="300")
    t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
    t.send("ctx 0")
    t.wait_err(BEFORE, 1)
    n1 = node.neighbour("n1", 0, "hold")
    assert t.reply() == "ok ctx rc=0 i=0"
    assert used(t) == CTX * MIB, t.log()
    t.close()
    whole_log(t)
    assert n1.pid not in learned(t) and learned(t) == [t.pid], t.log()


def test_no_context_charge_is_left_once_every_context_is_gone(node: Node) -> None:
    # Every way a context goes (destroy, primary release and reset, several references, a context
    # re-created after the last one went, a forked child's) gives back exactly what it was charged:
    # the container is charged 0 once the tenant holds no context, never less than its contexts.
    t = tenant(node, "4g")
    steps = [
        ("ctx 0", 1), ("primary 0", 2), ("primary 0", 2), ("ctx 0 v3", 3), ("release 0", 3), ("destroy 0", 2),
        ("release 0", 1), ("destroy 1", 0), ("primary 0", 1), ("ctx 0 v4", 2), ("reset 0", 1), ("destroy 2", 0),
        ("ctx 0", 1),
    ]
    for step, contexts in steps:
        assert t.cmd(step).startswith("ok"), (step, t.log())
        assert own(t) == contexts * CTX * MIB, step
        assert charged(node) == contexts * CTX * MIB, (step, t.log())
    t.send("fork 0")
    assert t.reply() == f"child used={2 * CTX * MIB} total={4 * GIB}"
    assert t.reply() == "ok fork exited=1 status=0"
    assert t.cmd("destroy 3") == "ok destroy rc=0"
    assert charged(node) == 0, t.log()
    t.close()
