"""The config is declared once (kube_vgpu/config.py); the loader, the chart's values.schema.json
and the key table in docs/configuration.md must agree with it and with each other.

The schema and docs table are generated (charts/tools/gen_schema.py): a stale file fails here.
Agreement is then checked by behaviour, not by reading the generator: every key is probed with
boundary, wrong-type and pattern values, and the loader and the JSON Schema must accept exactly
the same ones (except the few checks JSON Schema cannot express, which only the loader makes)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kube_vgpu.config import Config, Key, all_keys, config_from_dict, config_to_dict
from kube_vgpu.errors import ConfigError
from kube_vgpu.policyregistry import GPU_POLICIES, NODE_POLICIES

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "charts" / "kube-vgpu" / "values.schema.json").read_text())
CONFIG_SCHEMA = jsonschema.Draft7Validator(SCHEMA["properties"]["config"])
DOCS = (ROOT / "docs" / "configuration.md").read_text()
KEYS = list(all_keys())


def _gen_schema() -> Any:
    spec = importlib.util.spec_from_file_location("gen_schema", ROOT / "charts" / "tools" / "gen_schema.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_files_are_fresh(capsys: pytest.CaptureFixture[str]) -> None:
    assert _gen_schema().main(["--check"]) == 0, capsys.readouterr().err


def test_stale_check_notices_an_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    gen = _gen_schema()
    docs = tmp_path / "configuration.md"
    docs.write_text(DOCS.replace("| `defaults.gpuCount` | integer | `1` |", "| `defaults.gpuCount` | integer | `2` |"))
    schema = tmp_path / "values.schema.json"
    schema.write_text(gen.render_schema())
    monkeypatch.setattr(gen, "DOCS", str(docs))
    monkeypatch.setattr(gen, "SCHEMA", str(schema))
    assert gen.main(["--check"]) == 1
    assert "configuration.md" in capsys.readouterr().err


# -- loader and chart schema: the same verdict on every probe --------------------------------

def _doc(k: Key, v: Any) -> dict[str, Any]:
    """A config document setting key ``k`` to ``v`` (list-item keys inside one valid node)."""
    if k.path.startswith("nodes[]."):
        return {"nodes": [{"name": "n1", k.rule.yaml: v} if k.rule.yaml != "name" else {k.rule.yaml: v}]}
    if "." not in k.path:
        return {k.path: v}
    section, name = k.path.split(".", 1)
    return {section: {name: v}}


STRINGS = ["", "a", "A b", "Team_A", "a.b", "-a", "a" * 64, "a" * 254, "default-scheduler", "nvidia.com/gpu",
           "example.com/vmem-pct", "bad name/x", "2026-03-01T00:00:00Z", "2026-03-01T01:00:00+01:00",
           "2026-13-01T00:00:00Z", "2026-03-01", "yesterday", "64Mi", "8Gi", "1.5Gi", "0", "-1Gi", "1e3", "lots",
           "/etc", "/opt/x*", "etc", "/a*b", *NODE_POLICIES, *GPU_POLICIES, "worst", "deny", "allow",
           "leave", "random"]
ODD = [None, True, False, [], {}, 1.5, "1"]


def _probes(k: Key) -> list[Any]:
    r = k.rule
    out: list[Any] = [k.default] if k.default is not None and not isinstance(k.default, type) else []
    if isinstance(k.default, tuple):
        out = [list(k.default)]
    if k.kind in ("int", "number"):
        for b in (r.minimum, r.maximum, r.exclusive_minimum):
            if b is not None:
                out += [b - 1, b, b + 1, b - 0.5, b + 0.5]
        out += [0, 1, -1, 10**9]
    if k.kind in ("string", "int", "number", "bool"):
        out += STRINGS
    if k.kind in ("strings", "ids"):
        out += [[s] for s in STRINGS] + [["a", "b"], [1], [None], "a", [[1]]]
    return out + ODD


def _loader_error(doc: dict[str, Any]) -> ConfigError | None:
    try:
        config_from_dict(doc)
    except ConfigError as e:
        return e
    return None


def _loader_ok(doc: dict[str, Any]) -> bool:
    return _loader_error(doc) is None


@pytest.mark.parametrize("k", KEYS, ids=lambda k: k.path)
def test_loader_and_chart_schema_accept_the_same_values(k: Key) -> None:
    disagree = []
    for v in _probes(k):
        doc = _doc(k, v)
        err = _loader_error(doc)
        loader, chart = err is None, CONFIG_SCHEMA.is_valid(doc)
        if loader == chart:
            continue
        # the rules across keys (the five resourceNames distinct, the runtime class written is an allowed
        # one), listed under the docs table and made by the chart's templates (test_loader_only_checks.py)
        if err is not None and chart and ((err.key == "resourceNames" and "distinct" in str(err)) or (
                err.key == "webhook.runtimeClassName" and "allowedRuntimeClasses" in str(err))):
            continue
        # only the checks JSON Schema cannot express may make the loader stricter, never the chart
        if not loader and chart and k.rule.check is not None and isinstance(v, str) and k.rule.check(v):
            continue
        # a rule of the chart's own (documented in the docs table): the chart may be stricter
        if loader and not chart and k.rule.chart and not jsonschema.Draft7Validator(k.rule.chart).is_valid(v):
            continue
        disagree.append(f"{v!r}: loader {'accepts' if loader else 'refuses'}, chart {'accepts' if chart else 'refuses'}")
    assert not disagree, f"{k.path}:\n" + "\n".join(disagree)


def test_patterns_match_like_helm() -> None:
    # Python's "$" also matches before a final newline, Helm's (RE2) does not: the loader follows Helm
    # (python-jsonschema here would not, so this probe is not in the comparison above)
    assert not _loader_ok({"schedulerName": "a\n"}) and not _loader_ok({"resourceNames": {"gpu": "x/y\n"}})


def test_the_known_disagreements_are_gone() -> None:
    # helm install --set config.scheduling.nodePolicy=fgd-bestfit was refused by the chart
    for name in NODE_POLICIES:
        doc = {"scheduling": {"nodePolicy": name}}
        assert CONFIG_SCHEMA.is_valid(doc) and _loader_ok(doc), name
    # defaults.gpuCount: the chart stopped at 128, the loader did not
    assert _loader_ok({"defaults": {"gpuCount": 128}}) and CONFIG_SCHEMA.is_valid({"defaults": {"gpuCount": 128}})
    assert not _loader_ok({"defaults": {"gpuCount": 129}}) and not CONFIG_SCHEMA.is_valid({"defaults": {"gpuCount": 129}})


def test_every_schema_key_is_a_loader_key_and_back() -> None:
    def paths(node: dict[str, Any], prefix: str = "") -> set[str]:
        out = set()
        if node.get("type") == "array" and "properties" in node.get("items", {}):
            return paths(node["items"], prefix + "[]")
        for name, sub in node.get("properties", {}).items():
            p = f"{prefix}.{name}" if prefix else name
            kids = paths(sub, p)
            out |= kids or {p}
        return out
    assert paths(SCHEMA["properties"]["config"]) == {k.path for k in KEYS}


# -- loader and docs table ---------------------------------------------------------------------

def _docs_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOCS.splitlines():
        m = re.match(r"^\| `([A-Za-z\[\].-]+)` \|(.*)\|$", line)
        if m and m.group(1) != "key":
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def test_docs_table_lists_every_key_with_the_loaders_default_and_choices() -> None:
    rows = {p: r for p, r in _docs_rows().items() if "." in p or p == "schedulerName"}
    assert set(rows) == {k.path for k in KEYS}
    dump = config_to_dict(Config())
    for k in KEYS:
        _type, default, allowed, _meaning = rows[k.path]
        if k.path.startswith("nodes[]."):
            assert default in ("`null`", "`[]`", "(required)"), k.path
        else:
            section, _, name = k.path.rpartition(".")
            want = dump[section][name] if section else dump[name]
            assert default == (f"`{want}`" if isinstance(want, str) and want else "`\"\"`" if want == ""
                               else f"`{json.dumps(want)}`"), k.path
        if k.rule.choices is not None:
            assert re.findall(r"`([^`]+)`", allowed) == list(k.rule.choices), k.path
    # the policy table: every registered node policy, nothing else
    policies = [p for p in _docs_rows() if "." not in p and p != "schedulerName"]
    assert policies == list(NODE_POLICIES)


# -- helm itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NODE_POLICIES)
def test_helm_accepts_every_node_policy(renderer: Any, name: str) -> None:
    r = renderer.template({"config": {"scheduling": {"nodePolicy": name}}})
    assert r.returncode == 0, r.stderr


def test_helm_refuses_what_the_loader_refuses(renderer: Any) -> None:
    r = renderer.template({"config": {"defaults": {"gpuCount": 129}}})
    assert r.returncode != 0 and "config.defaults.gpuCount" in r.stderr, r.stderr
