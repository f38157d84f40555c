"""Label and field selectors, parsed the way kube-apiserver parses them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SelectorError",
    "LabelSelector",
    "FieldSelector",
    "parse_label_selector",
    "parse_field_selector",
]


class SelectorError(ValueError):
    """Raised for a selector the real apiserver would reject with 400 BadRequest."""


_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        val = labels.get(self.key)
        if self.op == "=":
            return has and val == self.values[0]
        if self.op == "!=":
            return not has or val != self.values[0]
        if self.op == "in":
            return has and val in self.values
        if self.op == "notin":
            return not has or val not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("gt", "lt"):
            if not has:
                return False
            try:
                lv = int(val)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return False
            rv = int(self.values[0])
            return lv > rv if self.op == "gt" else lv < rv
        return False  # pragma: no cover


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @property
    def empty(self) -> bool:
        return not self.requirements


def _split_top_level(s: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced parenthesis in selector {s!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SelectorError(f"unbalanced parenthesis in selector {s!r}")
    parts.append("".join(cur))
    return parts


def _check_key(key: str, whole: str) -> str:
    if not key or len(key) > 317 or not _LABEL_KEY.match(key):
        raise SelectorError(f"unable to parse requirement: invalid label key {key!r} in {whole!r}")
    return key


def _check_value(value: str, whole: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise SelectorError(f"unable to parse requirement: invalid label value {value!r} in {whole!r}")
    return value


_SET_RE = re.compile(r"^\s*(\S+?)\s+(in|notin)\s*\((.*)\)\s*$")


def parse_label_selector(s: str | None) -> LabelSelector:
    """Parse `a=b,c!=d,e,!f,g in (x,y),h notin (z),i>3`."""
    if s is None or not s.strip():
        return LabelSelector()
    reqs: list[Requirement] = []
    for raw in _split_top_level(s):
        part = raw.strip()
        if not part:
            raise SelectorError(f"found ',', expected: identifier in {s!r}")
        m = _SET_RE.match(part)
        if m:
            key, op, vals = m.group(1), m.group(2), m.group(3)
            values = tuple(_check_value(v.strip(), s) for v in vals.split(","))
            if op == "in" and values == ("",) and vals.strip() == "":
                raise SelectorError(f"for 'in', 'notin' operators, values set can't be empty in {s!r}")
            reqs.append(Requirement(_check_key(key, s), op, values))
            continue
        if part.startswith("!"):
            reqs.append(Requirement(_check_key(part[1:].strip(), s), "!"))
            continue
        for tok, op in (("!=", "!="), ("==", "="), ("=", "="), (">", "gt"), ("<", "lt")):
            if tok in part:
                key, _, value = part.partition(tok)
                key, value = key.strip(), value.strip()
                if op in ("gt", "lt"):
                    try:
                        int(value)
                    except ValueError as exc:
                        raise SelectorError(f"for 'Gt', 'Lt' operators, the value must be an integer in {s!r}") from exc
                else:
                    _check_value(value, s)
                reqs.append(Requirement(_check_key(key, s), op, (value,)))
                break
        else:
            if any(c in part for c in " ()"):
                raise SelectorError(f"unable to parse requirement {part!r} in {s!r}")
            reqs.append(Requirement(_check_key(part, s), "exists"))
    return LabelSelector(tuple(reqs))


def lookup_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for seg in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(seg)
    return cur


def _field_str(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


@dataclass(frozen=True)
class FieldSelector:
    terms: tuple[tuple[str, str, str], ...] = ()  # (field, op, value)
    getter: Callable[[dict[str, Any], str], Any] | None = None

    def matches(self, obj: dict[str, Any]) -> bool:
        for field, op, value in self.terms:
            got = _field_str(self.getter(obj, field) if self.getter else lookup_path(obj, field))
            if (got == value) != (op == "="):
                return False
        return True

    @property
    def empty(self) -> bool:
        return not self.terms


def parse_field_selector(
    s: str | None,
    allowed: frozenset[str] | None,
    getter: Callable[[dict[str, Any], str], Any] | None = None,
) -> FieldSelector:
    """Parse `spec.nodeName=n1,status.phase!=Failed`. `allowed` None accepts any field."""
    if s is None or not s.strip():
        return FieldSelector(getter=getter)
    terms = []
    for raw in s.split(","):
        part = raw.strip()
        if not part:
            continue
        if "!=" in part:
            field, _, value = part.partition("!=")
            op = "!="
        elif "==" in part:
            field, _, value = part.partition("==")
            op = "="
        elif "=" in part:
            field, _, value = part.partition("=")
            op = "="
        else:
            raise SelectorError(f"invalid selector: {s!r}; can't understand {part!r}")
        field = field.strip()
        if allowed is not None and field not in allowed:
            raise SelectorError(f'field label not supported: {field}')
        terms.append((field, op, value.strip()))
    return FieldSelector(tuple(terms), getter)
