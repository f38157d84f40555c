"""The chart sends gpushare pods to the webhook only with ``config.compat.gpushare: true``.

The MutatingWebhookConfiguration's CEL ``matchConditions`` decide which pod CREATEs reach the
webhook; with the compat key on they must include the gpushare resource names the webhook
translates (``webhook.compat.GPUSHARE_NAMES``), or gpushare pods would be created untranslated. The
expressions are evaluated with cel-python the way kube-apiserver hands the request over (see
tests/chart/test_webhook_admission.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chart.conftest import Renderer, _load_get_helm
from tests.chart.test_webhook_admission import pod, sent, webhook
from webhook.compat import GPUSHARE_NAMES


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Renderer]:
    try:
        helm = Path(_load_get_helm().get_helm())
    except Exception as e:  # no network and no cached helm: like tests/chart
        pytest.skip(f"helm unavailable: {e}")
    yield Renderer(helm, tmp_path_factory.mktemp("helm"))


@pytest.mark.parametrize("name", GPUSHARE_NAMES)
def test_gpushare_pods_are_sent_only_with_the_compat_key(renderer: Renderer, name: str) -> None:
    off, on = webhook(renderer), webhook(renderer, {"config": {"compat": {"gpushare": True}}})
    for where in ("limits", "requests"):
        for init in (False, True):
            p = pod(**{where: {name: "1"}}, init=init)  # type: ignore[arg-type]
            assert not sent(off, "CREATE", p), (where, init)
            assert sent(on, "CREATE", p), (where, init)
    plain = pod(limits={"cpu": "1"})
    assert not sent(on, "CREATE", plain)  # a plain pod is still not sent
    assert sent(on, "CREATE", pod(limits={"nvidia.com/gpumem": "3000"}))
