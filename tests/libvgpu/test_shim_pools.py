"""Memory that CUDA memory pools keep reserved is charged to the process whose allocations it held.

``cuMemFreeAsync`` returns memory to the pool, not to the driver: the pool keeps it reserved (the
container still holds it) until a synchronisation releases what exceeds the pool's release threshold,
or ``cuMemPoolTrimTo``. The fake driver's pools behave so (``tests/fakes/fakecuda.c``), and report
``CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT``. Before, a process could free asynchronously (uncharged at
once) and then allocate the same memory again elsewhere: 600 MiB in the pool + 600 MiB more under a
1 GiB limit.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from libvgpu.region import read_region
from tests.libvgpu.shim_helpers import MIB, Toolchain, parse, rc_usage, run

M600 = 600 * MIB


@pytest.mark.parametrize("mode", ["direct", "procaddr"])
def test_pool_reserve_is_charged_until_the_driver_releases_it(tc: Toolchain, mode: str) -> None:
    out = parse(run(tc, mode, "pool", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0").stdout)
    assert rc_usage(out["freeasync"]) == (0, M600)  # freed into the pool: still held
    assert rc_usage(out["alloc600_pool_holds"]) == (2, M600)  # 600 in the pool + 600 more > 1 GiB
    assert rc_usage(out["async600_reuse"]) == (0, M600)  # taken from the pool's reserve: no new charge
    assert rc_usage(out["alloc600_released"]) == (0, M600)  # the sync released the pool: 600 fits
    assert rc_usage(out["free"]) == (0, 0)
    assert rc_usage(out["sync_keep"]) == (0, M600)  # release threshold: the pool keeps it past a sync
    assert rc_usage(out["alloc600_kept"]) == (2, M600)
    assert rc_usage(out["trim"]) == (0, 0)  # cuMemPoolTrimTo gave it back
    assert rc_usage(out["alloc600_trimmed"]) == (0, M600)


def test_pool_reserve_is_charged_to_the_owning_process(tc: Toolchain, tmp_path: Path) -> None:
    cache = tmp_path / "vgpu.cache"
    env = tc.env(CUDA_DEVICE_MEMORY_LIMIT_0="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache),
                 LIBVGPU_CONTEXT_COST="0")
    owner = subprocess.Popen([str(tc.prog), "direct", "pool_hold", "600", "60"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert rc_usage(parse(owner.stdout.readline())["held"]) == (0, M600)
        slots = {p.pid: p.used[0] for p in read_region(cache).processes}
        assert list(slots.values()) == [M600], slots  # in the owner's slot
        other = run(tc, "direct", "alloc_bytes", str(M600), CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                    CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
        assert rc_usage(parse(other.stdout)["alloc"]) == (2, M600)  # another process cannot take it
    finally:
        owner.kill()
        owner.wait(timeout=10)
    # the owner is gone (the driver freed its pools): its charge is reclaimed
    other = run(tc, "direct", "alloc_bytes", str(M600), CUDA_DEVICE_MEMORY_LIMIT_0="1g",
                CUDA_DEVICE_MEMORY_SHARED_CACHE=str(cache), LIBVGPU_CONTEXT_COST="0")
    assert rc_usage(parse(other.stdout)["alloc"])[0] == 0


def test_pool_accounting_is_asan_clean(tc_asan: Toolchain) -> None:
    p = run(tc_asan, "dlsym", "pool", CUDA_DEVICE_MEMORY_LIMIT_0="1g", LIBVGPU_CONTEXT_COST="0")
    assert "ERROR: AddressSanitizer" not in p.stderr, p.stderr[-3000:]
    assert rc_usage(parse(p.stdout)["alloc600_pool_holds"]) == (2, M600)
