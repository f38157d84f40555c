"""The policy registry (kube_vgpu/policyregistry.py): every policy declared once, and every reader
(scorer factory, config, pod annotations, replay list) follows it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kube_vgpu import config, podspec
from kube_vgpu.errors import RequestError
from kube_vgpu.placement import Policy, TaskShape, make_policy
from kube_vgpu.placement import policies as scorers
from kube_vgpu.policyregistry import (
    DRA_MODELS,
    GPU_POLICIES,
    NODE_POLICIES,
    NODE_POLICY_SPECS,
    needs_shapes,
    node_policy,
    replay_policies,
)
from kube_vgpu.resources import ANN_NODE_POLICY

from .helpers import pod

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [TaskShape(0, 500, 1, frozenset(), 1.0)]


@pytest.mark.parametrize("spec", NODE_POLICY_SPECS, ids=lambda s: s.name)
def test_every_policy_builds_its_scorer_under_its_name(spec) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(getattr(scorers, spec.scorer), type) and issubclass(getattr(scorers, spec.scorer), Policy)
    p = make_policy(spec.name, GPU_POLICIES[0], SHAPES)
    assert type(p).__name__ == spec.scorer and p.name == spec.name
    if spec.needs_shapes:
        with pytest.raises(ValueError, match="task shapes"):
            make_policy(spec.name, GPU_POLICIES[0], None)
    else:
        assert make_policy(spec.name, GPU_POLICIES[0], None).name == spec.name


def test_names_are_unique_and_unknown_names_are_refused() -> None:
    assert len(set(NODE_POLICIES)) == len(NODE_POLICIES) and len(set(GPU_POLICIES)) == len(GPU_POLICIES)
    with pytest.raises(ValueError, match="unknown node policy 'worst'; allowed: " + ", ".join(NODE_POLICIES)):
        make_policy("worst")
    with pytest.raises(ValueError):
        node_policy("worst")
    assert not needs_shapes("worst")


def test_config_and_pod_annotations_read_the_registry() -> None:
    assert config.NODE_POLICIES == NODE_POLICIES and config.GPU_POLICIES == GPU_POLICIES
    for name in NODE_POLICIES:
        assert config.load_config_text(f"scheduling: {{nodePolicy: {name}}}").scheduling.node_policy == name
        r = podspec.parse_pod(pod("p", {"gpumem": 1000},
                                  annotations={ANN_NODE_POLICY: name}), config.Config())
        assert r.node_policy == name
    with pytest.raises(RequestError):
        podspec.parse_pod(pod("p", {"gpumem": 1000}, annotations={ANN_NODE_POLICY: "worst"}),
                          config.Config())


def test_replay_list_covers_every_policy_and_the_gpu_variants() -> None:
    rp = replay_policies()
    for spec in NODE_POLICY_SPECS:
        assert rp[spec.name] == (spec.name, spec.replay_gpu_policy)
    # the node policies that use a GPU policy get one entry per other GPU policy
    assert rp["binpack-gpuspread"] == ("binpack", "spread")
    # the replay-only DRA-path models are replay policies too (tests/simulate/test_dra_allocator.py)
    assert all(n in NODE_POLICIES + DRA_MODELS and g in GPU_POLICIES for n, g in rp.values())


#: where a node policy's name may be written: the registry, and the placement code that
#: implements GPU orderings ("binpack", "spread", "bestfit" orderings in fit.py / policies.py).
ALLOWED = {"kube_vgpu/policyregistry.py", "kube_vgpu/placement/fit.py", "kube_vgpu/placement/policies.py",
           # Engine's defaults (node_policy="binpack", gpu_policy="spread"): left to the engine's owner
           "kube_vgpu/placement/engine.py"}
PRODUCT = ["kube_vgpu", "scheduler", "webhook", "deviceplugin", "kubectl_vgpu", "certs", "replay", "kube_vgpu_cli",
           "charts/tools"]


def test_no_policy_name_literal_outside_the_registry() -> None:
    names = set(NODE_POLICIES) | set(GPU_POLICIES) | set(replay_policies())
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "policy names written outside kube_vgpu/policyregistry.py:\n" + "\n".join(found)


def test_placement_docs_describe_exactly_the_registered_policies() -> None:
    text = (ROOT / "docs" / "placement.md").read_text()
    section = text.split("## Policies", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines()
            if line.startswith("| `")]
    assert rows == list(NODE_POLICIES)


def test_config_validation_stays_light() -> None:
    # the webhook and the device plugin validate the config (and its policy names) without
    # loading the placement engine or numpy
    import subprocess
    import sys
    code = ("import sys, kube_vgpu.config, kube_vgpu.policyregistry; "
            "print(sorted(m for m in ('numpy', 'kube_vgpu.placement') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
