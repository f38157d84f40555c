"""The versioned config schema (one file for every component; the Helm chart's policy ConfigMap).

Schema ``apiVersion: kube-vgpu.io/v1``. Every key is optional; unknown keys are errors so typos do
not pass silently. Example (all defaults)::

    apiVersion: kube-vgpu.io/v1
    schedulerName: kube-vgpu-scheduler
    resourceNames: {gpu: nvidia.com/gpu, gpumem: nvidia.com/gpumem,
                    gpumemPercentage: nvidia.com/gpumem-percentage,
                    gpucores: nvidia.com/gpucores, priority: nvidia.com/priority}
    defaults: {gpuCount: 1, memoryMiB: 0, memoryPercentage: 100, cores: 0, bareGpuExclusive: true}
    scheduling: {nodePolicy: binpack, gpuPolicy: spread, inventoryStaleSeconds: 120,
                 bindHandoverSeconds: 30, adoptUnsignedBefore: ""}
    devices: {splitCount: 10, memoryScaling: 1.0, coreScaling: 1.0}
    nodes: []          # [{name, splitCount, memoryScaling, coreScaling, excludeGPUs: [uuid|index]}]
    webhook: {forceOverwriteDefaultScheduler: true, mutateBareGpu: true, privileged: deny,
              allowUserVisibleDevices: false, nonGpuVisibleDevicesNone: true,
              shmSizeLimit: "", foreignSchedulers: leave, systemUsers: [],
              allowDisableControlNamespaces: [], allowedRuntimeClasses: [nvidia],
              allowEnvFrom: false, protectedHostPaths: []}

Errors: :class:`kube_vgpu.errors.ConfigError` with the dotted key (``scheduling.nodePolicy``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, QuantityError
from .quantity import parse_quantity
from .resources import DEFAULT_SCHEDULER_NAME, ResourceNames

API_VERSION = "kube-vgpu.io/v1"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

NODE_POLICIES = ("binpack", "spread", "fgd", "fgd-bestfit", "bestfit", "dotprod")
GPU_POLICIES = ("binpack", "spread")


@dataclass(frozen=True, slots=True)
class Defaults:
    """Defaults applied when a container omits part of its request.

    gpu_count: ``nvidia.com/gpu`` when only gpumem/gpucores are given (count, >= 1).
    memory_mib: MiB when neither gpumem nor gpumem-percentage is given (0 = use memory_percentage).
    memory_percentage: percent of the GPU's memory in that case (1-100).
    cores: percent of compute when gpucores is not given (0-100; 0 = no reservation, no SM limit).
    bare_gpu_exclusive: a bare ``nvidia.com/gpu`` (no gpumem/cores) takes whole cards.
    """

    gpu_count: int = 1
    memory_mib: int = 0
    memory_percentage: int = 100
    cores: int = 0
    bare_gpu_exclusive: bool = True


@dataclass(frozen=True, slots=True)
class Scheduling:
    """Placement policy. node_policy is one of NODE_POLICIES; gpu_policy one of GPU_POLICIES.

    inventory_stale_seconds: a node whose inventory heartbeat is older is not a candidate (seconds).
    bind_handover_seconds: deprecated, no effect (still validated, 0..3600, so existing configs
    load): binds no longer wait for the device plugin, which identifies each container exactly at
    PreStartContainer (docs/device-plugin.md).
    adopt_unsigned_before: upgrade from unsigned allocation records (RFC 3339 time, "" = off): the
    extender also books the unsigned record of a pod that is bound, names this scheduler and was
    created before this time (checked against the pod's request), and signs it; see
    docs/upgrading-signed-allocations.md. :func:`rfc3339_seconds` reads it.
    """

    node_policy: str = "binpack"
    gpu_policy: str = "spread"
    inventory_stale_seconds: float = 120.0
    bind_handover_seconds: float = 30.0
    adopt_unsigned_before: str = ""


@dataclass(frozen=True, slots=True)
class DeviceDefaults:
    """split_count: vGPU slots (max containers) per GPU; memory_scaling: factor on NVML memory
    (>1 oversubscribes); core_scaling: factor on 100 percent of compute."""

    split_count: int = 10
    memory_scaling: float = 1.0
    core_scaling: float = 1.0


@dataclass(frozen=True, slots=True)
class NodeOverride:
    """Per-node device-plugin overrides (matched by node name)."""

    name: str
    split_count: int | None = None
    memory_scaling: float | None = None
    core_scaling: float | None = None
    exclude_gpus: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Admission policy.

    force_overwrite_default_scheduler: route pods of ``default-scheduler`` to ours.
    mutate_bare_gpu: treat a bare ``nvidia.com/gpu`` as a vGPU request.
    privileged: ``deny`` or ``allow`` privileged GPU containers (and ``SYS_ADMIN`` / ``ALL`` capabilities).
    allow_user_visible_devices: allow a container to set NVIDIA_VISIBLE_DEVICES itself.
    non_gpu_visible_devices_none: give non-GPU containers ``NVIDIA_VISIBLE_DEVICES=none``.
    shm_size_limit: sizeLimit of the injected /dev/shm emptyDir (quantity, "" = none).
    foreign_schedulers: ``leave`` pods of other schedulers alone, or ``deny`` them.
    system_users: user names (``request.userInfo.username``, e.g.
    ``system:serviceaccount:kube-vgpu:kube-vgpu-extender``) allowed to add, change or remove the
    system-owned ``kube-vgpu.io/`` annotations and labels of a pod; empty = nobody.
    allow_disable_control_namespaces: namespaces whose GPU containers may set ``CUDA_DISABLE_CONTROL``.
    allowed_runtime_classes: ``spec.runtimeClassName`` values a vGPU pod may name (unset is always allowed).
    allow_env_from: allow ``envFrom`` without a safe prefix in GPU containers.
    protected_host_paths: absolute host paths (a trailing ``*`` matches any name with that prefix)
    that a vGPU pod's hostPath volumes may not reach, in addition to the built-in list.
    """

    force_overwrite_default_scheduler: bool = True
    mutate_bare_gpu: bool = True
    privileged: str = "deny"
    allow_user_visible_devices: bool = False
    non_gpu_visible_devices_none: bool = True
    shm_size_limit: str = ""
    foreign_schedulers: str = "leave"
    system_users: tuple[str, ...] = ()
    allow_disable_control_namespaces: tuple[str, ...] = ()
    allowed_runtime_classes: tuple[str, ...] = ("nvidia",)
    allow_env_from: bool = False
    protected_host_paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    """The whole config (see module docstring for the YAML layout)."""

    scheduler_name: str = DEFAULT_SCHEDULER_NAME
    resource_names: ResourceNames = field(default_factory=ResourceNames)
    defaults: Defaults = field(default_factory=Defaults)
    scheduling: Scheduling = field(default_factory=Scheduling)
    devices: DeviceDefaults = field(default_factory=DeviceDefaults)
    nodes: tuple[NodeOverride, ...] = ()
    webhook: WebhookConfig = field(default_factory=WebhookConfig)

    def node_override(self, node: str) -> NodeOverride | None:
        """The override for ``node``, or None."""
        for n in self.nodes:
            if n.name == node:
                return n
        return None


# ---------------------------------------------------------------------------------------------
# Loading with validation

_KEYMAP: dict[type, dict[str, str]] = {
    ResourceNames: {"gpu": "gpu", "gpumem": "gpumem", "gpumemPercentage": "gpumem_percentage",
                    "gpucores": "gpucores", "priority": "priority"},
    Defaults: {"gpuCount": "gpu_count", "memoryMiB": "memory_mib", "memoryPercentage": "memory_percentage",
               "cores": "cores", "bareGpuExclusive": "bare_gpu_exclusive"},
    Scheduling: {"nodePolicy": "node_policy", "gpuPolicy": "gpu_policy",
                 "inventoryStaleSeconds": "inventory_stale_seconds",
                 "bindHandoverSeconds": "bind_handover_seconds",
                 "adoptUnsignedBefore": "adopt_unsigned_before"},
    DeviceDefaults: {"splitCount": "split_count", "memoryScaling": "memory_scaling",
                     "coreScaling": "core_scaling"},
    NodeOverride: {"name": "name", "splitCount": "split_count", "memoryScaling": "memory_scaling",
                   "coreScaling": "core_scaling", "excludeGPUs": "exclude_gpus"},
    WebhookConfig: {"forceOverwriteDefaultScheduler": "force_overwrite_default_scheduler",
                    "mutateBareGpu": "mutate_bare_gpu", "privileged": "privileged",
                    "allowUserVisibleDevices": "allow_user_visible_devices",
                    "nonGpuVisibleDevicesNone": "non_gpu_visible_devices_none",
                    "shmSizeLimit": "shm_size_limit", "foreignSchedulers": "foreign_schedulers",
                    "systemUsers": "system_users",
                    "allowDisableControlNamespaces": "allow_disable_control_namespaces",
                    "allowedRuntimeClasses": "allowed_runtime_classes", "allowEnvFrom": "allow_env_from",
                    "protectedHostPaths": "protected_host_paths"},
}


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"{value!r} is not a boolean (true/false)")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"{value!r} is not an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"{value!r} is not a number")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"{value!r} is not a string")
        return value
    raise AssertionError(kind)


