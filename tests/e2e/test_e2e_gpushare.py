"""End to end: a pod written for Alibaba's gpushare runs on kube-vgpu with a hard memory limit.

The pod is the template of gpushare's user guide (gpushare-scheduler-extender docs/userguide.md,
``binpack-1``: ``aliyun.com/gpu-mem: 3``, GiB), resources and container unchanged (the quantity
sent as the string "3": the Python client accepts only strings, the API server reads both alike);
the test adds only a nodeSelector so that it lands on the node served by the real device plugin. A second
``kube-vgpu webhook`` with ``compat.gpushare: true`` takes over the suite's webhook registration
for the duration of the test (the session's webhook runs the shared policy without the key). Then
the real kube-apiserver admits the translated pod, kube-scheduler and our extender bind it, the
device plugin allocates it over the fake kubelet's gRPC and writes the limits file: 3072 MiB.
"""

from __future__ import annotations

from typing import Any

import pytest

from .cluster import SCHEDULER_NAME, Proc, _https_ok, free_port, kube_vgpu, policy_yaml, wait_for
from .conftest import DP_NODE

pytestmark = pytest.mark.e2e


def readme_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "binpack-1"}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": DP_NODE},
                     "containers": [{"name": "binpack-1", "image": "cheyang/gpu-player:v2",
                                     "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}]}}


def test_gpushare_readme_pod_gets_a_hard_memory_limit(env: dict[str, Any]) -> None:
    from kubernetes import client

    core, ns, comps = env["core"], env["ns"], env["comps"]
    adm = client.AdmissionregistrationV1Api(env["api"])
    policy = comps.dir / "policy-gpushare.yaml"
    policy.write_text(policy_yaml() + "compat: {gpushare: true}\n")
    port = free_port()
    certs = comps.dir / "webhook-certs"
    proc = Proc("webhook-gpushare", kube_vgpu(
        "webhook", "--config", str(policy), "--bind-address", "127.0.0.1", "--port", str(port),
        "--tls-cert-file", str(certs / "tls.crt"), "--tls-key-file", str(certs / "tls.key")), comps.dir)
    name = f"kube-vgpu-e2e-{ns}"
    original = comps.webhook_configuration(ns)["webhooks"][0]["clientConfig"]["url"]

    def point_to(url: str) -> None:
        cfg = adm.read_mutating_webhook_configuration(name)
        assert cfg.webhooks, name
        cfg.webhooks[0].client_config.url = url
        adm.replace_mutating_webhook_configuration(name, cfg)

    def translated() -> bool:  # which webhook the API server calls now
        dry = core.create_namespaced_pod(ns, readme_pod("probe"), dry_run="All")
        return "nvidia.com/gpumem" in (dry.spec.containers[0].resources.limits or {})

    try:
        def ready() -> bool:
            proc.check()
            return _https_ok(f"https://127.0.0.1:{port}/readyz")

        wait_for(ready, 30, "gpushare webhook /readyz")
        point_to(f"https://127.0.0.1:{port}/mutate")
        wait_for(translated, 60, "the gpushare webhook in effect")
        created = core.create_namespaced_pod(ns, readme_pod("binpack-1-0"))
        lim = created.spec.containers[0].resources.limits
        assert created.spec.scheduler_name == SCHEDULER_NAME
        assert "aliyun.com/gpu-mem" not in lim and lim["nvidia.com/gpu"] == "1" and lim["nvidia.com/gpumem"] == "3072", lim
        wait_for(lambda: core.read_namespaced_pod("binpack-1-0", ns).status.phase == "Running", 90,
                 "the gpushare pod admitted by the fake kubelet and Running")
        a = env["kubelet"].admitted["binpack-1-0"]["binpack-1"]
        assert a.started and a.error is None, a.error
        assert a.limits is not None and a.limits.get("memory_mib_0") == "3072", a.limits
        print(f"\nE2E gpushare: user guide pod aliyun.com/gpu-mem=3 admitted as nvidia.com/gpumem=3072, bound to "
              f"{DP_NODE}, limits file memory_mib_0=3072")
    finally:
        point_to(original)
        wait_for(lambda: not translated(), 60, "the suite's webhook back in effect")
        proc.stop()
