"""Fixtures for the libvgpu tests: everything is compiled once per session with gcc."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from tests.fakes import build as fakebuild
from tests.libvgpu.shim_helpers import Toolchain, make_toolchain


def _need_gcc() -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")


@pytest.fixture(scope="session")
def tc(tmp_path_factory: pytest.TempPathFactory) -> Toolchain:
    """Fakes, shim and scenario program, optimised build."""
    _need_gcc()
    return make_toolchain(tmp_path_factory.mktemp("vgpu"))


@pytest.fixture(scope="session")
def tc_asan(tmp_path_factory: pytest.TempPathFactory) -> Toolchain:
    """The same, built with AddressSanitizer."""
    _need_gcc()
    try:
        fakebuild.asan_runtime()
        return make_toolchain(tmp_path_factory.mktemp("vgpu-asan"), asan=True)
    except fakebuild.BuildError as exc:  # pragma: no cover - toolchains without libasan
        pytest.skip(f"AddressSanitizer unavailable: {exc}")


@pytest.fixture(scope="session")
def tc_limits(tc: Toolchain) -> Toolchain:
    """The same fakes and program with a shim whose limits-file path is ``<tmp>/limits/vgpu.limits``
    (``limits_path(tc_limits)``); tests that write the file remove it (fixture ``limits_file``)."""
    out = tc.tmp / "limits-shim"
    shim = fakebuild.build_shim(out, limits_path=tc.tmp / "limits" / "vgpu.limits")
    return dataclasses.replace(tc, built=dataclasses.replace(tc.built, shim=shim))
