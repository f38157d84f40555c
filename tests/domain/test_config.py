"""kube_vgpu.config: schema defaults, validation with dotted keys, round trip."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.config import (
    API_VERSION,
    GPU_POLICIES,
    NODE_POLICIES,
    Config,
    Defaults,
    DeviceDefaults,
    NodeOverride,
    Scheduling,
    WebhookConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    load_config_text,
)
from kube_vgpu.errors import ConfigError, VGPUError
from kube_vgpu.resources import ResourceNames

SETTINGS = settings(max_examples=200, deadline=None)

FULL = textwrap.dedent("""\
    apiVersion: kube-vgpu.io/v1
    kind: Config
    schedulerName: my-scheduler
    resourceNames:
      gpu: example.com/gpu
      gpumem: example.com/vmem
      gpumemPercentage: example.com/vmem-pct
      gpucores: example.com/vcores
      priority: example.com/prio
    defaults: {gpuCount: 2, memoryMiB: 1024, memoryPercentage: 50, cores: 10, bareGpuExclusive: false}
    scheduling: {nodePolicy: fgd, gpuPolicy: binpack, inventoryStaleSeconds: 30}
    devices: {splitCount: 4, memoryScaling: 1.5, coreScaling: 2}
    nodes:
      - name: gpu-1
        splitCount: 20
        memoryScaling: 0.9
        excludeGPUs: [GPU-abc, 3]
      - name: gpu-2
    webhook:
      forceOverwriteDefaultScheduler: false
      mutateBareGpu: false
      privileged: allow
      allowUserVisibleDevices: true
      nonGpuVisibleDevicesNone: true
      shmSizeLimit: 8Gi
      foreignSchedulers: deny
    """)


def test_defaults() -> None:
    c = Config()
    assert c.scheduler_name == "kube-vgpu-scheduler"
    assert c.resource_names == ResourceNames()
    assert c.resource_names.gpumem == "nvidia.com/gpumem"
    assert c.resource_names.gpumem_percentage == "nvidia.com/gpumem-percentage"
    assert c.defaults == Defaults(gpu_count=1, memory_mib=0, memory_percentage=100, cores=0, bare_gpu_exclusive=True)
    assert c.scheduling == Scheduling(node_policy="binpack", gpu_policy="spread", inventory_stale_seconds=120.0)
    assert c.devices == DeviceDefaults(split_count=10, memory_scaling=1.0, core_scaling=1.0)
    assert c.devices.graph_memory_bound == "sum"  # sound whatever the driver reserves; peak is the admin's choice
    assert c.nodes == ()
    assert c.webhook == WebhookConfig(force_overwrite_default_scheduler=True, mutate_bare_gpu=True,
                                      privileged="deny", allow_user_visible_devices=False,
                                      non_gpu_visible_devices_none=True, shm_size_limit="",
                                      foreign_schedulers="leave")


@pytest.mark.parametrize("text", ["", "{}", "# nothing\n", f"apiVersion: {API_VERSION}\n", "null"])
def test_empty_config_is_defaults(text: str) -> None:
    assert load_config_text(text) == Config()


def test_load_config_none_and_file(tmp_path: Any) -> None:
    assert load_config(None) == Config()
    p = tmp_path / "c.yaml"
    p.write_text("scheduling: {nodePolicy: spread}\n")
    assert load_config(p).scheduling.node_policy == "spread"
    assert load_config(str(p)).scheduling.node_policy == "spread"
    with pytest.raises(OSError):
        load_config(tmp_path / "missing.yaml")


def test_full_example() -> None:
    c = load_config_text(FULL)
    assert c.scheduler_name == "my-scheduler"
    assert c.resource_names == ResourceNames("example.com/gpu", "example.com/vmem", "example.com/vmem-pct",
                                             "example.com/vcores", "example.com/prio")
    assert c.defaults == Defaults(2, 1024, 50, 10, False)
    assert c.scheduling == Scheduling("fgd", "binpack", 30.0)
    assert type(c.scheduling.inventory_stale_seconds) is float
    assert c.devices == DeviceDefaults(4, 1.5, 2.0)
    assert c.nodes == (NodeOverride("gpu-1", 20, 0.9, None, ("GPU-abc", "3")), NodeOverride("gpu-2"))
    assert c.node_override("gpu-1") is c.nodes[0]
    assert c.node_override("gpu-3") is None
    assert c.webhook == WebhookConfig(False, False, "allow", True, True, "8Gi", "deny")


def test_module_docstring_example_loads() -> None:
    import kube_vgpu.config as mod

    doc = mod.__doc__ or ""
    start = doc.index("Example (all defaults)::") + len("Example (all defaults)::")
    end = doc.index("Errors:")
    assert load_config_text(textwrap.dedent(doc[start:end])) == Config()


@pytest.mark.parametrize("policy", NODE_POLICIES)
def test_all_node_policies(policy: str) -> None:
    assert load_config_text(f"scheduling: {{nodePolicy: {policy}}}").scheduling.node_policy == policy


@pytest.mark.parametrize("policy", GPU_POLICIES)
def test_all_gpu_policies(policy: str) -> None:
    assert load_config_text(f"scheduling: {{gpuPolicy: {policy}}}").scheduling.gpu_policy == policy


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("schedulr: x", "schedulr"),
        ("scheduling: {nodePolicyy: binpack}", "scheduling.nodePolicyy"),
        ("defaults: {gpucount: 1}", "defaults.gpucount"),
        ("resourceNames: {gpuMem: x}", "resourceNames.gpuMem"),
        ("devices: {split: 3}", "devices.split"),
        ("webhook: {privilege: allow}", "webhook.privilege"),
        ("nodes: [{name: a}, {name: b, splitcount: 2}]", "nodes[1].splitcount"),
    ],
)
def test_unknown_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text(text)
    assert ei.value.key == key
    assert repr(key) in str(ei.value)
    assert "unknown key" in str(ei.value)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("scheduling: {nodePolicy: worst}", "scheduling.nodePolicy", "'worst'"),
        ("scheduling: {gpuPolicy: fgd}", "scheduling.gpuPolicy", "'fgd'"),
        ("scheduling: {inventoryStaleSeconds: 0}", "scheduling.inventoryStaleSeconds", "> 0"),
        ("scheduling: {inventoryStaleSeconds: soon}", "scheduling.inventoryStaleSeconds", "not a number"),
        ("scheduling: {bindHandoverSeconds: -1}", "scheduling.bindHandoverSeconds", "0..3600"),
        ("scheduling: {adoptUnsignedBefore: yesterday}", "scheduling.adoptUnsignedBefore", "RFC 3339 time with a zone"),
        ("scheduling: {adoptUnsignedBefore: 2026-03-01}", "scheduling.adoptUnsignedBefore", "RFC 3339 time with a zone"),
        ("devices: {splitCount: 0}", "devices.splitCount", "1..1024"),
        ("devices: {splitCount: 1025}", "devices.splitCount", "1..1024"),
        ("devices: {splitCount: 2.5}", "devices.splitCount", "not an integer"),
        ("devices: {splitCount: true}", "devices.splitCount", "not an integer"),
        ("devices: {memoryScaling: -1}", "devices.memoryScaling", "-1"),
        ("devices: {memoryScaling: 0}", "devices.memoryScaling", "> 0"),
        ("devices: {coreScaling: 101}", "devices.coreScaling", "<= 100"),
        ("devices: {coreScaling: true}", "devices.coreScaling", "not a number"),
        ("nodes: [{name: a, splitCount: 0}]", "nodes[0].splitCount", "1..1024"),
        ("nodes: [{name: a}, {name: b, memoryScaling: -1}]", "nodes[1].memoryScaling", "-1"),
        ("nodes: [{name: ''}]", "nodes[0].name", "non-empty"),
        ("nodes: [{name: a, excludeGPUs: GPU-1}]", "nodes[0].excludeGPUs", "list"),
        ("nodes: [{name: a, excludeGPUs: [[1]]}]", "nodes[0].excludeGPUs", "list"),
        ("nodes: [x]", "nodes[0]", "mapping"),
        ("nodes: {name: a}", "nodes", "list"),
        ("webhook: {privileged: maybe}", "webhook.privileged", "'maybe'"),
        ("webhook: {privileged: true}", "webhook.privileged", "not a string"),
        ("webhook: {foreignSchedulers: kill}", "webhook.foreignSchedulers", "'kill'"),
        ("webhook: {shmSizeLimit: lots}", "webhook.shmSizeLimit", "lots"),
        ("webhook: {shmSizeLimit: '0'}", "webhook.shmSizeLimit", "> 0"),
        ("webhook: {shmSizeLimit: '-1Gi'}", "webhook.shmSizeLimit", "> 0"),
        ("webhook: {mutateBareGpu: 'yes please'}", "webhook.mutateBareGpu", "not a boolean"),
        ("webhook: {mutateBareGpu: 1}", "webhook.mutateBareGpu", "not a boolean"),
        ("defaults: {gpuCount: 0}", "defaults.gpuCount", "1..128"),
        ("defaults: {gpuCount: 129}", "defaults.gpuCount", "1..128"),  # a pod may not ask for more
        ("resourceNames: {gpu: 'nvidia gpu'}", "resourceNames.gpu", "extended-resource name"),
        ("webhook: {allowDisableControlNamespaces: [a.b]}", "webhook.allowDisableControlNamespaces", "DNS label"),
        ("webhook: {allowedRuntimeClasses: [Nvidia]}", "webhook.allowedRuntimeClasses", "DNS subdomain"),
        ("webhook: {protectedHostPaths: [etc]}", "webhook.protectedHostPaths", "absolute path"),
        ("webhook: {systemUsers: ['']}", "webhook.systemUsers", "non-empty"),
        ("defaults: {gpuCount: '1'}", "defaults.gpuCount", "not an integer"),
        ("defaults: {memoryPercentage: 0}", "defaults.memoryPercentage", "1..100"),
        ("defaults: {memoryPercentage: 101}", "defaults.memoryPercentage", "1..100"),
        ("defaults: {memoryMiB: -1}", "defaults.memoryMiB", ">= 0"),
        ("defaults: {cores: 101}", "defaults.cores", "0..100"),
        ("defaults: {bareGpuExclusive: null}", "defaults.bareGpuExclusive", "not a boolean"),
        ("defaults: [1]", "defaults", "mapping"),
        ("resourceNames: {gpumem: nvidia.com/gpu}", "resourceNames", "distinct"),
        ("resourceNames: {gpucores: ''}", "resourceNames.gpucores", "extended-resource name"),
        ("resourceNames: {gpu: 5}", "resourceNames.gpu", "not a string"),
        ("schedulerName: ''", "schedulerName", "DNS subdomain"),
        ("schedulerName: [a]", "schedulerName", "not a string"),
        ("apiVersion: kube-vgpu.io/v2", "apiVersion", "kube-vgpu.io/v2"),
        ("apiVersion: v1", "apiVersion", "not supported"),
        ("- a\n- b\n", "(root)", "mapping"),
        ("just a string", "(root)", "mapping"),
    ],
)
def test_bad_values_name_the_key(text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text(text)
    assert ei.value.key == key
    assert fragment in str(ei.value)
    assert str(ei.value).startswith(f"config key {key!r}: ")


@pytest.mark.parametrize(
    ("text", "key", "value", "allowed"),
    [
        ("webhook: {shmSizeLimit: 0}", "webhook.shmSizeLimit", "0", "a quantity > 0"),
        ("defaults: {gpuCount: 1.5}", "defaults.gpuCount", "1.5", "an integer 1..128"),
        ("devices: {memoryScaling: x}", "devices.memoryScaling", "'x'", "a number > 0 and <= 100"),
        ("scheduling: {inventoryStaleSeconds: .nan}", "scheduling.inventoryStaleSeconds", "NaN", "a number > 0"),
        ("webhook: {mutateBareGpu: 1}", "webhook.mutateBareGpu", "1", "true or false"),
        ("scheduling: {nodePolicy: worst}", "scheduling.nodePolicy", "'worst'", "binpack | spread | fgd"),
        ("webhook: {privileged: true}", "webhook.privileged", "True", "deny | allow"),
        ("devices: {splitCount: 0}", "devices.splitCount", "0", "1..1024"),
        ("devices: {graphMemoryBound: max}", "devices.graphMemoryBound", "'max'", "sum | peak"),
        ("webhook: {systemUsers: x}", "webhook.systemUsers", "'x'", "a list of strings, each a non-empty string"),
        ("nodes: [{name: a, excludeGPUs: GPU-1}]", "nodes[0].excludeGPUs", "'GPU-1'", "a list of GPU UUIDs or indexes"),
        ("nodes: {name: a}", "nodes", "dict", "a list of mappings, one per node"),
        ("scheduling: [1]", "scheduling", "list", "a mapping of adoptUnsignedBefore, bindHandoverSeconds"),
        ("[1]", "(root)", "list", "a mapping of apiVersion, compat"),
        ("resourceNames: {gpumem: nvidia.com/gpu}", "resourceNames", "nvidia.com/gpu, nvidia.com/gpu",
         "five different extended-resource names"),
    ],
)
def test_every_error_names_the_value_and_what_is_allowed(text: str, key: str, value: str, allowed: str) -> None:
    """A wrong value is told what is allowed (a type error too, not only a range error)."""
    with pytest.raises(ConfigError) as ei:
        load_config_text(text)
    msg = str(ei.value)
    assert ei.value.key == key, msg
    assert value in msg and f"allowed: {allowed}" in msg, msg


def test_a_node_named_twice_in_nodes_is_refused() -> None:
    """Only the first override of a node would apply (``Config.node_override``): the second's values
    would be dropped silently."""
    with pytest.raises(ConfigError) as ei:
        load_config_text("nodes: [{name: a, splitCount: 2}, {name: b}, {name: a, splitCount: 4}]")
    assert ei.value.key == "nodes[2].name"
    assert "'a' is also nodes[0].name" in str(ei.value) and "allowed: one entry per node" in str(ei.value)


@pytest.mark.parametrize("when", ["2026-02-30T00:00:00Z", "2026-02-30"])
def test_unquoted_time_that_is_no_real_date_names_the_key(when: str) -> None:
    """YAML reads an unquoted ``2026-02-30T00:00:00Z`` as a time and PyYAML raises a bare ValueError
    for a day that does not exist: the loader turns it into the key's own error, not a traceback."""
    with pytest.raises(ConfigError) as ei:
        load_config_text(f"scheduling: {{adoptUnsignedBefore: {when}}}")
    assert ei.value.key == "scheduling.adoptUnsignedBefore"
    assert repr(when) in str(ei.value)


