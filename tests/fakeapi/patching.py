"""Patch application: JSON merge patch, a strategic merge patch subset, JSON patch."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

__all__ = ["PatchError", "merge_patch", "strategic_merge_patch", "json_patch"]


class PatchError(ValueError):
    """The patch could not be applied (the server answers 422, or 400 if malformed)."""

    def __init__(self, message: str, code: int = 422):
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists that the strategic merge patch merges element-wise by a key (from the Go struct tags
# `patchStrategy:"merge" patchMergeKey:"..."`). The path is the chain of map keys, with "*"
# standing for "any element of the list at this point". Lists not listed are replaced.
_MERGE_KEYS: dict[tuple[str, ...], str] = {}
_SET_LISTS: set[tuple[str, ...]] = {("metadata", "finalizers")}

_POD_SPEC_KEYS = {
    ("containers",): "name",
    ("initContainers",): "name",
    ("ephemeralContainers",): "name",
    ("volumes",): "name",
    ("imagePullSecrets",): "name",
    ("hostAliases",): "ip",
    ("resourceClaims",): "name",
    ("containers", "*", "env"): "name",
    ("containers", "*", "ports"): "containerPort",
    ("containers", "*", "volumeMounts"): "mountPath",
    ("containers", "*", "volumeDevices"): "devicePath",
    ("initContainers", "*", "env"): "name",
    ("initContainers", "*", "ports"): "containerPort",
    ("initContainers", "*", "volumeMounts"): "mountPath",
    ("initContainers", "*", "volumeDevices"): "devicePath",
}
for _k, _v in _POD_SPEC_KEYS.items():
    _MERGE_KEYS[("spec",) + _k] = _v
    _MERGE_KEYS[("spec", "template", "spec") + _k] = _v
_MERGE_KEYS.update(
    {
        ("metadata", "ownerReferences"): "uid",
        ("webhooks",): "name",  # Mutating/ValidatingWebhookConfiguration
        ("spec", "ports"): "port",  # Service
        ("status", "conditions"): "type",
        ("status", "addresses"): "type",
        ("status", "containerStatuses"): "name",
        ("status", "initContainerStatuses"): "name",
        ("status", "ephemeralContainerStatuses"): "name",
        ("status", "podIPs"): "ip",
    }
)


def _merge_key_for(path: tuple[str, ...]) -> str | None:
    return _MERGE_KEYS.get(path)


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """A subset of Kubernetes' strategic merge patch.

    Maps merge recursively and null deletes a key, as in a merge patch. Lists known to carry a
    `patchMergeKey` (containers by name, conditions by type, env by name, ...) merge element-wise;
    `metadata.finalizers` merges as a set; other lists are replaced. Directives supported:
    `$patch: replace|delete` on maps and list elements, `$deleteFromPrimitiveList/<field>`,
    `$setElementOrder/<field>` and `$retainKeys` are accepted (the last two only loosely honoured).
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive not in (None, "merge"):
        raise PatchError(f"Unknown patch type: {directive!r}")
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [x for x in result[field] if x not in value]
            continue
        sub = path + (key,)
        if value is None:
            result.pop(key, None)
            continue
        if isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, sub)
            continue
        merged = strategic_merge_patch(result.get(key), value, sub)
        if merged is None:
            result.pop(key, None)
        else:
            result[key] = merged
    if isinstance(retain, list):
        keep = set(retain)
        result = {k: v for k, v in result.items() if k in keep or k not in (target or {})}
    return result


def _merge_list(target: Any, patch: list, path: tuple[str, ...]) -> list:
    if path in _SET_LISTS:
        out = list(target) if isinstance(target, list) else []
        for item in patch:
            if item not in out:
                out.append(copy.deepcopy(item))
        return out
    key = _merge_key_for(path)
    if key is None or not isinstance(target, list):
        # replace (drop directive-only elements)
        return [copy.deepcopy(x) for x in patch if not (isinstance(x, dict) and "$patch" in x)]
    if any(isinstance(x, dict) and x.get("$patch") == "replace" for x in patch):
        return [copy.deepcopy(x) for x in patch if not (isinstance(x, dict) and "$patch" in x)]
    out = [copy.deepcopy(x) for x in target]
    elem_path = path + ("*",)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {key}")
        idx = next((i for i, e in enumerate(out) if isinstance(e, dict) and e.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(strategic_merge_patch({}, item, elem_path))
        else:
            out[idx] = strategic_merge_patch(out[idx], item, elem_path)
    return out


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise PatchError("json patch must be a list of operations", code=400)
    try:
        return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(target))
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}", code=422) from exc
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError, IndexError, TypeError) as exc:
        raise PatchError(f"the server rejected our request due to an error in our request: {exc}", code=422) from exc
