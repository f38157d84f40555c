"""Node taints and pod tolerations, with kube-scheduler's matching rules.

A bind must not put a pod on a node whose taints it does not tolerate: kube-scheduler's
``TaintToleration`` filter refuses such a node, and so must ``/bind`` (a caller of ``/bind`` can
name any node). The rules are upstream's ``Toleration.ToleratesTaint`` (``k8s.io/api/core/v1``):

* a toleration with an ``effect`` matches only taints of that effect (empty: every effect);
* a toleration with a ``key`` matches only taints of that key (empty key: every key; an empty key
  with ``Exists`` and no effect tolerates every taint);
* operator ``Equal`` (or empty) needs ``value`` to equal the taint's value; ``Exists`` matches any
  value; any other operator tolerates nothing (``Lt``/``Gt`` are an alpha extension of recent
  Kubernetes releases that this rule does not implement: such a toleration is treated as absent).

Only ``NoSchedule`` and ``NoExecute`` taints keep a pod off a node (``PreferNoSchedule`` is a
preference). ``spec.unschedulable: true`` (a cordoned node) counts as the taint
``node.kubernetes.io/unschedulable:NoSchedule``, as kube-scheduler's ``NodeUnschedulable`` plugin
treats it. ``tolerationSeconds`` does not matter for placement.

Inputs are the JSON of ``core/v1`` objects as the API server sends them; malformed entries (not an
object, non-string fields) never match, so a malformed toleration tolerates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ShapeError
from .views import NodeView

NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
PREFER_NO_SCHEDULE = "PreferNoSchedule"
#: the taint a cordoned node (``spec.unschedulable``) stands for
UNSCHEDULABLE_KEY = "node.kubernetes.io/unschedulable"
#: effects that keep a pod off a node
FILTER_EFFECTS = frozenset({NO_SCHEDULE, NO_EXECUTE})


@dataclass(frozen=True, slots=True)
class Taint:
    """One node taint (``key``, ``value`` may be empty; ``effect`` as the API spells it)."""

    key: str
    value: str
    effect: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


def _str(v: Any) -> str | None:
    """The string, "" for absent/null, None for any other JSON type (a malformed field)."""
    if v is None:
        return ""
    return v if isinstance(v, str) else None


def node_taints(node: Mapping[str, Any] | NodeView) -> tuple[Taint, ...]:
    """The taints of a Node dict that keep pods off it (NoSchedule, NoExecute), plus the
    unschedulable taint when ``spec.unschedulable`` is true. Never raises (malformed entries are
    skipped)."""
    try:
        spec = NodeView.of(node).spec
    except ShapeError:
        return ()
    out: list[Taint] = []
    raw = spec.get("taints")
    for t in raw if isinstance(raw, list) else ():
        if not isinstance(t, Mapping):
            continue
        key, value, effect = _str(t.get("key")), _str(t.get("value")), _str(t.get("effect"))
        if key is None or value is None or effect is None or effect not in FILTER_EFFECTS:
            continue
        taint = Taint(key, value, effect)
        if taint not in out:
            out.append(taint)
    if spec.get("unschedulable") is True:
        t = Taint(UNSCHEDULABLE_KEY, "", NO_SCHEDULE)
        if t not in out:
            out.append(t)
    return tuple(out)


def tolerates(toleration: Any, taint: Taint) -> bool:
    """Upstream ``Toleration.ToleratesTaint``: does this toleration (a JSON object) tolerate
    ``taint``? A malformed toleration tolerates nothing."""
    if not isinstance(toleration, Mapping):
        return False
    key, op, value, effect = (_str(toleration.get(f)) for f in ("key", "operator", "value", "effect"))
    if key is None or op is None or value is None or effect is None:
        return False
    if effect and effect != taint.effect:
        return False
    if key and key != taint.key:
        return False
    if op in ("", "Equal"):
        # (API validation refuses an empty key with Equal; if one gets through, upstream
        # matches it against every key, by value, and so do we)
        return value == taint.value
    return op == "Exists"


def untolerated(tolerations: Any, taints: Iterable[Taint]) -> Taint | None:
    """The first of ``taints`` that no entry of ``tolerations`` (the pod's
    ``spec.tolerations``, any JSON) tolerates, or None when the pod tolerates them all."""
    tols = tolerations if isinstance(tolerations, list) else []
    for taint in taints:
        if not any(tolerates(t, taint) for t in tols):
            return taint
    return None