@pytest.mark.parametrize("text", ["scheduling: {nodePolicy: [", "a: b: c", "defaults:\n  - x\n y: 1", "\t- x"])
def test_yaml_syntax_error(text: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text(text)
    assert ei.value.key == "(yaml)"
    # one line, where and what (PyYAML's own text spans lines and quotes the input)
    assert re.fullmatch(r"not valid YAML: line \d+, column \d+: [^\n]+", str(ei.value)), str(ei.value)


def test_config_error_is_vgpu_error() -> None:
    e = ConfigError("a.b", "bad")
    assert isinstance(e, VGPUError) and isinstance(e, ValueError)
    assert e.key == "a.b" and str(e) == "config key 'a.b': bad"


def test_optional_node_fields_accept_null() -> None:
    c = load_config_text("nodes: [{name: a, splitCount: null, memoryScaling: null}]")
    assert c.nodes == (NodeOverride("a"),)


def test_config_to_dict_shape() -> None:
    d = config_to_dict(Config())
    assert d["apiVersion"] == API_VERSION
    assert d["defaults"] == {"gpuCount": 1, "memoryMiB": 0, "memoryPercentage": 100, "cores": 0,
                             "bareGpuExclusive": True}
    assert d["scheduling"] == {"nodePolicy": "binpack", "gpuPolicy": "spread", "inventoryStaleSeconds": 120.0,
                               "bindHandoverSeconds": 30.0, "adoptUnsignedBefore": ""}
    assert d["resourceNames"]["gpumemPercentage"] == "nvidia.com/gpumem-percentage"
    assert d["nodes"] == []
    full = config_to_dict(load_config_text(FULL))
    assert full["nodes"][0] == {"name": "gpu-1", "splitCount": 20, "memoryScaling": 0.9,
                                "excludeGPUs": ["GPU-abc", "3"]}
    assert full["nodes"][1] == {"name": "gpu-2", "excludeGPUs": []}


def test_round_trip_full_example() -> None:
    c = load_config_text(FULL)
    assert config_from_dict(config_to_dict(c)) == c


def test_round_trip_through_yaml() -> None:
    import yaml

    c = load_config_text(FULL)
    assert load_config_text(yaml.safe_dump(config_to_dict(c))) == c


NAMES = st.from_regex(r"[a-z]{1,8}\.io/[a-z]([a-z-]{0,8}[a-z])?", fullmatch=True)  # valid resource names


@st.composite
def configs(draw: st.DrawFn) -> Config:
    names = draw(st.lists(NAMES, min_size=5, max_size=5, unique=True))
    nodes = tuple(
        NodeOverride(name=name,
                     split_count=draw(st.none() | st.integers(1, 1024)),
                     memory_scaling=draw(st.none() | st.floats(0.01, 100)),
                     core_scaling=draw(st.none() | st.floats(0.01, 100)),
                     exclude_gpus=tuple(draw(st.lists(st.text(max_size=6), max_size=3))))
        for name in draw(st.lists(st.text(min_size=1, max_size=8), max_size=3, unique=True))  # one entry per node
    )
    return Config(
        scheduler_name=draw(st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?\Z")),
        resource_names=ResourceNames(*names),
        defaults=Defaults(draw(st.integers(1, 16)), draw(st.integers(0, 10**6)), draw(st.integers(1, 100)),
                          draw(st.integers(0, 100)), draw(st.booleans())),
        scheduling=Scheduling(draw(st.sampled_from(NODE_POLICIES)), draw(st.sampled_from(GPU_POLICIES)),
                              draw(st.floats(0.001, 1e6))),
        devices=DeviceDefaults(draw(st.integers(1, 1024)), draw(st.floats(0.01, 100)), draw(st.floats(0.01, 100))),
        nodes=nodes,
        webhook=WebhookConfig(draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from(["deny", "allow"])),
                              draw(st.booleans()), draw(st.booleans()),
                              draw(st.sampled_from(["", "1Gi", "512Mi", "64M"])),
                              draw(st.sampled_from(["leave", "deny"]))),
    )


@SETTINGS
@given(cfg=configs())
def test_property_round_trip(cfg: Config) -> None:
    assert config_from_dict(config_to_dict(cfg)) == cfg


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)


