"""The chart's DRA scoring (dra.extenderScoring): off by default (one extender entry, no flag, no
DRA rights); on, a second prioritize-only extender entry, the extender's flags, and RBAC that is
exactly the calls of scheduler/drascore.py's list+watch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.fakeapi import FakeKubeAPI

from .conftest import Renderer, find
from .test_chart import FULL, containers
from .test_rbac import _drain, _extender_api_calls, _lease_calls, check, grants, recorded

KUBE = "1.36.0"
ON: dict[str, Any] = {"dra": {"enabled": True, "extenderScoring": True,
                              "modelClasses": [{"name": "h200.vgpu.kube-vgpu.io", "model": "NVIDIA H200"}]}}


@pytest.fixture
def fake_api() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI(auto_create_namespaces=True, bookmark_interval=0.2)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _extenders(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cm = find(docs, "ConfigMap", f"{FULL}-kube-scheduler")
    return yaml.safe_load(cm["data"]["config.yaml"])["extenders"]


def _extender_args(docs: list[dict[str, Any]]) -> list[str]:
    return containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]["args"]


def test_off_by_default_renders_no_second_entry(renderer: Renderer) -> None:
    for values in ({}, {"dra": {"enabled": True}}):
        docs = renderer.render(values, kube_version=KUBE)
        ext = _extenders(docs)
        assert len(ext) == 1 and ext[0]["prioritizeVerb"] == "prioritize"
        assert not any(a.startswith("--dra-") for a in _extender_args(docs))
        assert not any(g.group == "resource.k8s.io" for g in grants(docs, f"{FULL}-extender"))


def test_on_adds_a_prioritize_only_entry(renderer: Renderer) -> None:
    docs = renderer.render(ON, kube_version=KUBE)
    first, dra = _extenders(docs)
    assert first["prioritizeVerb"] == "prioritize" and first["managedResources"]
    assert dra["urlPrefix"] == first["urlPrefix"]
    assert dra["prioritizeVerb"] == "dra-prioritize" and dra["weight"] == 10 and dra["ignorable"] is True
    for absent in ("managedResources", "filterVerb", "bindVerb", "preemptVerb"):
        assert absent not in dra
    assert _extenders(renderer.render({"dra": {**ON["dra"], "extenderWeight": 3}}, kube_version=KUBE))[1]["weight"] == 3


def test_flags_parse_with_the_extenders_parser(renderer: Renderer) -> None:
    from scheduler.server import build_parser, options_from_args
    args = _extender_args(renderer.render(ON, kube_version=KUBE))
    opts = options_from_args(build_parser().parse_args(args[1:]))
    assert opts.dra_scoring is True
    assert opts.dra_classes == {"vgpu.kube-vgpu.io": "", "h200.vgpu.kube-vgpu.io": "NVIDIA H200"}


def test_needs_dra_enabled(renderer: Renderer) -> None:
    r = renderer.template({"dra": {"extenderScoring": True}}, kube_version=KUBE)
    assert r.returncode != 0 and "dra.extenderScoring=true needs dra.enabled=true" in r.stderr, r.stderr
    r = renderer.template({"dra": {"enabled": True, "extenderScoring": True, "extenderWeight": 0}}, kube_version=KUBE)
    assert r.returncode != 0 and "extenderWeight" in r.stderr


def test_extender_rbac_is_exactly_its_calls_with_scoring_on(renderer: Renderer, fake_api: FakeKubeAPI) -> None:
    """The extender's calls (its API layer, its Lease, and DraListWatch's list+watch of both kinds)
    against the roles rendered with scoring on: every call allowed, every grant used."""
    from scheduler.drascore import DraListWatch
    docs = renderer.render(ON, kube_version=KUBE)
    fake = fake_api
    base = {c for c in _extender_api_calls(fake) if c.resource != "leases"}
    lease = _lease_calls(docs, fake)
    fake.clear_requests()
    lw = DraListWatch(fake.api_client())
    for kind in ("resourceslices", "resourceclaims"):
        _, rv = lw.list_objects(kind)
        _drain(lw.watch_objects(kind, rv, 1))
    dra = recorded(fake)
    assert {(c.verb, c.group, c.resource) for c in dra} == {
        (v, "resource.k8s.io", r) for v in ("list", "watch") for r in ("resourceslices", "resourceclaims")}
    check(docs, f"{FULL}-extender", base | lease | dra)
