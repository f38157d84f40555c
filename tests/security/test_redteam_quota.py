"""Red team: a tenant under a GPU quota (docs/quota.md) tries to get more GPU than its namespace's
ResourceQuotas allow, over the real extender HTTP protocol against the in-process fake kube-apiserver.

Attacks played:

* **No compute limit under a compute quota.** ``nvidia.com/gpucores`` omitted (or ``0``) means
  *no SM limit* (docs/configuration.md ``defaults.cores``): the container may use all of the GPU's
  compute, yet it would book 0 percent units. Under ``nvidia.com/gpucores: 50`` a tenant would run
  any number of such pods, each unlimited. Like Kubernetes' own quota for ``limits.cpu`` (a pod
  without a CPU limit is refused where a CPU limit quota applies), the extender refuses a pod that
  asks for no compute limit where a compute quota applies, at filter and at bind, naming the
  container and the quota.
* **A fractional hard value.** ``requests.``-prefixed quota keys are not integer resources to
  kube-apiserver's validation, so ``requests.nvidia.com/gpumem: 24000500m`` can get through, and its
  own admission holds pods to it. Reading it as "no limit" would be fail-open: it is held as its whole part.

Who may write ResourceQuotas is the cluster's RBAC: Kubernetes' default ``admin`` and ``edit``
roles give a namespace's admin read-only access to ResourceQuotas, so a tenant cannot raise its own
quota; a cluster that grants that verb gives its tenants their quota (docs/quota.md, Permissions).
"""

from __future__ import annotations

from typing import Any

import pytest
from bind_support import bind_args, node_obj, pod_obj
from vgpu_sched_util import api_extender, create_pod, ctr, filter_args, quota_obj, run

from kube_vgpu.quota import Limit, limits_of
from kube_vgpu.resources import ResourceNames
from tests.fakeapi import FakeKubeAPI

NS = "team-a"


@pytest.fixture(autouse=True)
def _namespaces(fake: FakeKubeAPI) -> None:
    for ns in (NS, "team-b"):
        fake.create_object("namespaces", {"metadata": {"name": ns}})


def quota(hard: dict[str, str], name: str = "gpu", ns: str = NS) -> dict[str, Any]:
    return quota_obj(hard, name, ns)


def reasons(res: dict[str, Any]) -> set[str]:
    return set((res.get("FailedNodes") or {}).values()) | set((res.get("FailedAndUnresolvableNodes") or {}).values())


