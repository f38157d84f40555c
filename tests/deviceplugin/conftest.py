"""Fixtures for the device plugin tests: a fake libnvidia-ml.so.1 (built from tests/fakes/fakenvml.c),
a fake kubelet speaking the real v1beta1 gRPC protocol on unix sockets, and the in-process fake
Kubernetes API (tests/fakeapi)."""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dp_helpers import FakeGPUs, FakeKubelet, build_fake_nvml

_LOADED: list[Path] = []


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake NVML, loaded RTLD_GLOBAL in this process so pynvml's CDLL("libnvidia-ml.so.1") gets it.
    Built once per session: the modules that import this fixture each hold a definition of it, and
    only the first library loaded under that soname is ever used."""
    if not _LOADED:
        lib = build_fake_nvml(tmp_path_factory.mktemp("fakenvml"))
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        _LOADED.append(lib)
    return _LOADED[0]


@pytest.fixture
def gpus(fake_nvml_lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeGPUs:
    g = FakeGPUs(tmp_path)
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(g.config))
    monkeypatch.setenv("FAKE_NVML_EVENTS", str(g.events))
    monkeypatch.delenv("FAKE_GPU_STATE", raising=False)
    return g


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvdp", dir="/tmp")  # unix socket paths must stay < 108 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: str) -> Iterator[FakeKubelet]:
    k = FakeKubelet(sockdir)
    k.start()
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def kube_api(fake_kube_api: Any) -> Any:
    """The shared fake API server (tests/fakeapi/fixtures.py) under this suite's name."""
    return fake_kube_api


