"""``kubectl vgpu what-if`` (alias ``simulate``): where would each placement policy put this pod on
this cluster, and why not elsewhere. (The offline replay of a whole trace is ``kube-vgpu replay``.)

A dry run: nothing is written to the cluster. The cluster (live or a snapshot) is loaded into the
extender's own cache (:class:`kube_vgpu.cluster.ClusterCache`, the code the running scheduler uses:
same inventory decoding, staleness and availability rules, bookings from allocation annotations),
then for every policy the placement engine (:class:`kube_vgpu.placement.Engine`) evaluates the
pod on every node and chooses one. FGD's target workload comes from the pods already booked
(:func:`kube_vgpu.placement.liveshapes.shapes_from_state`, default mix when there are too few).

Not simulated: kube-scheduler's own filters (taints, affinity, host CPU/memory); only cordoned
and NotReady nodes are set aside here, as kube-scheduler would.
"""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any

from kube_vgpu.cluster import ClusterCache
from kube_vgpu.config import NODE_POLICIES, Config
from kube_vgpu.model import PodRequest
from kube_vgpu.placement import Plan
from kube_vgpu.placement.engine import normalise_scores
from kube_vgpu.placement.liveshapes import shapes_from_state
from kube_vgpu.placement.render import detail
from kube_vgpu.policyregistry import node_policy
from kube_vgpu.views import NodeView

from .cluster import Cluster
from .text import safe

WIDTH = 80


@dataclass
class PolicyResult:
    """One policy's choice. score: the policy's own (raw) score of the chosen node, on the
    policy's own scale (not comparable across policies); normalised: node -> the 0..10 score the
    extender's prioritize gives kube-scheduler (best feasible node 10, worst 0: comparable)."""

    policy: str
    node: str | None
    score: float | None
    gpus: list[list[dict[str, Any]]]  # per container: [{uuid, index, memoryMiB, cores}]
    ranking: list[tuple[str, float]]  # feasible nodes, best first (raw scores)
    normalised: dict[str, int] = field(default_factory=dict)


@dataclass
class Simulation:
    pod: PodRequest
    results: list[PolicyResult]
    rejected: dict[str, str]  # node -> reason (policy independent: fit rules and availability)
    codes: dict[str, str]  # node -> fit failure code (kube_vgpu.placement.status.Code) of the vGPU rules
    gpu_policy: str
    nodes: int


def _node_gate(node: NodeView) -> str | None:
    """kube-scheduler's own verdict we can reproduce cheaply: cordoned or NotReady."""
    if node.unschedulable:
        return "node is cordoned (spec.unschedulable)"
    c = node.condition("Ready")
    if c is not None and c.get("status") != "True":
        return f"node is not Ready ({c.get('reason') or c.get('status')})"
    return None


def _plan_gpus(cache: ClusterCache, node: str, pod: PodRequest, plan: Plan) -> list[list[dict[str, Any]]]:
    n = cache.state.nodes[node]
    out = []
    for req, cp in zip(pod.containers, plan.containers, strict=True):
        out.append([{"container": req.name, "init": req.init, "uuid": n.devices[i].uuid,
                     "index": n.devices[i].index, "memoryMiB": mem, "cores": cores} for i, mem, cores in cp])
    return out


def simulate(cluster: Cluster, pod: PodRequest, config: Config | None = None,
             policies: list[str] | None = None) -> Simulation:
    """Evaluate ``pod`` under each policy (default: all) without changing anything.

    Raises ValueError for an unknown policy name.
    """
    cfg = config or Config()
    policies = policies or list(NODE_POLICIES)
    for p in policies:
        if p not in NODE_POLICIES:
            raise ValueError(f"unknown policy {p!r}; allowed: {', '.join(NODE_POLICIES)}")
    # The cache logs undecodable annotations; here they are reported as rejections instead.
    logging.getLogger("kube_vgpu.cluster").setLevel(logging.ERROR)
    cache = ClusterCache(cfg, clock=lambda: cluster.now)
    cache.replace_nodes(cluster.nodes)
    cache.replace_pods(cluster.pods)
    cache.refresh_availability()
    gates = {v.name: _node_gate(v) for v in map(NodeView, cluster.nodes)}
    names = sorted(n for n in cache.nodes if not gates.get(n))
    rejected = {n: why for n, why in gates.items() if why and n in cache.nodes}
    shapes = shapes_from_state(cache.state)
    gpu_policy = pod.gpu_policy or cfg.scheduling.gpu_policy
    results = []
    codes: dict[str, str] = {}
    first = True
    for policy in policies:
        cache.engine.configure(policy, gpu_policy, shapes)
        # The pod's own policy annotations would override the engine's default: simulate each
        # policy as asked, keep the pod's GPU policy.
        probe = replace(pod, node_policy=None)
        ok, failed, scores = cache.evaluate(probe, names)
        if first:
            rejected.update({n: detail(f, cache.state.nodes.get(n)) for n, f in failed.items()})
            codes = {n: f.code.value for n, f in failed.items()}
            first = False
        ranking = sorted(scores.items(), key=lambda kv: (-kv[1], cache.state.nodes[kv[0]].idx))
        decision = cache.engine.choose(probe, ok) if ok else None
        norm = normalise_scores(dict(scores))
        if decision is None:
            results.append(PolicyResult(policy, None, None, [], ranking, norm))
        else:
            results.append(PolicyResult(policy, decision.node, decision.score,
                                        _plan_gpus(cache, decision.node, probe, decision.plan), ranking, norm))
    return Simulation(pod, results, rejected, codes, gpu_policy, len(cache.nodes))


