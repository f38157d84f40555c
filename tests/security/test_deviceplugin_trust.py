# ruff: noqa: F811 - fixtures imported from the device plugin tests are parameters here
"""What the device plugin trusts, under a hostile tenant. Each attack is played over the real
protocols: the real extender binds over HTTP and signs, the real device plugin answers the fake
kubelet over v1beta1 gRPC (Allocate, then PreStartContainer with kubelet's PodResources API naming the
pod; NVML from the fake libnvidia-ml), both against the in-process fake kube-apiserver over HTTP.

PreStartContainer writes limits only for a pod bound to its node whose allocation record the extender
signed (uid, node, bind time, exact record); anything else is refused with a message naming the pod
and the reason (the container does not start and keeps the fail-closed placeholder), and never gets
another pod's limits. Progress (bind-phase, allocated-containers) counts only when the plugin's own
progress signature verifies, else its in-memory record."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

_DP_TESTS = str(Path(__file__).resolve().parents[1] / "deviceplugin")
if _DP_TESTS not in sys.path:  # the device plugin tests' helpers and fixtures (fake kubelet, fake NVML)
    sys.path.insert(0, _DP_TESTS)

from bind_support import bind, create_pod, extender  # noqa: E402
from dp_helpers import KEYS, NODE, FakeKubelet, bound_pod  # noqa: E402
from vgpu_sched_util import Extender, pod_obj, run  # noqa: E402
from vgpu_sched_util import wait_until as _wait_until  # noqa: E402

from deviceplugin.podmatch import (  # noqa: E402
    MatchError,
    Progress,
    check_assignment,
    identified,
    pending_containers,
    preferred_allocation,
    trusted_view,
)
from deviceplugin.server import DevicePlugin  # noqa: E402
from kube_vgpu.codec import encode_allocation  # noqa: E402
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation  # noqa: E402
from kube_vgpu.resources import (  # noqa: E402
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    BIND_SUCCESS,
    LABEL_NODE,
)
from kube_vgpu.signing import sign_allocation, sign_progress, verify_progress  # noqa: E402
from tests.deviceplugin.conftest import fake_nvml_lib, gpus, kube_api, kubelet, sockdir  # noqa: E402,F401
from tests.deviceplugin.test_dp_daemon import U, _wait_seen, start_plugin  # noqa: E402,F401
from tests.fakeapi import FakeKubeAPI  # noqa: E402


async def eventually(cond: Callable[[], bool]) -> None:
    """Wait for ``cond`` (background work of the components; a generous bound for a loaded machine)."""
    await _wait_until(cond, timeout=60)


Start = Callable[..., DevicePlugin]


@pytest.fixture
def cluster(start_plugin: Start, kube_api: FakeKubeAPI) -> Iterator[DevicePlugin]:
    """The device plugin of node ``gpu-node-1`` (two GPUs, 4 slots each), its node schedulable for
    the extender (inventory from the plugin, allocatable slots as kubelet would report them)."""
    plugin = start_plugin()
    kube_api.patch_object("nodes", NODE, {"status": {"capacity": {"nvidia.com/gpu": "8"},
                                                     "allocatable": {"nvidia.com/gpu": "8"}}},
                          subresource="status")
    yield plugin


async def _ready(ext: Extender) -> None:
    await eventually(lambda: NODE in ext.svc.cache.state.nodes and NODE not in ext.svc.cache.unavailable)


def _pod(name: str, mem: int, cores: int = 0) -> dict[str, Any]:
    return pod_obj(name, limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": cores})


async def _admit(kubelet: FakeKubelet, pod: str, n: int = 1) -> dict[str, str]:
    """kubelet admits and starts ``pod`` (one container ``c`` of ``n`` GPUs): the limits file the
    container sees (PreStartContainer succeeded)."""
    (a,) = await asyncio.to_thread(kubelet.admit, pod, [("c", n)])
    assert a.started and a.error is None, a.error
    assert a.limits is not None and "state" not in a.limits, a.limits
    return a.limits


async def _refused(kubelet: FakeKubelet, pod: str) -> str:
    """kubelet admits ``pod``; PreStartContainer refuses it: the message. The container keeps the
    fail-closed placeholder (no limits of anyone's)."""
    (a,) = await asyncio.to_thread(kubelet.admit, pod, [("c", 1)])
    assert not a.started and a.code == grpc.StatusCode.FAILED_PRECONDITION, a
    assert a.limits is not None and a.limits.get("state") == "pending" and "memory_mib_0" not in a.limits
    return str(a.error)


def _ann(fake: FakeKubeAPI, name: str) -> dict[str, str]:
    return dict(fake.get_object("pods", name, "default")["metadata"].get("annotations") or {})


def _booked(ext: Extender) -> dict[str, int]:
    return {k: sum(m for m, _, _ in b.allocation.usage().values()) for k, b in ext.svc.cache.state.bookings.items()}


def _squatter(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    """A tenant's pod with a preset spec.nodeName (no scheduler places it), labelled as ours."""
    p = _pod(name, 1000)
    p["spec"]["nodeName"] = NODE
    p["spec"]["schedulerName"] = "default-scheduler"
    p["metadata"]["labels"] = {LABEL_NODE: NODE}
    p["metadata"]["annotations"] = annotations
    return p


def test_tenant_edit_to_24000_mib_after_bind_is_refused(cluster: DevicePlugin, kubelet: FakeKubelet,
                                                        kube_api: FakeKubeAPI) -> None:
    """The reported attack: the tenant raises its bound pod's allocation to 24000 MiB (and 100 %
    cores) before kubelet admits it. The record no longer verifies: Allocate refuses the pod (never
    24000m), naming it; the extender still books the 1000 MiB it signed."""
    fake = kube_api
    t = create_pod(fake, _pod("t", 1000, 10))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            assert await bind(ext, t, NODE) == ""
            rec = _ann(fake, "t")[ANN_ALLOCATION]
            uuid = rec.split('"uuid":"', 1)[1].split('"', 1)[0]
            edited = encode_allocation(PodAllocation(NODE, (ContainerAllocation("c", False, (
                DeviceBooking(uuid, 24000, 100),)),), 1.0))
            fake.patch_object("pods", "t", {"metadata": {"annotations": {ANN_ALLOCATION: edited}}}, "default")
            await asyncio.to_thread(_wait_seen, cluster, fake, "t")
            why = await _refused(kubelet, "t")
            assert "default/t" in why and "allocation signature invalid" in why and "24000" not in why
            assert _booked(ext) == {"default/t": 1000}
            assert ANN_ALLOCATED_CONTAINERS not in _ann(fake, "t")
    run(go, 60)


def test_preset_node_name_with_a_forged_record_is_refused_and_takes_nothing(cluster: DevicePlugin,
                                                                            kubelet: FakeKubelet,
                                                                            kube_api: FakeKubeAPI) -> None:
    """A pod the scheduler never placed (spec.nodeName preset) with a hand-written record for a
    whole GPU: Allocate refuses it naming the pod and the reason (the extender books nothing for
    it); a legitimate pod bound after it then gets exactly its own limits."""
    fake = kube_api
    forged = encode_allocation(PodAllocation(NODE, (ContainerAllocation("c", False, (
        DeviceBooking(U[0], 24576, 100),)),), 1.0))
    create_pod(fake, _squatter("squat", {ANN_ALLOCATION: forged, ANN_BIND_PHASE: BIND_ALLOCATING,
                                         ANN_BIND_TIME: "1"}))
    legit = create_pod(fake, _pod("legit", 3000, 30))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            await asyncio.to_thread(_wait_seen, cluster, fake, "squat")
            assert await bind(ext, legit, NODE) == ""
            await asyncio.to_thread(_wait_seen, cluster, fake, "legit")
            why = await _refused(kubelet, "squat")  # kubelet admits squat first (it was bound first)
            assert "pod default/squat container c: allocation signature missing" in why
            assert "did not place this pod on this node" in why
            fake.set_pod_phase("squat", "Failed", reason="UnexpectedAdmissionError")
            kubelet.remove("squat")
            lim = await _admit(kubelet, "legit")
            assert (lim["memory_mib_0"], lim["cores_0"]) == ("3000", "30")
            assert _booked(ext) == {"default/legit": 3000}
    run(go, 60)


def test_tenant_written_success_does_not_take_another_pods_limits(cluster: DevicePlugin, kubelet: FakeKubelet,
                                                                  kube_api: FakeKubeAPI) -> None:
    """The reported attack: the tenant writes ``bind-phase: success`` and its container in
    ``allocated-containers`` on its own just-bound pod, so that its container would be matched to
    the next pending pod (a victim with 5000 MiB). Unsigned progress does not count: the tenant's
    pod stays pending and gets its own 1000 MiB; the victim then gets its 5000 MiB."""
    fake = kube_api
    t = create_pod(fake, _pod("tenant", 1000, 10))
    v = create_pod(fake, _pod("victim", 5000, 50))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            assert await bind(ext, t, NODE) == ""
            await asyncio.to_thread(_wait_seen, cluster, fake, "tenant")
            assert await bind(ext, v, NODE) == ""
            await asyncio.to_thread(_wait_seen, cluster, fake, "victim")
            for forged in ({ANN_BIND_PHASE: BIND_SUCCESS, ANN_ALLOCATED_CONTAINERS: "c"},
                           {ANN_PROGRESS_SIGNATURE: "v1:test-1:" + "A" * 43}):
                fake.patch_object("pods", "tenant", {"metadata": {"annotations": forged}}, "default")
            lim = await _admit(kubelet, "tenant")  # kubelet admits the tenant's pod (bound first)
            assert (lim["memory_mib_0"], lim["cores_0"]) == ("1000", "10")
            lim = await _admit(kubelet, "victim")
            assert (lim["memory_mib_0"], lim["cores_0"]) == ("5000", "50")
            for name in ("tenant", "victim"):  # what the plugin wrote is signed, and the extender trusts it
                ann = _ann(fake, name)
                assert ann[ANN_BIND_PHASE] == BIND_SUCCESS and ann[ANN_ALLOCATED_CONTAINERS] == "c"
                assert verify_progress(KEYS, ann[ANN_PROGRESS_SIGNATURE], fake.get_object(
                    "pods", name, "default")["metadata"]["uid"], ann[ANN_ALLOCATION_SIGNATURE], BIND_SUCCESS, "c")
    run(go, 60)


def test_replaying_a_victims_signed_record_on_a_preset_node_pod_is_refused(cluster: DevicePlugin,
                                                                           kubelet: FakeKubelet,
                                                                           kube_api: FakeKubeAPI) -> None:
    """The tenant copies a victim's valid record, signature and bind-time onto its own pod with a
    preset spec.nodeName, bound before the victim is admitted: the signature binds the victim's uid,
    so the copy is refused (naming the tenant's pod) and never takes the victim's GPUs; the victim
    gets its own limits."""
    fake = kube_api
    v = create_pod(fake, _pod("victim", 5000, 50))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            assert await bind(ext, v, NODE) == ""
            ann = _ann(fake, "victim")
            create_pod(fake, _squatter("copy", {k: ann[k] for k in (ANN_ALLOCATION, ANN_ALLOCATION_SIGNATURE,
                                                                    ANN_BIND_TIME, ANN_BIND_PHASE)}))
            # the copy is seen before the victim (the plugin started listing after the victim's bind)
            await asyncio.to_thread(_wait_seen, cluster, fake, "copy", "victim")
            why = await _refused(kubelet, "copy")
            assert "pod default/copy container c: allocation signature invalid" in why
            assert "copied from another pod" in why
            fake.set_pod_phase("copy", "Failed", reason="CreateContainerError")
            kubelet.remove("copy")
            lim = await _admit(kubelet, "victim")
            assert lim["memory_mib_0"] == "5000"
            assert _booked(ext) == {"default/victim": 5000}
    run(go, 60)


def test_stripped_or_forged_progress_changes_no_limits(cluster: DevicePlugin, kubelet: FakeKubelet,
                                                       kube_api: FakeKubeAPI) -> None:
    """Two same-shape pods on one node at once (binds do not wait). After ``a`` started, the tenant
    strips the plugin's signed progress and writes its own ``success``/container list: a restart of
    a's container gets a's limits again, and ``b`` gets its own, never a's."""
    fake = kube_api
    a = create_pod(fake, _pod("a", 2000, 20))
    b = create_pod(fake, _pod("b", 7000, 70))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            await _ready(ext)
            assert await bind(ext, a, NODE) == ""
            assert await bind(ext, b, NODE) == ""  # no hand-over: b does not wait for a's allocation
            await asyncio.to_thread(_wait_seen, cluster, fake, "a", "b")
            lim = await _admit(kubelet, "a")
            assert (lim["memory_mib_0"], lim["cores_0"]) == ("2000", "20")
            assert verify_progress(KEYS, _ann(fake, "a")[ANN_PROGRESS_SIGNATURE], a["metadata"]["uid"],
                                   _ann(fake, "a")[ANN_ALLOCATION_SIGNATURE], BIND_SUCCESS, "c")
            fake.patch_object("pods", "a", {"metadata": {"annotations": {
                ANN_BIND_PHASE: BIND_ALLOCATING, ANN_ALLOCATED_CONTAINERS: None, ANN_PROGRESS_SIGNATURE: None}}},
                "default")
            fake.patch_object("pods", "b", {"metadata": {"annotations": {
                ANN_BIND_PHASE: BIND_SUCCESS, ANN_ALLOCATED_CONTAINERS: "c"}}}, "default")
            again = await asyncio.to_thread(kubelet.start_container, "a", "c")
            assert again.started and again.limits is not None and again.limits["memory_mib_0"] == "2000"
            lim = await _admit(kubelet, "b")
            assert (lim["memory_mib_0"], lim["cores_0"]) == ("7000", "70")
            assert _booked(ext) == {"default/a": 2000, "default/b": 7000}
    run(go, 60)


# ---------------------------------------------------------------------------------------------
# the trust rules, pure (deviceplugin.podmatch.trusted_view)

A = "GPU-aaaaaaaa-0000-4000-8000-000000000000"


def _signed(name: str, uid: str, mem: int, *, node: str = NODE) -> dict[str, Any]:
    p = bound_pod(name, [("c", False, [(A, mem, 10)], {})], node=NODE, bind_time=5)
    p["metadata"]["uid"] = uid
    ann = p["metadata"]["annotations"]
    ann[ANN_ALLOCATION_SIGNATURE] = sign_allocation(KEYS, uid, node, ann[ANN_BIND_TIME], ann[ANN_ALLOCATION])
    return p


def test_trusted_view_classifies_records() -> None:
    ok = _signed("ok", "u-ok", 1000)
    other_node = _signed("moved", "u-moved", 1000, node="elsewhere")
    replay = _signed("replay", "u-replay", 1000)
    replay["metadata"]["annotations"] = dict(ok["metadata"]["annotations"])
    unsigned = bound_pod("unsigned", [("c", False, [(A, 1000, 10)], {})])
    unsigned["metadata"]["uid"] = "u-unsigned"
    plain = {"metadata": {"name": "plain", "namespace": "default", "uid": "u-plain"},
             "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "x"}]}}
    views, refused = trusted_view([ok, other_node, replay, unsigned, plain], NODE, KEYS)
    assert set(refused) == {"u-moved", "u-replay", "u-unsigned", "u-plain"}
    assert "does not match the record" in refused["u-moved"] and refused["u-unsigned"] == "allocation signature missing"
    cands = pending_containers(views, NODE, arrivals=None, refused=refused)
    assert {(c.pod, bool(c.refused)) for c in cands} == {("ok", False), ("moved", True), ("replay", True),
                                                         ("unsigned", True)}  # plain asks for no GPU
    assert all(not c.devices for c in cands if c.refused)  # a refused pod's record is never read


def test_progress_counts_only_when_signed_or_remembered() -> None:
    p = _signed("p", "u-p", 1000)
    ann = p["metadata"]["annotations"]
    ann.update({ANN_BIND_PHASE: BIND_SUCCESS, ANN_ALLOCATED_CONTAINERS: "c"})  # tenant-written
    views, refused = trusted_view([p], NODE, KEYS)
    assert not refused and [c.pod for c in pending_containers(views, NODE)] == ["p"]
    # the plugin's own signed progress
    ann[ANN_PROGRESS_SIGNATURE] = sign_progress(KEYS, "u-p", ann[ANN_ALLOCATION_SIGNATURE], BIND_SUCCESS, "c")
    assert pending_containers(trusted_view([p], NODE, KEYS)[0], NODE) == []
    # stripped again, but remembered in memory (same allocation signature) ...
    for k in (ANN_BIND_PHASE, ANN_ALLOCATED_CONTAINERS, ANN_PROGRESS_SIGNATURE):
        del ann[k]
    mem = {"u-p": Progress(ann[ANN_ALLOCATION_SIGNATURE], BIND_SUCCESS, ("c",))}
    assert pending_containers(trusted_view([p], NODE, KEYS, mem)[0], NODE) == []
    # ... or admitted by kubelet (container statuses, written only by kubelet)
    p["status"] = {"phase": "Pending", "containerStatuses": [{"name": "c", "state": {"waiting": {}}}]}
    assert pending_containers(trusted_view([p], NODE, KEYS)[0], NODE) == []


def test_a_refused_pod_ahead_in_admission_order_is_never_matched_to_anothers_booking() -> None:
    """A refused pod ahead in admission order draws the preference with no GPUs of anyone's booking,
    and when kubelet's PodResources names it as the holder of IDs that happen to sit on a legitimate
    pod's GPU, it is refused: it never gets that pod's booking."""
    first = bound_pod("squat", [("c", False, [(A, 24576, 100)], {})], bind_time=1)
    first["metadata"]["uid"] = "u-squat"
    legit = _signed("legit", "u-legit", 1000)
    views, refused = trusted_view([first, legit], NODE, KEYS)
    cands = pending_containers(views, NODE, refused=refused)
    assert [c.pod for c in cands] == ["squat", "legit"]
    _, target = preferred_allocation([f"{A}::0", f"{A}::1"], [], 1, cands)
    assert target is not None and target.pod == "squat" and not target.devices
    squat_view = next(v for v in views if v["metadata"]["name"] == "squat")
    with pytest.raises(MatchError, match="pod default/squat container c: allocation signature missing"):
        identified(squat_view, "c", NODE, refused=refused["u-squat"])
    # the legitimate pod named as the holder of the same IDs gets its own booking
    legit_view = next(v for v in views if v["metadata"]["name"] == "legit")
    pc = identified(legit_view, "c", NODE)
    check_assignment(pc, [f"{A}::0"])
    assert pc.devices[0].memory_mib == 1000
