"""kube_vgpu.taints: upstream's Toleration.ToleratesTaint and the taints that keep pods off a node."""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.taints import Taint, node_taints, tolerates, untolerated

GPU = Taint("nvidia.com/gpu", "present", "NoSchedule")
EXEC = Taint("dedicated", "ml", "NoExecute")
BARE = Taint("maintenance", "", "NoSchedule")


@pytest.mark.parametrize(("toleration", "taint", "want"), [
    # key + Equal + value + effect: exact match only
    ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}, GPU, True),
    ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "absent", "effect": "NoSchedule"}, GPU, False),
    ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoExecute"}, GPU, False),
    ({"key": "other", "operator": "Equal", "value": "present", "effect": "NoSchedule"}, GPU, False),
    # empty operator means Equal; empty effect matches every effect
    ({"key": "nvidia.com/gpu", "value": "present"}, GPU, True),
    ({"key": "dedicated", "value": "ml"}, EXEC, True),
    ({"key": "dedicated", "value": "ML"}, EXEC, False),  # values are case-sensitive
    # Exists: any value of that key
    ({"key": "nvidia.com/gpu", "operator": "Exists"}, GPU, True),
    ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, GPU, False),
    ({"key": "maintenance", "operator": "Exists", "effect": "NoSchedule"}, BARE, True),
    ({"key": "maintenance"}, BARE, True),  # Equal with the empty value
    # empty key with Exists: every taint (of the effect, if one is given)
    ({"operator": "Exists"}, GPU, True),
    ({"operator": "Exists"}, EXEC, True),
    ({"operator": "Exists", "effect": "NoExecute"}, GPU, False),
    # operators this rule does not know (Lt/Gt are alpha upstream) tolerate nothing
    ({"key": "nvidia.com/gpu", "operator": "Gt", "value": "1"}, GPU, False),
    ({"key": "nvidia.com/gpu", "operator": "exists"}, GPU, False),  # case-sensitive, as upstream
    # malformed tolerations tolerate nothing
    ("nvidia.com/gpu", GPU, False),
    ({"key": 1, "operator": "Exists"}, GPU, False),
    ({"operator": ["Exists"]}, GPU, False),
    (None, GPU, False),
])
def test_tolerates_like_upstream(toleration: Any, taint: Taint, want: bool) -> None:
    assert tolerates(toleration, taint) is want


def test_node_taints_keep_only_filtering_effects_and_the_cordon() -> None:
    node = {"spec": {"unschedulable": True, "taints": [
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "soft", "effect": "PreferNoSchedule"},
        {"key": "dedicated", "value": "ml", "effect": "NoExecute", "timeAdded": "2026-01-01T00:00:00Z"},
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},  # duplicate
        "junk", {"key": 5, "effect": "NoSchedule"}, {"key": "x", "effect": "Sometimes"},
    ]}}
    assert node_taints(node) == (GPU, EXEC, Taint("node.kubernetes.io/unschedulable", "", "NoSchedule"))
    assert node_taints({"spec": {}}) == ()
    assert node_taints({"spec": {"taints": "nope", "unschedulable": "true"}}) == ()  # only the bool counts
    assert node_taints({}) == () and node_taints({"spec": None}) == ()


def test_untolerated_names_the_first_taint_nothing_tolerates() -> None:
    tols = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert untolerated(tols, (GPU, EXEC)) == EXEC
    assert untolerated(tols + [{"key": "dedicated", "value": "ml", "effect": "NoExecute"}], (GPU, EXEC)) is None
    assert untolerated([{"operator": "Exists"}], (GPU, EXEC, BARE)) is None
    assert untolerated(None, (GPU,)) == GPU and untolerated("junk", ()) is None
    assert str(GPU) == "nvidia.com/gpu=present:NoSchedule" and str(BARE) == "maintenance:NoSchedule"
