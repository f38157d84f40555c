"""Evaluate a rendered ValidatingAdmissionPolicy the way kube-apiserver does, with cel-python.

Covers what the chart's policies use: resourceRules (resources, subresources, operations),
matchConditions, variables, validations with message / messageExpression, failurePolicy Fail, and
the Kubernetes CEL string extension ``<list>.join(sep)``. Unlike the API server, variables are
evaluated eagerly; one that fails holds the error, which reaches only the expressions that use it
(as with lazy evaluation). Type checking is left to a real API server (tests/e2e).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import celpy
from celpy import celtypes, json_to_cel


def _join(items: Any, sep: Any = "") -> celtypes.StringType:
    return celtypes.StringType(str(sep).join(str(x) for x in items))


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def evaluate(expr: str, activation: dict[str, Any]) -> Any:
    """The value of ``expr``; a CEL error comes back as a ``celpy.CELEvalError`` value."""
    prog = _PROGRAMS.get(expr)
    if prog is None:
        prog = _PROGRAMS[expr] = _ENV.program(_ENV.compile(expr), functions={"join": _join})
    try:
        return prog.evaluate(activation)
    except celpy.CELEvalError as e:
        return e


@dataclass
class Request:
    """The parts of an AdmissionRequest the policies read."""

    operation: str
    resource: str  #: e.g. "pods", "nodes"
    user: str
    name: str = ""
    namespace: str = ""
    sub_resource: str = ""
    extra: dict[str, list[str]] = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)
    group: str = ""  #: API group of ``resource`` ("" = core)
    version: str = "v1"

    def as_cel(self) -> dict[str, Any]:
        """As kube-apiserver hands it to CEL: empty fields are absent (``has(request.subResource)``
        is false for the pod itself, and reading it is a "no such key" error)."""
        user: dict[str, Any] = {"username": self.user}
        if self.groups:
            user["groups"] = self.groups
        if self.extra:
            user["extra"] = self.extra
        out: dict[str, Any] = {"operation": self.operation, "userInfo": user,
                               "resource": {"group": self.group, "version": self.version, "resource": self.resource}}
        for key, value in (("subResource", self.sub_resource), ("name", self.name), ("namespace", self.namespace)):
            if value:
                out[key] = value
        return out


@dataclass
class Decision:
    """``matched``: the policy applied; ``denied``: messages of the failed validations."""

    matched: bool
    denied: list[str]

    @property
    def allowed(self) -> bool:
        return not self.denied


def _matches(policy: dict[str, Any], req: Request) -> bool:
    full = req.resource + (f"/{req.sub_resource}" if req.sub_resource else "")
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        if req.group in rule["apiGroups"] and full in rule["resources"] and (
                req.operation in rule["operations"] or "*" in rule["operations"]):
            return True
    return False


def decide(policy: dict[str, Any], req: Request, obj: dict[str, Any] | None,
           old: dict[str, Any] | None = None) -> Decision:
    """Admit or deny ``req`` (object ``obj``, old object ``old``) under ``policy`` (failurePolicy Fail)."""
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    if not _matches(policy, req):
        return Decision(False, [])
    act: dict[str, Any] = {"request": json_to_cel(req.as_cel()), "object": json_to_cel(obj),
                           "oldObject": json_to_cel(old)}
    for mc in spec.get("matchConditions", []):
        got = evaluate(mc["expression"], act)
        if isinstance(got, celpy.CELEvalError):
            return Decision(True, [f"matchCondition {mc['name']} failed: {got}"])
        if not got:
            return Decision(False, [])
    variables: dict[str, Any] = {}
    for v in spec.get("variables", []):
        act["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
        variables[v["name"]] = evaluate(v["expression"], act)
    act["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
    denied = []
    for val in spec["validations"]:
        ok = evaluate(val["expression"], act)
        if isinstance(ok, celpy.CELEvalError):
            denied.append(f"expression error: {val['expression']}: {ok}")
        elif not ok:
            msg = evaluate(val["messageExpression"], act) if "messageExpression" in val else val["message"]
            if isinstance(msg, celpy.CELEvalError):  # the API server falls back to a generic message
                msg = f"failed expression: {val['expression']}"
            denied.append(str(msg))
    return Decision(True, denied)
