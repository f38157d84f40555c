"""docs/CONTRACTS.md is what README.md calls it: every command's flags. Each option of each
command's parser (subcommands included) is named in that command's row; test_docs_links.py checks
the other direction (every flag the docs name exists)."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

CONTRACTS = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md").read_text()

#: the row's command (first cell) -> (module, parser factory)
ROWS = {
    "kube-vgpu scheduler": ("scheduler.server", "build_parser"),
    "kube-vgpu webhook": ("webhook.server", "build_parser"),
    "kube-vgpu device-plugin": ("deviceplugin.main", "parser"),
    "kube-vgpu dra-plugin": ("deviceplugin.dra.main", "parser"),
    "kube-vgpu certs": ("certs.main", "build_parser"),
    "kube-vgpu certs signing-keys ensure": ("certs.signing_keys", "build_parser"),
    "kube-vgpu replay": ("replay.main", "_parser"),
    "kubectl-vgpu": ("kubectl_vgpu.main", "_parser"),
    "kube-vgpu check-config": ("kube_vgpu_cli", "check_config_parser"),
}
#: named once for every service in the text above the table
COMMON = {"-h", "--help", "--log-level"}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for a in parser._actions:
        out.update(a.option_strings)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _options(sub)
    return out


def _row(command: str) -> str:
    for line in CONTRACTS.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and re.match(r"\|\s*`" + re.escape(command) + "`", cells[0]):
            return line
    raise AssertionError(f"CONTRACTS.md has no row for {command}")


@pytest.mark.parametrize("command", sorted(ROWS))
def test_every_option_is_in_its_row(command: str) -> None:
    module, factory = ROWS[command]
    options = _options(getattr(importlib.import_module(module), factory)()) - COMMON
    row = _row(command)
    missing = sorted(o for o in options if not re.search(r"(?<![\w-])" + re.escape(o) + r"(?![\w-])", row))
    assert not missing, f"CONTRACTS.md's {command} row lacks {', '.join(missing)}"
