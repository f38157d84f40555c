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
from .errors import QuantityError, RequestError, ShapeError
from .model import Constraints, ContainerRequest, PodRequest
from .policyregistry import HAMI_GPU_POLICIES_ALLOWED, hami_gpu_policy  # HAMI-ALIAS
from .quantity import parse_quantity, parse_whole
from .resources import (
    ANN_GPU_LINK,
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
from .topology import LINK_CLASSES
from .views import PodView

_DEFAULT_CONFIG = Config()

#: the largest gpumem accepted: 1 TiB in MiB (a larger number is almost always bytes or a
#: ``Gi`` suffix: gpumem counts MiB, so ``gpumem: 3Gi`` would mean 3,221,225,472 MiB)
MAX_GPUMEM_MIB = 1 << 20


def _mapping(value: Any, where: str, container: str = "(pod)", kind: str = "pod") -> Mapping[str, Any]:
    """``value`` if it is a JSON object (absent = empty), else RequestError naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(container, where, value, "an object", kind)
    return value


def _resources(container: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    cname = str(container.get("name", "?"))
    res = _mapping(container.get("resources"), "resources", cname, "container")
    return (_mapping(res.get("limits"), "resources.limits", cname, "container"),
            _mapping(res.get("requests"), "resources.requests", cname, "container"))


def resource_value(container: Mapping[str, Any], name: str) -> Any:
    """The raw value of resource ``name`` for a container: limits first, requests as fallback."""
    limits, requests = _resources(container)
    if name in limits:
        return limits[name]
    return requests.get(name)


def whole_resource(container: Mapping[str, Any], name: str) -> int | None:
    """Resource ``name`` of a container (limits first, requests as fallback) as an exact whole
    number, the rule :func:`parse_container` applies (``"2"``, ``"2.0"``, ``"2e0"``), or None when
    absent. Raises QuantityError for a value that is not a whole quantity (``"1.5"``, ``"500m"``)."""
    v = resource_value(container, name)
    return None if v is None else parse_whole(v)


def container_asks(container: Mapping[str, Any], names: ResourceNames) -> bool:
    """True if the container names any vGPU resource (gpu, gpumem, percentage, cores) at all.
    Never raises: a malformed container asks for nothing (:func:`parse_pod` reports it)."""
    if not isinstance(container, Mapping):
        return False
    res = container.get("resources")
    if not isinstance(res, Mapping):
        return False
    for part in (res.get("limits"), res.get("requests")):
        if isinstance(part, Mapping) and any(
                n in part for n in (names.gpu, names.gpumem, names.gpumem_percentage, names.gpucores)):
            return True
    return False


def pod_asks(pod: Mapping[str, Any], names: ResourceNames) -> bool:
    """True if any init or app container of the pod names a vGPU resource. Never raises."""
    try:
        spec = PodView.of(pod).spec
    except ShapeError:
        return False
    ctrs = [c for f in ("initContainers", "containers") if isinstance(spec.get(f), list) for c in spec[f]]
    return any(container_asks(c, names) for c in ctrs)


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
    if init and container.get("restartPolicy") == "Always":
        # a native sidecar runs beside the app containers (and the init containers after it), but is
        # booked as an init container, one at a time: it would get GPU memory nobody booked
        resource, raw = next((n, v) for n, v in ((names.gpu, gpu_raw), (names.gpumem, mem_raw),
                                                 (names.gpumem_percentage, pct_raw), (names.gpucores, core_raw))
                             if v is not None)
        raise RequestError(cname, resource, raw,
                           "no vGPU resource in a sidecar (an init container with restartPolicy: Always runs "
                           "beside the app containers, and kube-vgpu books init containers as running one at a "
                           "time); request the GPU in spec.containers", "sidecar container")
    mem = pct = 0
    if mem_raw is not None:
        mem = _whole(cname, kind, names.gpumem, mem_raw, 1, MAX_GPUMEM_MIB,
                     f"a whole number of MiB, 1..{MAX_GPUMEM_MIB} (gpumem counts MiB: write 3000, not 3Gi)")
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


#: the most entries each GPU selection annotation may list (the tenant writes the list, and the fit checks
#: every GPU it reads against it). A GPU type is matched as a substring of each GPU's model, entry by entry,
#: and a fleet has a few models: 64. A uuid is looked up once per GPU whatever the list's length
#: (:class:`kube_vgpu.model.UuidList`), and HAMi's users pin a job to, or keep it off, named cards of a
#: whole pool: 1024 (about 41 KB of annotation).
MAX_SELECTOR_ITEMS = {ANN_USE_GPUTYPE: 64, ANN_NOUSE_GPUTYPE: 64, ANN_USE_GPUUUID: 1024, ANN_NOUSE_GPUUUID: 1024}


def parse_constraints(annotations: Mapping[str, Any]) -> Constraints:
    """GPU selection constraints from pod annotations (HAMi keys, comma-separated lists).

    Raises: RequestError if one of these annotations is not a string or lists more entries than
    :data:`MAX_SELECTOR_ITEMS` allows for it.
    """
    for key, most in MAX_SELECTOR_ITEMS.items():
        v = annotations.get(key)
        if v is not None and not isinstance(v, str):
            raise RequestError("(pod)", f"metadata.annotations[{key}]", v, "a comma-separated string", "pod")
        if v is not None and v.count(",") >= most and len(_split(v)) > most:
            raise RequestError("(pod)", f"metadata.annotations[{key}]", v,
                               f"a comma-separated list of at most {most} entries "
                               f"(this one has {len(_split(v))})", "pod")
    link = annotations.get(ANN_GPU_LINK)
    if link is not None and link != "" and link not in LINK_CLASSES:
        raise RequestError("(pod)", f"metadata.annotations[{ANN_GPU_LINK}]", link,
                           f"one of {', '.join(LINK_CLASSES)}", "pod")
    return Constraints(
        use_types=_split(annotations.get(ANN_USE_GPUTYPE)),
        nouse_types=_split(annotations.get(ANN_NOUSE_GPUTYPE)),
        use_uuids=_split(annotations.get(ANN_USE_GPUUUID)),
        nouse_uuids=_split(annotations.get(ANN_NOUSE_GPUUUID)),
        min_link=LINK_CLASSES[link] if link else 0,
    )


def _policy(annotations: Mapping[str, Any], keys: tuple[str, str], allowed: tuple[str, ...]) -> str | None:
    for key in keys:
        v = annotations.get(key)
        if v is None or v == "":
            continue
        if key == HAMI_ANN_GPU_POLICY and isinstance(v, str) and v not in allowed:  # HAMI-ALIAS
            served = hami_gpu_policy(v)
            if served is None:
                raise RequestError("(pod)", f"metadata.annotations[{key}]", v, HAMI_GPU_POLICIES_ALLOWED, "pod")
            return served
        if v not in allowed:
            raise RequestError("(pod)", f"metadata.annotations[{key}]", v, f"one of {', '.join(allowed)}", "pod")
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


def _containers(spec: Mapping[str, Any], field: str) -> list[Mapping[str, Any]]:
    raw = spec.get(field)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("(pod)", f"spec.{field}", raw, "a list of containers", "pod")
    for i, c in enumerate(raw):
        if not isinstance(c, Mapping):
            raise RequestError("(pod)", f"spec.{field}[{i}]", c, "an object (core/v1 Container)", "pod")
    return raw


def parse_pod(pod: Mapping[str, Any], config: Config = _DEFAULT_CONFIG) -> PodRequest:
    """Parse a Pod JSON dict (``core/v1 Pod``) into a PodRequest.

    Raises: RequestError for the first invalid container value or policy annotation, and for a
    pod that is not shaped like a Pod (non-object containers, resources, limits, annotations).
    """
    if not isinstance(pod, Mapping):
        raise RequestError("(pod)", "(pod)", pod, "a core/v1 Pod object", "pod")
    try:
        view = PodView(pod)
        spec, ann = view.spec, view.annotations
        namespace, name, uid = view.namespace, view.name or view.generate_name, view.uid
    except ShapeError as e:
        raise RequestError("(pod)", e.path, e.value, e.allowed, "pod") from None
    inits = _containers(spec, "initContainers")
    apps = _containers(spec, "containers")
    init_reqs = tuple(r for c in inits if (r := parse_container(c, True, config)) is not None)
    app_reqs = tuple(r for c in apps if (r := parse_container(c, False, config)) is not None)
    cpu_init, cpu_app = _host(inits, "cpu"), _host(apps, "cpu")
    mem_init, mem_app = _host(inits, "memory"), _host(apps, "memory")
    return PodRequest(
        namespace=namespace,
        name=name,
        uid=uid,
        init=init_reqs,
        app=app_reqs,
        constraints=parse_constraints(ann),
        cpu_milli=max([sum(cpu_app)] + cpu_init),
        memory_mib=max([sum(mem_app)] + mem_init),
        node_policy=_policy(ann, (ANN_NODE_POLICY, HAMI_ANN_NODE_POLICY), NODE_POLICIES),
        gpu_policy=_policy(ann, (ANN_GPU_POLICY, HAMI_ANN_GPU_POLICY), GPU_POLICIES),
    )
