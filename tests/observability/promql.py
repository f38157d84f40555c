"""Which metric names and label names a PromQL expression (or a Grafana query) uses.

A small reader for the PromQL the dashboards, alert rules and HAMi fixtures contain, not a full
parser: string literals and range selectors are dropped; label names are read from selector
matchers ``{label=~"..."}``, from ``by / without / on / ignoring / group_left / group_right (...)``
lists, from ``label_values(metric, label)``, from Grafana legends ``{{label}}`` and from alert
templates ``{{ $labels.label }}``; every other
identifier that is not a function call, a keyword or a number is a metric name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

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


#: a sample: (metric name, labels without __name__) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_TOKEN = re.compile(r"\s*(?:(?P<num>[0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)"
                    r"|(?P<op>==|!=|>=|<=|>|<|[-+*/]))")
_PREC = {"and": 1, "==": 2, "!=": 2, ">": 2, "<": 2, ">=": 2, "<=": 2, "+": 3, "-": 3, "*": 4, "/": 4}


def evaluate(expr: str, samples: Samples) -> dict[tuple[tuple[str, str], ...], float] | float:
    """Evaluate the small PromQL subset the per-series alert rules use: bare metric names, numbers,
    ``+ - * /``, the comparisons (filtering, as without ``bool``) and ``and``; vector-vector
    operations match one-to-one on the full label set (no ``on``/``ignoring``). Returns the
    resulting vector (labels -> value) or a number. Raises ValueError on anything else."""
    toks: list[tuple[str, str]] = []
    pos = 0
    text = expr.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"unsupported PromQL at {text[pos:]!r}")
        kind = m.lastgroup or ""
        val = m.group(kind)
        toks.append(("op", val) if kind == "name" and val == "and" else (kind, val))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1

    def vector(name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {lab: v for (n, lab), v in samples.items() if n == name}

    def apply(op: str, a: Any, b: Any) -> Any:
        fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
              "/": lambda x, y: x / y if y else math.copysign(math.inf, x) if x else math.nan,
              ">": lambda x, y: x > y, "<": lambda x, y: x < y, ">=": lambda x, y: x >= y,
              "<=": lambda x, y: x <= y, "==": lambda x, y: x == y, "!=": lambda x, y: x != y}
        if op == "and":
            return {k: v for k, v in a.items() if k in b}
        cmp = _PREC[op] == 2
        if isinstance(a, dict) and isinstance(b, dict):
            out = {k: (a[k] if cmp else fn[op](a[k], b[k])) for k in a if k in b}
            return {k: v for k, v in out.items() if not cmp or fn[op](a[k], b[k])}
        if isinstance(a, dict):
            return {k: (v if cmp else fn[op](v, b)) for k, v in a.items() if not cmp or fn[op](v, b)}
        if isinstance(b, dict):
            return {k: (v if cmp else fn[op](a, v)) for k, v in b.items() if not cmp or fn[op](a, v)}
        return fn[op](a, b)

    def operand(i: int) -> tuple[Any, int]:
        kind, val = toks[i]
        if kind == "num":
            return float(val), i + 1
        if kind == "name":
            return vector(val), i + 1
        raise ValueError(f"unsupported PromQL operand {val!r} in {expr!r}")

    def parse(i: int, min_prec: int) -> tuple[Any, int]:
        lhs, i = operand(i)
        while i < len(toks) and toks[i][0] == "op" and _PREC[toks[i][1]] >= min_prec:
            op = toks[i][1]
            rhs, i = parse(i + 1, _PREC[op] + 1)
            lhs = apply(op, lhs, rhs)
        return lhs, i

    result, end = parse(0, 0)
    if end != len(toks):
        raise ValueError(f"unsupported PromQL {expr!r}")
    return result
