"""kube_vgpu.cli: the kube-vgpu console script dispatcher."""

from __future__ import annotations

import sys
import types

import pytest

import kube_vgpu
from kube_vgpu.cli import SUBCOMMANDS, main


def test_no_args_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: kube-vgpu" in out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert "usage: kube-vgpu" in capsys.readouterr().out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    cap = capsys.readouterr()
    assert "unknown command 'frobnicate'" in cap.err
    assert "usage: kube-vgpu" in cap.err
    assert cap.out == ""


@pytest.mark.parametrize("flag", ["--version", "version"])
def test_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == kube_vgpu.__version__ == "0.1.0"


def test_subcommand_targets_are_module_function() -> None:
    for target, desc in SUBCOMMANDS.values():
        mod, _, func = target.partition(":")
        assert mod and func and desc


def test_dispatch_passes_remaining_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("kvg_fake_cmd")
    fake.main = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvg_fake_cmd", fake)
    monkeypatch.setitem(SUBCOMMANDS, "fake", ("kvg_fake_cmd:main", "test"))
    assert main(["fake", "--x", "1"]) == 7
    assert seen == [["--x", "1"]]
