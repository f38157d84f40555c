"""GPU quota per namespace, counted on what the extender books (kube_vgpu/quota.py), over the real
extender HTTP protocol against the fake kube-apiserver (ResourceQuotas watched like pods and nodes).

The attack played: kube-apiserver's own quota admission counts only the numbers in a pod spec, so a
tenant under ``limits.nvidia.com/gpumem: 24000`` asks ``gpumem-percentage: 40`` in two containers
on 40000 MiB GPUs (32000 MiB booked, 0 MiB seen by admission), with or without an init container.
The extender refuses it at filter and at bind with a reason naming the quota, the namespace, used,
asked and hard."""

from __future__ import annotations

from typing import Any

import pytest
from vgpu_sched_util import (
    Extender,
    api_extender,
    bind_args,
    create_pod,
    ctr,
    filter_args,
    node_obj,
    pod_obj,
    quota_obj,
    run,
    wait_until,
)

from kube_vgpu.quota import Amount, Limit, QuotaBook, exceeded, limits_of
from kube_vgpu.resources import ResourceNames
from tests.fakeapi import FakeKubeAPI

NS = "team-a"
GPU_MIB = 40000


@pytest.fixture(autouse=True)
def _namespaces(request: pytest.FixtureRequest) -> None:
    """The tenants' namespaces, for the tests that use the fake API server."""
    if "fake" in request.fixturenames:
        for ns in (NS, "team-b"):
            request.getfixturevalue("fake").create_object("namespaces", {"metadata": {"name": ns}})


def quota(hard: dict[str, str], name: str = "gpu", ns: str = NS) -> dict[str, Any]:
    return quota_obj(hard, name, ns)


async def place(ext: Extender, pod: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str | None, dict[str, Any]]:
    """Filter, then bind to the first feasible node. Returns (node or None, the filter result)."""
    _, res = await ext.post("/filter", filter_args(pod, nodes))
    ok = res["NodeNames"] or []
    if not ok:
        return None, res
    _, b = await ext.post("/bind", bind_args(pod, ok[0]))
    assert b["Error"] == "", b
    return ok[0], res


def reasons(res: dict[str, Any]) -> set[str]:
    return set((res.get("FailedNodes") or {}).values()) | set((res.get("FailedAndUnresolvableNodes") or {}).values())


def test_percentage_pods_cannot_bypass_a_memory_quota(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj(f"n{i}", 2, mem=GPU_MIB)) for i in range(2)]
    fake.create_object("resourcequotas", quota({"limits.nvidia.com/gpumem": "24000"}), namespace=NS)
    two = [ctr("a", gpumem_percentage=40), ctr("b", gpumem_percentage=40)]
    plain = create_pod(fake, pod_obj("two", containers=two, ns=NS))
    with_init = create_pod(fake, pod_obj("two-init", containers=two, init=[ctr("i", gpumem_percentage=10)], ns=NS))

    async def go() -> None:
        async with api_extender(fake) as ext:
            for p in (plain, with_init):
                node, res = await place(ext, p, nodes)
                assert node is None
                assert reasons(res) == {"GPU quota exceeded: namespace team-a, ResourceQuota gpu: "
                                        "limits.nvidia.com/gpumem used 0 + asked 32000 > hard 24000"}, res
                assert set(res["FailedAndUnresolvableNodes"]) == {"n0", "n1"}  # preemption cannot help
                # a forged or stale filter answer does not help: bind checks the quota again
                _, b = await ext.post("/bind", bind_args(p, "n0"))
                assert "limits.nvidia.com/gpumem used 0 + asked 32000 > hard 24000" in b["Error"], b
            assert ext.svc.cache.state.bookings == {}
            assert ext.svc.metrics.registry.get_sample_value(
                "kube_vgpu_scheduler_filter_rejections_total", {"reason": "quota_exceeded"}) is not None
    run(go)


