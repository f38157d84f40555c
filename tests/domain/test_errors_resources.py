"""kube_vgpu.errors and kube_vgpu.resources: error shapes and the HAMi-compatible names."""

from __future__ import annotations

import pytest

from kube_vgpu import resources as r
from kube_vgpu.errors import CodecError, ConfigError, QuantityError, RequestError, VGPUError


@pytest.mark.parametrize("cls", [QuantityError, RequestError, CodecError, ConfigError])
def test_hierarchy(cls: type) -> None:
    assert issubclass(cls, VGPUError)
    assert issubclass(cls, ValueError)


def test_request_error_fields_and_message() -> None:
    e = RequestError("main", "nvidia.com/gpumem", "-1", "a whole number of MiB >= 1")
    assert (e.container, e.resource, e.value, e.allowed, e.kind) == (
        "main", "nvidia.com/gpumem", "-1", "a whole number of MiB >= 1", "container")
    assert str(e) == "container 'main': nvidia.com/gpumem='-1' is invalid; allowed: a whole number of MiB >= 1"
    e2 = RequestError("setup", "nvidia.com/gpu", 1.5, "x", "init container")
    assert str(e2).startswith("init container 'setup': nvidia.com/gpu=1.5 is invalid")


def test_hami_default_names() -> None:
    n = r.ResourceNames()
    assert n.all() == ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage",
                       "nvidia.com/gpucores", "nvidia.com/priority")
    assert n.share_names() == ("nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")
    custom = r.ResourceNames(gpumem="example.com/vmem")
    assert custom.all()[1] == "example.com/vmem"
    assert custom.share_names()[0] == "example.com/vmem"


def test_annotation_keys() -> None:
    assert r.ANN_USE_GPUTYPE == "nvidia.com/use-gputype"
    assert r.ANN_NOUSE_GPUTYPE == "nvidia.com/nouse-gputype"
    assert r.ANN_USE_GPUUUID == "nvidia.com/use-gpuuuid"
    assert r.ANN_NOUSE_GPUUUID == "nvidia.com/nouse-gpuuuid"
    assert r.ANN_NODE_POLICY == "kube-vgpu.io/node-scheduler-policy"
    assert r.HAMI_ANN_NODE_POLICY == "hami.io/node-scheduler-policy"
    assert r.ANN_GPU_POLICY == "kube-vgpu.io/gpu-scheduler-policy"
    assert r.HAMI_ANN_GPU_POLICY == "hami.io/gpu-scheduler-policy"
    assert r.ANN_ALLOCATION == "kube-vgpu.io/allocation"
    assert r.ANN_NODE_INVENTORY == "kube-vgpu.io/node-inventory"
    assert (r.BIND_ALLOCATING, r.BIND_SUCCESS, r.BIND_FAILED) == ("allocating", "success", "failed")
