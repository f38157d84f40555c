# ruff: noqa: F811 - fixtures imported from the device plugin tests are parameters here
"""HAMi's own example pods (Project-HAMi/HAMi ``examples/nvidia/*.yaml``) through kube-vgpu's real path.

Each test writes a pod carrying the same fields and values as one of HAMi's examples (resources,
annotations; the container is ``c`` and the image busybox, which changes nothing) and runs it as a
cluster would:

1. the webhook over real HTTPS, as the API server calls it: admitted, and changed only as
   docs/webhook.md says (``schedulerName``, resolved limits, a ``/dev/shm`` mount);
2. the admitted pod created in the fake kube-apiserver; the extender over HTTP against it:
   ``/filter`` keeps only the node whose GPUs match, ``/bind`` binds it (the signed record);
3. the real device plugin answering the fake kubelet over v1beta1 gRPC (Allocate, then
   PreStartContainer with the PodResources API naming the pod), NVML from the fake
   libnvidia-ml: the limits file each container gets (devices, MiB, cores, priority), which is what
   HAMi's device plugin hands out as ``CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m`` and
   ``CUDA_DEVICE_SM_LIMIT``.

The node ``gpu-node-1`` has two A100-40GB cards whose uuids are the two of HAMi's uuid examples, a
V100 and an RTX 2080 Ti; ``gpu-node-2`` has only 2080 Tis, so a type or uuid selection must leave it.

HAMi's semantics checked here (pkg/device/nvidia/device.go, pkg/device/devices.go): ``gpumem`` is
MiB per GPU, ``gpumem-percentage`` takes ``total * pct // 100`` MiB of each card, ``gpucores``
absent means 0 (no SM limit) unless the card is taken whole (bare ``nvidia.com/gpu`` or 100 %
memory: 100 cores), only ``gpucores`` given takes 100 % memory, ``use-gputype``/``nouse-gputype``
match a case-insensitive substring of the model, uuid lists match exactly, ``nvidia.com/priority``
reaches the container (HAMi: ``CUDA_TASK_PRIORITY``). Where kube-vgpu deliberately differs (a tenant's
``CUDA_DISABLE_CONTROL`` or ``GPU_CORE_UTILIZATION_POLICY``), the test shows the denial and its
message; docs/migration-from-hami.md says what to write instead.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

_TESTS = Path(__file__).resolve().parents[1]
for _d in ("deviceplugin", "scheduler", "security"):  # the device plugin, extender and bind helpers
    if str(_TESTS / _d) not in sys.path:
        sys.path.insert(0, str(_TESTS / _d))

from bind_support import bind, create_pod, extender  # noqa: E402
from dp_helpers import KEYS, NODE, FakeKubelet  # noqa: E402
from vgpu_sched_util import Extender, filter_args, node_obj, run  # noqa: E402
from vgpu_sched_util import wait_until as _wait_until  # noqa: E402
from wh_helpers import Client, base_pod, decode_patch, review_of  # noqa: E402

from deviceplugin.server import DevicePlugin  # noqa: E402
from kube_vgpu.codec import decode_allocation  # noqa: E402
from kube_vgpu.config import config_from_dict  # noqa: E402
from kube_vgpu.envcontract import VISIBLE_DEVICES  # noqa: E402
from kube_vgpu.podspec import parse_pod  # noqa: E402
from kube_vgpu.resources import ANN_ALLOCATION  # noqa: E402
from tests.deviceplugin.conftest import fake_nvml_lib, gpus, kube_api, kubelet, sockdir  # noqa: E402,F401
from tests.deviceplugin.test_dp_daemon import _wait_seen, start_plugin  # noqa: E402,F401
from tests.fakeapi import FakeKubeAPI  # noqa: E402

#: the uuids of HAMi's examples specify_uuid_to_use.yaml / specify_uuid_not_use.yaml
HAMI_UUID_D = "GPU-03f69c50-207a-2038-9b45-23cac89cb67d"
HAMI_UUID_E = "GPU-03f69c50-207a-2038-9b45-23cac89cb67e"
V100 = "GPU-0000000a-1111-4000-8000-00000000000a"
RTX = "GPU-0000000b-1111-4000-8000-00000000000b"
GPU_LIST = [
    {"uuid": HAMI_UUID_D, "name": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960, "numa": 0},
    {"uuid": HAMI_UUID_E, "name": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960, "numa": 0},
    {"uuid": V100, "name": "Tesla V100-SXM2-32GB", "memory_mib": 32768, "numa": 1},
    {"uuid": RTX, "name": "NVIDIA GeForce RTX 2080 Ti", "memory_mib": 11264, "numa": 1},
]
MEM = {g["uuid"]: g["memory_mib"] for g in GPU_LIST}
MODEL = {g["uuid"]: g["name"] for g in GPU_LIST}
SPLIT = 4
OTHER = "gpu-node-2"  #: two RTX 2080 Ti only


def hami_pod(name: str, containers: Sequence[dict[str, Any]], annotations: dict[str, str] | None = None,
             init: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A pod as the API server sends it to the webhook after defaulting, with HAMi's fields."""
    pod = base_pod()
    tmpl = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**copy.deepcopy(tmpl), **c} for c in containers]
    if init:
        pod["spec"]["initContainers"] = [{**copy.deepcopy(tmpl), **c} for c in init]
    pod["metadata"] = {"name": name, "namespace": "default", **({"annotations": annotations} if annotations else {})}
    return pod


