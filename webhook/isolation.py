"""Isolation rules: what a pod that asks for the vGPU system's resources may not carry (one table).

Pure functions, no I/O. Input: a ``core/v1 Pod`` JSON dict that passed :func:`webhook.shape.check_pod`;
output: a list of :class:`Violation`, each naming the container (kind and name) or the pod, the
field, the value and what is allowed.

**Which pods.** A pod is *ours* when any of its containers (init, sidecar or app) names any
configured resource name (``resourceNames``: gpu, gpumem, gpumem-percentage, gpucores, priority)
or a per-profile MIG resource (``nvidia.com/mig-<profile>``, docs/mig.md) in ``resources.limits`` or
``resources.requests``, whatever the value. That includes a bare
``nvidia.com/gpu`` while ``webhook.mutateBareGpu`` is false (the device plugin still serves it) and
pods of a foreign ``schedulerName``. Pod labels play no part: opting out is the admin's (the
webhook's namespaceSelector, the policy ConfigMap), never the tenant's.

**Which containers.** In an ours pod the rules check

* the pod (``scope`` ``pod``): host namespaces, hostPath volumes, runtimeClassName;
* every *GPU container* (a container, init container or sidecar that names one of the resource
  names) and every *ephemeral container* (it gets no GPU, but shares the pod's volumes and network
  and, with ``--target``, a GPU container's processes): ``scope`` ``gpu``;
* every container (``scope`` ``any``): ``NVIDIA_VISIBLE_DEVICES`` (a container may only hide GPUs).

**The rules** (:data:`RULES`, in this order):

===================  =====  ==============================================================================
rule                 scope  denied
===================  =====  ==============================================================================
visible-devices      any    env ``NVIDIA_VISIBLE_DEVICES`` from ``valueFrom`` or with a value other than
                            ``none``/``void``/empty, and a ``volumeMounts[].mountPath`` at or under
                            ``/var/run/nvidia-container-devices`` (or ``/run/...``: the runtime's device list
                            as volume mounts), unless ``webhook.allowUserVisibleDevices``
env                  gpu    env names of the env contract and the shim's knobs: ``CUDA_DEVICE_MEMORY_LIMIT*``,
                            ``CUDA_DEVICE_SM_LIMIT*``, ``CUDA_DEVICE_MEMORY_SHARED_CACHE``, ``CUDA_TASK_PRIORITY``,
                            ``GPU_CORE_UTILIZATION_POLICY``, ``LIBVGPU_*`` except ``LIBVGPU_LOG_LEVEL``,
                            ``LD_PRELOAD``, ``LD_AUDIT``, ``NVIDIA_*`` except ``NVIDIA_DRIVER_CAPABILITIES``,
                            ``NVIDIA_REQUIRE_*``, ``NVIDIA_DISABLE_REQUIRE`` (``value`` or ``valueFrom``
                            alike); ``CUDA_DISABLE_CONTROL`` outside
                            ``webhook.allowDisableControlNamespaces``
env-from             gpu    ``envFrom`` whose ``prefix`` could produce one of those names (none, or e.g.
                            ``CUDA_``), unless ``webhook.allowEnvFrom``
mounts               gpu    a ``volumeMounts[].mountPath`` or ``volumeDevices[].devicePath`` at, under or
                            above ``/etc/ld.so.preload`` or the
                            shim directory ``/usr/local/vgpu`` (holds the shim and the cache dir)
privileged           gpu    ``securityContext.privileged: true`` unless ``webhook.privileged: allow``
capabilities         gpu    ``securityContext.capabilities.add`` of ``SYS_ADMIN`` (any case, ``CAP_`` prefix
                            or not) or ``ALL``, unless ``webhook.privileged: allow``
host-namespaces      pod    ``spec.hostPID: true``, ``spec.hostIPC: true``
host-path            pod    a ``hostPath`` volume at, under or above a protected host path
                            (:data:`PROTECTED_HOST_PATHS` + ``webhook.protectedHostPaths``)
runtime-class        pod    ``spec.runtimeClassName`` not in ``webhook.allowedRuntimeClasses``
===================  =====  ==============================================================================

Paths are compared normalised (``//``, ``.``, ``..`` and trailing slashes resolved; a relative
path counts from ``/``); a mount or hostPath at a *parent* (``/``, ``/etc``, ``/dev``, ``/usr/local``)
covers what is below it and is denied too. ``subPath`` only selects what of the volume is mounted,
never where, so it is not needed for the comparison.

Not denied, by decision: ``LIBVGPU_LOG_LEVEL`` (only the shim's log verbosity, in the tenant's own
log), ``CUDA_VISIBLE_DEVICES`` (narrows the devices the container already has), ``hostNetwork``
(gives no device access, no shim bypass and no view of other processes; use Pod Security
Admission ``baseline`` to forbid it), ``allowPrivilegeEscalation``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kube_vgpu import envcontract
from kube_vgpu.config import Config
from kube_vgpu.resources import ResourceNames, is_mig_resource
from kube_vgpu.views import ObjectView, PodView

#: values of NVIDIA_VISIBLE_DEVICES that expose no GPU (allowed in non-GPU containers)
HIDDEN_VALUES = ("none", "void", "")
LD_PRELOAD = "LD_PRELOAD"
#: rtld-audit libraries see and can redirect every symbol binding, the shim's hooks included
LD_AUDIT = "LD_AUDIT"
#: NVIDIA container runtime knobs a GPU container may set (the others, e.g. NVIDIA_IMEX_CHANNELS or
#: NVIDIA_MIG_CONFIG_DEVICES, ask the runtime for devices the scheduler did not allocate)
NVIDIA_ENV_PREFIX = "NVIDIA_"
NVIDIA_ENV_ALLOWED = frozenset({"NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_REQUIRE_CUDA"})
#: shim knobs read by libvgpu (libvgpu/src/core.c) beyond the env contract the device plugin writes
CORE_POLICY_ENV = "GPU_CORE_UTILIZATION_POLICY"
SHIM_ENV_PREFIX = "LIBVGPU_"

#: env names a GPU container may not set: exact names
PROTECTED_ENV_NAMES = frozenset({envcontract.SHARED_CACHE, envcontract.TASK_PRIORITY, LD_PRELOAD, CORE_POLICY_ENV})
#: ... and name prefixes (``CUDA_DEVICE_MEMORY_LIMIT`` and ``_<i>``, ``CUDA_DEVICE_SM_LIMIT`` and ``_<i>``)
PROTECTED_ENV_PREFIXES = (envcontract.MEMORY_LIMIT_PREFIX.rstrip("_"), envcontract.SM_LIMIT, SHIM_ENV_PREFIX)
#: names under a protected prefix that are harmless
HARMLESS_ENV_NAMES = frozenset({envcontract.LOG_LEVEL})

#: where the NVIDIA container runtime, configured to take device lists as volume mounts, reads which
#: GPUs to expose (a mount of /dev/null at ``<root>/<uuid or index or all>``); ``/run`` for images
#: whose ``/var/run`` links there
DEVICE_LIST_MOUNT_ROOTS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")

#: container paths the device plugin mounts into a GPU container (the shim directory holds the shim,
#: the per-container cache dir and the limits file)
PROTECTED_CONTAINER_PATHS = (envcontract.PRELOAD_CONTAINER_PATH, posixpath.dirname(envcontract.SHIM_CONTAINER_PATH),
                             envcontract.CACHE_CONTAINER_DIR)

#: host paths a vGPU pod's hostPath volumes may not reach (``*``: any name with that prefix): NVIDIA
#: device nodes and driver directories, the kubelet's directory (device-plugin sockets, other pods'
#: volumes) and the device plugin's default shim and cache host directories. The chart adds its
#: configured shim/cache/plugin directories with ``--protected-host-path``.
PROTECTED_HOST_PATHS = (
    "/dev/nvidia*", "/dev/dri", "/dev/char", "/proc/driver/nvidia",
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/nvidia",
    # the same driver directories through the symlinks of merged-/usr hosts (/lib -> usr/lib, ...)
    "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/lib32", "/usr/lib32",
    "/run/nvidia*", "/var/run/nvidia*", "/var/lib/kubelet",
    envcontract.SHIM_HOST_DIR, envcontract.CACHE_HOST_ROOT,
    # container runtimes: their sockets and state start any container, privileged included
    "/run/containerd", "/var/run/containerd", "/var/lib/containerd", "/run/crio", "/var/run/crio",
    "/var/lib/containers", "/run/docker.sock", "/var/run/docker.sock", "/var/lib/docker",
)

CONTAINER = "container"
INIT = "init container"
SIDECAR = "sidecar container"
EPHEMERAL = "ephemeral container"

#: capability names (upper case, without ``CAP_``) that undo device isolation
DENIED_CAPABILITIES = frozenset({"SYS_ADMIN", "ALL"})


@dataclass(frozen=True, slots=True)
class Violation:
    """One denied field. subject: ``container 'c'``, ``init container 'prep'``, ``pod``; field: the
    field as the user wrote it (``env CUDA_DEVICE_SM_LIMIT``, ``spec.hostPID``); value: its value as
    shown in the message; why: what it would undo; allowed: what is accepted instead."""

    rule: str
    subject: str
    field: str
    value: str
    why: str
    allowed: str

    def message(self) -> str:
        """``<subject>: <field>=<value> is not allowed (<why>); allowed: <allowed>``."""
        return f"{self.subject}: {self.field}={self.value} is not allowed ({self.why}); allowed: {self.allowed}"

    def key(self) -> tuple[str, str, str]:
        """Identity of the violation (to tell new violations from ones an old object already had)."""
        return (self.subject, self.field, self.value)


@dataclass(frozen=True, slots=True)
class Target:
    """One container under review: kind (CONTAINER, INIT, SIDECAR, EPHEMERAL), name, the JSON dict,
    and whether the ``gpu`` rules apply to it (a GPU container or an ephemeral container)."""

    kind: str
    name: str
    spec: Mapping[str, Any]
    gpu: bool

    @property
    def subject(self) -> str:
        return f"{self.kind} {self.name!r}"


@dataclass(frozen=True, slots=True)
class Context:
    """What the rules read besides the pod: the config and the namespace of the request."""

    config: Config
    namespace: str


# --- helpers ---------------------------------------------------------------------------------------

def names_resource(container: Any, names: ResourceNames) -> bool:
    """True if the container names any of ``names.all()`` or a per-profile MIG resource
    (``nvidia.com/mig-<profile>``, :func:`kube_vgpu.resources.is_mig_resource`: its device plugin
    hands out MIG devices through NVIDIA_VISIBLE_DEVICES) in limits or requests (any value). Never raises."""
    if not isinstance(container, dict):  # JSON objects are dicts; plain type checks keep this cheap
        return False
    res = container.get("resources")
    if not isinstance(res, dict):
        return False
    wanted = names.all()
    return any(isinstance(part, dict) and (any(n in part for n in wanted) or names_mig(part, names))
               for part in (res.get("limits"), res.get("requests")))


def names_mig(resources: Mapping[str, Any], names: ResourceNames) -> bool:
    """True if a ``limits`` / ``requests`` mapping names a per-profile MIG resource."""
    return any(isinstance(k, str) and is_mig_resource(k, names.gpu) for k in resources)


def container_names_mig(container: Any, names: ResourceNames) -> bool:
    """True if the container asks for a per-profile MIG resource (it must keep the MIG devices its
    device plugin sets in NVIDIA_VISIBLE_DEVICES). Never raises."""
    res = container.get("resources") if isinstance(container, dict) else None
    return isinstance(res, dict) and any(isinstance(part, dict) and names_mig(part, names)
                                         for part in (res.get("limits"), res.get("requests")))


def _list(spec: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = spec.get(key)
    return [c for c in items if isinstance(c, dict)] if isinstance(items, list) else []


def pod_is_ours(pod: Mapping[str, Any], config: Config) -> bool:
    """True if any init, sidecar or app container names one of our resource names (see module doc).
    Raises ShapeError when ``spec`` is not an object."""
    spec = PodView.of(pod).spec
    names = config.resource_names
    return any(names_resource(c, names) for key in ("initContainers", "containers") for c in _list(spec, key))


def targets(spec: Mapping[str, Any], names: ResourceNames) -> list[Target]:
    """Every container of the pod, in spec order: init containers and sidecars, app containers,
    ephemeral containers."""
    out: list[Target] = []
    for c in _list(spec, "initContainers"):
        kind = SIDECAR if c.get("restartPolicy") == "Always" else INIT
        out.append(Target(kind, str(c.get("name", "?")), c, names_resource(c, names)))
    out += [Target(CONTAINER, str(c.get("name", "?")), c, names_resource(c, names)) for c in _list(spec, "containers")]
    out += [Target(EPHEMERAL, str(c.get("name", "?")), c, True) for c in _list(spec, "ephemeralContainers")]
    return out


def normalise_path(path: str) -> str:
    """``path`` as an absolute, normalised POSIX path (``//``, ``.``, ``..``, trailing ``/`` resolved)."""
    p = posixpath.normpath("/" + path)
    return re.sub("/+", "/", p)


def path_overlaps(path: str, protected: str) -> bool:
    """True if normalised ``path`` is ``protected``, below it, or a parent directory of it.
    ``protected`` may end in ``*`` (then any path starting with the text before it matches)."""
    if path == "/":
        return True
    if protected.endswith("*"):
        base = protected[:-1]
        return path.startswith(base) or base.startswith(path + "/")
    return path == protected or path.startswith(protected + "/") or protected.startswith(path + "/")


def _env_rule(name: str, ctx: Context) -> tuple[str, str] | None:
    """(why, allowed) if a GPU container may not set env ``name``; None if it may."""
    if name == envcontract.DISABLE_CONTROL:
        allowed_ns = ctx.config.webhook.allow_disable_control_namespaces
        if ctx.namespace in allowed_ns:
            return None
        where = ", ".join(repr(n) for n in allowed_ns) if allowed_ns else "none"
        return ("it turns off the vGPU limits",
                f"unset; only namespaces in webhook.allowDisableControlNamespaces may set it (now: {where}; "
                f"this pod's namespace: {ctx.namespace!r})")
    if name in HARMLESS_ENV_NAMES:
        return None
    if name in (LD_PRELOAD, LD_AUDIT):
        return ("it loads code that runs ahead of the vGPU shim",
                "unset (the shim is preloaded through /etc/ld.so.preload)")
    if name.startswith(NVIDIA_ENV_PREFIX) and name not in NVIDIA_ENV_ALLOWED \
            and not name.startswith("NVIDIA_REQUIRE_"):
        return ("it asks the NVIDIA container runtime for devices or features the scheduler did not allocate",
                f"unset, or one of {', '.join(sorted(NVIDIA_ENV_ALLOWED))} or NVIDIA_REQUIRE_*")
    if name in PROTECTED_ENV_NAMES or name.startswith(PROTECTED_ENV_PREFIXES):
        return ("it overrides the vGPU limits the device plugin sets from the scheduler's allocation",
                _limit_env_allowed(name, ctx.config.resource_names))
    return None


def _limit_env_allowed(name: str, names: ResourceNames) -> str:
    """What a container writes instead of limit env ``name`` (HAMi's shim reads these from the
    container's own env; here the request decides, or the cluster's config)."""
    if name.startswith(envcontract.MEMORY_LIMIT_PREFIX.rstrip("_")):
        return f"unset; ask with {names.gpumem} (MiB per GPU) or {names.gpumem_percentage}"
    if name.startswith(envcontract.SM_LIMIT):
        return f"unset; ask with {names.gpucores} (percent of one GPU)"
    if name == envcontract.TASK_PRIORITY:
        return f"unset; ask with {names.priority} (0 high, 1 low)"
    if name == CORE_POLICY_ENV:
        return "unset; whether the SM limit is enforced is the cluster's choice (config devices.corePolicy, devices.coreSharing)"
    if name == envcontract.SHARED_CACHE:
        return "unset (the device plugin gives each container its own accounting file)"
    return f"unset ({envcontract.LOG_LEVEL} is the only shim setting a container may set)"


def _env_from_prefix_safe(prefix: str) -> bool:
    """True if no name ``prefix + key`` can be protected (nor NVIDIA_VISIBLE_DEVICES / CUDA_DISABLE_CONTROL)."""
    if not prefix:
        return False
    exact = PROTECTED_ENV_NAMES | {envcontract.VISIBLE_DEVICES, envcontract.DISABLE_CONTROL, LD_AUDIT}
    if any(n.startswith(prefix) for n in exact):
        return False
    return not any(p.startswith(prefix) or prefix.startswith(p)
                   for p in PROTECTED_ENV_PREFIXES + (NVIDIA_ENV_PREFIX,))


# --- the rules -------------------------------------------------------------------------------------

def _visible_devices(t: Target, ctx: Context) -> Iterator[Violation]:
    if ctx.config.webhook.allow_user_visible_devices:
        return
    for e in t.spec.get("env") or []:
        if not isinstance(e, dict) or e.get("name") != envcontract.VISIBLE_DEVICES:
            continue
        if "valueFrom" in e and e.get("valueFrom") is not None:
            value = "valueFrom"
        else:
            raw = e.get("value") or ""
            if raw.strip().lower() in HIDDEN_VALUES:
                continue  # hides GPUs, never exposes one
            value = repr(raw)
        yield Violation("visible-devices", t.subject, f"env {envcontract.VISIBLE_DEVICES}", value,
                        "it bypasses the vGPU scheduler",
                        "unset (in a vGPU container the device plugin sets it from the scheduler's allocation), "
                        "'none' or 'void' (webhook.allowUserVisibleDevices=false)")
    for i, m in enumerate(t.spec.get("volumeMounts") or []):
        if not isinstance(m, dict) or not isinstance(m.get("mountPath"), str):
            continue
        path = normalise_path(m["mountPath"])
        hit = next((r for r in DEVICE_LIST_MOUNT_ROOTS if path == r or path.startswith(r + "/")), None)
        if hit is not None:
            yield Violation("visible-devices", t.subject, f"volumeMounts[{i}].mountPath", repr(m["mountPath"]),
                            f"the NVIDIA container runtime reads the GPUs to expose from mounts under {hit} "
                            "(accept-nvidia-visible-devices-as-volume-mounts): it bypasses the vGPU scheduler",
                            f"a path outside {' and '.join(DEVICE_LIST_MOUNT_ROOTS)} "
                            "(webhook.allowUserVisibleDevices=false)")


def _env(t: Target, ctx: Context) -> Iterator[Violation]:
    for e in t.spec.get("env") or []:
        if not isinstance(e, dict):
            continue
        name = e.get("name")
        if not isinstance(name, str) or name == envcontract.VISIBLE_DEVICES:
            continue
        rule = _env_rule(name, ctx)
        if rule is None:
            continue
        value = "valueFrom" if e.get("valueFrom") is not None else repr(e.get("value") or "")
        yield Violation("env", t.subject, f"env {name}", value, *rule)


def _env_from(t: Target, ctx: Context) -> Iterator[Violation]:
    if ctx.config.webhook.allow_env_from:
        return
    for i, src in enumerate(t.spec.get("envFrom") or []):
        if not isinstance(src, dict):
            continue
        prefix = src.get("prefix") or ""
        if _env_from_prefix_safe(prefix):
            continue
        ref = src.get("configMapRef") or src.get("secretRef") or {}
        kind = "configMapRef" if src.get("configMapRef") is not None else "secretRef"
        source = f"{kind} {ref.get('name', '?')!r}" if isinstance(ref, dict) else kind
        yield Violation("env-from", t.subject, f"envFrom[{i}]", f"{source} with prefix {prefix!r}",
                        "the webhook cannot see the names it sets, which may override the vGPU limits or "
                        "LD_PRELOAD",
                        "env entries, or envFrom with a prefix that no protected name starts with (e.g. "
                        "'APP_'), or webhook.allowEnvFrom=true")


def _mounts(t: Target, ctx: Context) -> Iterator[Violation]:
    for key, field in (("volumeMounts", "mountPath"), ("volumeDevices", "devicePath")):
        for i, m in enumerate(t.spec.get(key) or []):
            if not isinstance(m, dict) or not isinstance(m.get(field), str):
                continue
            path = normalise_path(m[field])
            hit = next((p for p in PROTECTED_CONTAINER_PATHS if path_overlaps(path, p)), None)
            if hit is None:
                continue
            yield Violation("mounts", t.subject, f"{key}[{i}].{field}", repr(m[field]),
                            f"it covers {hit}, where the device plugin mounts the vGPU shim and its files",
                            f"a path that is neither {', '.join(PROTECTED_CONTAINER_PATHS[:2])} nor above or "
                            "below them")


def _privileged(t: Target, ctx: Context) -> Iterator[Violation]:
    if ctx.config.webhook.privileged != "deny":
        return
    sc = t.spec.get("securityContext") or {}
    if isinstance(sc, dict) and sc.get("privileged") is True:
        yield Violation("privileged", t.subject, "securityContext.privileged", "true",
                        "a privileged container sees every GPU of the node and bypasses isolation",
                        "false or unset (webhook.privileged=deny)")


def _capabilities(t: Target, ctx: Context) -> Iterator[Violation]:
    if ctx.config.webhook.privileged != "deny":
        return
    sc = t.spec.get("securityContext") or {}
    caps = sc.get("capabilities") if isinstance(sc, dict) else None
    added = caps.get("add") if isinstance(caps, dict) else None
    for i, cap in enumerate(added or []):
        if not isinstance(cap, str):
            continue
        norm = cap.strip().upper()
        norm = norm[4:] if norm.startswith("CAP_") else norm
        if norm in DENIED_CAPABILITIES:
            yield Violation("capabilities", t.subject, f"securityContext.capabilities.add[{i}]", repr(cap),
                            "it can remount the shim away and reach devices and other processes",
                            f"capabilities other than {', '.join(sorted(DENIED_CAPABILITIES))} "
                            "(webhook.privileged=deny)")


def _host_namespaces(spec: Mapping[str, Any], ctx: Context) -> Iterator[Violation]:
    for key, what in (("hostPID", "the node's processes, other tenants' GPU processes included"),
                      ("hostIPC", "the node's shared memory and IPC, which GPU processes use")):
        if spec.get(key) is True:
            yield Violation("host-namespaces", "pod", f"spec.{key}", "true",
                            f"it shares {what}", "false or unset")


def _host_path(spec: Mapping[str, Any], ctx: Context) -> Iterator[Violation]:
    protected = PROTECTED_HOST_PATHS + ctx.config.webhook.protected_host_paths
    for i, v in enumerate(spec.get("volumes") or []):
        if not isinstance(v, dict):
            continue
        hp = v.get("hostPath")
        if not isinstance(hp, dict) or not isinstance(hp.get("path"), str):
            continue
        path = normalise_path(hp["path"])
        hit = next((p for p in protected if path_overlaps(path, p)), None)
        if hit is None:
            continue
        yield Violation("host-path", "pod", f"spec.volumes[{i}] ({v.get('name', '?')!r}).hostPath.path",
                        repr(hp["path"]), f"it reaches {hit} on the node (GPU devices, driver or vGPU files)",
                        "a hostPath outside the protected paths (see webhook.protectedHostPaths) or another "
                        "volume type")


def _runtime_class(spec: Mapping[str, Any], ctx: Context) -> Iterator[Violation]:
    rc = spec.get("runtimeClassName")
    allowed = ctx.config.webhook.allowed_runtime_classes
    if rc is None or rc in allowed:
        return
    shown = ", ".join(repr(x) for x in allowed)
    yield Violation("runtime-class", "pod", "spec.runtimeClassName", repr(rc),
                    "another runtime may skip the NVIDIA hook that enforces the allocated devices",
                    f"unset or one of webhook.allowedRuntimeClasses ({shown or 'none'})")


@dataclass(frozen=True, slots=True)
class Rule:
    """One isolation rule: name, scope (``pod``, ``gpu`` or ``any``), and the check."""

    name: str
    scope: str
    check: Callable[..., Iterator[Violation]]


#: every isolation rule, in the order they are reported
RULES: tuple[Rule, ...] = (
    Rule("visible-devices", "any", _visible_devices),
    Rule("env", "gpu", _env),
    Rule("env-from", "gpu", _env_from),
    Rule("mounts", "gpu", _mounts),
    Rule("privileged", "gpu", _privileged),
    Rule("capabilities", "gpu", _capabilities),
    Rule("host-namespaces", "pod", _host_namespaces),
    Rule("host-path", "pod", _host_path),
    Rule("runtime-class", "pod", _runtime_class),
)


def check_pod(pod: Mapping[str, Any], config: Config, namespace: str = "") -> list[Violation]:
    """Every isolation violation of ``pod`` (empty when the pod is not ours, see module doc).

    namespace: the request's namespace (falls back to ``metadata.namespace``), for the per-namespace
    ``CUDA_DISABLE_CONTROL`` allowance. Expects a pod that passed :func:`webhook.shape.check_pod`;
    raises ShapeError when ``metadata`` or ``spec`` is not an object.
    """
    view = ObjectView.of(pod)
    spec = view.spec
    all_targets = targets(spec, config.resource_names)
    if not any(t.gpu and t.kind != EPHEMERAL for t in all_targets):  # not ours (see pod_is_ours)
        return []
    ctx = Context(config, namespace or ObjectView(view.raw).namespace)
    out: list[Violation] = []
    for rule in RULES:
        if rule.scope == "pod":
            out += rule.check(spec, ctx)
            continue
        for t in all_targets:
            if rule.scope == "any" or t.gpu:
                out += rule.check(t, ctx)
    return out


def new_violations(new: Mapping[str, Any], old: Mapping[str, Any] | None, config: Config,
                   namespace: str = "") -> list[Violation]:
    """Violations of ``new`` that ``old`` did not have (all of them when old is None).

    On UPDATE only what the update introduces is denied: a pod admitted before a rule existed (or
    while its namespace was exempt) can still be labelled, finalised and deleted.
    """
    found = check_pod(new, config, namespace)
    if old is None or not found:
        return found
    before = {v.key() for v in check_pod(old, config, namespace)}
    return [v for v in found if v.key() not in before]


def denial_message(violations: list[Violation]) -> str:
    """One status message: the first violation, then the others (the server clips it at 1,024 chars)."""
    first = violations[0].message()
    if len(violations) == 1:
        return first
    rest = " | ".join(v.message() for v in violations[1:])
    return f"{first} [and {len(violations) - 1} more: {rest}]"


__all__ = ["CONTAINER", "EPHEMERAL", "INIT", "PROTECTED_CONTAINER_PATHS", "PROTECTED_ENV_NAMES",
           "PROTECTED_ENV_PREFIXES", "PROTECTED_HOST_PATHS", "RULES", "Rule", "SIDECAR", "Violation",
           "check_pod", "container_names_mig", "denial_message", "names_mig", "names_resource", "new_violations",
           "normalise_path",
           "path_overlaps", "pod_is_ours", "targets"]
