"""Bind verifies what it binds. ``POST /bind`` has no caller authentication (it listens on loopback
for the kube-scheduler in its pod), so whoever reaches it could try to make the extender bind any
pod anywhere with its ServiceAccount. Each attack is played over real HTTP against the extender,
with the in-process fake kube-apiserver: it must be refused with an Error that names the pod, the
field and the value, with nothing written to the API server and nothing booked.

Also the binary's defaults: the extender API listens on 127.0.0.1, and leader election is on, so
two replicas started with default flags never both bind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bind_support import (
    Extender,
    bind,
    check_books,
    create_nodes,
    create_pod,
    extender,
    node_obj,
    pod_obj,
    writes,
)
from vgpu_sched_util import run, wait_until

from kube_vgpu.resources import ANN_ALLOCATION, DEFAULT_SCHEDULER_NAME
from kube_vgpu.signing import KeyRing
from scheduler.kube import KubeAPI
from scheduler.server import build_parser, options_from_args
from scheduler.service import SchedulerService
from tests.fakeapi import FakeKubeAPI

VGPU = {"nvidia.com/gpumem": 4000}


@pytest.fixture
def fake() -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI(bookmark_interval=0.5, namespaces=("default", "kube-system", "tenant-b"))
    api.start()
    try:
        yield api
    finally:
        api.stop()


def untouched(fake: FakeKubeAPI, name: str, ns: str = "default") -> None:
    """The pod carries no record of ours and is not bound (by this attack)."""
    p = fake.get_object("pods", name, ns)
    assert p is not None
    assert ANN_ALLOCATION not in (p["metadata"].get("annotations") or {})
    assert not p["spec"].get("nodeName")


async def refused(ext: Extender, fake: FakeKubeAPI, pod: dict[str, Any], node: str, *want: str) -> str:
    """Bind ``pod`` to ``node``: refused with an Error containing every ``want``, no write."""
    fake.clear_requests()
    err = await bind(ext, pod, node)
    for w in want:
        assert w in err, (w, err)
    assert writes(fake) == [], writes(fake)
    return err


# -- pods that are not ours ---------------------------------------------------------------------

@pytest.mark.parametrize(("ns", "scheduler"), [
    ("tenant-b", "nobody"),               # another tenant's pod, for some scheduler of theirs
    ("default", "default-scheduler"),     # a plain default-scheduler pod
    ("default", "volcano"),               # a volcano pod
])
def test_pod_of_another_scheduler_is_refused(fake: FakeKubeAPI, ns: str, scheduler: str) -> None:
    """A pod that asks for vGPU resources but names another scheduler is that scheduler's to
    bind: refused, naming spec.schedulerName, its value and ours."""
    create_nodes(fake, 1)
    victim = create_pod(fake, pod_obj("victim", ns=ns, limits=VGPU, scheduler=scheduler))

    async def go() -> None:
        async with extender(fake) as ext:
            err = await refused(ext, fake, victim, "node-0", f"pod {ns}/victim",
                                f"spec.schedulerName={scheduler!r}", repr(DEFAULT_SCHEDULER_NAME))
            assert "binds only pods of schedulerName" in err
            untouched(fake, "victim", ns)
            assert check_books(fake, ext.svc) == {}
    run(go)


def test_pod_without_vgpu_resources_is_refused(fake: FakeKubeAPI) -> None:
    """A pod that asks for no vGPU resource is never bound by the extender, even if it names our
    scheduler (kube-scheduler calls our bind only for pods with managed resources)."""
    create_nodes(fake, 1)
    plain = create_pod(fake, pod_obj("plain", limits={"cpu": "1"}))

    async def go() -> None:
        async with extender(fake) as ext:
            await refused(ext, fake, plain, "node-0", "pod default/plain asks for no vGPU resource",
                          "nvidia.com/gpumem")
            untouched(fake, "plain")
            assert check_books(fake, ext.svc) == {}
    run(go)


# -- taints -------------------------------------------------------------------------------------

def tainted_node(name: str, taints: list[dict[str, str]] | None = None, cordoned: bool = False) -> dict[str, Any]:
    n = node_obj(name, 1)
    n.setdefault("spec", {})["taints"] = taints or []
    if cordoned:
        n["spec"]["unschedulable"] = True
    return n


def test_pod_is_not_bound_onto_a_node_whose_taints_it_does_not_tolerate(fake: FakeKubeAPI) -> None:
    """NoSchedule and NoExecute taints, and a cordon, keep a pod off a node unless it tolerates
    them (upstream matching rules); a PreferNoSchedule taint does not. The Error names the taint."""
    fake.create_object("nodes", tainted_node("ml", [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"},
                                                    {"key": "soft", "effect": "PreferNoSchedule"}]))
    fake.create_object("nodes", tainted_node("evict", [{"key": "maintenance", "effect": "NoExecute"}]))
    fake.create_object("nodes", tainted_node("cordoned", cordoned=True))
    fake.create_object("nodes", tainted_node("open", [{"key": "soft", "effect": "PreferNoSchedule"}]))
    intruder = create_pod(fake, pod_obj("intruder", limits=VGPU))
    wrong = pod_obj("wrong-value", limits=VGPU)
    wrong["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Equal", "value": "web", "effect": "NoSchedule"}]
    wrong = create_pod(fake, wrong)
    ml = pod_obj("ml-job", limits=VGPU)
    ml["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    ml = create_pod(fake, ml)

    async def go() -> None:
        async with extender(fake) as ext:
            await wait_until(lambda: len(ext.svc.cache.nodes) == 4)
            await refused(ext, fake, intruder, "ml", "pod default/intruder", "node's taint dedicated=ml:NoSchedule",
                          "spec.tolerations")
            await refused(ext, fake, intruder, "evict", "taint maintenance:NoExecute")
            await refused(ext, fake, intruder, "cordoned", "taint node.kubernetes.io/unschedulable:NoSchedule")
            await refused(ext, fake, wrong, "ml", "dedicated=ml:NoSchedule")
            untouched(fake, "intruder")
            untouched(fake, "wrong-value")
            assert check_books(fake, ext.svc) == {}
            assert await bind(ext, ml, "ml") == ""  # it tolerates the taint
            assert await bind(ext, intruder, "open") == ""  # PreferNoSchedule is a preference
            await wait_until(lambda: len(ext.svc.cache.pods) == 2)
            assert check_books(fake, ext.svc) == {"GPU-ml-00": 4000, "GPU-open-00": 4000}
    run(go)


def test_taints_added_later_are_honoured(fake: FakeKubeAPI) -> None:
    """The cache follows each node's taints from the watch: a taint added after the extender
    started refuses the next bind; removing it allows it again."""
    create_nodes(fake, 1)
    p = create_pod(fake, pod_obj("p", limits=VGPU))

    async def go() -> None:
        async with extender(fake) as ext:
            fake.patch_object("nodes", "node-0", {"spec": {"taints": [
                {"key": "gpu-broken", "value": "true", "effect": "NoSchedule"}]}})
            await wait_until(lambda: bool(ext.svc.cache.nodes["node-0"].taints))
            await refused(ext, fake, p, "node-0", "taint gpu-broken=true:NoSchedule")
            fake.patch_object("nodes", "node-0", {"spec": {"taints": None}})
            await wait_until(lambda: not ext.svc.cache.nodes["node-0"].taints)
            assert await bind(ext, p, "node-0") == ""
    run(go)


# -- pods that must not be bound now ------------------------------------------------------------

def test_already_bound_pod_is_refused(fake: FakeKubeAPI) -> None:
    """Binding a bound pod again (to move it, or to book its GPUs twice) is refused, naming
    spec.nodeName; its booking stays as it was."""
    create_nodes(fake, 2)
    p = create_pod(fake, pod_obj("p", limits=VGPU))

    async def go() -> None:
        async with extender(fake) as ext:
            assert await bind(ext, p, "node-0") == ""
            await wait_until(lambda: "default/p" in ext.svc.cache.pods)
            for node in ("node-1", "node-0"):
                await refused(ext, fake, p, node, "pod default/p is already bound", "spec.nodeName='node-0'")
            assert check_books(fake, ext.svc) == {"GPU-node-0-00": 4000}
    run(go)


def test_pod_that_no_longer_fits_is_refused(fake: FakeKubeAPI) -> None:
    """A bind of a pod the node's GPUs cannot hold any more (per the current books) is refused
    with the fit rule's reason; nothing is written or booked for it."""
    create_nodes(fake, 1)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpumem": 20000}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpumem": 20000}))

    async def go() -> None:
        async with extender(fake) as ext:
            assert await bind(ext, a, "node-0") == ""
            await refused(ext, fake, b, "node-0", "cannot place default/b on node-0", "20000 MiB")
            untouched(fake, "b")
            await wait_until(lambda: "default/a" in ext.svc.cache.pods)
            assert check_books(fake, ext.svc) == {"GPU-node-0-00": 20000}
    run(go)


