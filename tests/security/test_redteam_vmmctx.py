"""Red team: VMM memory outlives the context it was made in (docs/shim.md "Memory limit").

The CUDA driver documents that ``cuCtxDestroy`` does not free memory from ``cuMemCreate`` (nor
``cuMemAllocAsync`` / ``cuMemAllocFromPoolAsync``): it belongs to no context and stays allocated until it is
released (and unmapped) or the process exits. The shim dropped a destroyed context's ``cuMemCreate`` handles
from its accounting, so a tenant under a 1 GiB limit could create a context, take 600 MiB with
``cuMemCreate``, destroy the context and do it again, holding 1.2 GiB and more. The fake driver keeps such
memory across the destruction as documented (checked without the shim); each tenant is its own container on
the fake driver and NVML (tests/fakes), with the plain and the sanitised builds. The program is
tests/security/ctxcost_redteam.c ("steps").
"""

from __future__ import annotations

from pathlib import Path

from tests.libvgpu.shim_helpers import GIB, MIB, program_fixtures
from tests.security.test_redteam_ctxcost import charged, own, tenant
from tests.security.test_redteam_hostpid_probe import Node

SRC = Path(__file__).resolve().parent / "ctxcost_redteam.c"
CTX = 300  # MiB a context takes on the fake driver (FAKE_CUDA_CTX_MIB's default)
PART = 600 * MIB  # two of them are past the 1 GiB limit

built, built_asan, any_build = program_fixtures(SRC, "vmmctx")


def test_the_fake_driver_keeps_vmm_memory_of_a_destroyed_context(node: Node) -> None:
    # Without the shim: the 600 MiB stays the process's after its context is gone, until cuMemRelease.
    t = node.start("tenant", "steps", LD_PRELOAD="")
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd(f"vmm 0 {PART}") == "ok vmm rc=0"
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    assert own(t) == PART
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=1"
    assert t.cmd("vmmrelease") == "ok vmmrelease rc=0"
    assert own(t) == CTX * MIB
    t.close()


def test_vmm_memory_stays_charged_after_its_context_is_destroyed(node: Node) -> None:
    # The tenant's second 600 MiB in a new context is refused: the first is still on the GPU. Released, it is
    # given back and the second fits.
    t = tenant(node)
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=0"
    assert t.cmd(f"vmm 0 {PART}") == "ok vmm rc=0"
    assert t.cmd("destroy 0") == "ok destroy rc=0"
    assert charged(node) == PART, t.log()  # the context's cost went, the memory did not
    assert t.cmd("ctx 0") == "ok ctx rc=0 i=1"
    assert t.cmd(f"vmm 0 {PART}") == "fail vmm rc=2", t.log()
    assert own(t) <= GIB
    assert t.cmd("vmmrelease") == "ok vmmrelease rc=0"
    assert charged(node) == CTX * MIB, t.log()
    assert t.cmd(f"vmm 0 {PART}") == "ok vmm rc=0"
    assert own(t) == CTX * MIB + PART
    t.close()
