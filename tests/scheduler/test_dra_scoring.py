"""The extender's DRA scoring (scheduler/drascore.py, /dra-prioritize): the nodes of pods whose
claims ask kube-vgpu's DeviceClass are ranked by the node policy on the allocator's first-fit
placement; anything a tenant writes (claims of other drivers or namespaces, unallocated claims,
annotations) moves no score."""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import numpy as np
import pytest
from vgpu_sched_util import SAFETY_SCALE, Extender, offline_service, run, wait_until

from kube_vgpu.config import load_config_text
from kube_vgpu.placement.policies import TaskShape
from kube_vgpu.placement.status import FitFailure
from scheduler.drascore import DraScorer, parse_device_classes, pod_request
from tests.dra.dra_objects import claim, claim_pod, node_slice, owner, result

SLICES = [node_slice("n-empty", 2), node_slice("n-used", 2), node_slice("n-small", 1, mem=2048)]
#: n-used: 10000 MiB and 40 cores of its gpu-0 held by another tenant's allocated claim
USED = claim("held", ns="team-b", memory="10000Mi", cores="40", results=[result("n-used", "gpu-0", "10000Mi", "40")])
NAMES = ["n-empty", "n-used", "n-small", "n-none"]


def scorer(*claims: dict[str, Any]) -> DraScorer:
    d = DraScorer()
    d.replace("resourceslices", copy.deepcopy(SLICES))
    d.replace("resourceclaims", [USED, *claims])
    return d


def scores(d: DraScorer, pod: dict[str, Any], policy: str = "binpack",
           shapes: list[TaskShape] | None = None) -> dict[str, int]:
    return dict(zip(NAMES, d.scores(pod, NAMES, policy, shapes).tolist(), strict=True))


def test_binpack_prefers_the_used_node_spread_the_empty_one() -> None:
    mine = claim("mine", memory="3000Mi", cores="30")
    d = scorer(mine)
    pod = claim_pod("p", claims=("mine",))
    assert scores(d, pod, "binpack") == {"n-empty": 0, "n-used": 10, "n-small": 0, "n-none": 0}
    assert scores(d, pod, "spread") == {"n-empty": 10, "n-used": 0, "n-small": 0, "n-none": 0}


def test_a_node_where_the_claim_cannot_fit_scores_zero() -> None:
    d = scorer(claim("big", memory="12000Mi", cores="30", count=2))
    got = scores(d, claim_pod("p", claims=("big",)), "spread")
    assert got["n-small"] == 0 and got["n-none"] == 0  # one GPU of 2 GiB; no slices at all
    raw = d.raw_scores(claim_pod("p", claims=("big",)), NAMES, "spread", None)
    assert raw is not None and math.isinf(raw[2]) and math.isinf(raw[3])
    assert np.isfinite(raw[:2]).all()


def test_score_is_the_policys_on_the_allocators_first_fit() -> None:
    """bestfit scores the leftover of the GPUs used: first fit by index puts a 10000 MiB claim on
    n-used's gpu-0 (already 10000 used); both nodes rank as the registry's BestFit says."""
    d = scorer(claim("c", memory="10000Mi", cores="10"))
    pod = claim_pod("p", claims=("c",))
    from kube_vgpu.placement.fit import fit_pod
    n = d.node_state("n-used")
    assert n is not None
    plan = fit_pod(n, pod_request(pod, d.claims, d.classes))  # type: ignore[arg-type]
    assert [i for cp in plan.containers for i, _, _ in cp] == [0]  # type: ignore[union-attr]
    got = scores(d, pod, "bestfit")
    assert got["n-used"] == 10 and got["n-empty"] == 0