@SETTINGS
@given(section=st.sampled_from(["defaults", "scheduling", "devices", "webhook", "resourceNames"]),
       key=st.sampled_from(["gpuCount", "memoryMiB", "memoryPercentage", "cores", "bareGpuExclusive", "nodePolicy",
                            "gpuPolicy", "splitCount", "memoryScaling", "privileged", "shmSizeLimit", "gpu"]),
       value=JUNK)
def test_property_junk_only_config_error(section: str, key: str, value: Any) -> None:
    try:
        config_from_dict({section: {key: value}})
    except ConfigError as e:
        assert e.key.startswith(section)


def test_node_without_name_is_config_error() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text("nodes: [{splitCount: 2}]")
    assert ei.value.key == "nodes[0].name"


def test_nan_inventory_stale_seconds_rejected() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text("scheduling: {inventoryStaleSeconds: .nan}")
    assert ei.value.key == "scheduling.inventoryStaleSeconds"


def test_huge_shm_size_limit_is_config_error() -> None:
    with pytest.raises(ConfigError):
        load_config_text("webhook: {shmSizeLimit: '%s'}" % ("9" * 5000))


def test_duplicate_yaml_keys_are_refused() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config_text("scheduling: {nodePolicy: spread}\nscheduling: {nodePolicy: fgd}\n")
    assert ei.value.key == "scheduling" and "given twice (line 2)" in str(ei.value)
    with pytest.raises(ConfigError, match="given twice"):
        load_config_text("defaults:\n  cores: 1\n  cores: 2\n")