_FIELD_KIND: dict[str, type] = {}


def _section(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"must be a mapping, got {type(raw).__name__}")
    keymap = _KEYMAP[cls]
    kinds = {f.name: f.type for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{prefix}.{k}"
        if k not in keymap:
            raise ConfigError(key, f"unknown key; allowed: {', '.join(sorted(keymap))}")
        name = keymap[k]
        t = str(kinds[name])
        if name == "exclude_gpus":
            if not isinstance(v, list) or not all(isinstance(x, str | int) for x in v):
                raise ConfigError(key, "must be a list of GPU UUIDs or indexes")
            kwargs[name] = tuple(str(x) for x in v)
            continue
        if "tuple[str" in t:
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                raise ConfigError(key, f"{v!r} is not a list of non-empty strings")
            kwargs[name] = tuple(v)
            continue
        if name == "adopt_unsigned_before" and not isinstance(v, str) and v is not None:
            # YAML reads an unquoted time as a datetime (with its zone) or a date
            if not isinstance(v, datetime) or v.tzinfo is None:
                raise ConfigError(key, f"{str(v)!r} is not an RFC 3339 time with a zone (e.g. 2026-03-01T00:00:00Z)")
            v = v.isoformat()
        base = int if "int" in t else float if "float" in t else bool if "bool" in t else str
        if v is None and "None" in t:
            continue
        kwargs[name] = _typed(key, v, base)
        if base is float and kwargs[name] != kwargs[name]:
            raise ConfigError(key, "NaN is not allowed")
    if cls is NodeOverride and "name" not in kwargs:
        raise ConfigError(f"{prefix}.name", "is required (the node this override applies to)")
    return cls(**kwargs)


def _check(cfg: Config) -> None:
    d = cfg.defaults
    if d.gpu_count < 1:
        raise ConfigError("defaults.gpuCount", f"{d.gpu_count} is not allowed; must be >= 1")
    if d.memory_mib < 0:
        raise ConfigError("defaults.memoryMiB", f"{d.memory_mib} is not allowed; must be >= 0 (0 = use memoryPercentage)")
    if not 1 <= d.memory_percentage <= 100:
        raise ConfigError("defaults.memoryPercentage", f"{d.memory_percentage} is not allowed; must be 1..100")
    if not 0 <= d.cores <= 100:
        raise ConfigError("defaults.cores", f"{d.cores} is not allowed; must be 0..100")
    s = cfg.scheduling
    if s.node_policy not in NODE_POLICIES:
        raise ConfigError("scheduling.nodePolicy", f"{s.node_policy!r} is not one of {', '.join(NODE_POLICIES)}")
    if s.gpu_policy not in GPU_POLICIES:
        raise ConfigError("scheduling.gpuPolicy", f"{s.gpu_policy!r} is not one of {', '.join(GPU_POLICIES)}")
    if s.inventory_stale_seconds <= 0:
        raise ConfigError("scheduling.inventoryStaleSeconds", "must be > 0")
    if not 0 <= s.bind_handover_seconds <= 3600:
        raise ConfigError("scheduling.bindHandoverSeconds", "must be 0..3600 (deprecated: it has no effect)")
    if s.adopt_unsigned_before:
        try:
            rfc3339_seconds(s.adopt_unsigned_before)
        except ValueError as e:
            raise ConfigError("scheduling.adoptUnsignedBefore", str(e)) from None
    for prefix, dev in [("devices", cfg.devices)] + [(f"nodes[{i}]", n) for i, n in enumerate(cfg.nodes)]:
        split = getattr(dev, "split_count", None)
        if split is not None and not 1 <= split <= 1024:
            raise ConfigError(f"{prefix}.splitCount", f"{split} is not allowed; must be 1..1024")
        for attr, key in (("memory_scaling", "memoryScaling"), ("core_scaling", "coreScaling")):
            val = getattr(dev, attr)
            if val is not None and not 0 < val <= 100:
                raise ConfigError(f"{prefix}.{key}", f"{val} is not allowed; must be > 0 and <= 100")
    for i, n in enumerate(cfg.nodes):
        if not n.name:
            raise ConfigError(f"nodes[{i}].name", "must be a non-empty node name")
    w = cfg.webhook
    if w.privileged not in ("deny", "allow"):
        raise ConfigError("webhook.privileged", f"{w.privileged!r} is not one of deny, allow")
    if w.foreign_schedulers not in ("leave", "deny"):
        raise ConfigError("webhook.foreignSchedulers", f"{w.foreign_schedulers!r} is not one of leave, deny")
    if w.shm_size_limit:
        try:
            if parse_quantity(w.shm_size_limit) <= 0:  # QuantityError for junk and absurd lengths
                raise ConfigError("webhook.shmSizeLimit", f"{w.shm_size_limit!r} must be > 0")
        except QuantityError as e:
            raise ConfigError("webhook.shmSizeLimit", str(e)) from e
    for ns in w.allow_disable_control_namespaces:
        if not _DNS_LABEL.match(ns):
            raise ConfigError("webhook.allowDisableControlNamespaces",
                              f"{ns!r} is not a namespace name; allowed: a DNS label (lowercase letters, digits, "
                              "'-', at most 63)")
    for rc in w.allowed_runtime_classes:
        if not _DNS_SUBDOMAIN.match(rc) or len(rc) > 253:
            raise ConfigError("webhook.allowedRuntimeClasses",
                              f"{rc!r} is not a RuntimeClass name; allowed: a DNS subdomain")
    for hp in w.protected_host_paths:
        if not hp.startswith("/") or "*" in hp[:-1]:
            raise ConfigError("webhook.protectedHostPaths",
                              f"{hp!r} is not allowed; allowed: an absolute path, optionally ending in '*'")
    names = cfg.resource_names.all()
    if len(set(names)) != len(names) or not all(names):
        raise ConfigError("resourceNames", "names must be non-empty and distinct")
    if not _DNS_SUBDOMAIN.match(cfg.scheduler_name) or len(cfg.scheduler_name) > 253:
        raise ConfigError("schedulerName", f"{cfg.scheduler_name!r} is not a valid scheduler name; allowed: a DNS "
                                           "subdomain (lowercase letters, digits, '-' and '.', at most 253)")


def rfc3339_seconds(text: str) -> float:
    """Unix seconds of an RFC 3339 time with a zone (``2026-03-01T00:00:00Z``,
    ``2026-03-01T01:00:00+01:00``, fractions allowed). Raises ValueError naming the value."""
    bad = ValueError(f"{text!r} is not an RFC 3339 time with a zone (e.g. 2026-03-01T00:00:00Z)")
    if not isinstance(text, str) or not _RFC3339.match(text):
        raise bad
    try:
        t = datetime.fromisoformat(text.replace("z", "Z").replace("t", "T"))
    except ValueError:
        raise bad from None
    return t.timestamp()


_TOP = {"apiVersion", "kind", "schedulerName", "resourceNames", "defaults", "scheduling", "devices",
        "nodes", "webhook"}


def config_from_dict(raw: Any) -> Config:
    """Build and validate a Config from parsed YAML/JSON.

    Raises: ConfigError naming the dotted key, the value and what is allowed.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("(root)", f"must be a mapping, got {type(raw).__name__}")
    for k in raw:
        if k not in _TOP:
            raise ConfigError(str(k), f"unknown key; allowed: {', '.join(sorted(_TOP))}")
    version = raw.get("apiVersion", API_VERSION)
    if version != API_VERSION:
        raise ConfigError("apiVersion", f"{version!r} is not supported; use {API_VERSION!r}")
    nodes_raw = raw.get("nodes") or []
    if not isinstance(nodes_raw, list):
        raise ConfigError("nodes", "must be a list")
    sched_name = raw.get("schedulerName", DEFAULT_SCHEDULER_NAME)
    cfg = Config(
        scheduler_name=_typed("schedulerName", sched_name, str),
        resource_names=_section(ResourceNames, raw.get("resourceNames"), "resourceNames"),
        defaults=_section(Defaults, raw.get("defaults"), "defaults"),
        scheduling=_section(Scheduling, raw.get("scheduling"), "scheduling"),
        devices=_section(DeviceDefaults, raw.get("devices"), "devices"),
        nodes=tuple(_section(NodeOverride, n, f"nodes[{i}]") for i, n in enumerate(nodes_raw)),
        webhook=_section(WebhookConfig, raw.get("webhook"), "webhook"),
    )
    _check(cfg)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                dup = key in seen
            except TypeError:
                continue
            if dup:
                raise ConfigError(str(key), f"given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config_text(text: str) -> Config:
    """Parse YAML text into a validated Config. Raises ConfigError (also for YAML syntax errors and
    keys given twice)."""
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError("(yaml)", f"not valid YAML: {e}") from e
    return config_from_dict(raw)


def load_config(path: str | Path | None) -> Config:
    """Load the config file at ``path`` (None or missing key file -> defaults). Raises ConfigError, OSError."""
    if path is None:
        return Config()
    return load_config_text(Path(path).read_text())


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The YAML-shaped dict of a Config (inverse of :func:`config_from_dict`)."""

    def sect(obj: Any) -> dict[str, Any]:
        inv = {v: k for k, v in _KEYMAP[type(obj)].items()}
        out: dict[str, Any] = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            out[inv[f.name]] = list(v) if isinstance(v, tuple) else v
        return out

    return {
        "apiVersion": API_VERSION,
        "schedulerName": cfg.scheduler_name,
        "resourceNames": sect(cfg.resource_names),
        "defaults": sect(cfg.defaults),
        "scheduling": sect(cfg.scheduling),
        "devices": sect(cfg.devices),
        "nodes": [sect(n) for n in cfg.nodes],
        "webhook": sect(cfg.webhook),
    }


__all__ = ["API_VERSION", "Config", "Defaults", "DeviceDefaults", "NodeOverride", "Scheduling",
           "WebhookConfig", "config_from_dict", "config_to_dict", "load_config", "load_config_text",
           "replace", "rfc3339_seconds", "NODE_POLICIES", "GPU_POLICIES"]
