"""Packaging: the components' dependencies carry no plotting or progress stack (those are the
``sim`` extra); constraints.txt pins every declared dependency at a version its specifier allows
(reproducible installs: make install and the Dockerfile use it); the replay works without the
extra (no progress bar) and says which extra the plot needs."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            out[canonicalize_name(name)] = version
    return out


def test_components_do_not_depend_on_the_plotting_stack() -> None:
    core = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert not core & {"matplotlib", "tqdm"}
    sim = {canonicalize_name(Requirement(r).name) for r in PROJECT["optional-dependencies"]["sim"]}
    assert sim == {"matplotlib", "tqdm"}


def test_every_dependency_is_pinned_within_its_range() -> None:
    pinned = pins()
    reqs = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["sim"], *PROJECT["optional-dependencies"]["dev"]]
    for r in map(Requirement, reqs):
        name = canonicalize_name(r.name)
        assert name in pinned, f"{r.name} is not pinned in constraints.txt (make constraints)"
        assert r.specifier.contains(pinned[name], prereleases=True), f"{r.name}=={pinned[name]} outside {r.specifier}"


def test_replay_without_the_sim_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from replay import main as replay

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert replay._tqdm() is None
    curve = np.full(replay.MAX_PCT + 1, np.nan)
    curve[:3] = [0.0, 1.0, 2.0]
    r = replay.ReplayResult("binpack", 42, 8, curve, 10, 0, 0.1, np.zeros(0))
    with pytest.raises(replay.SimExtraMissing, match=r"pip install 'kube-vgpu\[sim\]'"):
        replay.write_outputs([r], tmp_path)
    assert (tmp_path / "allocation.csv").read_text().startswith("policy,seed,arrived_pct")


def _floor(name: str) -> str:
    for r in PROJECT["dependencies"]:
        req = Requirement(r)
        if canonicalize_name(req.name) == name:
            lows = [s.version for s in req.specifier if s.operator == ">="]
            assert len(lows) == 1, f"{name}: one >= floor expected in {r!r}"
            return lows[0]
    raise AssertionError(f"{name} is not a dependency")


def test_generated_grpc_stubs_load_on_the_declared_floors() -> None:
    """Every checked-in stub was written by the generator whose versions are pyproject's floors:
    protobuf gencode refuses a runtime older than itself and the grpc stubs a grpcio older than
    theirs, so a stub regenerated with a newer generator would break the declared range."""
    import re

    stubs = sorted((ROOT / "deviceplugin").rglob("*_pb2.py"))
    grpc_stubs = sorted((ROOT / "deviceplugin").rglob("*_pb2_grpc.py"))
    assert len(stubs) >= 4 and len(grpc_stubs) == len(stubs)
    for p in stubs:
        m = re.search(r"^# Protobuf Python Version: (\S+)$", p.read_text(), re.M)
        assert m and m.group(1) == _floor("protobuf"), (p.name, m and m.group(1))
    for p in grpc_stubs:
        m = re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", p.read_text(), re.M)
        assert m and m.group(1) == _floor("grpcio"), (p.name, m and m.group(1))