def test_terminating_finished_or_unknown_targets_are_refused(fake: FakeKubeAPI) -> None:
    """A terminating pod (metadata.deletionTimestamp), a finished pod (status.phase) and a node
    the extender does not know are refused, each naming what."""
    create_nodes(fake, 1)
    t = pod_obj("terminating", limits=VGPU)
    t["metadata"]["finalizers"] = ["test.kube-vgpu.io/hold"]
    t = create_pod(fake, t)
    fake.delete_object("pods", "terminating", "default")
    done = create_pod(fake, pod_obj("done", limits=VGPU))
    fake.set_pod_phase("done", "Failed")
    p = create_pod(fake, pod_obj("p", limits=VGPU))

    async def go() -> None:
        async with extender(fake) as ext:
            await refused(ext, fake, t, "node-0", "pod default/terminating is being deleted",
                          "metadata.deletionTimestamp=")
            await refused(ext, fake, done, "node-0", "pod default/done has finished", "status.phase='Failed'")
            await refused(ext, fake, p, "node-9", "node 'node-9' is not known")
            assert check_books(fake, ext.svc) == {}
    run(go)


# -- the binary's defaults ----------------------------------------------------------------------

def key_dir(tmp: Path) -> Path:
    (tmp / "active").write_text("k1\n")
    (tmp / "key.k1").write_bytes(b"0123456789abcdef0123456789abcdef")
    return tmp