def ctr(name: str, limits: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A container with HAMi's resource values (as YAML numbers, the way the examples write them)."""
    return {"name": name, "resources": {"limits": dict(limits)}, **extra}


def admit(client: Client, pod: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """CREATE through the webhook: the admitted pod and the patch (asserts it was allowed, and that
    a second review changes nothing, as with ``reinvocationPolicy: IfNeeded``)."""
    resp = client.review(review_of(copy.deepcopy(pod)))
    r = resp["response"]
    assert r["allowed"], r.get("status")
    patch = decode_patch(resp)
    out = jsonpatch.apply_patch(pod, patch)
    again = client.review(review_of(copy.deepcopy(out)))["response"]
    assert again["allowed"] and "patch" not in again, again
    return out, patch


def denied(client: Client, pod: dict[str, Any]) -> str:
    r = client.review(review_of(copy.deepcopy(pod)))["response"]
    assert not r["allowed"], "expected a denial"
    return str(r["status"]["message"])


def patched_paths(patch: list[dict[str, Any]]) -> set[str]:
    """The patch's paths with container indexes kept (what the webhook touched)."""
    return {p["path"] for p in patch}


def lim_of(pod: dict[str, Any], i: int = 0, field: str = "containers") -> dict[str, str]:
    return {k: str(v) for k, v in pod["spec"][field][i]["resources"]["limits"].items()}


@pytest.fixture
def cluster(start_plugin: Any, kube_api: FakeKubeAPI) -> Iterator[DevicePlugin]:
    """``gpu-node-1`` served by the real device plugin (the four GPUs above, 4 slots each), and
    ``gpu-node-2`` (two RTX 2080 Ti, inventory written as the device plugin would) that matches no
    type or uuid selection of these examples."""
    plugin = start_plugin(config_from_dict({"devices": {"splitCount": SPLIT}}), GPU_LIST)
    slots = str(SPLIT * len(GPU_LIST))
    kube_api.patch_object("nodes", NODE, {"status": {"capacity": {"nvidia.com/gpu": slots},
                                                     "allocatable": {"nvidia.com/gpu": slots}}},
                          subresource="status")
    kube_api.create_object("nodes", node_obj(OTHER, 2, mem=11264, split=SPLIT, model="NVIDIA GeForce RTX 2080 Ti"))
    yield plugin


async def _ready(ext: Extender) -> None:
    await _wait_until(lambda: all(n in ext.svc.cache.state.nodes and n not in ext.svc.cache.unavailable
                                  for n in (NODE, OTHER)), timeout=60)


class Placed:
    """Where one admitted pod went and what each of its GPU containers got."""

    def __init__(self, passed: list[str], failed: dict[str, str], record: Any, limits: dict[str, dict[str, str]]):
        self.passed = passed  #: nodes /filter kept
        self.failed = failed  #: node -> reason /filter gave
        self.record = record  #: the signed allocation record (kube_vgpu.model.PodAllocation)
        self.limits = limits  #: container -> its limits file

    def uuids(self, container: str) -> list[str]:
        lim = self.limits[container]
        return [lim[f"uuid_{i}"] for i in range(int(lim["devices"]))]

    def got(self, container: str) -> list[tuple[str, int, int]]:
        """(uuid, MiB, cores) per visible device of ``container``, in visible order."""
        lim = self.limits[container]
        return [(lim[f"uuid_{i}"], int(lim[f"memory_mib_{i}"]), int(lim[f"cores_{i}"]))
                for i in range(int(lim["devices"]))]


def place(fake: FakeKubeAPI, plugin: DevicePlugin, kubelet: FakeKubelet, admitted: Sequence[dict[str, Any]]
          ) -> list[Placed]:
    """Create each admitted pod, filter it over both nodes, bind it to the node the filter kept
    (gpu-node-1) and let kubelet admit and start its GPU containers (init containers first). Each
    pod's placement, in order."""
    created = [create_pod(fake, copy.deepcopy(p)) for p in admitted]

    async def go() -> list[Placed]:
        out = []
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            for pod in created:
                name = pod["metadata"]["name"]
                st, res = await ext.post("/filter", filter_args(pod, [node_obj(NODE), node_obj(OTHER)]))
                assert st == 200 and res["Error"] == "", res
                failed = {**res["FailedNodes"], **res["FailedAndUnresolvableNodes"]}
                assert res["NodeNames"] == [NODE], failed
                assert await bind(ext, pod, NODE) == ""
                await asyncio.to_thread(_wait_seen, plugin, fake, name)
                record = decode_allocation(fake.get_object("pods", name, "default")["metadata"]["annotations"]
                                           [ANN_ALLOCATION])
                order = [(c.name, len(c.devices)) for c in sorted(record.containers, key=lambda c: not c.init)
                         if c.devices]
                admitted_ctrs = await asyncio.to_thread(kubelet.admit, name, order)
                limits = {}
                for a in admitted_ctrs:
                    assert a.started and a.error is None, a.error
                    assert a.limits is not None and "state" not in a.limits, a.limits
                    limits[a.container] = a.limits
                    # the runtime exposes exactly the booked GPUs (the shim maps each by uuid,
                    # docs/env-contract.md), as many as the container asked for
                    uuids = [a.limits[f"uuid_{i}"] for i in range(int(a.limits["devices"]))]
                    assert sorted(a.envs[VISIBLE_DEVICES].split(",")) == sorted(uuids), a.envs
                    assert len(set(uuids)) == dict(order)[a.container], uuids
                out.append(Placed(res["NodeNames"], failed, record, limits))
        return out
    return run(go, 120)


# --- examples/nvidia/*.yaml -----------------------------------------------------------------------

def test_default_use_3000_mib_and_30_cores_unchanged(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                     kube_api: FakeKubeAPI) -> None:
    """default_use.yaml: ``gpu: 1, gpumem: 3000, gpucores: 30``. The limits are left as written
    (only the scheduler name and a /dev/shm mount are added); one GPU, 3000 MiB, 30 %."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30})])
    out, patch = admit(client, pod)
    assert lim_of(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}
    assert patched_paths(patch) == {"/spec/schedulerName", "/spec/volumes/-", "/spec/containers/0/volumeMounts/-"}
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    (p,) = place(kube_api, cluster, kubelet, [out])
    ((_, mib, cores),) = p.got("c")
    assert (mib, cores) == (3000, 30)


def test_deployment_example_gpumem_without_gpucores_gets_no_sm_limit(client: Client, cluster: DevicePlugin,
                                                                    kubelet: FakeKubelet,
                                                                    kube_api: FakeKubeAPI) -> None:
    """example.yaml (a Deployment's pod: ``gpu: 1, gpumem: 3000``, a toleration for
    ``nvidia.com/gpu``, ``schedulerName: default-scheduler``): HAMi's default cores are 0, so no
    SM limit; the webhook writes the resolved ``gpucores: 0`` and routes the pod to our scheduler."""
    pod = hami_pod("cuda-sample-vector-add-0", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000})])
    pod["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    out, _ = admit(client, pod)
    assert lim_of(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "0"}
    assert out["spec"]["tolerations"] == pod["spec"]["tolerations"]
    (p,) = place(kube_api, cluster, kubelet, [out])
    ((_, mib, cores),) = p.got("c")
    assert (mib, cores) == (3000, 0)


@pytest.mark.parametrize("example", ["default_use_legacy", "use_exclusive_card"])
def test_two_whole_cards(example: str, client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                         kube_api: FakeKubeAPI) -> None:
    """default_use_legacy.yaml (bare ``nvidia.com/gpu: 2``) and use_exclusive_card.yaml (``gpu: 2,
    gpumem-percentage: 100, gpucores: 100``): two different cards, each whole (all its memory, 100 %);
    the bare form is written out as ``gpumem-percentage: 100, gpucores: 100`` (docs/webhook.md)."""
    res = {"nvidia.com/gpu": 2} if example == "default_use_legacy" else {
        "nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 100, "nvidia.com/gpucores": 100}
    out, _ = admit(client, hami_pod("gpu-pod1", [ctr("c", res)]))
    assert lim_of(out) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "100", "nvidia.com/gpucores": "100"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    got = p.got("c")
    assert len({u for u, _, _ in got}) == 2
    assert all(mib == MEM[u] and cores == 100 for u, mib, cores in got), got


def test_use_as_normal_two_pods_each_take_a_whole_card(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                       kube_api: FakeKubeAPI) -> None:
    """use_as_normal.yaml: two pods of a bare ``nvidia.com/gpu: 1``: each gets a card of its own."""
    pods = [admit(client, hami_pod(f"gpu-pod{i}", [ctr("c", {"nvidia.com/gpu": 1})]))[0] for i in (1, 2)]
    p1, p2 = place(kube_api, cluster, kubelet, pods)
    ((u1, m1, c1),), ((u2, m2, c2),) = p1.got("c"), p2.got("c")
    assert u1 != u2 and (m1, c1, m2, c2) == (MEM[u1], 100, MEM[u2], 100)


def test_use_memory_fraction_50_percent_of_each_card(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                     kube_api: FakeKubeAPI) -> None:
    """use_memory_fraction.yaml: ``gpu: 2, gpumem-percentage: 50, gpucores: 30``: half of each of
    two cards' memory (HAMi: total * 50 / 100, whole MiB) and 30 % of each."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 50,
                                         "nvidia.com/gpucores": 30})])
    out, _ = admit(client, pod)
    assert lim_of(out) == {"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50", "nvidia.com/gpucores": "30"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    got = p.got("c")
    assert len({u for u, _, _ in got}) == 2
    assert all(mib == MEM[u] * 50 // 100 and cores == 30 for u, mib, cores in got), got


def test_use_sharing_card_40_and_60_percent(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                            kube_api: FakeKubeAPI) -> None:
    """use_sharing_card.yaml: 40 % memory / 60 % cores and 60 % memory / 40 % cores."""
    pods = [admit(client, hami_pod(f"gpu-pod{i}", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": m,
                                                               "nvidia.com/gpucores": c})]))[0]
            for i, (m, c) in ((1, (40, 60)), (2, (60, 40)))]
    p1, p2 = place(kube_api, cluster, kubelet, pods)
    ((u1, m1, c1),), ((u2, m2, c2),) = p1.got("c"), p2.got("c")
    assert (m1, c1) == (MEM[u1] * 40 // 100, 60) and (m2, c2) == (MEM[u2] * 60 // 100, 40)


def test_specify_card_type_to_use_a100_or_v100(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                               kube_api: FakeKubeAPI) -> None:
    """specify_card_type_to_use.yaml: ``nvidia.com/use-gputype: "A100,V100"``, ``gpu: 2``: the
    2080-only node is filtered out, and both cards are A100 or V100 (HAMi: case-insensitive
    substring of the model)."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 2})], {"nvidia.com/use-gputype": "A100,V100"})
    out, _ = admit(client, pod)
    assert out["metadata"]["annotations"] == {"nvidia.com/use-gputype": "A100,V100"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert "GPU type constraints" in p.failed[OTHER], p.failed
    assert all("A100" in MODEL[u] or "V100" in MODEL[u] for u in p.uuids("c")), p.uuids("c")
    # lower case and spaces after the commas select the same cards (HAMi upper-cases and trims)
    assert parse_pod(hami_pod("q", [ctr("c", {"nvidia.com/gpu": 2})], {"nvidia.com/use-gputype": "a100, v100"})
                     ).constraints.use_types == ("a100", "v100")


def test_specify_card_type_not_use_1080_2080(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                             kube_api: FakeKubeAPI) -> None:
    """specify_card_type_not_use.yaml: ``nvidia.com/nouse-gputype: "1080,2080"``, ``gpu: 2``."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 2})], {"nvidia.com/nouse-gputype": "1080,2080"})
    out, _ = admit(client, pod)
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert "GPU type constraints" in p.failed[OTHER], p.failed
    assert RTX not in p.uuids("c") and len(p.uuids("c")) == 2


def test_specify_uuid_to_use(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                             kube_api: FakeKubeAPI) -> None:
    """specify_uuid_to_use.yaml: ``nvidia.com/use-gpuuuid`` lists HAMi's two uuids, ``gpu: 1``: the
    card is one of them (the only ones this cluster has are gpu-node-1's A100s)."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 1})],
                   {"nvidia.com/use-gpuuuid": f"{HAMI_UUID_D},{HAMI_UUID_E}"})
    out, _ = admit(client, pod)
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert "GPU uuid constraints" in p.failed[OTHER], p.failed
    assert p.uuids("c")[0] in (HAMI_UUID_D, HAMI_UUID_E)


def test_specify_uuid_not_use(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                              kube_api: FakeKubeAPI) -> None:
    """specify_uuid_not_use.yaml: ``nvidia.com/nouse-gpuuuid: GPU-03f69c50-...-67d``, ``gpu: 2``,
    here with the 2080s excluded too, so that the listed card is the only one the pod could not use."""
    pod = hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 2})],
                   {"nvidia.com/nouse-gpuuuid": HAMI_UUID_D, "nvidia.com/nouse-gputype": "2080"})
    out, _ = admit(client, pod)
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert sorted(p.uuids("c")) == sorted([HAMI_UUID_E, V100])


def test_specify_scheduling_policy_annotations(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                               kube_api: FakeKubeAPI) -> None:
    """specify_scheduling_policy.yaml: ``hami.io/node-scheduler-policy: spread``,
    ``hami.io/gpu-scheduler-policy: binpack``, a bare ``gpu: 1``: both are read (and left on the pod),
    and ``topology-aware`` is served by ``spread`` (docs/migration-from-hami.md)."""
    ann = {"hami.io/node-scheduler-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"}
    out, _ = admit(client, hami_pod("gpu-pod", [ctr("c", {"nvidia.com/gpu": 1})], dict(ann)))
    assert out["metadata"]["annotations"] == ann
    req = parse_pod(out)
    assert (req.node_policy, req.gpu_policy) == ("spread", "binpack")
    for hami, served in (("topology-aware", "spread"), ("spread", "spread"), ("binpack,numa", "binpack")):
        q = parse_pod(hami_pod("q", [ctr("c", {"nvidia.com/gpu": 1})], {"hami.io/gpu-scheduler-policy": hami}))
        assert q.gpu_policy == served, hami
    (p,) = place(kube_api, cluster, kubelet, [out])
    ((u, mib, cores),) = p.got("c")
    assert (mib, cores) == (MEM[u], 100)


def test_vllm_cross_vgpu_requests_and_its_own_dev_shm(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                      kube_api: FakeKubeAPI) -> None:
    """vllm_cross_vgpu.yaml: ``gpu: 2, gpumem-percentage: 30, gpucores: 30`` in limits *and* requests,
    cpu/memory beside them, and its own ``shm`` emptyDir at /dev/shm: the webhook adds no second
    /dev/shm mount (two mounts at one path would make the API server refuse the pod); 30 % of each
    of two cards."""
    res = {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 30, "nvidia.com/gpucores": 30}
    c = ctr("c", {"cpu": "8", "memory": "20Gi", **res})
    c["resources"]["requests"] = {"cpu": "2", "memory": "6Gi", **res}
    c["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
    pod = hami_pod("vllm-cross-vgpu-0", [c])
    pod["spec"]["volumes"].append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
    out, patch = admit(client, pod)
    assert patched_paths(patch) == {"/spec/schedulerName"}
    mounts = [m["mountPath"] for m in out["spec"]["containers"][0]["volumeMounts"]]
    assert mounts.count("/dev/shm") == 1
    (p,) = place(kube_api, cluster, kubelet, [out])
    got = p.got("c")
    assert len({u for u, _, _ in got}) == 2
    assert all(mib == MEM[u] * 30 // 100 and cores == 30 for u, mib, cores in got), got


# --- HAMi's documented resources and defaults -----------------------------------------------------

def test_gpucores_alone_takes_one_gpu_and_all_its_memory(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                         kube_api: FakeKubeAPI) -> None:
    """Only ``nvidia.com/gpucores: 30``: HAMi adds ``nvidia.com/gpu: 1`` (defaultGPUNum) and, with
    defaultMemory 0, books 100 % of the card's memory; 30 % cores."""
    out, _ = admit(client, hami_pod("cores-only", [ctr("c", {"nvidia.com/gpucores": 30})]))
    assert lim_of(out) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "100", "nvidia.com/gpucores": "30"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    ((u, mib, cores),) = p.got("c")
    assert (mib, cores) == (MEM[u], 30)


def test_gpumem_alone_and_priority(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                   kube_api: FakeKubeAPI) -> None:
    """Only ``nvidia.com/gpumem: 2000`` (count 1 added, cores 0), and ``nvidia.com/priority`` 0 and 1
    (HAMi: ``CUDA_TASK_PRIORITY``): each container gets its priority in its limits file and env."""
    pods = [admit(client, hami_pod(f"prio-{v}", [ctr("c", {"nvidia.com/gpumem": 2000, "nvidia.com/priority": v})]))[0]
            for v in (0, 1)]
    assert lim_of(pods[0]) == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2000", "nvidia.com/gpucores": "0",
                               "nvidia.com/priority": "0"}
    assert not any(e.get("name") == "CUDA_TASK_PRIORITY" for e in pods[0]["spec"]["containers"][0].get("env", []))
    placed = place(kube_api, cluster, kubelet, pods)
    for v, p in zip((0, 1), placed, strict=True):
        ((_, mib, cores),) = p.got("c")
        assert (mib, cores, p.limits["c"]["priority"]) == (2000, 0, str(v))
    # HAMi's webhook wrote CUDA_TASK_PRIORITY into the pod's env; here the limits file carries it
    # (the env is the tenant's; docs/migration-from-hami.md)
    assert set(kubelet.pods[("default", "prio-0")]["c"].envs) == {VISIBLE_DEVICES}


