"""Which metric names and label names a PromQL expression (or a Grafana query) uses.

A small reader for the PromQL the dashboards, alert rules and HAMi fixtures contain, not a full
parser: string literals and range selectors are dropped; label names are read from selector
matchers ``{label=~"..."}``, from ``by / without / on / ignoring / group_left / group_right (...)``
lists, from ``label_values(metric, label)``, from Grafana legends ``{{label}}`` and from alert
templates ``{{ $labels.label }}``; every other
identifier that is not a function call, a keyword or a number is a metric name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                      "bool", "offset", "inf", "nan", "e"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\s*\(\s*([A-Za-z_:][A-Za-z0-9_:]*)[^,)]*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")
_LEGEND = re.compile(r"\{\{\s*(?:\$labels\.)?([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class Uses:
    """What one query uses: metric names; label names matched on a given metric
    (``selectors``: metric -> labels); label names used anywhere in the query (``labels``)."""

    metrics: set[str] = field(default_factory=set)
    selectors: dict[str, set[str]] = field(default_factory=dict)
    labels: set[str] = field(default_factory=set)


def uses(expr: str, legend: str = "") -> Uses:
    """The metric and label names ``expr`` (and its Grafana ``legend``) use."""
    out = Uses()
    for m in _LABEL_VALUES.finditer(expr):
        out.metrics.add(m.group(1))
        out.labels.add(m.group(2))
        out.selectors.setdefault(m.group(1), set()).add(m.group(2))
    e = _LABEL_VALUES.sub(" ", expr)
    e = _STRING.sub('""', e)
    e = _RANGE.sub(" ", e)
    for m in _SELECTOR.finditer(e):
        names = {x.group(1) for x in _MATCHER.finditer(m.group(2))} - {"__name__"}
        out.labels |= names
        if m.group(1):
            out.selectors.setdefault(m.group(1), set()).update(names)
    e = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", e)
    for m in _GROUPING.finditer(e):
        out.labels |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    e = _GROUPING.sub(" ", e)
    for m in _IDENT.finditer(e):
        name = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or name.lower() in KEYWORDS:
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # the exponent or unit of a number (1e6, 5m)
        out.metrics.add(name)
    out.labels |= set(_LEGEND.findall(legend))
    return out