def test_no_compute_limit_is_refused_under_a_compute_quota(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 4, mem=40000))]
    fake.create_object("resourcequotas", quota({"requests.nvidia.com/gpucores": "50"}, name="compute"),
                       namespace=NS)
    # gpucores omitted (the default 0: no SM limit), and gpucores: 0 written out; one of two containers
    unlimited = [
        create_pod(fake, pod_obj("omitted", limits={"nvidia.com/gpumem": 1000}, ns=NS)),
        create_pod(fake, pod_obj("zero", limits={"nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 0}, ns=NS)),
        create_pod(fake, pod_obj("mixed", containers=[ctr("a", gpumem=1000, gpucores=20), ctr("b", gpumem=1000)],
                                 ns=NS)),
    ]
    # a pod whose GPU containers set their compute limit places, sidecars without GPU included
    limited = create_pod(fake, pod_obj("limited", containers=[ctr("gpu", gpumem=1000, gpucores=20),
                                                              {"name": "sidecar", "image": "busybox"}], ns=NS))
    elsewhere = create_pod(fake, pod_obj("other-ns", limits={"nvidia.com/gpumem": 1000}, ns="team-b"))

    async def go() -> None:
        async with api_extender(fake) as ext:
            for p in unlimited:
                _, res = await ext.post("/filter", filter_args(p, nodes))
                assert not res["NodeNames"], res
                (why,) = reasons(res)
                assert "ResourceQuota compute" in why and "requests.nvidia.com/gpucores" in why, why
                assert "asks no nvidia.com/gpucores" in why and "container " in why, why
                assert set(res["FailedAndUnresolvableNodes"]) == {"n0"}
                # a forged filter answer does not help: bind checks again
                _, b = await ext.post("/bind", bind_args(p, "n0"))
                assert "asks no nvidia.com/gpucores" in b["Error"], b
            assert ext.svc.cache.state.bookings == {}
            # the pod that sets its compute limit, and a namespace without a compute quota, still place
            for p in (limited, elsewhere):
                _, res = await ext.post("/filter", filter_args(p, nodes))
                assert res["NodeNames"] == ["n0"], res
                _, b = await ext.post("/bind", bind_args(p, "n0"))
                assert b["Error"] == "", b
    run(go)


def test_fractional_hard_value_is_held_as_its_whole_part_not_ignored() -> None:
    names = ResourceNames()
    q = quota({"requests.nvidia.com/gpumem": "24000500m", "requests.nvidia.com/gpucores": "0.5",
               "limits.nvidia.com/gpumem": "1e3", "nvidia.com/gpumem": "1Ki"})
    assert sorted(limits_of(q, names), key=lambda x: x.key) == [
        Limit("gpu", "limits.nvidia.com/gpumem", "mib", 1000),
        Limit("gpu", "nvidia.com/gpumem", "mib", 1024),
        Limit("gpu", "requests.nvidia.com/gpucores", "cores", 0),
        Limit("gpu", "requests.nvidia.com/gpumem", "mib", 24000),
    ]


def test_fractional_quota_applies_over_http(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 2, mem=40000))]
    fake.create_object("resourcequotas", quota({"requests.nvidia.com/gpumem": "1500500m"}), namespace=NS)
    p = create_pod(fake, pod_obj("pct", limits={"nvidia.com/gpumem-percentage": 50}, ns=NS))

    async def go() -> None:
        async with api_extender(fake) as ext:
            _, res = await ext.post("/filter", filter_args(p, nodes))
            assert not res["NodeNames"], res
            assert reasons(res) == {"GPU quota exceeded: namespace team-a, ResourceQuota gpu: "
                                    "requests.nvidia.com/gpumem used 0 + asked 20000 > hard 1500"}, res
    run(go)


def test_whole_gpus_held_with_a_tiny_memory_request_count_their_memory(fake: FakeKubeAPI) -> None:
    """``gpumem: 1, gpucores: 100`` is exclusive: the card takes no other pod. Counted as 1 MiB, a
    tenant under a 100000 MiB quota would hold every 40000 MiB GPU of the cluster; counted as the
    whole card's memory it holds two."""
    nodes = [fake.create_object("nodes", node_obj("n0", 4, mem=40000))]
    fake.create_object("resourcequotas", quota({"requests.nvidia.com/gpumem": "100000"}), namespace=NS)
    squat = [create_pod(fake, pod_obj(f"squat-{i}", limits={"nvidia.com/gpumem": 1, "nvidia.com/gpucores": 100},
                                      ns=NS)) for i in range(3)]
    shared = create_pod(fake, pod_obj("shared", limits={"nvidia.com/gpumem": 10000, "nvidia.com/gpucores": 50},
                                      ns=NS))
    victim = create_pod(fake, pod_obj("victim", limits={"nvidia.com/gpumem": 1000}, ns="team-b"))

    async def go() -> None:
        async with api_extender(fake) as ext:
            for p in squat[:2]:
                _, res = await ext.post("/filter", filter_args(p, nodes))
                assert res["NodeNames"] == ["n0"], res
                _, b = await ext.post("/bind", bind_args(p, "n0"))
                assert b["Error"] == "", b
            assert ext.svc.cache.namespace_usage(NS).mib == 80000
            _, res = await ext.post("/filter", filter_args(squat[2], nodes))
            assert reasons(res) == {"GPU quota exceeded: namespace team-a, ResourceQuota gpu: "
                                    "requests.nvidia.com/gpumem used 80000 + asked 40000 > hard 100000"}, res
            _, b = await ext.post("/bind", bind_args(squat[2], "n0"))
            assert "used 80000 + asked 40000 > hard 100000" in b["Error"], b
            # a shared (non-exclusive) request still counts what it books
            _, res = await ext.post("/filter", filter_args(shared, nodes))
            assert res["NodeNames"] == ["n0"], res
            # and the other tenant still finds GPUs
            _, res = await ext.post("/filter", filter_args(victim, nodes))
            assert res["NodeNames"] == ["n0"], res
    run(go)