def test_gpumem_beside_a_100_percent_keeps_its_cores_default(client: Client, cluster: DevicePlugin,
                                                             kubelet: FakeKubelet, kube_api: FakeKubeAPI) -> None:
    """A deliberate difference (docs/migration-from-hami.md): ``gpumem: 3000`` beside
    ``gpumem-percentage: 100`` without gpucores. gpumem wins in both systems (3000 MiB); HAMi >= 2.7
    also defaults gpucores to 100 from the percentage alone, kube-vgpu ignores the percentage
    entirely (cores 0, the card shared): a pod that wants the card writes ``gpucores: 100``."""
    pod = hami_pod("whole", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000,
                                       "nvidia.com/gpumem-percentage": 100})])
    out, _ = admit(client, pod)
    assert lim_of(out)["nvidia.com/gpucores"] == "0"
    (p,) = place(kube_api, cluster, kubelet, [out])
    ((_, mib, cores),) = p.got("c")
    assert (mib, cores) == (3000, 0)
    assert not parse_pod(out).app[0].exclusive


def test_a_uuid_list_naming_a_whole_pool(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                         kube_api: FakeKubeAPI) -> None:
    """``use-gpuuuid`` naming the 1024 cards of a pool (128 nodes of 8; one of them HAMi's example
    uuid on gpu-node-1): admitted, and the pod lands on the one listed card this cluster has. A
    list past 1024 is refused naming the annotation (tests/security/test_redteam_tenant4.py)."""
    pool = [f"GPU-{n:08x}-0000-4000-8000-{i:012x}" for n in range(128) for i in range(8)][:1023] + [HAMI_UUID_E]
    pod = hami_pod("pinned", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})],
                   {"nvidia.com/use-gpuuuid": ",".join(pool)})
    out, _ = admit(client, pod)
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert p.uuids("c") == [HAMI_UUID_E]


