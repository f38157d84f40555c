"""Every `helm install` / `helm upgrade` command line the docs show renders with the values it sets
(`--set`, `--set-string`, `--set-json`, `-f`), and one the docs show failing fails with the output
shown. A newcomer copies these lines first: a value the schema refuses or that no longer exists
must fail here, not on their cluster. Inline spans made of `--set` options count too."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts" / "kube-vgpu" / "README.md"]
SET_OPTIONS = ("--set", "--set-string", "--set-json", "-f", "--values")


def _blocks(text: str) -> list[list[str]]:
    """Fenced code blocks as lists of logical lines (backslash continuations joined)."""
    out = []
    for body in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines: list[str] = []
        for raw in body.splitlines():
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + raw.strip()
            else:
                lines.append(raw.strip())
        out.append(lines)
    return out


def _set_args(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    args = []
    for i, w in enumerate(words):
        if w in SET_OPTIONS and i + 1 < len(words):
            value = words[i + 1]
            args += [w, str(ROOT / value) if w in ("-f", "--values") else value]
    return args


def _commands() -> list[Any]:
    cases = []
    for doc in DOCS:
        if not doc.exists():
            continue
        text = doc.read_text()
        for block in _blocks(text):
            for i, line in enumerate(block):
                cmd = line.removeprefix("$ ")
                if not re.match(r"helm (install|upgrade) ", cmd):
                    continue
                shown = []
                if line.startswith("$ "):  # a transcript: the lines up to the next prompt are its output
                    shown = [o for o in block[i + 1:] if o][:next((k for k, o in enumerate(block[i + 1:])
                                                                    if o.startswith("$ ")), None)]
                cases.append(pytest.param(_set_args(cmd), shown, id=f"{doc.name}:{cmd[:60]}"))
        for span in re.findall(r"`(--set[^`]*)`", text):
            cases.append(pytest.param(_set_args(span), [], id=f"{doc.name}:{span[:60]}"))
    return cases


CASES = _commands()


def test_the_docs_show_helm_commands() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize(("args", "shown"), CASES)
def test_documented_helm_command_renders_as_shown(renderer: Any, args: list[str], shown: list[str]) -> None:
    r = renderer.template(extra=args)
    if shown and shown[0].startswith("Error:"):
        assert r.returncode != 0, f"the docs show {args} failing; it renders"
        for line in shown:
            assert line in r.stderr, f"the docs show {line!r}; helm says:\n{r.stderr}"
    else:
        assert r.returncode == 0, f"{' '.join(args)}:\n{r.stderr}"