def test_quota_counts_bookings_and_promises_and_applies_live(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 4, mem=GPU_MIB))]
    fake.create_object("resourcequotas", quota({"requests.nvidia.com/gpumem": "24000"}), namespace=NS)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpumem": 16000}, ns=NS))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpumem": 16000}, ns=NS))
    c = create_pod(fake, pod_obj("c", limits={"nvidia.com/gpumem": 16000}, ns="team-b"))  # another namespace

    async def go() -> None:
        async with api_extender(fake) as ext:
            svc = ext.svc
            # a passes filter (promised on the single feasible node) but is not bound yet: its
            # promise already counts against the namespace
            _, res = await ext.post("/filter", filter_args(a, nodes))
            assert res["NodeNames"] == ["n0"]
            _, res = await ext.post("/filter", filter_args(b, nodes))
            assert reasons(res) == {"GPU quota exceeded: namespace team-a, ResourceQuota gpu: "
                                    "requests.nvidia.com/gpumem used 16000 + asked 16000 > hard 24000"}, res
            _, bound = await ext.post("/bind", bind_args(a, "n0"))
            assert bound["Error"] == ""
            assert (await place(ext, b, nodes))[0] is None
            assert (await place(ext, c, nodes))[0] == "n0"  # team-b has no quota
            # the admin raises the quota: it applies at once
            fake.patch_object("resourcequotas", "gpu", {"spec": {"hard": {"requests.nvidia.com/gpumem": "32000"}}}, NS)
            await wait_until(lambda: svc.cache.quotas.limits(NS)[0].hard == 32000)
            assert (await place(ext, b, nodes))[0] == "n0"
    run(go)


def test_cores_quota_and_deleted_quota(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 4, mem=GPU_MIB))]
    fake.create_object("resourcequotas", quota({"nvidia.com/gpucores": "50"}, name="compute"), namespace=NS)
    p = create_pod(fake, pod_obj("p", limits={"nvidia.com/gpu": 2, "nvidia.com/gpumem": 1000,
                                              "nvidia.com/gpucores": 30}, ns=NS))

    async def go() -> None:
        async with api_extender(fake) as ext:
            node, res = await place(ext, p, nodes)
            assert node is None and reasons(res) == {"GPU quota exceeded: namespace team-a, ResourceQuota compute: "
                                                     "nvidia.com/gpucores used 0 + asked 60 > hard 50"}, res
            fake.delete_object("resourcequotas", "compute", NS)
            await wait_until(lambda: not ext.svc.cache.quotas.limits(NS))
            assert (await place(ext, p, nodes))[0] == "n0"
    run(go)


def test_limits_of_reads_the_three_key_forms_and_skips_bad_values() -> None:
    names = ResourceNames()
    q = quota({"requests.nvidia.com/gpumem": "24000", "limits.nvidia.com/gpumem": "30k", "nvidia.com/gpucores": "150",
               "limits.nvidia.com/gpucores": "1500m", "requests.nvidia.com/gpu": "2", "cpu": "4",
               "nvidia.com/gpumem": "lots"})
    assert sorted(limits_of(q, names), key=lambda x: x.key) == [
        Limit("gpu", "limits.nvidia.com/gpucores", "cores", 1),  # fractional: its whole part, never "no limit"
        Limit("gpu", "limits.nvidia.com/gpumem", "mib", 30000),
        Limit("gpu", "nvidia.com/gpucores", "cores", 150),
        Limit("gpu", "requests.nvidia.com/gpumem", "mib", 24000),
    ]


def test_tightest_limit_wins_and_asking_nothing_never_exceeds() -> None:
    lims = [Limit("big", "requests.nvidia.com/gpumem", "mib", 50000),
            Limit("small", "limits.nvidia.com/gpumem", "mib", 20000)]
    over = exceeded(NS, lims, Amount(15000, 0), Amount(10000, 0))
    assert over is not None and over.limit.quota == "small" and (over.used, over.asked) == (15000, 10000)
    assert exceeded(NS, lims, Amount(60000, 0), Amount(0, 30)) is None  # over already, asks no memory
    assert exceeded(NS, lims, Amount(10000, 0), Amount(10000, 0)) is None  # exactly at hard: fits


def test_quota_book_follows_events_and_renamed_resources() -> None:
    book = QuotaBook(ResourceNames())
    book.on_quota("ADDED", quota({"limits.nvidia.com/gpumem": "1000"}))
    book.on_quota("ADDED", quota({"cpu": "4"}, name="cpu-only"))
    assert [lim.quota for lim in book.limits(NS)] == ["gpu"] and book.namespaces() == [NS]
    book.set_names(ResourceNames(gpumem="example.com/vmem"))
    assert book.limits(NS) == []
    book.on_quota("MODIFIED", quota({"limits.example.com/vmem": "2000"}))
    assert [lim.hard for lim in book.limits(NS)] == [2000]
    book.on_quota("DELETED", quota({}))
    assert book.limits(NS) == [] and book.namespaces() == []