def test_multiple_containers_each_get_their_own_limits(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                                       kube_api: FakeKubeAPI) -> None:
    """Two GPU containers and a sidecar without GPUs: each GPU container gets its own request."""
    pod = hami_pod("multi", [ctr("a", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 2000, "nvidia.com/gpucores": 20}),
                             ctr("b", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 5000, "nvidia.com/gpucores": 50}),
                             ctr("log", {"cpu": "100m"})])
    out, _ = admit(client, pod)
    assert lim_of(out, 2) == {"cpu": "100m"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert set(p.limits) == {"a", "b"}
    assert [(m, c) for _, m, c in p.got("a")] == [(2000, 20)]
    assert [(m, c) for _, m, c in p.got("b")] == [(5000, 50), (5000, 50)]


def test_init_container_and_app_container(client: Client, cluster: DevicePlugin, kubelet: FakeKubelet,
                                          kube_api: FakeKubeAPI) -> None:
    """An init container (``gpumem: 6000``) before the app container (``gpumem: 3000, gpucores: 30``):
    each gets its own limits (init containers run one at a time, docs/placement.md)."""
    pod = hami_pod("with-init", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30})],
                   init=[ctr("warm", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 6000})])
    out, _ = admit(client, pod)
    assert lim_of(out, 0, "initContainers") == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "6000",
                                                "nvidia.com/gpucores": "0"}
    (p,) = place(kube_api, cluster, kubelet, [out])
    assert [(m, c) for _, m, c in p.got("warm")] == [(6000, 0)]
    assert [(m, c) for _, m, c in p.got("c")] == [(3000, 30)]


