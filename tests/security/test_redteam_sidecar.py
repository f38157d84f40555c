"""Red team: a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29)
asks for GPU memory beside the app containers.

kube-vgpu books init containers as running one at a time: per GPU the larger of the biggest init
container and the sum of the app containers. A sidecar is not like that: it starts before the app
containers and keeps running beside them (and beside the init containers after it). A pod with a
20000 MiB sidecar and a 20000 MiB app container on one 24576 MiB GPU would be booked 20000 MiB and
use 40000 MiB, each container held only to its own limit: the neighbours on that GPU run out of
memory. Until sidecars are booked as running containers, a sidecar may not ask for a vGPU resource:
the webhook refuses the pod at CREATE (400 naming the sidecar, the resource, the value and where to
put the request), and the extender, which never trusts that the webhook ran, refuses it at filter and
at bind. A sidecar without GPU resources, and plain init containers with them, are unaffected.
"""

from __future__ import annotations

from typing import Any

import pytest
from bind_support import bind_args, node_obj, pod_obj
from vgpu_sched_util import api_extender, ctr, filter_args, run

from kube_vgpu.config import Config
from kube_vgpu.errors import RequestError
from kube_vgpu.podspec import parse_pod
from tests.fakeapi import FakeKubeAPI
from webhook.admission import answer

GPU_MIB = 24576


def sidecar(name: str, **limits: Any) -> dict[str, Any]:
    c = ctr(name, **limits)
    c["restartPolicy"] = "Always"
    return c


def attack_pod(name: str = "squeeze") -> dict[str, Any]:
    return pod_obj(name, containers=[ctr("app", gpumem=20000)], init=[sidecar("helper", gpumem=20000)])


def review(pod: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": pod["metadata"]["namespace"], "operation": "CREATE",
                        "userInfo": {"username": "tenant"}, "object": pod}}
    resp, _ = answer(body, Config())
    return resp["response"]


def test_parse_refuses_a_gpu_sidecar_naming_it() -> None:
    with pytest.raises(RequestError) as e:
        parse_pod(attack_pod(), Config())
    msg = str(e.value)
    assert "sidecar container 'helper'" in msg and "nvidia.com/gpumem='20000'" in msg, msg
    assert "restartPolicy: Always" in msg and "spec.containers" in msg, msg
    # a GPU-less sidecar and a GPU init container (one at a time) are fine
    ok = pod_obj("ok", containers=[ctr("app", gpumem=20000)],
                 init=[{"name": "mesh", "image": "busybox", "restartPolicy": "Always"}, ctr("warm", gpumem=20000)])
    req = parse_pod(ok, Config())
    assert [c.name for c in req.init] == ["warm"] and [c.name for c in req.app] == ["app"]


def test_webhook_refuses_a_gpu_sidecar_at_create() -> None:
    r = review(attack_pod())
    assert r["allowed"] is False and r["status"]["code"] == 400, r
    assert "sidecar container 'helper'" in r["status"]["message"], r


def test_extender_refuses_a_gpu_sidecar_at_filter_and_bind(fake: FakeKubeAPI) -> None:
    nodes = [fake.create_object("nodes", node_obj("n0", 1, mem=GPU_MIB))]
    p = attack_pod()
    p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
    p = fake.create_object("pods", p, namespace=p["metadata"]["namespace"])

    async def go() -> None:
        async with api_extender(fake) as ext:
            _, res = await ext.post("/filter", filter_args(p, nodes))
            assert not res["NodeNames"], res
            assert all("sidecar container 'helper'" in why for why in res["FailedAndUnresolvableNodes"].values()), res
            _, b = await ext.post("/bind", bind_args(p, "n0"))
            assert "sidecar container 'helper'" in b["Error"], b
            assert ext.svc.cache.state.bookings == {}
            assert not (fake.get_object("pods", p["metadata"]["name"], p["metadata"]["namespace"])
                        .get("spec") or {}).get("nodeName")
    run(go)
