"""The GitHub Actions workflows, checked offline (no runner is reachable from CI): valid YAML of the
right shape, every action pinned to a full commit, no `${{ }}` expression inside a shell script
(script injection), least privilege, and every file, script and make target they name exists."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), path
    if True in doc:  # YAML 1.1 reads the key `on` as a boolean
        doc["on"] = doc.pop(True)
    return doc


def steps(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, s) for name, job in doc["jobs"].items() for s in job["steps"]]


def test_there_are_ci_and_release_workflows() -> None:
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "release.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_shape_and_least_privilege(path: Path) -> None:
    doc = load(path)
    assert doc.get("name") and doc.get("on") and doc.get("jobs"), path
    assert doc.get("permissions") == {"contents": "read"}, "default token must be read-only"
    for name, job in doc["jobs"].items():
        assert job.get("runs-on") and job.get("steps"), name
        assert isinstance(job.get("timeout-minutes"), int), f"{name}: no timeout-minutes"
        needs = job.get("needs") or []
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in doc["jobs"], f"{name} needs unknown job {need}"
        for s in job["steps"]:
            assert ("uses" in s) != ("run" in s), f"{name}: a step must either use an action or run a script"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_pinned_and_scripts_free_of_expressions(path: Path) -> None:
    text = path.read_text()
    for job, s in steps(load(path)):
        if "uses" in s:
            assert PINNED.match(s["uses"]), f"{job}: {s['uses']} is not pinned to a full commit SHA"
            line = next(ln for ln in text.splitlines() if s["uses"] in ln)
            assert re.search(r"#\s*v\d+\.\d+\.\d+", line), f"{job}: {s['uses']} has no version comment"
        else:
            assert "${{" not in s["run"], f"{job}: an expression inside a script (pass it through env:)"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_named_files_scripts_and_targets_exist(path: Path) -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    for job, s in steps(load(path)):
        script = s.get("run", "")
        for t in re.findall(r"\bmake (\w[\w-]*)", script):
            assert t in targets, f"{job}: make {t} is not a Makefile target"
        for f in re.findall(r"(?:^|\s)((?:\.ci|scripts|docker)/[\w./-]+)", script):
            assert (ROOT / f).exists(), f"{job}: {f} does not exist"
        if script.strip() == ".ci/run":
            assert os.access(ROOT / ".ci" / "run", os.X_OK)
        w = s.get("with") or {}
        if "file" in w:
            assert (ROOT / w["file"]).is_file(), w["file"]


def test_release_builds_both_architectures_and_the_dockerfile_has_a_shim_builder_for_each() -> None:
    doc = load(ROOT / ".github" / "workflows" / "release.yml")
    build = next(s for _, s in steps(doc) if "build-push-action" in s.get("uses", ""))
    platforms = set(build["with"]["platforms"].split(","))
    assert platforms == {"linux/amd64", "linux/arm64"}
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for arch in ("amd64", "arm64"):
        assert re.search(rf"^FROM \S+ AS shim-builder-{arch}$", dockerfile, re.M), arch
    assert "FROM shim-builder-${TARGETARCH} AS shim" in dockerfile
    assert doc["on"]["push"]["tags"] == ["v*.*.*"]


def test_make_chart_refuses_a_version_that_is_not_the_charts() -> None:
    r = subprocess.run(["make", "-s", "chart", "VERSION=0.0.0-not-the-chart", "HELM=/bin/false"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "but Chart.yaml has version" in r.stderr, r.stderr