# --- deliberate differences (docs/migration-from-hami.md, "Stricter than HAMi") ---------------------

@pytest.mark.parametrize("name,value,why", [
    ("CUDA_DISABLE_CONTROL", "true", "webhook.allowDisableControlNamespaces"),
    ("GPU_CORE_UTILIZATION_POLICY", "disable", "config devices.corePolicy"),
    ("CUDA_DEVICE_MEMORY_LIMIT_0", "24000m", "ask with nvidia.com/gpumem (MiB per GPU) or nvidia.com/gpumem-percentage"),
    ("CUDA_DEVICE_MEMORY_LIMIT", "24000m", "ask with nvidia.com/gpumem (MiB per GPU)"),
    ("CUDA_DEVICE_SM_LIMIT", "100", "ask with nvidia.com/gpucores"),
    ("CUDA_DEVICE_SM_LIMIT_1", "100", "ask with nvidia.com/gpucores"),
    ("CUDA_TASK_PRIORITY", "0", "ask with nvidia.com/priority"),
    ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/x", "its own accounting file"),
    ("LIBVGPU_SM_WINDOW_MS", "1", "LIBVGPU_LOG_LEVEL is the only shim setting"),
])
def test_env_hami_honours_from_the_tenant_is_denied_naming_it(name: str, value: str, why: str,
                                                              client: Client) -> None:
    """HAMi's device plugin and shim take these from the container's own env (a tenant turns its
    limits off with ``CUDA_DISABLE_CONTROL=true`` or ``GPU_CORE_UTILIZATION_POLICY=disable``).
    kube-vgpu denies them in a GPU container, naming the container, the variable and what to do."""
    c = ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}, env=[{"name": name, "value": value}])
    msg = denied(client, hami_pod("env", [c]))
    assert f"container 'c': env {name}" in msg and why in msg, msg


