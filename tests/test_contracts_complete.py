"""docs/CONTRACTS.md is what README.md calls it: every command's flags. Each option of each
command's parser (subcommands included) is named in that command's row; test_docs_links.py checks
the other direction (every flag the docs name exists)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kube_vgpu_cli import PARSERS
from tests.cli_parsers import command_options

CONTRACTS = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md").read_text()

#: the row's command (first cell): every command of kube_vgpu_cli.PARSERS (the plugin's row is named
#: by its executable, kubectl-vgpu)
ROWS = {("kubectl-vgpu" if c == "kubectl vgpu" else c): c for c in PARSERS}
#: named once for every service in the text above the table
COMMON = {"-h", "--help", "--log-level"}


def _row(command: str) -> str:
    for line in CONTRACTS.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and re.match(r"\|\s*`" + re.escape(command) + "`", cells[0]):
            return line
    raise AssertionError(f"CONTRACTS.md has no row for {command}")


@pytest.mark.parametrize("command", sorted(ROWS))
def test_every_option_is_in_its_row(command: str) -> None:
    options = command_options(ROWS[command]) - COMMON
    row = _row(command)
    missing = sorted(o for o in options if not re.search(r"(?<![\w-])" + re.escape(o) + r"(?![\w-])", row))
    assert not missing, f"CONTRACTS.md's {command} row lacks {', '.join(missing)}"
