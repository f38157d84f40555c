"""Fixtures for the libvgpu tests: everything is compiled once per session with gcc."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator

import pytest

from tests.fakes import build as fakebuild
from tests.libvgpu.shim_helpers import Toolchain, shared_toolchain


@pytest.fixture(scope="package", autouse=True)
def _simulated_gpu_ahead_of_other_load() -> Iterator[None]:
    """The fake driver keeps simulated GPU time on the wall clock: a kernel keeps its device busy
    for so many ns whether or not the host CPU runs the tenant. On a machine busy with other work
    the tenants, the fake NVML's sampler and the shim's limiter thread then lose the CPU for tens of
    ms at a time and the measured shares drift from what the limiter does on a real GPU (whose
    clock no host load stops). Where the OS allows it (root), these tests and every process they
    start (tenants inherit the niceness) run at nice -10 so other load on the machine cannot
    starve the simulation; elsewhere they run as they are."""
    try:
        old = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:  # not permitted: unchanged
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, old)


def _need_gcc() -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")


@pytest.fixture(scope="session")
def tc(tmp_path_factory: pytest.TempPathFactory) -> Toolchain:
    """Fakes, shim and scenario program, optimised build."""
    _need_gcc()
    return shared_toolchain(tmp_path_factory)


@pytest.fixture(scope="session")
def tc_asan(tmp_path_factory: pytest.TempPathFactory) -> Toolchain:
    """The same, built with AddressSanitizer."""
    _need_gcc()
    try:
        fakebuild.asan_runtime()
        return shared_toolchain(tmp_path_factory, asan=True)
    except fakebuild.BuildError as exc:  # pragma: no cover - toolchains without libasan
        pytest.skip(f"AddressSanitizer unavailable: {exc}")


@pytest.fixture(scope="session")
def tc_limits(tc: Toolchain) -> Toolchain:
    """The same fakes and program with a shim whose limits-file path is ``<tmp>/limits/vgpu.limits``
    (``limits_path(tc_limits)``); tests that write the file remove it (fixture ``limits_file``)."""
    out = tc.tmp / "limits-shim"
    shim = fakebuild.build_shim(out, limits_path=tc.tmp / "limits" / "vgpu.limits")
    return dataclasses.replace(tc, built=dataclasses.replace(tc.built, shim=shim))
