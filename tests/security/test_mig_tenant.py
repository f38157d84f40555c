# ruff: noqa: F811 - fixtures imported from other test modules are parameters here
"""A hostile tenant against MIG (docs/mig.md): it cannot get a bigger MIG device or another tenant's by
writing env, annotations or its container spec.

* webhook, over real HTTPS: a container asking for ``nvidia.com/mig-<profile>`` is a GPU container of
  an *ours* pod, so the isolation rules apply to it as to a vGPU container: ``NVIDIA_VISIBLE_DEVICES``
  naming another MIG device (value or ``valueFrom``), ``NVIDIA_MIG_CONFIG_DEVICES``, privileged, and a
  sidecar exposing GPUs are denied; a plain MIG pod is allowed and its MIG container is never given
  ``NVIDIA_VISIBLE_DEVICES=none`` (its device plugin's value must stand);
* device plugin, ``migStrategy: single`` (real gRPC, fake kubelet, fake NVML): a container put on
  another tenant's MIG device, or a pod carrying a MIG booking the scheduler never signed, does not
  start; ``mixed``: Allocate of one profile's resource never hands out a device of another (bigger)
  profile (tests/deviceplugin/test_dp_mig.py::test_strategy_mixed_registers_one_resource_per_profile).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_DP_TESTS = str(Path(__file__).resolve().parents[1] / "deviceplugin")
if _DP_TESTS not in sys.path:  # the device plugin tests' helpers and fixtures (fake kubelet, fake NVML)
    sys.path.insert(0, _DP_TESTS)

from dp_helpers import FakeGPUs, FakeKubelet, bound_pod, create_signed  # noqa: E402

from kube_vgpu.resources import ANN_ALLOCATION  # noqa: E402
from tests.deviceplugin.conftest import fake_nvml_lib, gpus, kube_api, kubelet, sockdir  # noqa: E402,F401
from tests.deviceplugin.test_dp_mig import _partition, _plugin, migstate  # noqa: E402,F401
from tests.security.test_webhook_isolation import (  # noqa: E402,F401
    allowed,
    client,
    create,
    denied,
    patch_of,
    tls,
)
from tests.webhook.wh_helpers import Client, base_pod  # noqa: E402

OTHER = "MIG-6d160002-0000-4002-8000-0000f1bbcdcc"


def mig_pod(**ctr: Any) -> dict[str, Any]:
    """A tenant's pod: container 'infer' asking for one 1g.18gb MIG device."""
    pod = base_pod({"limits": {"nvidia.com/mig-1g.18gb": "1"}})
    pod["metadata"]["namespace"] = "team-a"
    pod["spec"]["containers"][0].update(name="infer", **ctr)
    return pod


def test_mig_container_cannot_name_another_mig_device(client: Client) -> None:
    denied(create(client, mig_pod(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": OTHER}])),
           "container 'infer'", "NVIDIA_VISIBLE_DEVICES", OTHER)
    denied(create(client, mig_pod(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {
        "configMapKeyRef": {"name": "devs", "key": "uuid"}}}])), "container 'infer'", "NVIDIA_VISIBLE_DEVICES")
    denied(create(client, mig_pod(env=[{"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"}])),
           "container 'infer'", "NVIDIA_MIG_CONFIG_DEVICES")
    denied(create(client, mig_pod(securityContext={"privileged": True})), "container 'infer'", "privileged")


def test_sidecar_of_a_mig_pod_cannot_expose_gpus(client: Client) -> None:
    pod = mig_pod()
    pod["spec"]["containers"].append({"name": "helper", "image": "nvidia/cuda",
                                      "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})
    denied(create(client, pod), "container 'helper'", "NVIDIA_VISIBLE_DEVICES")


def test_plain_mig_pod_is_allowed_and_keeps_its_devices(client: Client) -> None:
    resp = allowed(create(client, mig_pod()))
    ops = patch_of(resp) if resp.get("patch") else []
    assert not any(op.get("path", "").startswith(("/spec/containers/0/env", "/spec/schedulerName")) for op in ops)
    # beside a vGPU container, the MIG container is not given NVIDIA_VISIBLE_DEVICES=none; a plain one is
    pod = mig_pod()
    pod["spec"]["containers"] += [
        {"name": "train", "image": "busybox", "resources": {"limits": {"nvidia.com/gpumem": "4000"}}},
        {"name": "log", "image": "busybox"}]
    ops = patch_of(allowed(create(client, pod)))
    none_for = [op["path"] for op in ops if op.get("value") == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}
                or op.get("value") == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]]
    assert none_for and all(p.startswith("/spec/containers/2/") for p in none_for), ops


def test_forged_mig_annotation_is_stripped(client: Client) -> None:
    pod = mig_pod()
    pod["metadata"]["annotations"] = {ANN_ALLOCATION: '{"v":1,"node":"n","ctrs":[]}'}
    ops = patch_of(allowed(create(client, pod)))
    assert {"op": "remove", "path": "/metadata/annotations/kube-vgpu.io~1allocation"} in ops


def test_single_container_on_another_tenants_mig_device_does_not_start(
        gpus: FakeGPUs, migstate: Path, kubelet: FakeKubelet, kube_api: Any, sockdir: str, tmp_path: Path) -> None:
    _, migs = _partition(gpus, [("1g.18gb", 0), ("1g.18gb", 6)])
    p = _plugin(kube_api, sockdir, kubelet, tmp_path, "single")
    p.start()
    try:
        kubelet.wait(lambda k: k.updates > 0, what="ListAndWatch")
        assert p.wait_pods_synced(10)
        create_signed(kube_api, bound_pod("victim", [("c", False, [(migs[0], 18432, 100)], {})], bind_time=100))
        create_signed(kube_api, bound_pod("tenant", [("c", False, [(migs[1], 18432, 100)], {})], bind_time=101))
        (v,) = kubelet.admit("victim", [("c", 1)])
        assert v.started and dict(v.envs)["NVIDIA_VISIBLE_DEVICES"] == migs[0]
        # the tenant's container is handed the victim's MIG device: it must not start
        (a,) = kubelet.admit("tenant", [("c", [f"{migs[0]}::0"])])
        assert not a.started and a.error is not None and "tenant" in a.error, a.error
        assert a.limits is None or a.limits.get("state") == "pending"
        # a pod that carries a MIG booking nobody signed gets nothing either
        forged = bound_pod("forged", [("c", False, [(migs[1], 18432, 100)], {})], bind_time=102)
        kube_api.create_object("pods", forged)
        (f,) = kubelet.admit("forged", [("c", [f"{migs[1]}::0"])])
        assert not f.started and f.error is not None and "forged" in f.error, f.error
    finally:
        p.stop()
