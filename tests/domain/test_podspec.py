"""kube_vgpu.podspec: the documented pod-parsing rules (limits first, defaults, errors)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.config import Config, load_config_text
from kube_vgpu.errors import RequestError
from kube_vgpu.model import Constraints, ContainerRequest
from kube_vgpu.podspec import (
    container_asks,
    parse_constraints,
    parse_container,
    parse_pod,
    pod_asks,
    resource_value,
)
from kube_vgpu.resources import ResourceNames

SETTINGS = settings(max_examples=200, deadline=None)

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIO = "nvidia.com/priority"


def ctr(name: str = "main", limits: dict[str, Any] | None = None,
        requests: dict[str, Any] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if limits is not None:
        res["limits"] = limits
    if requests is not None:
        res["requests"] = requests
    return {"name": name, "image": "busybox", "resources": res}


def pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None, name: str = "p") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers}
    if init is not None:
        spec["initContainers"] = init
    meta: dict[str, Any] = {"name": name, "namespace": "ns1", "uid": "u-1"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


# --------------------------------------------------------------------------------------- lookup

def test_resource_value_limits_first_requests_fallback_per_resource() -> None:
    c = ctr(limits={MEM: "3000"}, requests={MEM: "1000", CORES: "30"})
    assert resource_value(c, MEM) == "3000"
    assert resource_value(c, CORES) == "30"  # only in requests: fallback for this resource
    assert resource_value(c, GPU) is None
    assert resource_value({"name": "x"}, MEM) is None
    assert resource_value({"name": "x", "resources": None}, MEM) is None


def test_parse_container_limits_over_requests() -> None:
    r = parse_container(ctr(limits={GPU: 1, MEM: "3000"}, requests={GPU: 1, MEM: "1000", CORES: "30"}), False)
    assert r == ContainerRequest(name="main", init=False, count=1, memory_mib=3000, memory_percent=0, cores=30)


def test_requests_only() -> None:
    r = parse_container(ctr(requests={GPU: "2", MEM: "2048"}), False)
    assert r is not None
    assert (r.count, r.memory_mib, r.memory_percent, r.cores) == (2, 2048, 0, 0)


def test_container_and_pod_asks() -> None:
    names = ResourceNames()
    assert container_asks(ctr(limits={CORES: "10"}), names)
    assert container_asks(ctr(requests={PCT: "10"}), names)
    assert not container_asks(ctr(limits={"cpu": "1"}), names)
    assert not container_asks({"name": "x"}, names)
    assert pod_asks(pod([ctr(limits={"cpu": "1"})], init=[ctr("i", limits={GPU: 1})]), names)
    assert not pod_asks(pod([ctr(limits={"memory": "1Gi"})]), names)
    assert not pod_asks({}, names)


# --------------------------------------------------------------------------------------- defaults

def test_bare_gpu_is_whole_card_by_default() -> None:
    r = parse_container(ctr(limits={GPU: 2}), False)
    assert r == ContainerRequest(name="main", init=False, count=2, memory_mib=0, memory_percent=100, cores=100)
    assert r.exclusive


def test_bare_gpu_exclusive_wins_over_memory_mib_default() -> None:
    cfg = load_config_text("defaults: {memoryMiB: 2000, cores: 10}")
    r = parse_container(ctr(limits={GPU: 1}), False, cfg)
    assert r is not None
    assert (r.memory_mib, r.memory_percent, r.cores) == (0, 100, 100)


def test_bare_gpu_not_exclusive_uses_defaults() -> None:
    cfg = load_config_text("defaults: {bareGpuExclusive: false, memoryPercentage: 50, cores: 20}")
    r = parse_container(ctr(limits={GPU: 1}), False, cfg)
    assert r == ContainerRequest(name="main", init=False, count=1, memory_mib=0, memory_percent=50, cores=20)
    assert not r.exclusive
    cfg2 = load_config_text("defaults: {bareGpuExclusive: false, memoryMiB: 4096}")
    r2 = parse_container(ctr(limits={GPU: 1}), False, cfg2)
    assert r2 is not None
    assert (r2.memory_mib, r2.memory_percent, r2.cores) == (4096, 0, 0)


def test_only_gpumem_count_from_defaults() -> None:
    r = parse_container(ctr(limits={MEM: "3000"}), False)
    assert r == ContainerRequest(name="main", init=False, count=1, memory_mib=3000, memory_percent=0, cores=0)
    cfg = load_config_text("defaults: {gpuCount: 3}")
    r3 = parse_container(ctr(limits={MEM: "3000"}), False, cfg)
    assert r3 is not None and r3.count == 3
    # an explicit nvidia.com/gpu is not overridden by the default
    r4 = parse_container(ctr(limits={GPU: 2, MEM: "3000"}), False, cfg)
    assert r4 is not None and r4.count == 2


def test_only_gpucores_gets_default_memory() -> None:
    r = parse_container(ctr(limits={CORES: "30"}), False)
    assert r is not None
    assert (r.count, r.memory_mib, r.memory_percent, r.cores) == (1, 0, 100, 30)
    cfg = load_config_text("defaults: {memoryMiB: 1024}")
    r2 = parse_container(ctr(limits={CORES: "30"}), False, cfg)
    assert r2 is not None
    assert (r2.memory_mib, r2.memory_percent, r2.cores) == (1024, 0, 30)


def test_gpumem_wins_over_percentage() -> None:
    r = parse_container(ctr(limits={GPU: 1, MEM: "3000", PCT: "50"}), False)
    assert r is not None
    assert (r.memory_mib, r.memory_percent) == (3000, 0)
    # ... even when the percentage is 100: it is ignored entirely (no exclusive cores either)
    r2 = parse_container(ctr(limits={GPU: 1, MEM: "3000", PCT: "100"}), False)
    assert r2 is not None
    assert (r2.memory_mib, r2.memory_percent, r2.cores) == (3000, 0, 0)


def test_percentage_without_cores() -> None:
    r = parse_container(ctr(limits={GPU: 1, PCT: "50"}), False)
    assert r is not None
    assert (r.memory_mib, r.memory_percent, r.cores) == (0, 50, 0)
    r100 = parse_container(ctr(limits={GPU: 1, PCT: "100"}), False)
    assert r100 is not None
    assert (r100.memory_mib, r100.memory_percent, r100.cores) == (0, 100, 100)
    # an explicit gpucores is kept even at 100%
    r100c = parse_container(ctr(limits={GPU: 1, PCT: "100", CORES: "40"}), False)
    assert r100c is not None and r100c.cores == 40
    cfg = load_config_text("defaults: {cores: 25}")
    r25 = parse_container(ctr(limits={GPU: 1, PCT: "50"}), False, cfg)
    assert r25 is not None and r25.cores == 25


def test_gpucores_zero_allowed() -> None:
    r = parse_container(ctr(limits={GPU: 1, MEM: 100, CORES: 0}), False)
    assert r is not None and r.cores == 0


def test_priority() -> None:
    r = parse_container(ctr(limits={GPU: 1, MEM: 100, PRIO: "1"}), False)
    assert r is not None and r.priority == 1
    r0 = parse_container(ctr(limits={GPU: 1, MEM: 100}), False)
    assert r0 is not None and r0.priority is None
    with pytest.raises(RequestError) as ei:
        parse_container(ctr(limits={GPU: 1, MEM: 100, PRIO: "2"}), False)
    assert ei.value.resource == PRIO


def test_priority_alone_is_not_a_request() -> None:
    assert parse_container(ctr(limits={PRIO: 0}), False) is None


def test_gpu_zero() -> None:
    assert parse_container(ctr(limits={GPU: 0}), False) is None
    with pytest.raises(RequestError) as ei:
        parse_container(ctr(limits={GPU: 0, MEM: "3000"}), False)
    assert ei.value.resource == GPU
    assert ei.value.container == "main"
    assert "allowed" in str(ei.value)


def test_non_gpu_container_is_none() -> None:
    assert parse_container(ctr(limits={"cpu": "1", "memory": "1Gi"}), False) is None
    assert parse_container({"name": "plain"}, False) is None


def test_init_flag() -> None:
    r = parse_container(ctr("setup", limits={GPU: 1, MEM: 10}), True)
    assert r is not None and r.init is True and r.name == "setup"


# --------------------------------------------------------------------------------------- errors

BAD = [
    (PCT, "99.1"),
    (PCT, "50m"),
    (PCT, "0"),
    (PCT, 0),
    (PCT, "101"),
    (PCT, "-5"),
    (MEM, "-1"),
    (MEM, "0"),
    (MEM, 0),
    (MEM, "1.5"),
    (MEM, "abc"),
    (CORES, "101"),
    (CORES, "-5"),
    (CORES, "50m"),
    (GPU, "1.5"),
    (GPU, "-1"),
    (GPU, "abc"),
    (GPU, "129"),
    (GPU, True),
]


@pytest.mark.parametrize(("resource", "value"), BAD)
@pytest.mark.parametrize("init", [False, True])
def test_invalid_values_raise_request_error(resource: str, value: object, init: bool) -> None:
    limits: dict[str, Any] = {GPU: 1, MEM: "1000"}
    limits[resource] = value
    if resource == PCT:
        del limits[MEM]  # otherwise gpumem wins; the percentage is still validated though
    with pytest.raises(RequestError) as ei:
        parse_container(ctr("trainer-7", limits=limits), init)
    e = ei.value
    msg = str(e)
    assert e.container == "trainer-7"
    assert e.resource == resource
    assert e.value == value
    assert e.kind == ("init container" if init else "container")
    assert "trainer-7" in msg
    assert resource in msg
    assert repr(value) in msg
    assert "allowed" in msg
    assert e.allowed and e.allowed in msg


def test_percentage_validated_even_when_gpumem_wins() -> None:
    with pytest.raises(RequestError) as ei:
        parse_container(ctr(limits={GPU: 1, MEM: "1000", PCT: "101"}), False)
    assert ei.value.resource == PCT


def test_invalid_value_in_requests_fallback() -> None:
    with pytest.raises(RequestError) as ei:
        parse_container(ctr(limits={GPU: 1}, requests={MEM: "-1"}), False)
    assert ei.value.resource == MEM and ei.value.value == "-1"


def test_invalid_requests_shadowed_by_valid_limits() -> None:
    r = parse_container(ctr(limits={GPU: 1, MEM: "1000"}, requests={MEM: "-1"}), False)
    assert r is not None and r.memory_mib == 1000


def test_parse_pod_error_names_first_bad_container() -> None:
    p = pod([ctr("ok", limits={GPU: 1, MEM: 10}), ctr("bad", limits={GPU: 1, CORES: "150"})])
    with pytest.raises(RequestError) as ei:
        parse_pod(p)
    assert ei.value.container == "bad" and ei.value.resource == CORES


# --------------------------------------------------------------------------------------- parse_pod

def test_parse_pod_init_and_app_apart() -> None:
    p = pod(
        [ctr("app", limits={GPU: 1, MEM: "4096", CORES: "30"}), ctr("sidecar", limits={"cpu": "100m"})],
        init=[ctr("init-a", limits={GPU: 1, MEM: "10240"}), ctr("init-plain", limits={"cpu": "1"}),
              ctr("init-b", limits={GPU: 2, PCT: "25"})],
    )
    req = parse_pod(p)
    assert req.namespace == "ns1" and req.name == "p" and req.uid == "u-1" and req.key == "ns1/p"
    assert [c.name for c in req.init] == ["init-a", "init-b"]
    assert all(c.init for c in req.init)
    assert [c.name for c in req.app] == ["app"]
    assert not any(c.init for c in req.app)
    assert req.init[0].memory_mib == 10240
    assert (req.init[1].count, req.init[1].memory_percent) == (2, 25)
    assert (req.app[0].memory_mib, req.app[0].cores) == (4096, 30)
    assert [c.name for c in req.containers] == ["init-a", "init-b", "app"]
    assert req.has_gpu
    assert req.constraints == Constraints() and req.constraints.empty
    assert req.node_policy is None and req.gpu_policy is None


def test_parse_pod_no_gpu() -> None:
    req = parse_pod(pod([ctr(limits={"cpu": "1"})]))
    assert not req.has_gpu
    assert req.init == () and req.app == ()


def test_parse_pod_generate_name_and_default_namespace() -> None:
    req = parse_pod({"metadata": {"generateName": "job-"}, "spec": {"containers": []}})
    assert req.name == "job-" and req.namespace == "default" and req.uid == ""


def test_parse_pod_host_resources() -> None:
    p = pod(
        [ctr("a", requests={"cpu": "500m", "memory": "1Gi"}), ctr("b", limits={"cpu": "2", "memory": "512Mi"})],
        init=[ctr("i", requests={"cpu": "4", "memory": "100Mi"})],
    )
    req = parse_pod(p)
    assert req.cpu_milli == 4000  # max(sum(app)=2500, init peak=4000)
    assert req.memory_mib == 1536  # max(sum(app)=1536, init=100)


def test_parse_pod_constraints() -> None:
    ann = {
        "nvidia.com/use-gputype": " H200 , A100,,",
        "nvidia.com/nouse-gputype": "T4",
        "nvidia.com/use-gpuuuid": "GPU-a,GPU-b",
        "nvidia.com/nouse-gpuuuid": " GPU-c ",
    }
    req = parse_pod(pod([ctr(limits={GPU: 1})], annotations=ann))
    c = req.constraints
    assert c.use_types == ("H200", "A100")
    assert c.nouse_types == ("T4",)
    assert c.use_uuids == ("GPU-a", "GPU-b")
    assert c.nouse_uuids == ("GPU-c",)
    assert not c.empty


def test_parse_constraints_direct() -> None:
    assert parse_constraints({}) == Constraints()
    assert parse_constraints({"nvidia.com/use-gputype": ""}).use_types == ()
    with pytest.raises(RequestError, match="comma-separated string"):  # non-string: a clear error
        parse_constraints({"nvidia.com/use-gputype": 5})
    assert parse_constraints({"unrelated": "H200"}).empty


@pytest.mark.parametrize("key", ["kube-vgpu.io/node-scheduler-policy", "hami.io/node-scheduler-policy"])
def test_node_policy_annotation(key: str) -> None:
    req = parse_pod(pod([ctr(limits={GPU: 1})], annotations={key: "spread"}))
    assert req.node_policy == "spread"
    with pytest.raises(RequestError) as ei:
        parse_pod(pod([ctr(limits={GPU: 1})], annotations={key: "worst"}))
    assert ei.value.resource == f"metadata.annotations[{key}]" and ei.value.value == "worst"
    assert "binpack" in str(ei.value) and "allowed" in str(ei.value)


@pytest.mark.parametrize("key", ["kube-vgpu.io/gpu-scheduler-policy", "hami.io/gpu-scheduler-policy"])
def test_gpu_policy_annotation(key: str) -> None:
    req = parse_pod(pod([ctr(limits={GPU: 1})], annotations={key: "binpack"}))
    assert req.gpu_policy == "binpack"
    with pytest.raises(RequestError):
        parse_pod(pod([ctr(limits={GPU: 1})], annotations={key: "fgd"}))  # node-only policy


def test_own_policy_annotation_preferred_over_hami() -> None:
    ann = {"kube-vgpu.io/node-scheduler-policy": "fgd", "hami.io/node-scheduler-policy": "spread"}
    assert parse_pod(pod([ctr(limits={GPU: 1})], annotations=ann)).node_policy == "fgd"
    ann2 = {"kube-vgpu.io/node-scheduler-policy": "", "hami.io/node-scheduler-policy": "spread"}
    assert parse_pod(pod([ctr(limits={GPU: 1})], annotations=ann2)).node_policy == "spread"


def test_configurable_resource_names() -> None:
    cfg = load_config_text("resourceNames: {gpumem: example.com/vmem}")
    assert cfg.resource_names.gpumem == "example.com/vmem"
    r = parse_container(ctr(limits={GPU: 1, "example.com/vmem": "2000", MEM: "9999"}), False, cfg)
    assert r is not None and r.memory_mib == 2000
    # nvidia.com/gpumem is now just an unrelated resource
    r2 = parse_container(ctr(limits={GPU: 1, MEM: "9999"}), False, cfg)
    assert r2 is not None and (r2.memory_mib, r2.memory_percent, r2.cores) == (0, 100, 100)  # bare GPU
    assert parse_container(ctr(limits={MEM: "9999"}), False, cfg) is None
    assert not container_asks(ctr(limits={MEM: "9999"}), cfg.resource_names)
    with pytest.raises(RequestError) as ei:
        parse_container(ctr(limits={GPU: 1, "example.com/vmem": "-1"}), False, cfg)
    assert ei.value.resource == "example.com/vmem"
    req = parse_pod(pod([ctr(limits={"example.com/vmem": "100"})]), cfg)
    assert req.app[0].memory_mib == 100


# --------------------------------------------------------------------------------------- properties

def _qty(n: int) -> st.SearchStrategy[object]:
    return st.sampled_from([n, str(n), f"{n}", f"{n * 1000}m", f"+{n}"])


@st.composite
def valid_container(draw: st.DrawFn) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if draw(st.booleans()):
        res[GPU] = draw(st.integers(1, 128).flatmap(_qty))
    if draw(st.booleans()):
        res[MEM] = draw(st.integers(1, 200_000).flatmap(_qty))
    if draw(st.booleans()):
        res[PCT] = draw(st.integers(1, 100).flatmap(_qty))
    if draw(st.booleans()):
        res[CORES] = draw(st.integers(0, 100).flatmap(_qty))
    if draw(st.booleans()):
        res[PRIO] = draw(st.integers(0, 1).flatmap(_qty))
    if not set(res) & {GPU, MEM, PCT, CORES}:
        res[GPU] = 1  # priority alone does not make a vGPU request
    split = draw(st.sets(st.sampled_from(sorted(res))))
    limits = {k: v for k, v in res.items() if k not in split}
    requests = {k: v for k, v in res.items() if k in split}
    return ctr(draw(st.text(min_size=1, max_size=10)), limits=limits, requests=requests)


CONFIGS = st.builds(
    lambda count, mib, pct, cores, bare: load_config_text(
        f"defaults: {{gpuCount: {count}, memoryMiB: {mib}, memoryPercentage: {pct}, cores: {cores}, "
        f"bareGpuExclusive: {str(bare).lower()}}}"),
    st.integers(1, 8), st.sampled_from([0, 0, 1024]), st.integers(1, 100), st.integers(0, 100), st.booleans(),
)


@SETTINGS
@given(c=valid_container(), init=st.booleans(), cfg=st.one_of(st.just(Config()), CONFIGS))
def test_property_valid_containers(c: dict[str, Any], init: bool, cfg: Config) -> None:
    r = parse_container(c, init, cfg)
    assert r is not None
    assert r.count >= 1
    assert 0 <= r.cores <= 100
    assert (r.memory_mib > 0) != (r.memory_percent > 0)
    assert 0 <= r.memory_percent <= 100
    assert r.init is init
    assert r.name == c["name"]


def _not_whole(f: float) -> bool:
    return not math.isfinite(f) or f != int(f)


JUNK = st.one_of(
    st.text(max_size=20).filter(lambda s: not s.strip().isdigit()),
    st.floats().filter(_not_whole),
    st.none(),
    st.booleans(),
    st.lists(st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(max_value=-1),
    st.sampled_from(["99.1", "50m", "-1", "1.5", "abc", "1e-3", "", " ", "1Gi", "NaN", "inf"]),
)


@SETTINGS
@given(resource=st.sampled_from([GPU, MEM, PCT, CORES, PRIO]), junk=JUNK, in_requests=st.booleans())
def test_property_junk_raises_request_error_only(resource: str, junk: object, in_requests: bool) -> None:
    base: dict[str, Any] = {GPU: 1, CORES: 10}
    if resource == PCT:
        base[PCT] = junk
    else:
        base[MEM] = 100
        base[resource] = junk
    c = ctr("j", requests=base) if in_requests else ctr("j", limits=base)
    try:
        r = parse_container(c, False)
    except RequestError as e:
        assert e.container == "j"
        assert e.resource == resource
        return
    # Accepted junk must at least parse to a valid request (e.g. "1Gi" MiB is a big whole number).
    assert r is not None and r.count >= 1 and 0 <= r.cores <= 100


@SETTINGS
@given(resource=st.sampled_from([MEM, PCT, CORES, PRIO]),
       junk=st.one_of(st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
                      st.sampled_from(["99.1", "50m", "-1", "1.5", "abc", "", "NaN"]),
                      st.floats().filter(_not_whole)))
def test_property_definitely_invalid_always_raises(resource: str, junk: object) -> None:
    limits: dict[str, Any] = {GPU: 1, resource: junk}
    if junk is None:
        limits = {GPU: 1, resource: "abc"}
    with pytest.raises(RequestError):
        parse_container(ctr("k", limits=limits), False)


def test_huge_value_is_request_error() -> None:
    with pytest.raises(RequestError):
        parse_container(ctr(limits={GPU: 1, MEM: "9" * 5000}), False)


@pytest.mark.parametrize(("value", "served"), [
    ("topology-aware", "spread"), ("numa", "spread"), ("binpack,numa", "binpack"), ("numa, spread", "spread"),
    ("binpack", "binpack"), ("topology-aware,binpack", "binpack"),
])
def test_hamis_gpu_policy_values_are_served_by_ours(value: str, served: str) -> None:
    pod = {"metadata": {"name": "p", "annotations": {"hami.io/gpu-scheduler-policy": value}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    assert parse_pod(pod).gpu_policy == served


@pytest.mark.parametrize(("key", "value"), [
    ("hami.io/gpu-scheduler-policy", "mutex"), ("hami.io/gpu-scheduler-policy", "binpack,mutex"),
    ("hami.io/gpu-scheduler-policy", ","), ("kube-vgpu.io/gpu-scheduler-policy", "topology-aware"),
])
def test_gpu_policy_values_not_served_are_refused_naming_what_is(key: str, value: str) -> None:
    pod = {"metadata": {"name": "p", "annotations": {key: value}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    with pytest.raises(RequestError) as e:
        parse_pod(pod)
    assert key in str(e.value) and repr(value) in str(e.value) and "binpack, spread" in str(e.value)
    # the same form as every other pod-level annotation error (it read "annotation '(pod)': <key>=...",
    # then "pod '(pod)': <key>=...": a placeholder, not the pod's name)
    assert str(e.value).startswith(f"pod: metadata.annotations[{key}]={value!r} is invalid; allowed: ")
    if key.startswith("hami.io"):
        assert "nvidia.com/gpucores: 100" in str(e.value)


@pytest.mark.parametrize("pod, start", [
    ({"metadata": {"annotations": {"kube-vgpu.io/gpu-link": "nvlinkk"}}, "spec": {"containers": []}},
     "pod: metadata.annotations[kube-vgpu.io/gpu-link]='nvlinkk' is invalid; allowed: one of "),
    ({"spec": {"containers": {"name": "c"}}}, "pod: spec.containers={'name': 'c'} is invalid; allowed: a list"),
    ([1, 2], "pod: [1, 2] is invalid; allowed: a core/v1 Pod object"),
])
def test_pod_level_errors_name_no_placeholder_container(pod: object, start: str) -> None:
    # a pod-level error read "pod '(pod)': ...", the placeholder looking like the pod's name
    with pytest.raises(RequestError) as e:
        parse_pod(pod)  # type: ignore[arg-type]
    assert str(e.value).startswith(start) and "(pod)" not in str(e.value), str(e.value)
