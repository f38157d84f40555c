"""Red-team tests of the extender's DRA scoring (scheduler/drascore.py, ``dra.extenderScoring``).

The extender keeps every ResourceClaim of the cluster and ranks the nodes of claim pods on its
single event loop (the one that also answers the vGPU path's filter and bind). A tenant who can
create pods and ResourceClaims in its own namespace must not be able to make one scoring call
cost unbounded CPU, nor make the extender hold its claims' bulk in memory."""

from __future__ import annotations

import copy
from typing import Any

import orjson

import kube_vgpu.placement.policies as policies
from kube_vgpu.dra import DEVICE_CLASS
from kube_vgpu.dra.capacity import node_capacity
from scheduler.drascore import MAX_PREDICTED_CLAIMS, MAX_PREDICTED_DEVICES, DraScorer, pod_request
from tests.dra.dra_objects import claim, claim_pod, node_slice, owner, result

Obj = dict[str, Any]


def _many_requests(name: str, n: int, ns: str = "team-a") -> Obj:
    """A claim of ``n`` tiny requests (1 MiB, 1 core) of our class: each fits a shared GPU slot."""
    c = claim(name, ns=ns, memory="1Mi", cores="1")
    c["spec"]["devices"]["requests"] = [
        {"name": f"r{k}", "exactly": {"deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": 1,
                                      "capacity": {"requests": {"memory": "1Mi", "cores": "1"}}}}
        for k in range(n)]
    return c


def _scorer(nodes: int, claims: list[Obj]) -> DraScorer:
    d = DraScorer()
    d.replace("resourceslices", [node_slice(f"n{i}", 8) for i in range(nodes)])
    # every node in a different state, so no memo shares one node's placement work with another
    used = [claim(f"u{i}", ns="team-b", results=[result(f"n{i}", "gpu-0", f"{i + 1}Mi", "1")]) for i in range(nodes)]
    d.replace("resourceclaims", used + claims)
    return d


