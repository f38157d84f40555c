"""The admission decision for one Pod: strip, guard, isolate, route, default and prepare vGPU pods.

Pure functions, no I/O. The input is the ``request.object`` (and on UPDATE ``request.oldObject``)
of an ``admission.k8s.io/v1`` (or ``v1beta1``) AdmissionReview, i.e. a ``core/v1 Pod`` as a JSON
dict; the output is a :class:`Decision` (allowed or denied, plus RFC 6902 JSONPatch operations).

Every resource rule comes from the domain package: names from :mod:`kube_vgpu.resources` via the
config, values and defaults from :func:`kube_vgpu.podspec.parse_pod` / ``parse_container`` (which
raise :class:`kube_vgpu.errors.RequestError`), policy knobs from :class:`kube_vgpu.config.WebhookConfig`,
isolation rules from :mod:`webhook.isolation`, the system-owned keys from
:func:`kube_vgpu.resources.system_owned`.

CREATE (:func:`review_pod`), in this order:

0. with ``compat.gpushare``, a pod whose containers name Alibaba gpushare resources
   (``aliyun.com/gpu-mem``, ``gpu-count``, ``gpu-core.percentage``) and that is not a foreign
   scheduler's is translated into our resources first (:mod:`webhook.compat`; a refused value is
   denied with 400); every step below runs on the translated pod, and the translation ops come first
   in the patch. A ``spec.schedulerName`` in ``compat.schedulerAliases`` (e.g. ``hami-scheduler``)
   counts as ours (step 4) and is rewritten to ours (step 7);
1. every system-owned ``kube-vgpu.io/`` annotation and label is removed (JSONPatch ``remove``, one
   admission warning per key), on every pod that reaches the webhook: a tenant cannot create a pod
   that carries a forged allocation, node label or bind phase;
2. a pod that is not ours (:func:`webhook.isolation.pod_is_ours`: no container names any of our
   resource names) -> allowed with only those removals (``stripped``, or ``skipped`` when none);
3. isolation (:func:`webhook.isolation.check_pod`) -> denied (403) naming container, field, value
   and what is allowed. Pod labels never opt out, and foreign schedulers are checked too; a preset
   ``spec.nodeName`` on a pod whose containers name gpu, gpumem, gpumem-percentage or gpucores
   (:func:`kube_vgpu.podspec.pod_asks`), whatever its scheduler -> denied (403): kubelet would give
   it the node's vGPU slots, which it keeps while PreStartContainer refuses it;
4. ``spec.schedulerName`` set to another scheduler (not ours; not ``default-scheduler`` while
   ``webhook.forceOverwriteDefaultScheduler``) -> ``webhook.foreignSchedulers``: ``leave`` = allowed
   with only the removals (``foreign``); ``deny`` = denied;
5. no container asks for a vGPU (only ``nvidia.com/priority``, a bare ``gpu`` while
   ``webhook.mutateBareGpu`` is false, ``gpu: 0``) -> allowed with only the removals (``skipped``);
6. invalid quantities (``RequestError``, 400) -> denied;
7. mutation (``patched``, or ``allowed`` when the pod is already in shape):
   ``schedulerName``; every GPU container's ``resources.limits`` carry its whole resolved request
   (vGPU values given only in ``requests`` are copied to ``limits``; missing ``gpu`` count, memory
   and ``gpucores`` are written from the parsed request, so a bare ``nvidia.com/gpu: 1`` becomes
   ``gpumem-percentage: 100, gpucores: 100`` under ``defaults.bareGpuExclusive``); a ``/dev/shm``
   ``emptyDir`` (``medium: Memory``, ``sizeLimit`` = ``webhook.shmSizeLimit``) mounted in every GPU
   container unless some container already mounts ``/dev/shm``; ``NVIDIA_VISIBLE_DEVICES=none`` in
   non-GPU containers when ``webhook.nonGpuVisibleDevicesNone``; ``spec.runtimeClassName`` =
   ``webhook.runtimeClassName`` when that is set and the pod names none.

UPDATE (:func:`review_update`; never patched): a change that adds, changes or removes a system-owned
annotation or label is denied unless ``request.userInfo.username`` is in ``webhook.systemUsers``;
isolation violations the update introduces (an ephemeral container through the
``pods/ephemeralcontainers`` subresource, the only way to add containers to a pod) are denied.

The mutation is a fixed point: re-parsing the mutated pod gives the same requests and writes
nothing, so a second review yields an empty patch (safe with ``reinvocationPolicy: IfNeeded``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
from jsonpointer import escape

from kube_vgpu.config import Config
from kube_vgpu.envcontract import VISIBLE_DEVICES
from kube_vgpu.errors import RequestError
from kube_vgpu.model import ContainerRequest
from kube_vgpu.podspec import container_asks, parse_pod, pod_asks, resource_value
from kube_vgpu.resources import ResourceNames, system_owned
from kube_vgpu.views import ObjectView, PodView

from . import compat, isolation

DEFAULT_SCHEDULER = "default-scheduler"
SHM_PATH = "/dev/shm"
SHM_VOLUME = "kube-vgpu-shm"
#: most removed keys named one by one in admission warnings (the rest are counted)
MAX_KEY_WARNINGS = 8
#: longest key or value quoted in a warning or message
_QUOTE = 80

# Outcomes (the ``outcome`` label of the requests metric).
PATCHED = "patched"
ALLOWED = "allowed"
SKIPPED = "skipped"
STRIPPED = "stripped"
FOREIGN = "foreign"
DENIED = "denied"


@dataclass(slots=True)
class Decision:
    """The answer for one pod.

    allowed: admit or reject. patch: JSONPatch operations (RFC 6902, paths into the Pod); empty
    when nothing changes. code/reason/message: the ``status`` of a denial (HTTP-like code, e.g. 400
    for invalid values, 403 for policy). outcome: one of PATCHED, ALLOWED, SKIPPED, STRIPPED,
    FOREIGN, DENIED. warnings: admission warnings shown by kubectl.
    """

    allowed: bool
    outcome: str
    patch: list[dict[str, Any]] = field(default_factory=list)
    code: int = 200
    reason: str = ""
    message: str = ""
    warnings: list[str] = field(default_factory=list)


def _deny(code: int, reason: str, message: str) -> Decision:
    return Decision(allowed=False, outcome=DENIED, code=code, reason=reason, message=message)


def _containers(spec: Mapping[str, Any]) -> list[tuple[bool, dict[str, Any]]]:
    """(is_init, container) for init containers then app containers; non-dict entries dropped."""
    out: list[tuple[bool, dict[str, Any]]] = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise TypeError(f"spec.{key} is not a list")
        out.extend((init, c) for c in items if isinstance(c, dict))
    return out


def _indexed(spec: Mapping[str, Any]) -> list[tuple[bool, int, dict[str, Any]]]:
    """(is_init, index in its list, container) in the order of :func:`_containers`."""
    out: list[tuple[bool, int, dict[str, Any]]] = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        out.extend((init, i, c) for i, c in enumerate(spec.get(key) or []) if isinstance(c, dict))
    return out


def asks_vgpu(container: Mapping[str, Any], config: Config) -> bool:
    """True if the container makes its pod a vGPU pod (see module docstring, step 2)."""
    names = config.resource_names
    if not container_asks(container, names):
        return False
    if config.webhook.mutate_bare_gpu:
        return True
    return any(resource_value(container, n) is not None for n in names.share_names())


def is_foreign_scheduler(scheduler_name: Any, config: Config) -> bool:
    """True if ``spec.schedulerName`` names a scheduler whose pods we must leave alone: not ours, not
    one of ``compat.schedulerAliases`` (routed to ours like an empty name), not ``default-scheduler``
    while ``webhook.forceOverwriteDefaultScheduler``."""
    if not scheduler_name or scheduler_name == config.scheduler_name \
            or scheduler_name in config.compat.scheduler_aliases:
        return False
    if scheduler_name == DEFAULT_SCHEDULER:
        return not config.webhook.force_overwrite_default_scheduler
    return True


def _resolved_limits(req: ContainerRequest, names: ResourceNames) -> dict[str, str]:
    """The ``resources.limits`` entries that spell out a parsed request completely."""
    out = {names.gpu: str(req.count)}
    if req.memory_mib:
        out[names.gpumem] = str(req.memory_mib)
    else:
        out[names.gpumem_percentage] = str(req.memory_percent)
    out[names.gpucores] = str(req.cores)
    if req.priority is not None:
        out[names.priority] = str(req.priority)
    return out


def _limit_ops(path: str, container: Mapping[str, Any], req: ContainerRequest,
               names: ResourceNames) -> list[dict[str, Any]]:
    """Ops that make ``limits`` carry the whole request. Values already in limits are kept; vGPU
    values given only in ``requests`` are copied (extended resources need a limit)."""
    res = container.get("resources")
    limits_raw = res.get("limits") if isinstance(res, dict) else None
    limits: Mapping[str, Any] = limits_raw if isinstance(limits_raw, dict) else {}
    requests_raw = res.get("requests") if isinstance(res, dict) else None
    requests: Mapping[str, Any] = requests_raw if isinstance(requests_raw, dict) else {}
    want: dict[str, Any] = {n: requests[n] for n in names.all() if n not in limits and n in requests}
    mem_names = (names.gpumem, names.gpumem_percentage)
    has_memory = any(n in limits or n in want for n in mem_names)
    for n, v in _resolved_limits(req, names).items():
        if n in limits or n in want or (n in mem_names and has_memory):
            continue
        want[n] = v
    if not want:
        return []
    if not isinstance(res, dict):
        return [{"op": "add", "path": f"{path}/resources", "value": {"limits": want}}]
    if not isinstance(limits_raw, dict):
        return [{"op": "add", "path": f"{path}/resources/limits", "value": want}]
    return [{"op": "add", "path": f"{path}/resources/limits/{escape(n)}", "value": v} for n, v in want.items()]


def _append_op(path: str, obj: Mapping[str, Any], key: str, item: Any) -> dict[str, Any]:
    """Append ``item`` to the list ``obj[key]`` at ``path`` (creating the list if absent/null)."""
    if isinstance(obj.get(key), list):
        return {"op": "add", "path": f"{path}/{key}/-", "value": item}
    return {"op": "add", "path": f"{path}/{key}", "value": [item]}


def _mounts_shm(containers: list[tuple[bool, dict[str, Any]]]) -> bool:
    for _, c in containers:
        for m in c.get("volumeMounts") or []:
            if isinstance(m, dict) and str(m.get("mountPath", "")).rstrip("/") == SHM_PATH:
                return True
    return False


def _shm_volume_name(spec: Mapping[str, Any]) -> str:
    taken = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)}
    name, i = SHM_VOLUME, 1
    while name in taken:
        name, i = f"{SHM_VOLUME}-{i}", i + 1
    return name


def _visible_devices_entry(container: Mapping[str, Any]) -> dict[str, Any] | None:
    for e in container.get("env") or []:
        if isinstance(e, dict) and e.get("name") == VISIBLE_DEVICES:
            return e
    return None


def _clip(text: str) -> str:
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "..."


def system_keys(pod: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """The pod's system-owned annotations and labels: ``{("annotations"|"labels", key): value}``.
    Raises ShapeError when ``metadata``, its annotations or labels are not objects."""
    view = ObjectView.of(pod)
    return {(where, k): v for where, m in (("annotations", view.annotations), ("labels", view.labels))
            for k, v in m.items() if system_owned(k)}


def strip_system_keys(pod: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """JSONPatch ``remove`` ops for every system-owned annotation and label, and the warnings."""
    ops: list[dict[str, Any]] = []
    warnings: list[str] = []
    found = sorted(system_keys(pod))
    for where, key in found:
        ops.append({"op": "remove", "path": f"/metadata/{where}/{escape(key)}"})
    for where, key in found[:MAX_KEY_WARNINGS]:
        kind = "annotation" if where == "annotations" else "label"
        warnings.append(f"removed {kind} {_clip(key)!r}: kube-vgpu.io/ keys are written only by the kube-vgpu system")
    if len(found) > MAX_KEY_WARNINGS:
        warnings.append(f"removed {len(found) - MAX_KEY_WARNINGS} more system-owned kube-vgpu.io/ keys")
    return ops, warnings


def system_key_changes(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """The system-owned keys an UPDATE adds, changes or removes, as ``metadata.<where>["key"] (<what>)``."""
    before, after = system_keys(old), system_keys(new)
    out = []
    for where, key in sorted(set(before) | set(after)):
        if before.get((where, key)) == after.get((where, key)):
            continue
        what = "added" if (where, key) not in before else "removed" if (where, key) not in after else "changed"
        out.append(f"metadata.{where}[{_clip(key)!r}] ({what})")
    return out


def _with(base: Decision, ops: list[dict[str, Any]], warnings: list[str]) -> Decision:
    """``base`` with the removal ops and warnings put first (a denial is returned as it is)."""
    if not base.allowed:
        return base
    base.patch = ops + base.patch
    base.warnings = warnings + base.warnings
    if base.allowed and ops and base.outcome in (SKIPPED, ALLOWED):
        base.outcome = STRIPPED if base.outcome == SKIPPED else PATCHED
    return base


def review_pod(pod: Mapping[str, Any], config: Config, namespace: str = "") -> Decision:
    """Decide on the CREATE of one Pod (``core/v1 Pod`` JSON dict). See the module docstring.

    namespace: the request's namespace (``request.namespace``; default ``metadata.namespace``).
    Expects a pod that passed :func:`webhook.shape.check_pod` (the caller, ``admission.answer``,
    checks first and denies a wrong shape with a message naming the field path). Returns: a Decision.
    """
    spec = PodView(pod).spec
    if not (config.compat.gpushare and compat.pod_names_gpushare(pod)) \
            or is_foreign_scheduler(spec.get("schedulerName"), config):
        return _review(pod, spec, config, namespace)
    try:
        compat_ops, compat_warnings = compat.translate_pod(pod, config)
    except RequestError as e:
        return _deny(400, "BadRequest", str(e))
    translated = jsonpatch.apply_patch(pod, compat_ops)  # a copy; every rule below reads the translation
    d = _review(translated, PodView(translated).spec, config, namespace)
    if d.allowed:
        d.patch = compat_ops + d.patch
        d.warnings = compat_warnings + d.warnings
        d.outcome = PATCHED
    return d


def _review(pod: Mapping[str, Any], spec: Mapping[str, Any], config: Config, namespace: str) -> Decision:
    """Steps 1-7 of the module docstring (after the gpushare translation, if any)."""
    strip_ops, strip_warnings = strip_system_keys(pod)
    if not isolation.pod_is_ours(pod, config):
        return _with(Decision(allowed=True, outcome=SKIPPED), strip_ops, strip_warnings)
    violations = isolation.check_pod(pod, config, namespace)
    if violations:
        return _deny(403, "Forbidden", isolation.denial_message(violations))
    node = spec.get("nodeName")
    if node and pod_asks(pod, config.resource_names):
        # Whatever its scheduler: kubelet hands a pod bound by name the node's vGPU slots, which it
        # keeps while its containers are refused at PreStartContainer (no signed record).
        return _deny(403, "Forbidden",
                     f"spec.nodeName={node!r} is preset on a pod that names a vGPU resource; allowed: empty, "
                     f"so that {config.scheduler_name!r} places the pod (a pod bound by name would hold the "
                     f"node's vGPU slots without the scheduler's booking)")
    return _with(_route_and_mutate(pod, spec, config), strip_ops, strip_warnings)


def review_update(new: Mapping[str, Any], old: Mapping[str, Any], config: Config, username: str,
                  namespace: str = "", subresource: str = "") -> Decision:
    """Decide on an UPDATE of a Pod (``subresource`` ``""`` or ``ephemeralcontainers``).

    username: ``request.userInfo.username``. Returns a Decision: denied (403) when a user outside
    ``webhook.systemUsers`` adds, changes or removes a system-owned annotation or label (checked on
    the pod itself; the ephemeralcontainers subresource cannot change metadata), or when the update
    introduces an isolation violation (:func:`webhook.isolation.new_violations`); allowed otherwise.
    The only patch: through the ephemeralcontainers subresource, with
    ``webhook.nonGpuVisibleDevicesNone``, a new ephemeral container of a vGPU pod without its own
    ``NVIDIA_VISIBLE_DEVICES`` gets ``none`` (a debug image such as ``nvidia/cuda`` carries
    ``NVIDIA_VISIBLE_DEVICES=all``, which a default ``nvidia`` runtime would honour).
    """
    if not subresource:
        changed = system_key_changes(new, old)
        if changed and username not in config.webhook.system_users:
            users = ", ".join(repr(u) for u in config.webhook.system_users) or "none configured"
            return _deny(403, "Forbidden",
                         f"user {_clip(username)!r}: {', '.join(changed)} is not allowed: kube-vgpu.io/ "
                         f"annotations and labels are written only by the kube-vgpu system; allowed: leave them as "
                         f"they are (webhook.systemUsers: {users})")
    violations = isolation.new_violations(new, old, config, namespace)
    if violations:
        return _deny(403, "Forbidden", isolation.denial_message(violations))
    ops = _hide_gpus_from_new_ephemeral(new, old, config) if subresource else []
    return Decision(allowed=True, outcome=PATCHED if ops else ALLOWED, patch=ops)


def _hide_gpus_from_new_ephemeral(new: Mapping[str, Any], old: Mapping[str, Any], config: Config
                                  ) -> list[dict[str, Any]]:
    """``NVIDIA_VISIBLE_DEVICES=none`` for each ephemeral container of ``new`` (a vGPU pod) that
    ``old`` did not have and that sets no ``NVIDIA_VISIBLE_DEVICES`` itself (see review_update)."""
    if not config.webhook.non_gpu_visible_devices_none or not isolation.pod_is_ours(new, config):
        return []
    spec, old_spec = PodView(new).spec, PodView(old).spec
    before = {c.get("name") for c in old_spec.get("ephemeralContainers") or [] if isinstance(c, dict)}
    ops: list[dict[str, Any]] = []
    for i, c in enumerate(spec.get("ephemeralContainers") or []):
        if isinstance(c, dict) and c.get("name") not in before and _visible_devices_entry(c) is None:
            ops.append(_append_op(f"/spec/ephemeralContainers/{i}", c, "env",
                                  {"name": VISIBLE_DEVICES, "value": "none"}))
    return ops


def _route_and_mutate(pod: Mapping[str, Any], spec: Mapping[str, Any], config: Config) -> Decision:
    """Steps 4-7 of the module docstring for a pod that is ours and passed the isolation rules."""
    containers = _containers(spec)
    wh = config.webhook
    sched = spec.get("schedulerName")
    if is_foreign_scheduler(sched, config):
        if wh.foreign_schedulers == "deny":
            return _deny(403, "Forbidden",
                         f"spec.schedulerName={sched!r} is not allowed for a pod that requests a vGPU; "
                         f"allowed: empty, {DEFAULT_SCHEDULER!r}, {config.scheduler_name!r} or one of "
                         f"compat.schedulerAliases ({', '.join(config.compat.scheduler_aliases) or 'none'}) "
                         f"(webhook.foreignSchedulers=deny)")
        return Decision(allowed=True, outcome=FOREIGN)
    if not any(asks_vgpu(c, config) for _, c in containers):
        return Decision(allowed=True, outcome=SKIPPED)

    try:
        parsed = parse_pod(pod, config)
    except RequestError as e:
        return _deny(400, "BadRequest", str(e))
    # container names are unique in a valid pod; parse_pod keeps init and app requests apart
    by_name = {(r.init, r.name): r for r in parsed.init + parsed.app}
    reqs = [(init, c, by_name.get((init, str(c.get("name", "?"))))) for init, c in containers]
    if all(req is None for _, _, req in reqs):  # e.g. only ``nvidia.com/gpu: 0``
        return Decision(allowed=True, outcome=SKIPPED)

    # Build the JSONPatch directly (RFC 6902 paths into the Pod); jsonpatch checks it below.
    names = config.resource_names
    ops: list[dict[str, Any]] = []
    if sched != config.scheduler_name:
        ops.append({"op": "replace" if "schedulerName" in spec else "add", "path": "/spec/schedulerName",
                    "value": config.scheduler_name})
    gpu_paths: list[tuple[str, dict[str, Any]]] = []
    for (init, i, c), (_, _, req) in zip(_indexed(spec), reqs, strict=True):
        path = f"/spec/{'initContainers' if init else 'containers'}/{i}"
        if req is not None:
            ops += _limit_ops(path, c, req, names)
            gpu_paths.append((path, c))
        elif (wh.non_gpu_visible_devices_none and _visible_devices_entry(c) is None
              and not isolation.container_names_mig(c, names)):  # a MIG container keeps its MIG devices
            ops.append(_append_op(path, c, "env", {"name": VISIBLE_DEVICES, "value": "none"}))
    if gpu_paths and wh.runtime_class_name and spec.get("runtimeClassName") is None:
        ops.append({"op": "add", "path": "/spec/runtimeClassName", "value": wh.runtime_class_name})
    if gpu_paths and not _mounts_shm(containers):
        vol_name = _shm_volume_name(spec)
        empty_dir: dict[str, Any] = {"medium": "Memory"}
        if wh.shm_size_limit:
            empty_dir["sizeLimit"] = wh.shm_size_limit
        ops.append(_append_op("/spec", spec, "volumes", {"name": vol_name, "emptyDir": empty_dir}))
        for path, c in gpu_paths:
            ops.append(_append_op(path, c, "volumeMounts", {"name": vol_name, "mountPath": SHM_PATH}))
    ops = jsonpatch.JsonPatch(ops).patch
    warnings = []
    for _, c, req in reqs:
        if req is not None and resource_value(c, names.gpumem) is not None \
                and resource_value(c, names.gpumem_percentage) is not None:
            warnings.append(f"container {c.get('name', '?')!r}: {names.gpumem} is set, so "
                            f"{names.gpumem_percentage} is ignored")
    return Decision(allowed=True, outcome=PATCHED if ops else ALLOWED, patch=ops, warnings=warnings)
