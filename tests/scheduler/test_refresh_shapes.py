"""The extender's FGD shape refresh: every node policy the registry marks ``needs_shapes``
(fgd and fgd-bestfit) gets the live workload's shapes; the others keep none."""

from __future__ import annotations

import pytest
from vgpu_sched_util import node_obj, offline_service

from kube_vgpu.config import Config, Scheduling
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.placement.liveshapes import default_shapes, shapes_from_state
from kube_vgpu.policyregistry import NODE_POLICY_SPECS


def _booked_service(node_policy: str):  # type: ignore[no-untyped-def]
    svc = offline_service([node_obj("n1", 4, mem=40000)])
    st = svc.cache.state
    for i in range(30):
        a = PodAllocation("n1", (ContainerAllocation("c", False, (
            DeviceBooking(f"GPU-n1-0{i % 4}", 10000 if i % 3 else 20000, 0),)),))
        st.book(f"default/p{i}", a, check=False)
    svc.cache.apply_config(Config(scheduling=Scheduling(node_policy=node_policy)))
    return svc


def test_fgd_bestfit_refreshes_its_shapes_from_the_bookings() -> None:
    svc = _booked_service("fgd-bestfit")
    live = shapes_from_state(svc.cache.state)
    assert live != default_shapes()  # 30 bookings: the live mix, not the default
    assert svc.cache.engine.shapes == default_shapes()
    assert svc.refresh_shapes()
    assert svc.cache.engine.node_policy == "fgd-bestfit" and svc.cache.engine.shapes == live
    assert not svc.refresh_shapes()  # unchanged workload: no reconfiguration


@pytest.mark.parametrize("spec", NODE_POLICY_SPECS, ids=lambda s: s.name)
def test_refresh_follows_the_registry(spec) -> None:  # type: ignore[no-untyped-def]
    svc = _booked_service(spec.name)
    assert svc.refresh_shapes() is spec.needs_shapes
    if spec.needs_shapes:
        assert svc.cache.engine.shapes == shapes_from_state(svc.cache.state)