def test_a_pod_with_a_thousand_requests_costs_no_placement_work(monkeypatch) -> None:
    """32 claims x 32 tiny requests (1,024 devices, each fitting a slot of a shared GPU): before the
    bound, every scoring call fitted 1,024 containers on every node state (6 s of the event loop
    on 1,000 nodes, again for every new shape). Now a pod asking more than MAX_PREDICTED_DEVICES
    devices is not predicted (zeros: kube-scheduler still places it) and nothing is fitted, while
    a pod at the bound is still ranked, with at most the bound's containers fitted per node."""
    fitted: list[int] = []
    real = policies.fit_pod

    def counting(node, pod, order=None):  # type: ignore[no-untyped-def]
        fitted.append(len(pod.app))
        return real(node, pod, order) if order is not None else real(node, pod)

    monkeypatch.setattr(policies, "fit_pod", counting)
    hostile = [_many_requests(f"h{j}", 32) for j in range(32)]
    at_bound = [_many_requests(f"b{j}", 32) for j in range(MAX_PREDICTED_DEVICES // 32)]
    d = _scorer(20, hostile + at_bound)
    names = [f"n{i}" for i in range(20)]

    pod = claim_pod("greedy", claims=tuple(c["metadata"]["name"] for c in hostile))
    assert pod_request(pod, d.claims, d.classes) is None
    for policy in ("binpack", "spread"):
        assert d.scores(pod, names, policy, None).tolist() == [0] * 20
    assert fitted == []

    ok = claim_pod("fits", claims=tuple(c["metadata"]["name"] for c in at_bound))
    req = pod_request(ok, d.claims, d.classes)
    assert req is not None and sum(c.count for c in req.app) == MAX_PREDICTED_DEVICES
    s = d.scores(ok, names, "spread", None)
    assert s.max() == 10  # ranked: the bound does not switch scoring off for real pods
    assert fitted and max(fitted) <= MAX_PREDICTED_DEVICES and len(fitted) <= 20


def test_one_request_over_the_bound_by_count_is_not_predicted() -> None:
    """The bound counts devices, not requests: 3 claims of count 30 (90 devices) are not predicted."""
    big = [claim(f"k{j}", count=30) for j in range(3)]
    d = _scorer(2, big)
    pod = claim_pod("p", claims=tuple(c["metadata"]["name"] for c in big))
    assert pod_request(pod, d.claims, d.classes) is None
    assert d.scores(pod, ["n0", "n1"], "binpack", None).tolist() == [0, 0]


def test_a_pod_listing_thousands_of_claims_is_not_read_claim_by_claim(monkeypatch) -> None:
    """A pod spec listing 20,000 existing claims (1.3 MB) had each looked up and parsed on every
    scoring call (0.27 s of the event loop per call). Beyond MAX_PREDICTED_CLAIMS none is read;
    at the bound the pod is still ranked."""
    import scheduler.drascore as drascore
    read: list[str] = []
    real = drascore.claim_requests

    def counting(claim, classes):  # type: ignore[no-untyped-def]
        read.append(claim["metadata"]["name"])
        return real(claim, classes)

    monkeypatch.setattr(drascore, "claim_requests", counting)
    many = [claim(f"o{i}", device_class="other-class") for i in range(2000)]
    d = _scorer(2, [*many, claim("mine")])
    pod = claim_pod("p", claims=(*(c["metadata"]["name"] for c in many), "mine"))
    assert d.scores(pod, ["n0", "n1"], "spread", None).tolist() == [0, 0]
    assert read == []
    ok = claim_pod("q", claims=(*(c["metadata"]["name"] for c in many[:MAX_PREDICTED_CLAIMS - 1]), "mine"))
    assert d.scores(ok, ["n0", "n1"], "spread", None).max() == 10
    assert len(read) == MAX_PREDICTED_CLAIMS


def _bloated(c: Obj) -> Obj:
    """``c`` with what a tenant may pad a claim with: 1 MB of opaque driver config, long CEL
    selectors and constraints, many requests of another class, and a large unrelated annotation."""
    c = copy.deepcopy(c)
    dev = c["spec"]["devices"]
    dev["config"] = [{"opaque": {"driver": "other.example.com", "parameters": {"pad": "x" * 1_000_000}}}]
    dev["constraints"] = [{"matchAttribute": "x" * 5000}]
    for r in dev["requests"]:
        r["exactly"]["selectors"] = [{"cel": {"expression": "true || " + "x" * 10_000}}]
    dev["requests"] += [{"name": f"o{k}", "exactly": {"deviceClassName": "other-class",
                                                      "selectors": [{"cel": {"expression": "y" * 10_000}}]}}
                        for k in range(20)]
    c["metadata"]["annotations"] = {"pad": "z" * 200_000}
    c["metadata"]["managedFields"] = [{"manager": "m", "fieldsV1": {"f:pad": "w" * 100_000}}]
    return c


def test_padded_claims_are_not_held_in_full_and_predict_the_same() -> None:
    """Thousands of tenant claims padded to ~1.3 MB each would be held whole by the extender's
    claim cache (every namespace, every driver): gigabytes, then an OOM-killed extender, which
    stops the vGPU path for every tenant. The cache keeps only what scoring reads (a few KB per
    claim), and every prediction, share and capacity is what the whole object gives."""
    pod = claim_pod("p", templates={"gpu": "p-gpu"})
    gen = claim("p-gpu", owner=owner(pod))
    held = claim("held", ns="team-b", results=[result("n0", "gpu-0", "10000Mi", "40"),
                                              result("n0", "gpu-1", None, None),
                                              result("n1", "gpu-0", "3Gi", "10", driver="other.example.com")])
    held["status"]["devices"] = [{"driver": "x", "pool": "n0", "device": "gpu-0", "data": {"pad": "d" * 500_000}}]
    held["status"]["reservedFor"] = [{"resource": "pods", "name": f"p{i}", "uid": f"u{i}"} for i in range(256)]
    plain = DraScorer()
    plain.replace("resourceslices", [node_slice("n0", 2), node_slice("n1", 2)])
    plain.replace("resourceclaims", [gen, held])
    padded = DraScorer()
    padded.replace("resourceslices", [node_slice("n0", 2), node_slice("n1", 2)])
    padded.replace("resourceclaims", [_bloated(gen)])
    padded.event("resourceclaims", "ADDED", _bloated(held))
    for key, c in padded.claims.items():
        assert len(orjson.dumps(c)) < 4096, key
    assert padded.capacity() == plain.capacity() == node_capacity(padded.slices.values(), padded.claims.values())
    names = ["n0", "n1", "nx"]
    for policy in ("binpack", "spread"):
        assert padded.scores(pod, names, policy, None).tolist() == plain.scores(pod, names, policy, None).tolist()
    assert pod_request(pod, padded.claims, padded.classes) == pod_request(pod, plain.claims, plain.classes)
    # the template rule still holds on the kept objects: another pod's generated claim is not its own
    other = claim_pod("q", templates={"gpu": "p-gpu"})
    assert pod_request(other, padded.claims, padded.classes) is None


def test_kept_claims_keep_every_refusal() -> None:
    """What made a claim unpredictable on the whole object still does on the kept one:
    ``firstAvailable`` naming our class, ``allocationMode: All``, an unknown capacity name,
    a count out of range, malformed owner references; and an allocation without results of ours
    still marks the claim as placed."""
    base = claim("c")
    fa = copy.deepcopy(base)
    fa["spec"]["devices"]["requests"] = [{"name": "g", "firstAvailable": [
        {"name": "a", "deviceClassName": "other-class"}, {"name": "b", "deviceClassName": DEVICE_CLASS}]}]
    all_mode = copy.deepcopy(base)
    all_mode["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] = "All"
    unknown = copy.deepcopy(base)
    unknown["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["bandwidth"] = "1"
    count = copy.deepcopy(base)
    count["spec"]["devices"]["requests"][0]["exactly"]["count"] = 65
    placed = copy.deepcopy(base)
    placed["status"] = {"allocation": {"devices": {"results": [result("n0", "gpu-0", driver="other.example.com")]}}}
    for bad in (fa, all_mode, unknown, count, placed):
        d = _scorer(1, [bad])
        pod = claim_pod("p", claims=("c",))
        assert pod_request(pod, d.claims, d.classes) is None
    ok = _scorer(1, [base])
    assert pod_request(claim_pod("p", claims=("c",)), ok.claims, ok.classes) is not None
    pod = claim_pod("p", templates={"gpu": "p-gpu"})
    bad_owner = claim("p-gpu", owner=owner(pod))
    bad_owner["metadata"]["ownerReferences"].append("not an object")
    d = _scorer(1, [bad_owner])
    assert pod_request(pod, d.claims, d.classes) is None
