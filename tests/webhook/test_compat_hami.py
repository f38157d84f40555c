"""HAMi scheduler-name aliases (``compat.schedulerAliases``) over real HTTPS.

Pods written for HAMi name ``schedulerName: hami-scheduler``. Off by default such a pod is another
scheduler's (``webhook.foreignSchedulers``: left alone, or denied). With the alias the webhook treats
it as ours: it rewrites ``spec.schedulerName`` to our scheduler, which the extender's bind check
requires (a pod is bound only when its schedulerName is ours after admission), and every isolation
rule applies as to any vGPU pod.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from wh_helpers import Client, base_pod, decode_patch, limits, review_of

from certs import pki, store
from kube_vgpu.config import config_from_dict
from kube_vgpu.errors import ConfigError
from webhook.server import BackgroundServer, WebhookServer

ALIAS = {"compat": {"schedulerAliases": ["hami-scheduler"]}}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    store.write_files(d, pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-vgpu"), ["127.0.0.1"]))
    return d


def _serve(tls: Path, raw: dict[str, Any]) -> Iterator[Client]:
    srv = WebhookServer(config_from_dict(raw), str(tls / "tls.crt"), str(tls / "tls.key"), host="127.0.0.1", port=0)
    with BackgroundServer(srv) as bg:
        c = Client(bg.port, tls / "ca.crt")
        yield c
        c.close()


@pytest.fixture(scope="module")
def aliased(tls: Path) -> Iterator[Client]:
    yield from _serve(tls, ALIAS)


@pytest.fixture(scope="module")
def deny_foreign(tls: Path) -> Iterator[Client]:
    yield from _serve(tls, {"webhook": {"foreignSchedulers": "deny"}})


def hami_pod(**spec: Any) -> dict[str, Any]:
    """HAMi's own example: 1 GPU, 3000 MiB, 30 cores, schedulerName hami-scheduler."""
    return base_pod(limits(gpu="1", gpumem="3000", cores="30"), schedulerName="hami-scheduler", **spec)


def test_alias_is_rewritten_to_our_scheduler(aliased: Client) -> None:
    pod = hami_pod()
    r = aliased.review(review_of(copy.deepcopy(pod)))["response"]
    assert r["allowed"], r
    out = jsonpatch.apply_patch(pod, decode_patch({"response": r}))
    assert out["spec"]["schedulerName"] == "kube-vgpu-scheduler"
    again = aliased.review(review_of(out))["response"]
    assert again["allowed"] and "patch" not in again


def test_without_the_alias_hami_pods_stay_foreign(deny_foreign: Client, tls: Path) -> None:
    r = deny_foreign.review(review_of(hami_pod()))["response"]
    assert not r["allowed"]
    assert "spec.schedulerName='hami-scheduler' is not allowed" in r["status"]["message"]
    assert "compat.schedulerAliases (none)" in r["status"]["message"]
    for client in _serve(tls, {}):  # default foreignSchedulers: leave -> untouched
        r = client.review(review_of(hami_pod()))["response"]
        assert r["allowed"] and "patch" not in r


def test_an_aliased_pod_is_isolated_like_any_vgpu_pod(aliased: Client) -> None:
    pod = hami_pod(hostPID=True)
    r = aliased.review(review_of(pod))["response"]
    assert not r["allowed"] and r["status"]["code"] == 403 and "spec.hostPID" in r["status"]["message"]
    pod = hami_pod()
    pod["spec"]["containers"][0]["env"] = [{"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"}]
    r = aliased.review(review_of(pod))["response"]
    assert not r["allowed"] and "container 'c': env CUDA_DEVICE_SM_LIMIT" in r["status"]["message"]


def test_other_foreign_schedulers_are_unaffected(aliased: Client) -> None:
    pod = base_pod(limits(gpumem="3000"), schedulerName="volcano")
    r = aliased.review(review_of(pod))["response"]
    assert r["allowed"] and "patch" not in r


def test_alias_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"compat.schedulerAliases.*'Hami_Scheduler' is not allowed; allowed: "
                                          r"a scheduler name: a DNS subdomain"):
        config_from_dict({"compat": {"schedulerAliases": ["Hami_Scheduler"]}})
    with pytest.raises(ConfigError, match=r"compat.schedulerAliases"):
        config_from_dict({"compat": {"schedulerAliases": "hami-scheduler"}})
