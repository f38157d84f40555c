"""AdmissionReview envelope: decode a request body, answer with an AdmissionReview response.

Wire format: ``admission.k8s.io/v1`` and ``admission.k8s.io/v1beta1`` ``AdmissionReview``
(Kubernetes API reference, "Dynamic Admission Control"; a real request is in
``shared/reference/captures/mutate.json``). The answer carries the same ``apiVersion``, ``kind:
AdmissionReview`` and ``response.uid`` = ``request.uid``; a patch is RFC 6902 JSONPatch, base64 in
``response.patch`` with ``patchType: JSONPatch``; a denial sets ``allowed: false`` and
``status: {code, reason, message}`` (a ``meta/v1 Status``).

Reviewed: ``CREATE`` of ``pods`` (strip, isolate, route, mutate: :func:`webhook.mutate.review_pod`),
``UPDATE`` of ``pods`` and of the ``pods/ephemeralcontainers`` subresource (guard the system-owned
keys, deny new isolation violations: :func:`webhook.mutate.review_update`). Anything else is allowed
unchanged (outcome ``not-pod``).

Malformed envelopes (not JSON, not an object, wrong ``apiVersion``/``kind``, no ``request`` or
``uid``) raise :class:`BadReview`; the server answers those with HTTP 400. A well-formed envelope
whose pod is structurally broken gets an AdmissionReview denial with code 400.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
from typing import Any

from kube_vgpu.config import Config

from .mutate import ALLOWED, DENIED, Decision, review_pod, review_update
from .shape import ShapeError, check_pod

log = logging.getLogger("kube_vgpu.webhook")

API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
KIND = "AdmissionReview"
INVALID = "invalid"  #: outcome of a malformed pod inside a valid envelope
NOT_POD = "not-pod"  #: outcome of a review for another resource or operation
#: the subresource through which ephemeral containers are added (``kubectl debug``)
EPHEMERAL_SUBRESOURCE = "ephemeralcontainers"


#: Python's JSON decoder gives up (RecursionError) at about this nesting depth
MAX_DEPTH_HINT = sys.getrecursionlimit()
#: longest status message sent back (a value quoted in a message can be as long as the body)
MAX_MESSAGE = 1024


def _clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class BadReview(ValueError):
    """The body is not an AdmissionReview request we can answer (-> HTTP 400)."""


def decode_review(body: bytes) -> dict[str, Any]:
    """Parse and check the envelope. Returns the whole review dict. Raises BadReview."""
    try:
        review = json.loads(body)
    except RecursionError:
        raise BadReview(f"body is not acceptable JSON: nested deeper than {MAX_DEPTH_HINT} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, huge integers, bad UTF-8
        raise BadReview(f"body is not JSON: {_clip(str(e))}") from None
    if not isinstance(review, dict):
        raise BadReview(f"body is a JSON {type(review).__name__}, expected an AdmissionReview object")
    if review.get("kind") != KIND:
        raise BadReview(f"kind={review.get('kind')!r}; expected {KIND!r}")
    if review.get("apiVersion") not in API_VERSIONS:
        raise BadReview(f"apiVersion={review.get('apiVersion')!r}; expected one of {', '.join(API_VERSIONS)}")
    req = review.get("request")
    if not isinstance(req, dict):
        raise BadReview("request is missing or not an object")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid is missing or not a string")
    return review


def _response(review: dict[str, Any], d: Decision) -> dict[str, Any]:
    resp: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": d.allowed}
    if d.patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(d.patch, separators=(",", ":")).encode()).decode()
    if not d.allowed:
        resp["status"] = {"code": d.code, "reason": d.reason, "message": _clip(d.message)}
    if d.warnings:
        resp["warnings"] = d.warnings
    return {"apiVersion": review["apiVersion"], "kind": KIND, "response": resp}


def _invalid(message: str) -> Decision:
    return Decision(allowed=False, outcome=INVALID, code=400, reason="BadRequest", message=message)


def _decide(req: dict[str, Any], config: Config) -> Decision:
    """The Decision for a pod request; raises ShapeError / TypeError & co. for broken pods."""
    op = req.get("operation", "CREATE")
    sub = req.get("subResource") or ""
    pod = req.get("object")
    if not isinstance(pod, dict):
        return _invalid("request.object is missing or not a Pod object")
    ns = req.get("namespace")
    namespace = ns if isinstance(ns, str) else ""
    check_pod(pod)
    if op == "CREATE" and not sub:
        return review_pod(pod, config, namespace)
    old = req.get("oldObject")
    if not isinstance(old, dict):
        return _invalid("request.oldObject is missing or not a Pod object (required on UPDATE)")
    check_pod(old, "request.oldObject")
    user = req.get("userInfo")
    username = user.get("username") if isinstance(user, dict) else None
    return review_update(pod, old, config, username if isinstance(username, str) else "", namespace, sub)


def answer(review: dict[str, Any], config: Config) -> tuple[dict[str, Any], Decision]:
    """Answer a decoded review. Returns (AdmissionReview response dict, the Decision).

    ``CREATE`` of ``pods`` (core/v1), ``UPDATE`` of ``pods`` and ``UPDATE`` of
    ``pods/ephemeralcontainers`` are reviewed; anything else is allowed unchanged (outcome
    ``not-pod``). Never raises for pod content: a structurally broken pod is denied with code 400.
    """
    req = review["request"]
    kind = req.get("kind") or {}
    resource = req.get("resource") or {}
    obj = req.get("object")
    if not kind and not resource:  # hand-made reviews: trust the object's own kind
        is_pod = isinstance(obj, dict) and obj.get("kind") == "Pod"
    else:
        is_pod = (isinstance(kind, dict) and kind.get("kind") == "Pod" and kind.get("group", "") == "") or (
            isinstance(resource, dict) and resource.get("resource") == "pods" and resource.get("group", "") == "")
    op = req.get("operation", "CREATE")
    sub = req.get("subResource") or ""
    reviewed = (op == "CREATE" and not sub) or (op == "UPDATE" and sub in ("", EPHEMERAL_SUBRESOURCE))
    if not is_pod or not reviewed:
        d = Decision(allowed=True, outcome=NOT_POD)
        return _response(review, d), d
    try:
        d = _decide(req, config)
    except ShapeError as e:
        d = _invalid(str(e))
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError):
        # a shape check_pod does not know about: say so without leaking Python's wording
        log.warning("malformed pod not caught by the shape check", exc_info=True)
        d = _invalid("request.object is not a valid core/v1 Pod (a field has the wrong type)")
    return _response(review, d), d


__all__ = ["API_VERSIONS", "ALLOWED", "BadReview", "DENIED", "EPHEMERAL_SUBRESOURCE", "INVALID", "KIND", "NOT_POD",
           "answer", "decode_review"]