@pytest.mark.parametrize("name", ["Not A Valid Name!", "UPPER", "-lead", "a" * 254, "trail-"])
def test_scheduler_name_must_be_a_dns_subdomain(name: str) -> None:
    with pytest.raises(ConfigError) as ei:
        config_from_dict({"schedulerName": name})
    assert ei.value.key == "schedulerName" and "DNS subdomain" in str(ei.value)
    assert config_from_dict({"schedulerName": "gpu.sched-1"}).scheduler_name == "gpu.sched-1"


@pytest.mark.parametrize("attr", ["split_count", "memory_scaling", "core_scaling", "mig_strategy"])
def test_node_override_keeps_the_devices_rule(attr: str) -> None:
    """A per-node override allows exactly what its ``devices`` key allows (one rule), plus null."""
    def rule(cls: type) -> Any:
        return next(f.metadata["rule"] for f in dataclasses.fields(cls) if f.name == attr)
    dev, node = rule(DeviceDefaults), rule(NodeOverride)
    assert node.nullable and not dev.nullable
    assert dataclasses.replace(node, doc=dev.doc, nullable=False) == dev
    yaml_key = dev.yaml
    bad = {"split_count": 0, "memory_scaling": 0, "core_scaling": 101, "mig_strategy": "sometimes"}[attr]
    with pytest.raises(ConfigError, match=rf"nodes\[0\]\.{yaml_key}"):
        load_config_text(f"nodes:\n- name: a\n  {yaml_key}: {bad}\n")
    with pytest.raises(ConfigError, match=rf"devices\.{yaml_key}"):
        load_config_text(f"devices:\n  {yaml_key}: {bad}\n")