def _cut(text: str, width: int = WIDTH) -> str:
    text = safe(text)
    return text if len(text) <= width else text[: width - 1] + "~"


def _describe(pod: PodRequest) -> str:
    parts = []
    for c in pod.containers:
        mem = f"{c.memory_mib} MiB" if c.memory_mib else f"{c.memory_percent}% memory"
        parts.append(f"{c.name}{' (init)' if c.init else ''}: {c.count} GPU x {mem}, {c.cores}% cores")
    return "; ".join(parts) if parts else "no vGPU request"


def _wrap(text: str, indent: str = "      ") -> list[str]:
    return textwrap.wrap(safe(text), WIDTH, subsequent_indent=indent, break_long_words=True) or [""]


def render_table(sim: Simulation) -> str:
    """The human report; every line is at most 80 characters (reasons are wrapped, not cut)."""
    out = _wrap(f"POD {sim.pod.key}  ({_describe(sim.pod)})", "    ")
    out += _wrap(f"    {sim.nodes} nodes, GPU policy {sim.gpu_policy}; dry run, nothing is written", "    ")
    out.append("")
    pw = max([6] + [len(r.policy) for r in sim.results])
    nw = 24
    out.append(f"{'POLICY':<{pw}}  {'NODE':<{nw}}  {'SCORE':>9}  GPUS (MiB)")
    out += _wrap("  SCORE: 0-10 as the extender gives kube-scheduler (best feasible node 10, worst 0), "
                 "comparable across policies; each policy's raw score and its scale are in the rankings", "  ")
    for r in sim.results:
        if r.node is None:
            out.append(f"{r.policy:<{pw}}  {'(fits nowhere)':<{nw}}  {'-':>9}  -")
            continue
        gpus = " ".join(f"#{g['index']}:{g['memoryMiB']}" for cont in r.gpus for g in cont)
        out.append(_cut(f"{r.policy:<{pw}}  {_cut(r.node, nw):<{nw}}  {r.normalised.get(r.node, 0):>9}  {gpus}"))
    out.append("")
    ranked = [r for r in sim.results if len(r.ranking) > 1]
    for r in ranked:
        ranks = ", ".join(f"{n} {r.normalised.get(n, 0)} (raw {s:.4g})" for n, s in r.ranking[:5])
        more = f" (+{len(r.ranking) - 5} more)" if len(r.ranking) > 5 else ""
        out += _wrap(f"{r.policy} ranking (raw: {node_policy(r.policy).doc}): {ranks}{more}", "    ")
    if ranked:
        out.append("")
    if sim.rejected:
        out.append("REJECTED")
        for node, why in sorted(sim.rejected.items()):
            out += _wrap(f"  {node}: {why}")
    elif not sim.nodes:  # nothing to place on: "no node rejected it" would read as if it fits
        out.append("No node in the cluster (or the snapshot) to place the pod on.")
    else:
        out.append("No node rejected the pod.")
    return "\n".join(out) + "\n"


def to_json(sim: Simulation) -> dict[str, Any]:
    return {
        "pod": sim.pod.key, "gpuPolicy": sim.gpu_policy, "nodes": sim.nodes, "dryRun": True,
        "policies": [{"policy": r.policy, "node": r.node, "score": r.score,
                      "extenderScore": r.normalised.get(r.node) if r.node else None, "containers": r.gpus,
                      "ranking": [{"node": n, "score": s, "extenderScore": r.normalised.get(n, 0)}
                                  for n, s in r.ranking]} for r in sim.results],
        "rejected": dict(sorted(sim.rejected.items())),
        "rejectedCodes": dict(sorted(sim.codes.items())),
    }
