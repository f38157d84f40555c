"""A hostile tenant's MIG pod against the chart's webhook registration.

The webhook's MIG isolation rules (``tests/security/test_mig_tenant.py``: a container asking for
``nvidia.com/mig-<profile>`` may not name another MIG device in ``NVIDIA_VISIBLE_DEVICES``, ask the
runtime for more with ``NVIDIA_MIG_CONFIG_DEVICES``, run privileged, nor may a sidecar expose
``all`` GPUs) only defend a pod the API server actually sends to the webhook. The chart's CEL
``matchConditions`` decide that. A pod that asks *only* for a per-profile MIG resource (the whole
point of ``migStrategy: mixed``) must be sent, or every one of those rules is skipped on a real
cluster and the tenant's ``NVIDIA_VISIBLE_DEVICES=all`` reaches the NVIDIA runtime unchecked.

The conditions are evaluated with cel-python the way kube-apiserver hands them over
(``tests/chart/vap.py``, ``tests/chart/test_webhook_admission.py::sent``); the webhook's own decision
on the same pod is played through its admission handler.
"""

from __future__ import annotations

from typing import Any

import pytest

from kube_vgpu.config import Config
from tests.chart.conftest import Renderer, helm, renderer  # noqa: F401 - fixtures used below
from tests.chart.test_render import option_values
from tests.chart.test_webhook_admission import pod, sent, webhook
from tests.e2e.conftest import SKIP_REASON, have_control_plane
from tests.e2e.test_e2e_webhook_config import cluster, env  # noqa: F401 - the e2e test's fixtures
from tests.webhook.wh_helpers import review_of
from webhook.admission import answer

MIG = "nvidia.com/mig-1g.18gb"


def _mig_pod(envs: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    p = pod(limits={MIG: "1"}, **kw)
    c = (p["spec"].get("initContainers") or p["spec"]["containers"])[0]
    if envs:
        c["env"] = [{"name": k, "value": v} for k, v in envs.items()]
    return p


@pytest.mark.parametrize("kwargs", [{}, {"init": True}])
def test_a_mig_only_pod_reaches_the_webhook(renderer: Renderer, kwargs: dict[str, Any]) -> None:  # noqa: F811
    """The tenant asks for nothing but a MIG device (limits or requests, app or init container)."""
    wh = webhook(renderer)
    assert sent(wh, "CREATE", _mig_pod(**kwargs)), "a pod asking only for a MIG profile is not sent to the webhook"
    only_requests = pod(requests={MIG: "1"}, **kwargs)
    assert sent(wh, "CREATE", only_requests)
    # positive control: another vendor's resource that merely looks alike is not ours
    assert not sent(wh, "CREATE", pod(limits={"example.com/mig-1g.18gb": "1"}))


def test_mig_prefix_follows_a_custom_gpu_resource_name(renderer: Renderer) -> None:  # noqa: F811
    values = option_values("custom-resource-names")
    gpu = values["config"]["resourceNames"]["gpu"]
    domain = gpu.rpartition("/")[0]
    wh = webhook(renderer, values)
    assert sent(wh, "CREATE", pod(limits={f"{domain}/mig-2g.35gb": "1"}))


def test_the_mig_pod_that_is_sent_is_denied_for_exposing_every_gpu(renderer: Renderer) -> None:  # noqa: F811
    """End to end of the two halves: sent by the chart's conditions, denied by the webhook's rules."""
    wh = webhook(renderer)
    bad = _mig_pod(envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert sent(wh, "CREATE", bad)
    rev = review_of(bad)
    rev["request"]["namespace"] = "team-a"
    out, _ = answer(rev, Config())
    resp = out["response"]
    assert resp["allowed"] is False and "NVIDIA_VISIBLE_DEVICES" in resp["status"]["message"], resp


@pytest.mark.e2e
def test_real_api_server_sends_a_mig_pod_and_the_webhook_denies_it(request: pytest.FixtureRequest) -> None:
    """On a real kube-apiserver with the chart's MutatingWebhookConfiguration (the fixtures of
    tests/e2e/test_e2e_webhook_config.py): a tenant's pod asking only for a MIG profile, with
    ``NVIDIA_VISIBLE_DEVICES=all``, reaches the webhook and is refused; a clean one is admitted."""
    if not have_control_plane():
        pytest.skip(SKIP_REASON)
    from tests.e2e import test_e2e_webhook_config as wc

    e = request.getfixturevalue("env")
    tenant, port = e["tenant"], e["port"]
    bad = wc._pod("mig-all", limits={MIG: "1"}, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    with wc.Reviews(port) as seen:
        msg = wc._refused(tenant.create_namespaced_pod, wc.TENANT_NS, bad)
    assert seen.n == 1 and "NVIDIA_VISIBLE_DEVICES" in msg and wc.WEBHOOK_NAME in msg, (seen.n, msg)
    with wc.Reviews(port) as seen:
        got = tenant.create_namespaced_pod(wc.TENANT_NS, wc._pod("mig-ok", limits={MIG: "1"}))
    assert seen.n == 1 and got.metadata.name == "mig-ok", seen.n
