"""Drop-in compatibility: translate Alibaba gpushare requests into ours at pod CREATE (pure, no I/O).

Only with ``compat.gpushare: true`` (:class:`kube_vgpu.config.CompatConfig`), and only for a pod the
webhook would route to our scheduler (the caller, :func:`webhook.mutate.review_pod`, leaves pods of
a foreign ``schedulerName`` alone). The translated pod then goes through every rule of the webhook
(system-key removal, the isolation rules of :mod:`webhook.isolation`, routing, defaulting), exactly
like a pod written with our resource names.

gpushare's request (AliyunContainerService/gpushare-scheduler-extender and gpushare-device-plugin;
ACK's documented extensions), per container, ``resources.limits`` (``requests`` must be equal):

* ``aliyun.com/gpu-mem``: GPU memory in GiB (``compat.gpushareMemoryUnit: MiB`` when gpushare's
  device plugin ran with ``--memory-unit=MiB``), whole numbers. It is the container's **total**
  over its GPUs: with ``gpu-count`` M, each GPU gets gpu-mem / M, which must be whole (ACK's rule
  for multi-GPU sharing; rounding up would hand out more than was asked).
* ``aliyun.com/gpu-count``: GPUs, a container resource or ACK's pod label of the same name
  (label: applies to every container that asks ``gpu-mem``). Default 1, written explicitly, so the
  config's ``defaults.gpuCount`` never multiplies a gpushare request.
* ``aliyun.com/gpu-core.percentage``: percent of one GPU's compute (ACK cGPU), only together with
  ``gpu-mem`` and one GPU (ACK refuses compute with multi-GPU sharing; per GPU it would hand out
  M times the compute asked for).

The containers also get gpushare's informational env (unless they set it themselves), so programs
that size their memory from it, as gpushare's user guide shows for TensorFlow, run unchanged:
``ALIYUN_COM_GPU_MEM_CONTAINER`` = the container's gpu-mem, ``ALIYUN_COM_GPU_MEM_DEV`` = the
memory of each of its GPUs as the container sees it (gpu-mem / M: inside a kube-vgpu container a
GPU shows its limit as its total), both in gpushare's unit. gpushare's device index
(``ALIYUN_COM_GPU_MEM_IDX``) and pod total (``_POD``) are not set.

Result, with the configured resource names: ``nvidia.com/gpu`` = M, ``nvidia.com/gpumem`` =
gpu-mem x 1024 / M (MiB per GPU; x 1 for MiB), ``nvidia.com/gpucores`` = percentage; written to
``limits`` (and to ``requests`` when the container had gpushare names there); every
``aliyun.com/`` GPU resource is removed. Refused (:class:`kube_vgpu.errors.RequestError`, the webhook
answers 400 naming container, field, value and what is allowed): fractions, zero, negatives,
values over the ranges below, ``requests`` different from ``limits``, a container that names both
gpushare and our resources, gpu-mem not divisible by gpu-count, a percentage without gpu-mem or
with more than one GPU, a count label that disagrees with the container's count resource.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonpointer import escape

from kube_vgpu.config import MAX_GPUS_PER_CONTAINER, Config
from kube_vgpu.errors import QuantityError, RequestError, ShapeError
from kube_vgpu.podspec import MAX_GPUMEM_MIB
from kube_vgpu.quantity import parse_whole
from kube_vgpu.views import ObjectView, PodView

#: gpushare's GPU memory resource (GiB by default; see module docstring)
GPUSHARE_MEM = "aliyun.com/gpu-mem"
#: GPUs per container (gpushare's node capacity name; ACK: a container resource or pod label)
GPUSHARE_COUNT = "aliyun.com/gpu-count"
#: ACK cGPU's compute share, percent of one GPU
GPUSHARE_CORE = "aliyun.com/gpu-core.percentage"
GPUSHARE_NAMES = (GPUSHARE_MEM, GPUSHARE_COUNT, GPUSHARE_CORE)
#: ACK's pod label for multi-GPU sharing (same key as the resource)
LABEL_GPUSHARE_COUNT = GPUSHARE_COUNT
#: gpushare's env: the container's GPU memory, and one GPU's memory as the container sees it (its unit)
ENV_MEM_CONTAINER = "ALIYUN_COM_GPU_MEM_CONTAINER"
ENV_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
#: MiB per unit of aliyun.com/gpu-mem, by ``compat.gpushareMemoryUnit``
UNIT_MIB = {"GiB": 1024, "MiB": 1}


def _maps(container: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    res = container.get("resources")
    if not isinstance(res, dict):
        return {}, {}
    lim, req = res.get("limits"), res.get("requests")
    return (lim if isinstance(lim, dict) else {}), (req if isinstance(req, dict) else {})


def names_gpushare(container: Any) -> bool:
    """True if the container names a gpushare resource in limits or requests. Never raises."""
    if not isinstance(container, dict):
        return False
    return any(n in part for part in _maps(container) for n in GPUSHARE_NAMES)


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    out: list[tuple[str, int, dict[str, Any]]] = []
    for key in ("initContainers", "containers"):
        items = spec.get(key)
        if isinstance(items, list):
            out.extend((key, i, c) for i, c in enumerate(items) if isinstance(c, dict))
    return out


def pod_names_gpushare(pod: Mapping[str, Any]) -> bool:
    """True if any init or app container of the pod names a gpushare resource. Never raises."""
    try:
        spec = PodView.of(pod).spec
    except ShapeError:
        return False
    return any(names_gpushare(c) for _, _, c in _containers(spec))


def _whole(cname: str, kind: str, field: str, raw: Any, lo: int, hi: int, allowed: str) -> int:
    try:
        v = parse_whole(raw)
    except QuantityError:
        raise RequestError(cname, field, raw, allowed, kind) from None
    if not lo <= v <= hi:
        raise RequestError(cname, field, raw, allowed, kind)
    return v


def _value(cname: str, kind: str, container: Mapping[str, Any], name: str, lo: int, hi: int,
           allowed: str) -> int | None:
    """The whole value of gpushare resource ``name`` (limits, else requests), or None if absent.
    Raises RequestError for a bad value or requests different from limits."""
    limits, requests = _maps(container)
    got = {}
    for where, part in (("limits", limits), ("requests", requests)):
        if name in part:
            got[where] = _whole(cname, kind, f"resources.{where}[{name}]", part[name], lo, hi, allowed)
    if len(got) == 2 and got["limits"] != got["requests"]:
        raise RequestError(cname, f"resources.requests[{name}]", requests[name],
                           f"the same value as resources.limits[{name}] ({limits[name]!r})", kind)
    return got.get("limits", got.get("requests"))


def _label_count(pod: Mapping[str, Any]) -> int | None:
    raw = ObjectView.of(pod).labels.get(LABEL_GPUSHARE_COUNT)
    if raw is None:
        return None
    return _whole("(pod)", "pod", f"metadata.labels[{LABEL_GPUSHARE_COUNT}]", raw, 1, MAX_GPUS_PER_CONTAINER,
                  f"a whole number of GPUs, 1..{MAX_GPUS_PER_CONTAINER}")


def translate_container(container: Mapping[str, Any], init: bool, config: Config,
                        label_count: int | None = None) -> dict[str, str]:
    """Our resources (configured names -> value text) for one container that names gpushare
    resources (see module docstring). label_count: the pod's ``aliyun.com/gpu-count`` label, or None.

    Raises: RequestError naming the container, the field, the value and what is allowed.
    """
    names = config.resource_names
    cname = str(container.get("name", "?"))
    kind = "init container" if init else "container"
    limits, requests = _maps(container)
    ours = [n for n in names.all() if n in limits or n in requests]
    if ours:
        where = "limits" if ours[0] in limits else "requests"
        raw = (limits if where == "limits" else requests)[ours[0]]
        raise RequestError(cname, f"resources.{where}[{ours[0]}]", raw,
                           f"either the gpushare resources ({', '.join(GPUSHARE_NAMES)}) or the vGPU resources "
                           f"({', '.join(names.all()[:4])}) in one container, not both", kind)
    unit = config.compat.gpushare_memory_unit
    per_unit = UNIT_MIB[unit]
    max_mem = MAX_GPUMEM_MIB // per_unit
    mem = _value(cname, kind, container, GPUSHARE_MEM, 1, max_mem,
                 f"a whole number of {unit}, 1..{max_mem} (compat.gpushareMemoryUnit={unit})")
    count = _value(cname, kind, container, GPUSHARE_COUNT, 1, MAX_GPUS_PER_CONTAINER,
                   f"a whole number of GPUs, 1..{MAX_GPUS_PER_CONTAINER}")
    core = _value(cname, kind, container, GPUSHARE_CORE, 1, 100, "a whole number of percent of one GPU, 1..100")
    if mem is not None and label_count is not None:
        if count is not None and count != label_count:
            raise RequestError(cname, f"resources.limits[{GPUSHARE_COUNT}]", count,
                               f"the pod label {LABEL_GPUSHARE_COUNT}={label_count} or no label", kind)
        count = label_count
    gpus = count or 1
    out = {names.gpu: str(gpus)}
    if mem is not None:
        if mem % gpus:
            raise RequestError(cname, f"resources.limits[{GPUSHARE_MEM}]", mem,
                               f"a whole multiple of {GPUSHARE_COUNT} ({gpus}): {GPUSHARE_MEM} is the total over "
                               f"the container's GPUs and each GPU gets an equal whole share", kind)
        out[names.gpumem] = str(mem * per_unit // gpus)
    if core is not None:
        if mem is None:
            raise RequestError(cname, f"resources.limits[{GPUSHARE_CORE}]", core,
                               f"only together with {GPUSHARE_MEM} in the same container", kind)
        if gpus != 1:
            raise RequestError(cname, f"resources.limits[{GPUSHARE_CORE}]", core,
                               f"only with one GPU ({GPUSHARE_COUNT}={gpus} given): it is a share of one GPU's "
                               "compute", kind)
        out[names.gpucores] = str(core)
    return out


def gpushare_env(container: Mapping[str, Any], config: Config, label_count: int | None = None) -> dict[str, str]:
    """gpushare's env for a container that asks ``aliyun.com/gpu-mem`` (see module docstring), less
    the names the container sets itself; {} without gpu-mem. Call after :func:`translate_container`
    accepted the container (values are read without re-checking)."""
    limits, requests = _maps(container)
    raw = limits.get(GPUSHARE_MEM, requests.get(GPUSHARE_MEM))
    if raw is None:
        return {}
    mem = parse_whole(raw)
    count_raw = limits.get(GPUSHARE_COUNT, requests.get(GPUSHARE_COUNT))
    gpus = parse_whole(count_raw) if count_raw is not None else (label_count or 1)
    env = container.get("env")
    taken = {e.get("name") for e in env if isinstance(e, dict)} if isinstance(env, list) else set()
    want = {ENV_MEM_CONTAINER: str(mem), ENV_MEM_DEV: str(mem // gpus)}
    return {k: v for k, v in want.items() if k not in taken}


def translate_pod(pod: Mapping[str, Any], config: Config) -> tuple[list[dict[str, Any]], list[str]]:
    """JSONPatch operations (RFC 6902, paths into the Pod) that replace every container's gpushare
    resources with ours, and one admission warning per translated container. Empty when no
    container names a gpushare resource. Expects a pod that passed :func:`webhook.shape.check_pod`.

    Raises: RequestError for the first container (init containers first) whose request is refused;
    ShapeError when ``spec`` or ``metadata.labels`` is not an object.
    """
    spec = PodView.of(pod).spec
    todo = [(key, i, c) for key, i, c in _containers(spec) if names_gpushare(c)]
    if not todo:
        return [], []
    label_count = _label_count(pod)
    ops: list[dict[str, Any]] = []
    warnings: list[str] = []
    for key, i, c in todo:
        ours = translate_container(c, key == "initContainers", config, label_count)
        path = f"/spec/{key}/{i}/resources"
        res = c.get("resources")
        limits, requests = _maps(c)
        for where, part in (("limits", limits), ("requests", requests)):
            ops += [{"op": "remove", "path": f"{path}/{where}/{escape(n)}"} for n in GPUSHARE_NAMES if n in part]
        targets = ["limits"] + (["requests"] if any(n in requests for n in GPUSHARE_NAMES) else [])
        for where in targets:
            if isinstance(res, dict) and isinstance(res.get(where), dict):
                ops += [{"op": "add", "path": f"{path}/{where}/{escape(n)}", "value": v} for n, v in ours.items()]
            elif isinstance(res, dict):
                ops.append({"op": "add", "path": f"{path}/{where}", "value": dict(ours)})
        env = gpushare_env(c, config, label_count)
        items = [{"name": k, "value": v} for k, v in env.items()]
        if items and isinstance(c.get("env"), list):
            ops += [{"op": "add", "path": f"/spec/{key}/{i}/env/-", "value": e} for e in items]
        elif items:
            ops.append({"op": "add", "path": f"/spec/{key}/{i}/env", "value": items})
        asked = ", ".join(f"{n}={(limits if n in limits else requests)[n]}" for n in GPUSHARE_NAMES
                          if n in limits or n in requests)
        got = ", ".join(f"{n}={v}" for n, v in ours.items())
        warnings.append(f"container {str(c.get('name', '?'))!r}: gpushare request {asked} translated to {got} "
                        f"(compat.gpushare)")
    return ops, warnings


__all__ = ["ENV_MEM_CONTAINER", "ENV_MEM_DEV", "GPUSHARE_CORE", "GPUSHARE_COUNT", "GPUSHARE_MEM", "GPUSHARE_NAMES",
           "LABEL_GPUSHARE_COUNT", "UNIT_MIB", "gpushare_env", "names_gpushare", "pod_names_gpushare", "translate_container", "translate_pod"]