def test_no_runtime_class_is_written_and_nvidia_may_be_named(client: Client) -> None:
    """HAMi's webhook writes its configured ``runtimeClassName`` into GPU pods that name none;
    kube-vgpu's does so only with ``webhook.runtimeClassName`` set (default ``""``: none written;
    tests/webhook/test_webhook_rules.py), and a pod naming ``nvidia`` is admitted with it."""
    res = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}
    out, _ = admit(client, hami_pod("plain", [ctr("c", res)]))
    assert "runtimeClassName" not in out["spec"]
    named = hami_pod("named", [ctr("c", res)])
    named["spec"]["runtimeClassName"] = "nvidia"
    out, _ = admit(client, named)
    assert out["spec"]["runtimeClassName"] == "nvidia"


def test_a_gpu_sidecar_is_refused_naming_it(client: Client) -> None:
    """HAMi books a native sidecar (init container, ``restartPolicy: Always``) as an init container,
    one at a time, though it runs beside the app containers; kube-vgpu refuses it, naming the
    sidecar and what to do (docs/migration-from-hami.md)."""
    pod = hami_pod("sidecar", [ctr("c", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000})],
                   init=[ctr("proxy", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}, restartPolicy="Always")])
    msg = denied(client, pod)
    assert "sidecar container 'proxy'" in msg and "request the GPU in spec.containers" in msg, msg
