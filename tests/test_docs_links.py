"""The docs stay true to the code: every relative link in README.md and docs/ resolves to a file in
the repository (and its ``#anchor`` to a heading of that file); every flag written after a ``kube-vgpu <command>`` or ``kubectl vgpu <command>``
exists in that command's parser; every port in observability.md's table is the chart's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kube_vgpu_cli import PARSERS
from tests.cli_parsers import command_options

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

#: command -> its options (``kube-vgpu certs`` also takes ``signing-keys ensure``'s)
COMMANDS = [c for c in PARSERS if c != "kube-vgpu certs signing-keys ensure"] + ["kube-vgpu simulate"]
OPTIONS = {cmd: command_options(cmd) for cmd in COMMANDS}
OPTIONS["kube-vgpu certs"] |= command_options("kube-vgpu certs signing-keys ensure")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        assert (doc.parent / path).exists(), f"{doc.name}: link to {target} which does not exist"
        if anchor and (path == "" or path.endswith(".md")):
            assert anchor in _anchors(doc.parent / path if path else doc), \
                f"{doc.name}: link to {target}: no heading of {path or doc.name} has the anchor #{anchor}"


def _anchors(md: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lowercased, punctuation other than '-'
    and '_' dropped, spaces as '-' (headings inside code blocks do not count)."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6}\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_flags_named_after_a_command_exist(doc: Path) -> None:
    text = doc.read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + [ln for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
                                                 for ln in b.splitlines()]
    for span in spans:
        for m in re.finditer(r"\b(kube-vgpu (?:scheduler|webhook|device-plugin|dra-plugin|certs|replay|simulate)|kubectl vgpu)\b"
                             r"([^|#;]*)", span):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                assert flag in OPTIONS[m.group(1)], f"{doc.name}: `{m.group(0).strip()}`: {m.group(1)} has no {flag}"


def test_observability_ports_are_the_charts() -> None:
    values = yaml.safe_load((ROOT / "charts" / "kube-vgpu" / "values.yaml").read_text())
    ports = {values["scheduler"]["extender"]["metricsPort"], values["devicePlugin"]["metricsPort"],
             values["webhook"]["port"]}
    text = (ROOT / "docs" / "observability.md").read_text()
    named = {int(p) for p in re.findall(r"^\| (?:scheduler extender|extender|webhook|device plugin) \| (\d+)", text, re.M)}
    assert len(named) == 3 and named <= ports, (named, ports)


def test_changelog_exists_with_a_section_per_chart_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "kube-vgpu" / "Chart.yaml").read_text())
    assert f"## {chart['version']}" in (ROOT / "CHANGELOG.md").read_text()