def test_defaults_listen_on_loopback_and_elect_a_leader(tmp_path: Path) -> None:
    keys = ["--signing-keys-dir", str(key_dir(tmp_path))]
    ns = build_parser().parse_args(keys)
    assert ns.bind_address == "127.0.0.1" and ns.metrics_bind_address == "0.0.0.0"
    o = options_from_args(ns)
    assert (o.leader_elect, o.leader_mode, o.lease_name) == (True, "own", "kube-vgpu-extender")
    assert build_parser().parse_args([*keys, "--leader-elect"]).leader_elect is True
    assert build_parser().parse_args([*keys, "--leader-elect=true"]).leader_elect is True
    for off in ("--leader-elect=false", "--leader-elect=False", "--leader-elect=0"):
        assert build_parser().parse_args([*keys, off]).leader_elect is False
    o = options_from_args(build_parser().parse_args([*keys, "--leader-elect-mode=follow"]))
    assert o.lease_name == "kube-vgpu-scheduler"  # follow reads kube-scheduler's Lease
    o = options_from_args(build_parser().parse_args([*keys, "--lease-name=x"]))
    assert o.lease_name == "x"


def test_bad_leader_elect_value_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--signing-keys-dir", str(key_dir(tmp_path)), "--leader-elect=maybe"])
    assert e.value.code == 2
    assert "--leader-elect" in (err := capsys.readouterr().err) and "'maybe' is not a boolean" in err
    assert "allowed: true or false" in err


def test_two_replicas_with_default_flags_only_the_leader_binds(fake: FakeKubeAPI, tmp_path: Path) -> None:
    """Two extenders started with the binary's default flags: one holds the Lease and binds, the
    other refuses every bind (nothing written) and reports not ready; no GPU is booked twice."""
    create_nodes(fake, 1)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpumem": 20000}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpumem": 20000}))
    args = build_parser().parse_args(["--signing-keys-dir", str(key_dir(tmp_path))])
    ring = KeyRing.generate()

    def replica() -> SchedulerService:
        o = dataclasses.replace(options_from_args(args), freeze_gc=False, sync_wait=5.0)
        return SchedulerService(load_default_config(), KubeAPI(fake.api_client()), o, keys=ring)

    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            e1 = await stack.enter_async_context(Extender(replica()))
            e2 = await stack.enter_async_context(Extender(replica()))
            for e in (e1, e2):
                await asyncio.wait_for(e.svc.synced.wait(), 10)
            await wait_until(lambda: e1.svc.is_leader or e2.svc.is_leader, timeout=10)
            leader, follower = (e1, e2) if e1.svc.is_leader else (e2, e1)
            assert not follower.svc.is_leader
            lease = fake.get_object("leases", "kube-vgpu-extender", "kube-system")
            assert lease is not None and lease["spec"]["holderIdentity"] == leader.svc.opts.identity
            assert (await follower.get("/readyz"))[0] == 503
            for p in (a, b):
                await refused(follower, fake, p, "node-0", "not the leader")
            assert await bind(leader, a, "node-0") == ""
            assert "cannot place default/b" in await bind(leader, b, "node-0")
            await refused(follower, fake, b, "node-0", "not the leader")
            await wait_until(lambda: "default/a" in leader.svc.cache.pods and "default/a" in follower.svc.cache.pods)
            assert check_books(fake, leader.svc) == {"GPU-node-0-00": 20000}
            assert check_books(fake, follower.svc) == {"GPU-node-0-00": 20000}
    run(go)


def load_default_config() -> Any:
    from kube_vgpu.config import Config
    return Config()