def test_fgd_policy_scores_with_the_engines_shapes() -> None:
    shapes = [TaskShape(0, 300, 1, frozenset(), 0.5), TaskShape(0, 1000, 1, frozenset(), 0.5)]
    d = scorer(claim("c", memory="3000Mi", cores="30"))
    got = scores(d, claim_pod("p", claims=("c",)), "fgd-bestfit", shapes)
    assert max(got.values()) == 10 and got["n-none"] == 0
    assert scores(d, claim_pod("p", claims=("c",)), "fgd", None) == dict.fromkeys(NAMES, 0)  # no shapes: no ranking


def test_fgd_scores_the_allocators_first_fit_not_its_own_gpu_choice() -> None:
    """docs/dra-placement.md's example: node a has 600 and 300 milli free, node b 300 and 1000, the
    claim asks 300 milli. FGD's own GPU choice (a's gpu-1) would rank a first; the allocator takes
    a's gpu-0 (first fit), leaving two slivers, so the extender must rank b first."""
    from kube_vgpu.placement.policies import make_policy
    slices = [node_slice("a", 2, mem=10000), node_slice("b", 2, mem=10000)]
    held = [claim("u1", results=[result("a", "gpu-0", "4000Mi", "40")]),
            claim("u2", results=[result("a", "gpu-1", "7000Mi", "70")]),
            claim("u3", results=[result("b", "gpu-0", "7000Mi", "70")])]
    d = DraScorer()
    d.replace("resourceslices", slices)
    d.replace("resourceclaims", [*held, claim("mine", memory="3000Mi", cores="30")])
    pod = claim_pod("p", claims=("mine",))
    shapes = [TaskShape(0, 600, 1, frozenset(), 0.5), TaskShape(0, 1000, 1, frozenset(), 0.5)]
    assert d.scores(pod, ["a", "b"], "fgd-bestfit", shapes).tolist() == [0, 10]
    own = make_policy("fgd-bestfit", "spread", shapes)  # FGD choosing its own GPU
    req = pod_request(pod, d.claims, d.classes)
    assert req is not None
    on_a, on_b = (own.evaluate(d.node_state(n), req) for n in ("a", "b"))  # type: ignore[arg-type]
    assert not isinstance(on_a, FitFailure) and not isinstance(on_b, FitFailure)
    assert on_a[1].containers == (((1, 3000, 30),),) and on_a[0] > on_b[0]


def test_only_the_best_node_keeps_the_top_score() -> None:
    """A node a hair less used than the best rounds to 10 too: it gets 9, so the policy's best node
    wins over kube-scheduler's own scores; nodes the policy cannot tell apart keep 10 together."""
    d = DraScorer()
    d.replace("resourceslices", [node_slice(n, 2) for n in ("a", "b", "c", "d")])
    d.replace("resourceclaims", [claim("x", ns="o", results=[result("a", "gpu-0", "10001Mi", "40")]),
                                 claim("y", ns="o", results=[result("b", "gpu-0", "10000Mi", "40")]),
                                 claim("z", ns="o", results=[result("d", "gpu-0", "10001Mi", "40")]),
                                 claim("mine")])
    pod = claim_pod("p", claims=("mine",))
    raw = d.raw_scores(pod, ["a", "b", "c", "d"], "binpack", None)
    assert raw is not None and raw[0] == raw[3] > raw[1] > raw[2]
    assert d.scores(pod, ["a", "b", "c", "d"], "binpack", None).tolist() == [10, 9, 0, 10]


def test_template_claims_are_read_from_the_pod_status() -> None:
    pod = claim_pod("p", templates={"gpu": "p-gpu-x7"})
    d = scorer(claim("p-gpu-x7", memory="3000Mi", cores="30", owner=owner(pod)))
    assert scores(d, pod)["n-used"] == 10


def test_pods_without_our_claims_get_zeros() -> None:
    d = scorer(claim("other", device_class="gpu.example.com"))
    zero = dict.fromkeys(NAMES, 0)
    assert scores(d, claim_pod("p")) == zero  # no claims
    assert scores(d, claim_pod("p", claims=("other",))) == zero  # another driver's class
    assert scores(d, claim_pod("p", claims=("missing",))) == zero  # not in the cache (yet)
    assert scores(d, claim_pod("p", templates={"gpu": ""})) == zero  # template claim not created yet
    d.synced["resourceclaims"] = False
    assert scores(d, claim_pod("p", claims=("held",))) == zero  # not synced


