"""kube_vgpu.placement.render: every failure code has its text, and details only add to it."""

from __future__ import annotations

import pytest

from kube_vgpu.placement.render import detail, summary
from kube_vgpu.placement.status import Code, FitFailure


@pytest.mark.parametrize("code", list(Code))
def test_every_code_has_a_summary_and_a_detail_that_extends_it(code: Code) -> None:
    f = FitFailure(code=code, container="main", count=2, need=7, have=3, gpu=0, detail="nvidia.com/gpu")
    text = summary(f)
    assert text and text != code.value
    assert detail(f).startswith(text)


def test_detail_names_the_gpu_it_measured() -> None:
    f = FitFailure(code=Code.INSUFFICIENT_MEMORY, container="main", count=1, need=8000, have=5000, gpu=2)
    assert summary(f) == "insufficient GPU memory: container main needs 8000 MiB on one GPU"
    assert detail(f) == f"{summary(f)}; largest free is 5000 MiB on the node's GPU #2"
