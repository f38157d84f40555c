"""Parse a Kubernetes Pod (``core/v1 Pod`` as JSON dict) into a :class:`PodRequest`.

Rules (documented in docs/configuration.md and README):

* Per resource, ``limits`` first, ``requests`` as fallback.
* ``nvidia.com/gpu`` counts *physical GPUs per container* (not vGPU slots); whole number >= 1.
* ``nvidia.com/gpumem`` MiB per GPU, whole number >= 1.
* ``nvidia.com/gpumem-percentage`` percent of each GPU's memory, whole number 1..100
  (0 is rejected: it would book 0 MiB and give an unlimited limit).
* ``nvidia.com/gpucores`` percent of one GPU's compute, whole number 0..100.
* Both gpumem and gpumem-percentage set: **gpumem wins** and the percentage is ignored (HAMi's rule).
* Only gpumem/gpucores given: ``nvidia.com/gpu`` defaults to ``defaults.gpuCount``.
* A bare ``nvidia.com/gpu`` (no gpumem/percentage/cores): whole cards (100% memory, 100 cores)
  when ``defaults.bareGpuExclusive``; else the memory/cores defaults.
* Neither gpumem nor percentage: ``defaults.memoryMiB`` if > 0 else ``defaults.memoryPercentage``;
  a 100% memory request without gpucores gets 100 cores (the card is exclusive anyway).
* Init containers and app containers are kept apart (init run one at a time).

Fractions (``"99.1"``, ``"50m"``), negatives, percentages over 100, zero memory and unparseable
values raise :class:`RequestError` naming the container, resource, value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import GPU_POLICIES, NODE_POLICIES, Config
from .errors import QuantityError, RequestError
from .model import Constraints, ContainerRequest, PodRequest
from .quantity import parse_quantity, parse_whole
from .resources import (
    ANN_GPU_POLICY,
    ANN_NODE_POLICY,
    ANN_NOUSE_GPUTYPE,
    ANN_NOUSE_GPUUUID,
    ANN_USE_GPUTYPE,
    ANN_USE_GPUUUID,
    HAMI_ANN_GPU_POLICY,
    HAMI_ANN_NODE_POLICY,
    ResourceNames,
)

_DEFAULT_CONFIG = Config()


def _resources(container: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    res = container.get("resources") or {}
    return (res.get("limits") or {}), (res.get("requests") or {})


def resource_value(container: Mapping[str, Any], name: str) -> Any:
    """The raw value of resource ``name`` for a container: limits first, requests as fallback."""
    limits, requests = _resources(container)
    if name in limits:
        return limits[name]
    return requests.get(name)


def container_asks(container: Mapping[str, Any], names: ResourceNames) -> bool:
    """True if the container names any vGPU resource (gpu, gpumem, percentage, cores) at all."""
    limits, requests = _resources(container)
    for n in (names.gpu, names.gpumem, names.gpumem_percentage, names.gpucores):
        if n in limits or n in requests:
            return True
    return False


def pod_asks(pod: Mapping[str, Any], names: ResourceNames) -> bool:
    """True if any init or app container of the pod names a vGPU resource."""
    spec = pod.get("spec") or {}
    return any(container_asks(c, names) for c in (spec.get("initContainers") or []) + (spec.get("containers") or []))


def _whole(cname: str, kind: str, resource: str, raw: Any, lo: int, hi: int | None, allowed: str) -> int:
    try:
        v = parse_whole(raw)
    except QuantityError:
        raise RequestError(cname, resource, raw, allowed, kind) from None
    if v < lo or (hi is not None and v > hi):
        raise RequestError(cname, resource, raw, allowed, kind)
    return v


def parse_container(
    container: Mapping[str, Any], init: bool, config: Config = _DEFAULT_CONFIG
) -> ContainerRequest | None:
    """Parse one container (``core/v1 Container``) into a request, or None if it asks for no vGPU.

    Raises: RequestError for invalid values (message names container, resource, value, allowed).
    """
    names = config.resource_names
    d = config.defaults
    cname = str(container.get("name", "?"))
    kind = "init container" if init else "container"
    gpu_raw = resource_value(container, names.gpu)
    mem_raw = resource_value(container, names.gpumem)
    pct_raw = resource_value(container, names.gpumem_percentage)
    core_raw = resource_value(container, names.gpucores)
    prio_raw = resource_value(container, names.priority)
    share = mem_raw is not None or pct_raw is not None or core_raw is not None
    if gpu_raw is None and not share:
        return None
    if gpu_raw is not None:
        count = _whole(cname, kind, names.gpu, gpu_raw, 0, 128, "a whole number of physical GPUs, 1..128")
        if count == 0:
            if share:
                raise RequestError(cname, names.gpu, gpu_raw,
                                   "a whole number >= 1 when gpumem/gpucores are requested", kind)
            return None
    else:
        count = d.gpu_count
    mem = pct = 0
    if mem_raw is not None:
        mem = _whole(cname, kind, names.gpumem, mem_raw, 1, None, "a whole number of MiB >= 1")
    if pct_raw is not None:
        p = _whole(cname, kind, names.gpumem_percentage, pct_raw, 1, 100, "a whole number of percent, 1..100")
        if not mem:
            pct = p
    cores: int | None = None
    if core_raw is not None:
        cores = _whole(cname, kind, names.gpucores, core_raw, 0, 100, "a whole number of percent, 0..100")
    prio: int | None = None
    if prio_raw is not None:
        prio = _whole(cname, kind, names.priority, prio_raw, 0, 1, "0 (high) or 1 (low)")
    if not share and d.bare_gpu_exclusive:
        pct, cores = 100, 100
    if not mem and not pct:
        if d.memory_mib:
            mem = d.memory_mib
        else:
            pct = d.memory_percentage
    if cores is None:
        cores = 100 if pct >= 100 else d.cores
    return ContainerRequest(name=cname, init=init, count=count, memory_mib=mem, memory_percent=pct,
                            cores=cores, priority=prio)


def _split(value: Any) -> tuple[str, ...]:
    if not isinstance(value, str):
        return ()
    return tuple(x.strip() for x in value.split(",") if x.strip())


def parse_constraints(annotations: Mapping[str, Any]) -> Constraints:
    """GPU selection constraints from pod annotations (HAMi keys, comma-separated lists)."""
    return Constraints(
        use_types=_split(annotations.get(ANN_USE_GPUTYPE)),
        nouse_types=_split(annotations.get(ANN_NOUSE_GPUTYPE)),
        use_uuids=_split(annotations.get(ANN_USE_GPUUUID)),
        nouse_uuids=_split(annotations.get(ANN_NOUSE_GPUUUID)),
    )


def _policy(annotations: Mapping[str, Any], keys: tuple[str, str], allowed: tuple[str, ...]) -> str | None:
    for key in keys:
        v = annotations.get(key)
        if v is None or v == "":
            continue
        if v not in allowed:
            raise RequestError("(pod)", key, v, f"one of {', '.join(allowed)}", "annotation")
        return str(v)
    return None


def _host(containers: list[Mapping[str, Any]], name: str) -> list[int]:
    out = []
    for c in containers:
        raw = ((c.get("resources") or {}).get("requests") or {}).get(name)
        if raw is None:
            raw = ((c.get("resources") or {}).get("limits") or {}).get(name)
        if raw is None:
            out.append(0)
            continue
        try:
            q = parse_quantity(raw)
        except QuantityError:
            raise RequestError(str(c.get("name", "?")), name, raw, "a Kubernetes quantity") from None
        out.append(int(q * 1000) if name == "cpu" else int(q // (1 << 20)))
    return out


def parse_pod(pod: Mapping[str, Any], config: Config = _DEFAULT_CONFIG) -> PodRequest:
    """Parse a Pod JSON dict (``core/v1 Pod``) into a PodRequest.

    Raises: RequestError for the first invalid container value or policy annotation.
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    ann = meta.get("annotations") or {}
    inits = [c for c in (spec.get("initContainers") or [])]
    apps = [c for c in (spec.get("containers") or [])]
    init_reqs = tuple(r for c in inits if (r := parse_container(c, True, config)) is not None)
    app_reqs = tuple(r for c in apps if (r := parse_container(c, False, config)) is not None)
    cpu_init, cpu_app = _host(inits, "cpu"), _host(apps, "cpu")
    mem_init, mem_app = _host(inits, "memory"), _host(apps, "memory")
    return PodRequest(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or meta.get("generateName") or ""),
        uid=str(meta.get("uid") or ""),
        init=init_reqs,
        app=app_reqs,
        constraints=parse_constraints(ann),
        cpu_milli=max([sum(cpu_app)] + cpu_init),
        memory_mib=max([sum(mem_app)] + mem_init),
        node_policy=_policy(ann, (ANN_NODE_POLICY, HAMI_ANN_NODE_POLICY), NODE_POLICIES),
        gpu_policy=_policy(ann, (ANN_GPU_POLICY, HAMI_ANN_GPU_POLICY), GPU_POLICIES),
    )