def test_an_allocated_claim_is_not_ranked_again() -> None:
    d = scorer()
    assert scores(d, claim_pod("p", ns="team-b", claims=("held",))) == dict.fromkeys(NAMES, 0)


# -- hostile tenants ---------------------------------------------------------------------------------

def test_claim_in_another_namespace_is_never_read() -> None:
    """A pod in team-a naming team-b's claim (or a path-like name) gets nothing from it."""
    d = scorer(claim("mine", ns="team-b"))
    zero = dict.fromkeys(NAMES, 0)
    assert scores(d, claim_pod("p", ns="team-a", claims=("mine",))) == zero
    assert scores(d, claim_pod("p", ns="team-a", claims=("team-b/mine",))) == zero
    assert scores(d, claim_pod("p", ns="team-b", claims=("mine",)))["n-used"] == 10


def test_generated_claim_must_be_owned_by_the_pod() -> None:
    """A template pod whose status names a claim it does not own (another pod's) is not ranked."""
    victim = claim_pod("victim", templates={"gpu": "victim-gpu"})
    d = scorer(claim("victim-gpu", owner=owner(victim)))
    thief = claim_pod("thief", templates={"gpu": "victim-gpu"})
    assert scores(d, thief) == dict.fromkeys(NAMES, 0)


def test_malformed_claims_and_empty_uids_never_break_or_match() -> None:
    """A claim whose ownerReferences are not a list, or that names an owner with an empty uid, for a
    pod without uid: no score, no error."""
    pod = claim_pod("p", templates={"gpu": "p-gpu"}, pod_uid="")
    bad = claim("p-gpu")
    bad["metadata"]["ownerReferences"] = "pod p"
    empty = claim("p-gpu", owner={"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "", "controller": True})
    for c in (bad, empty):
        assert scores(scorer(c), pod) == dict.fromkeys(NAMES, 0)


def test_foreign_unallocated_and_forged_claims_move_nothing() -> None:
    """Claims of another driver allocated on n-empty, claims of our class never allocated, forged
    allocation annotations on claims and pods, and a pod asking for another policy by annotation:
    the scores are those of the clean cluster."""
    mine = claim("mine", memory="3000Mi", cores="30")
    pod = claim_pod("p", claims=("mine",))
    clean = scores(scorer(mine), pod)
    noise = [
        claim("foreign", ns="team-c", results=[result("n-empty", "gpu-0", "24Gi", "100", driver="gpu.example.com"),
                                               result("n-empty", "gpu-1", "24Gi", "100", driver="gpu.example.com")]),
        claim("never", ns="team-c", memory="24Gi", cores="100"),
        claim("forged", ns="team-c", annotations={"kube-vgpu.io/allocation": "n-empty:gpu-0:24576:100"}),
    ]
    forged_pod = claim_pod("p", claims=("mine",), annotations={
        "kube-vgpu.io/node-scheduler-policy": "spread", "kube-vgpu.io/allocation": "{}",
        "kube-vgpu.io/allocation-signature": "x"})
    assert scores(scorer(mine, *noise), pod) == clean
    assert scores(scorer(mine, *noise), forged_pod) == clean


def test_watch_events_update_the_view() -> None:
    d = scorer(claim("mine"))
    pod = claim_pod("p", claims=("mine",))
    assert scores(d, pod)["n-used"] == 10
    d.event("resourceclaims", "DELETED", USED)  # n-used's claim released: both nodes empty
    assert scores(d, pod)["n-used"] == scores(d, pod)["n-empty"] == 10
    d.event("resourceclaims", "ADDED", claim("late", ns="team-b", results=[result("n-empty", "gpu-1")]))
    assert scores(d, pod) == {"n-empty": 10, "n-used": 0, "n-small": 0, "n-none": 0}


def test_device_class_flag_values() -> None:
    assert parse_device_classes([]) == {"vgpu.kube-vgpu.io": ""}
    assert parse_device_classes(["a.example.com", "h200.x=NVIDIA H200"]) == {"a.example.com": "", "h200.x": "NVIDIA H200"}
    for bad in ("", "Bad", "a..b", "-a"):
        with pytest.raises(ValueError, match="--dra-device-class"):
            parse_device_classes([bad])


# -- over HTTP -----------------------------------------------------------------------------------------

def _fresh(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as a client creates it (the server assigns uid and resourceVersion)."""
    obj = copy.deepcopy(obj)
    obj["metadata"] = {k: v for k, v in obj["metadata"].items() if k not in ("uid", "resourceVersion")}
    return obj


def _args(pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": pod, "Nodes": None, "NodeNames": names}


def test_http_dra_prioritize_offline_service() -> None:
    """With scoring off the verb answers zeros; a malformed body gets 400 naming the problem."""
    async def go() -> None:
        async with Extender(offline_service()) as ext:
            st, res = await ext.post("/dra-prioritize", _args(claim_pod("p", claims=("x",)), ["a", "b"]))
            assert st == 200 and res == [{"Host": "a", "Score": 0}, {"Host": "b", "Score": 0}]
            st, res = await ext.post("/dra-prioritize", {"Pod": 3, "NodeNames": ["a"]})
            assert st == 400 and "Pod" in res["Error"]
    run(go)


def test_http_dra_prioritize_over_the_fake_api_server(fake) -> None:
    """The real extender, its DRA reflectors against the fake API server, served over HTTP."""
    from scheduler.kube import KubeAPI
    from scheduler.service import Options, SchedulerService

    for ns in ("team-a", "team-b"):
        fake.create_object("namespaces", {"metadata": {"name": ns}})
    for s in SLICES:
        fake.create_object("resourceslices", s)
    for c in (USED, claim("mine", memory="3000Mi", cores="30")):
        c = _fresh(c)
        status = c.pop("status", None)
        fake.create_object("resourceclaims", c, namespace=c["metadata"]["namespace"])
        if status is not None:
            fake.patch_object("resourceclaims", c["metadata"]["name"], {"status": status},
                              c["metadata"]["namespace"], subresource="status")
    pod = claim_pod("p", claims=("mine",))

    async def go(policy: str) -> list[dict[str, Any]]:
        cfg = load_config_text(f"apiVersion: kube-vgpu.io/v1\nscheduling: {{nodePolicy: {policy}}}\n")
        svc = SchedulerService(cfg, KubeAPI(fake.api_client()), Options(sync_wait=5.0, dra_scoring=True))
        async with Extender(svc) as ext:
            assert svc.dra is not None
            await wait_until(lambda: svc.dra is not None and svc.dra.ready, timeout=10)
            st, res = await ext.post("/dra-prioritize", _args(pod, NAMES))
            assert st == 200
            # a claim allocated later on n-empty's both GPUs reaches the scores through the watch
            late = _fresh(claim("late", ns="team-b"))
            await asyncio.to_thread(fake.create_object, "resourceclaims", late, "team-b")
            status = {"allocation": {"devices": {"results": [result("n-empty", "gpu-0", "20000Mi", "60"),
                                                             result("n-empty", "gpu-1", "20000Mi", "60")]}}}
            await asyncio.to_thread(lambda: fake.patch_object("resourceclaims", "late", {"status": status}, "team-b",
                                                              subresource="status"))
            await wait_until(lambda: ("team-b", "late") in svc.dra.claims
                             and svc.dra.claims[("team-b", "late")].get("status") is not None, timeout=10)
            st, after = await ext.post("/dra-prioritize", _args(pod, NAMES))
            return [res, after]
    binpack, after = run(lambda: go("binpack"), timeout=60 / SAFETY_SCALE * 2)
    assert binpack == [{"Host": "n-empty", "Score": 0}, {"Host": "n-used", "Score": 10},
                       {"Host": "n-small", "Score": 0}, {"Host": "n-none", "Score": 0}]
    assert [h["Score"] for h in after][:2] == [10, 0]  # n-empty is now the fuller node
    assert fake.errors == []



def test_readyz_waits_for_the_dra_lists_the_vgpu_path_does_not(fake) -> None:
    """While resourceslices cannot be listed (RBAC missing, say) the extender is not Ready and says
    why, but its caches of nodes, pods and quotas are synced: vGPU pods are still filtered."""
    from scheduler.kube import KubeAPI
    from scheduler.service import Options, SchedulerService

    fake.fail_next("list", "resourceslices", 403, count=None)

    async def go() -> None:
        svc = SchedulerService(load_config_text("apiVersion: kube-vgpu.io/v1\n"), KubeAPI(fake.api_client()),
                               Options(sync_wait=5.0, dra_scoring=True))
        async with Extender(svc) as ext:
            await asyncio.wait_for(svc.synced.wait(), 10 * SAFETY_SCALE)
            assert svc.dra is not None and not svc.dra.ready
            await wait_until(lambda: any(r.path.endswith("/resourceslices") and r.status == 403
                                         for r in fake.request_log), timeout=10)
            st, text = await ext.get("/readyz")
            assert st == 503 and "DRA caches" in text
            fake.clear_failures()
            await wait_until(lambda: svc.dra is not None and svc.dra.ready, timeout=20)
            st, text = await ext.get("/readyz")
            assert st == 200
    run(go, timeout=60)


def test_incremental_view_equals_the_pure_derivation() -> None:
    """Random claim events (added, re-allocated, deleted, malformed) and slice changes: the
    scorer's per-event totals always equal kube_vgpu.dra.capacity.node_capacity over its objects."""
    import random

    from kube_vgpu.dra.capacity import node_capacity
    rng = random.Random(7)
    d = DraScorer()
    d.replace("resourceslices", [node_slice(f"n{i}", 3) for i in range(4)])
    d.replace("resourceclaims", [])
    for step in range(400):
        name = f"c{rng.randrange(30)}"
        op = rng.random()
        if op < 0.2:
            d.event("resourceclaims", "DELETED", claim(name, ns="o"))
        elif op < 0.25:
            d.event("resourceslices", "MODIFIED", node_slice(f"n{rng.randrange(5)}", rng.randrange(1, 4),
                                                             generation=step + 2))
        else:
            res = [result(f"n{rng.randrange(5)}", f"gpu-{rng.randrange(4)}",
                          rng.choice(["1000Mi", "3Gi", None, "x"]), rng.choice(["10", None, "55"]))
                   for _ in range(rng.randrange(3))]
            d.event("resourceclaims", rng.choice(["ADDED", "MODIFIED"]),
                    claim(name, ns="o", results=res if rng.random() < 0.8 else None))
        if step % 50 == 25:  # a relist: the same claims but one dropped, or the same slices
            items = list(d.claims.values())
            d.replace("resourceclaims", items[1:] if items and rng.random() < 0.5 else items)
            d.replace("resourceslices", list(d.slices.values()))
        if step % 10 == 0:
            want = node_capacity(d.slices.values(), d.claims.values())
            assert d.capacity() == want
            for node, cap in want.items():  # the cached placement views follow too
                n = d.node_state(node)
                assert n is not None
                assert (n.free_mem, n.free_cores) == ([cap.free(i)[0] for i in range(len(cap.devices))],
                                                      [cap.free(i)[1] for i in range(len(cap.devices))])
    assert d.capacity() == node_capacity(d.slices.values(), d.claims.values())
