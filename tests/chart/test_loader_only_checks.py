"""The config loader's checks that JSON Schema cannot state ("not in the schema" in
docs/configuration.md) are made by the chart too: a value the loader refuses must not install, or
every component refuses to start with the rendered policy file (the webhook crash-loops, the
scheduler keeps its last good config only until it restarts). The chart's verdict equals the
loader's on every probe, and its message names the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.config import all_keys

from .test_config_agreement import _loader_error

#: per loader-only check: values its schema pattern lets through, for the loader and helm to judge
PROBES: dict[str, list[str]] = {
    "scheduling.adoptUnsignedBefore": [
        "2026-12-01T09:00:00Z", "2026-12-01t09:00:00z", "2026-12-01T09:00:00.123456789+05:30",
        "2024-02-29T00:00:00Z", "2023-02-29T00:00:00Z", "2026-02-30T00:00:00Z", "2026-13-01T00:00:00Z",
        "2026-00-10T00:00:00Z", "2026-12-00T00:00:00Z", "2026-12-01T24:00:00Z", "2026-12-01T09:60:00Z",
        "2026-12-01T09:00:60Z", "2026-12-01T09:00:00+23:59", "2026-12-01T09:00:00-23:59",
        "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z",
    ],
    "webhook.shmSizeLimit": [
        "64Mi", "8Gi", "1", "1.", ".5", "+1", "1n", "1E3", "1e30", "1e-30", "0", "+0", ".0", "0.", "00.000",
        "0Mi", "0n", "0e5", "0E-3", "1e31", "1e-31",
    ],
}


#: zone offsets RFC 3339 does not allow (hours 00-23, minutes 00-59): the schema's pattern refuses them
BAD_OFFSETS = ["2026-12-01T09:00:00+24:00", "2026-12-01T09:00:00+23:60", "2026-12-01T09:00:00+01:60",
               "2026-12-01T09:00:00+01:99", "2026-12-01T09:00:00-99:00"]


def _doc(path: str, value: Any) -> dict[str, Any]:
    section, name = path.split(".")
    return {section: {name: value}}


def test_every_loader_only_check_is_probed() -> None:
    """A new check in kube_vgpu/config.py needs its probes here (and its rule in the chart's
    kube-vgpu.validateConfig)."""
    assert {k.path for k in all_keys() if k.rule.check is not None} == set(PROBES)


@pytest.mark.parametrize(("path", "value"), [(p, v) for p, vs in PROBES.items() for v in vs])
def test_chart_and_loader_agree(renderer: Any, path: str, value: str) -> None:
    doc = _doc(path, value)
    loader_err = _loader_error(doc)
    # --set-string: a values file written by PyYAML would leave 1e30 unquoted, a number to helm
    r = renderer.template(extra=["--set-string", f"config.{path}={value}"])
    assert "values don't meet the specifications of the schema" not in r.stderr, r.stderr  # a probe the schema passes
    if loader_err is None:
        assert r.returncode == 0, f"the loader accepts {path}={value!r}, the chart refuses it:\n{r.stderr}"
    else:
        assert r.returncode != 0, f"the loader refuses {path}={value!r} ({loader_err}), the chart renders it"
        assert f'config.{path}="{value}"' in r.stderr and "allowed:" in r.stderr, r.stderr


@pytest.mark.parametrize("value", BAD_OFFSETS)
def test_offsets_rfc3339_does_not_allow_are_refused_by_both(renderer: Any, value: str) -> None:
    err = _loader_error(_doc("scheduling.adoptUnsignedBefore", value))
    assert err is not None and err.key == "scheduling.adoptUnsignedBefore", err
    r = renderer.template(extra=["--set-string", f"config.scheduling.adoptUnsignedBefore={value}"])
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert "config.scheduling.adoptUnsignedBefore" in r.stderr, r.stderr


@pytest.mark.parametrize(("names", "ok"), [
    ({"gpumem": "nvidia.com/gpu"}, False),
    ({"priority": "nvidia.com/gpucores"}, False),
    ({"gpu": "example.com/vgpu", "gpumem": "example.com/vgpu-mem"}, True),
])
def test_resource_names_must_be_distinct(renderer: Any, names: dict[str, str], ok: bool) -> None:
    doc = {"resourceNames": names}
    assert (_loader_error(doc) is None) == ok
    r = renderer.template({"config": doc})
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        key, value = next(iter(names.items()))
        assert f'config.resourceNames.{key}="{value}"' in r.stderr and "must be distinct" in r.stderr, r.stderr


@pytest.mark.parametrize(("webhook", "ok"), [
    ({"runtimeClassName": "runc"}, False),
    ({"runtimeClassName": "nvidia"}, True),
    ({"runtimeClassName": "nvidia-cdi", "allowedRuntimeClasses": ["nvidia-cdi"]}, True),
    ({"runtimeClassName": "nvidia", "allowedRuntimeClasses": []}, False),
    ({"runtimeClassName": ""}, True),
])
def test_runtime_class_written_must_be_allowed(renderer: Any, webhook: dict[str, Any], ok: bool) -> None:
    """The runtime class the webhook writes must be one its own rules allow (the loader and the chart)."""
    doc = {"webhook": webhook}
    err = _loader_error(doc)
    assert (err is None) == ok, err
    r = renderer.template({"config": doc})
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert err is not None and err.key == "webhook.runtimeClassName"
        assert f'config.webhook.runtimeClassName="{webhook["runtimeClassName"]}"' in r.stderr, r.stderr
        assert "allowed:" in r.stderr, r.stderr


@pytest.mark.parametrize(("nodes", "dup"), [
    ([{"name": "gpu-1", "splitCount": 2}, {"name": "gpu-2"}, {"name": "gpu-1", "splitCount": 4}], (2, 0)),
    ([{"name": "gpu-1", "splitCount": 2}, {"name": "gpu-2", "splitCount": 4}], None),
])
def test_each_node_override_names_its_node_once(renderer: Any, nodes: list[dict[str, Any]],
                                                dup: tuple[int, int] | None) -> None:
    """Two ``nodes[]`` entries for one node: the device plugin would apply only the first, silently
    dropping the other's values. The loader and the chart refuse it, naming both entries."""
    doc = {"nodes": nodes}
    err = _loader_error(doc)
    r = renderer.template({"config": doc})
    if dup is None:
        assert err is None and r.returncode == 0, (err, r.stderr)
        return
    i, first = dup
    assert err is not None and err.key == f"nodes[{i}].name", err
    assert f"'gpu-1' is also nodes[{first}].name" in str(err) and "allowed: one entry per node" in str(err)
    assert r.returncode != 0, "the chart renders two overrides for one node"
    assert f'config.nodes[{i}].name="gpu-1" is also config.nodes[{first}].name' in r.stderr, r.stderr
    assert "allowed: one entry per node" in r.stderr, r.stderr
