"""Per-GPU cordon (kube_vgpu/cordon.py) through the extender's HTTP protocol and the fake
kube-apiserver: a cordoned GPU (by index, by uuid, or by HAMi's annotation) is never chosen for a
new pod; pods already on it keep their bookings; uncordon makes it usable again, live."""

from __future__ import annotations

from typing import Any

import pytest
from vgpu_sched_util import Extender, api_extender, bind_args, filter_args, node_obj, pod_obj, run, wait_until

from kube_vgpu.codec import decode_allocation
from kube_vgpu.cordon import cordoned_tokens, edit
from kube_vgpu.resources import ANN_ALLOCATION, ANN_GPU_CORDON, ANN_HAMI_DEVICE_CORDON
from tests.fakeapi import FakeKubeAPI


def create_pod(fake: FakeKubeAPI, name: str, **limits: int) -> dict[str, Any]:
    p = pod_obj(name, limits={f"nvidia.com/{k}": v for k, v in limits.items()})
    p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
    return fake.create_object("pods", p)


async def place(ext: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str | None, str]:
    """Filter then bind to the first feasible node: (node, "") or (None, the failure reasons)."""
    _, res = await ext.post("/filter", filter_args(pod, nodes))
    if not res["NodeNames"]:
        return None, " | ".join({**(res["FailedNodes"] or {}), **(res["FailedAndUnresolvableNodes"] or {})}.values())
    _, b = await ext.post("/bind", bind_args(pod, res["NodeNames"][0]))
    assert b["Error"] == "", b
    return res["NodeNames"][0], ""


def gpus_of(fake: FakeKubeAPI, name: str) -> set[str]:
    p = fake.get_object("pods", name, "default")
    assert p is not None
    return {d.uuid for c in decode_allocation(p["metadata"]["annotations"][ANN_ALLOCATION]).containers
            for d in c.devices}


@pytest.mark.parametrize("how", ["index", "uuid", "hami"])
def test_cordoned_gpu_is_never_chosen_and_running_pods_stay(fake: FakeKubeAPI, how: str) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 2))]

    async def go() -> None:
        async with api_extender(fake) as ext:
            svc = ext.svc
            uuids = [d.uuid for d in svc.cache.state.nodes["n0"].devices]
            gpu0 = uuids[0]
            early = create_pod(fake, "early", gpumem=1000)
            assert (await place(ext, early, nodes))[0] == "n0"
            assert gpus_of(fake, "early") == {gpu0}  # binpack: GPU 0 first
            key, value = ((ANN_HAMI_DEVICE_CORDON, gpu0) if how == "hami" else
                          (ANN_GPU_CORDON, "0" if how == "index" else gpu0))
            fake.patch_object("nodes", "n0", {"metadata": {"annotations": {key: value}}})
            await wait_until(lambda: not svc.cache.state.nodes["n0"].devices[0].healthy)
            assert "default/early" in svc.cache.state.bookings  # the running pod keeps its booking
            two = create_pod(fake, "two", gpu=2, gpumem=1000)  # needs both GPUs: one is cordoned
            node, why = await place(ext, two, nodes)
            assert node is None and "needs 2 GPUs" in why, why
            for i in range(3):
                p = create_pod(fake, f"p{i}", gpumem=1000)
                assert (await place(ext, p, nodes))[0] == "n0"
                assert gpus_of(fake, f"p{i}") == {uuids[1]}, how
            # every GPU cordoned: the reason says so
            both = f"{value},1" if how == "index" else f"{value},{uuids[1]}"
            fake.patch_object("nodes", "n0", {"metadata": {"annotations": {key: both}}})
            await wait_until(lambda: not svc.cache.state.nodes["n0"].devices[1].healthy)
            node, why = await place(ext, create_pod(fake, "none", gpumem=1000), nodes)
            assert node is None and "unhealthy or cordoned" in why, why
            fake.patch_object("nodes", "n0", {"metadata": {"annotations": {key: None}}})
            await wait_until(lambda: all(d.healthy for d in svc.cache.state.nodes["n0"].devices))
            late = create_pod(fake, "late", gpumem=1000)
            assert (await place(ext, late, nodes))[0] == "n0" and gpus_of(fake, "late") == {gpu0}
    run(go)


def test_cordon_annotation_helpers() -> None:
    assert cordoned_tokens({ANN_GPU_CORDON: " GPU-a, 3,,", ANN_HAMI_DEVICE_CORDON: "GPU-b"}) == {"GPU-a", "3", "GPU-b"}
    assert cordoned_tokens({ANN_GPU_CORDON: 7}) == frozenset()  # not a string: nothing cordoned
    assert edit(None, "GPU-a", True) == "GPU-a" and edit("GPU-a", "GPU-a", True) == "GPU-a"
    assert edit("GPU-a,1", "2", True) == "GPU-a,1,2" and edit("GPU-a,1,2", "1", False) == "GPU-a,2"
