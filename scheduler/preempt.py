"""The extender's ``preemptVerb``: GPU-aware victims for kube-scheduler's preemption.

kube-scheduler (``pkg/scheduler/framework/preemption``) first finds candidate nodes and victims
itself, with its own filters only; those cannot see vGPU resources (``ignoredByScheduler``). It
then posts ``ExtenderPreemptionArgs`` to ``<urlPrefix>/<preemptVerb>`` and replaces its candidates
with the answer (``k8s.io/kube-scheduler/extender/v1``; no JSON tags, so the keys are the Go field
names):

* request: ``{Pod, NodeNameToVictims: {node: {Pods: [Pod], NumPDBViolations}} | null,
  NodeNameToMetaVictims: {node: {Pods: [{UID}], NumPDBViolations}} | null}``; with
  ``nodeCacheCapable: true`` only ``NodeNameToMetaVictims`` is set.
* answer: ``ExtenderPreemptionResult {NodeNameToMetaVictims: {node: {Pods: [{UID}],
  NumPDBViolations}}}``. A node left out is no longer a candidate. kube-scheduler looks each UID up
  among the pods on that node in its own snapshot (an unknown one fails the whole preemption
  attempt), so an answer may name any pod on the node, not only those proposed; a node answered
  with no pod is an error for a non-ignorable extender, so such a node is left out instead.
  ``NumPDBViolations`` is taken as answered, and the first pod is read as the highest-priority
  victim (the list is ordered highest priority first).

What this extender answers, per node (domain rules: :mod:`kube_vgpu.placement.preempt`):

* victims it adds are pods its own cache books on that node (verified allocation records), with a
  known ``spec.priority`` lower than the preemptor's: the request body contributes UIDs only;
* kube-scheduler's own victims are kept (its filters, CPU, memory, pod count, need them) and are
  removed first: a UID the cache books on that node with a lower priority counts as freeing its
  GPUs; a UID the cache does not know at all (a pod without GPUs) is passed through unchanged;
  a UID the cache books elsewhere, or with an equal, higher or unknown priority, is left out;
* the node is left out when it is unknown, not a candidate (stale inventory, no allocatable), or
  no set of lower-priority pods makes room;
* ``NumPDBViolations`` is kube-scheduler's count for its own victims (the extender does not watch
  PodDisruptionBudgets; the pods it adds are not counted).

Nothing here changes the cache, books, releases or writes anything: the answer is advice, and
capacity is freed only when the victims are actually deleted (their watch events).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kube_vgpu.cluster import pod_key, pod_priority
from kube_vgpu.errors import RequestError, ShapeError
from kube_vgpu.placement.fit import gpu_order
from kube_vgpu.placement.preempt import DEFAULT_BUDGET, Holder, VictimSet, select_victims
from kube_vgpu.placement.render import summary
from kube_vgpu.placement.status import NO_INVENTORY, FitFailure
from kube_vgpu.podshape import check_pod_placement, key_path
from kube_vgpu.podspec import parse_pod, pod_asks
from kube_vgpu.views import PodView

if TYPE_CHECKING:
    from .bindstate import BindCache

log = logging.getLogger("kube_vgpu.scheduler")

Obj = dict[str, Any]


def _victims_shape(args: Obj, field: str, meta: bool) -> None:
    """Check ``args[field]`` (node name -> ``{Pods, NumPDBViolations}`` or null). Raises ShapeError."""
    m = args.get(field)
    if m is None:
        return
    if not isinstance(m, dict):
        raise ShapeError(field, m, "an object of node name -> victims")
    for node, v in m.items():
        if v is None:
            continue
        f = key_path(field, node)
        if not isinstance(v, dict):
            raise ShapeError(f, v, "an object {Pods, NumPDBViolations}")
        n = v.get("NumPDBViolations")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ShapeError(f"{f}.NumPDBViolations", n, "a whole number >= 0")
        pods = v.get("Pods")
        if pods is None:
            continue
        if not isinstance(pods, list):
            raise ShapeError(f"{f}.Pods", pods, "a list")
        for i, p in enumerate(pods):
            if not meta:
                check_pod_placement(p, f"{f}.Pods[{i}]")
            elif not isinstance(p, dict):
                raise ShapeError(f"{f}.Pods[{i}]", p, "an object {UID: string}")
            elif not isinstance(p.get("UID"), str):
                raise ShapeError(f"{f}.Pods[{i}].UID", p.get("UID"), "a string")


def check_preemption_args(args: Any) -> str | None:
    """Shape check of ``ExtenderPreemptionArgs`` (only what is read; the pods as
    :func:`kube_vgpu.podshape.check_pod_placement` checks them): None when usable, else the
    :class:`~kube_vgpu.errors.ShapeError` text naming the field, the JSON type found and what is
    allowed (``NodeNameToMetaVictims["n0"].Pods[0].UID must be a string, got a number``)."""
    try:
        if not isinstance(args, dict):
            raise ShapeError("ExtenderPreemptionArgs", args, "an object (ExtenderPreemptionArgs)")
        check_pod_placement(args.get("Pod"), "Pod")
        _victims_shape(args, "NodeNameToMetaVictims", True)
        _victims_shape(args, "NodeNameToVictims", False)
    except ShapeError as e:
        return str(e)
    return None


def proposed(args: Obj) -> dict[str, tuple[list[str], int]]:
    """Node -> (victim UIDs in kube-scheduler's order, its NumPDBViolations), from
    ``NodeNameToMetaVictims`` or else ``NodeNameToVictims`` (only the pods' ``metadata.uid`` is read)."""
    out: dict[str, tuple[list[str], int]] = {}
    meta = args.get("NodeNameToMetaVictims")
    full = args.get("NodeNameToVictims")
    src = meta if isinstance(meta, dict) else full if isinstance(full, dict) else {}
    for node, v in src.items():
        v = v or {}
        uids = []
        for p in v.get("Pods") or []:
            uid = p.get("UID") if src is meta else PodView(p).uid
            if isinstance(uid, str) and uid:
                uids.append(uid)
        out[str(node)] = (uids, int(v.get("NumPDBViolations") or 0))
    return out


def meta_result(victims: Mapping[str, tuple[list[str], int]]) -> Obj:
    """An ``ExtenderPreemptionResult`` from node -> (UIDs, NumPDBViolations)."""
    return {"NodeNameToMetaVictims": {n: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
                                      for n, (uids, pdb) in victims.items()}}


@dataclass(frozen=True, slots=True)
class NodeAnswer:
    """One node's answer: the victims' UIDs (kube-scheduler's pass-through ones first, then ours,
    highest priority first) and why, as data (:func:`answer_text` renders it): ``failure`` when the
    node is not a candidate (no inventory, or why the cache holds it unavailable); ``choice`` the
    victim set found (None: no set of lower-priority pods makes room, or the node is not a
    candidate); ``ignored``: how many of kube-scheduler's victims the answer leaves out."""

    uids: tuple[str, ...]
    choice: VictimSet | None = None
    failure: FitFailure | None = None
    ignored: int = 0


def answer_text(a: NodeAnswer) -> str:
    """Why a node is answered as it is, for the log (fit failures as
    :func:`kube_vgpu.placement.render.summary` words them)."""
    if a.failure is not None:
        return f"not a candidate: {summary(a.failure)}"
    if a.choice is None:
        return "no set of lower-priority pods makes room"
    if not a.uids:
        return "the pod fits without evicting any pod the extender knows"
    return f"{len(a.choice.added)} added, {a.ignored} proposed ignored"


class PreemptMetrics:
    """``kube_vgpu_scheduler_preempt_seconds`` (handler latency), ``preempt_nodes_total{outcome}``
    (nodes answered: ``kept`` or ``dropped``) and ``preempt_victims_total`` (pods the extender
    added to kube-scheduler's victims), on the service's registry."""

    def __init__(self, registry: CollectorRegistry):
        p = "kube_vgpu_scheduler_"
        self.seconds = Histogram(p + "preempt_seconds", "Preempt handler latency", registry=registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.nodes = Counter(p + "preempt_nodes", "Candidate nodes answered by the preempt verb, by outcome "
                                                  "(kept: with victims; dropped: preemption there cannot help)",
                             ["outcome"], registry=registry)
        self.victims = Counter(p + "preempt_victims", "Pods the preempt verb added to kube-scheduler's victims",
                               registry=registry)


class Preemption:
    """The preempt verb over the extender's cache (a :class:`scheduler.bindstate.BindCache`).
    Read-only: it never changes the cache."""

    #: fit checks the exact searches of one request may spend over all its nodes together (the
    #: handler runs on the event loop; kube-scheduler sends up to ~100 candidate nodes): nodes
    #: beyond it get the greedy reprieve (about one check per pod on the node)
    request_budget = 30_000

    def __init__(self, cache: BindCache, metrics: PreemptMetrics):
        self.cache = cache
        self.metrics = metrics

    def preemptor_priority(self, pod: Obj) -> int:
        """The preemptor's priority: from the pod as the cache's watch shows it (same uid), else
        from the request body."""
        view = PodView(pod)
        uid = view.uid
        watched = self.cache.pod_to_bind(view.key, uid) if uid else None
        return pod_priority(watched if watched is not None else pod)

    def holders(self, node: str) -> tuple[list[Holder], dict[str, str]]:
        """The pods the cache books on ``node`` with a known priority, as preemption candidates,
        and uid -> key of every pod the cache books on it."""
        out: list[Holder] = []
        uids: dict[str, str] = {}
        st = self.cache.state
        for key in sorted(self.cache.pods_by_node.get(node, ())):
            info = self.cache.pods.get(key)
            b = st.bookings.get(key)
            if info is None or b is None or b.node != node or self.cache.booked_uid.get(key) != info.uid:
                continue
            uids[info.uid] = key
            if info.priority is not None:
                out.append(Holder(key, info.uid, info.priority, b.usage, b.cpu_milli, b.memory_mib))
        return out, uids

    def answer(self, pod: Obj, victims: Mapping[str, tuple[list[str], int]]) -> dict[str, NodeAnswer]:
        """Per node of ``victims`` (kube-scheduler's proposal): the victims to answer, or why the
        node is left out. Raises RequestError when the pod's request cannot be parsed."""
        cfg = self.cache.config
        req = parse_pod(pod, cfg)
        prio = self.preemptor_priority(pod)
        order = gpu_order(req.gpu_policy or self.cache.engine.gpu_policy)
        promise = self.cache.state.assumed.get(req.key)
        uid = PodView(pod).uid
        everywhere = {info.uid for info in self.cache.pods.values()}
        out: dict[str, NodeAnswer] = {}
        left = self.request_budget  # fit checks for the exact search over all nodes of this request
        for node, (uids, _pdb) in victims.items():
            ns = self.cache.state.nodes.get(node)
            if ns is None:
                out[node] = NodeAnswer((), failure=NO_INVENTORY)
                continue
            why = self.cache.unavailable.get(node)
            if why is not None:
                out[node] = NodeAnswer((), failure=why)
                continue
            holders, on_node = self.holders(node)
            by_uid = {h.uid: h for h in holders}
            forced = {by_uid[u].key for u in uids if u in by_uid and by_uid[u].priority < prio}
            passthrough = [u for u in uids if u not in everywhere]  # kube-scheduler's own, no GPUs
            give_back = promise.usage if promise is not None and promise.node == node and promise.uid == uid else ()
            choice = select_victims(ns, req, prio, holders, forced, order, give_back,
                                    budget=max(0, min(DEFAULT_BUDGET, left)))
            if choice is not None:
                left -= choice.checks
            if choice is None:
                out[node] = NodeAnswer(())
                continue
            ours = [h.uid for h in choice.victims]
            if not passthrough and not ours:
                out[node] = NodeAnswer((), choice)
                continue
            ignored = [u for u in uids if u in on_node and u not in set(ours)] + \
                      [u for u in uids if u in everywhere and u not in on_node]
            out[node] = NodeAnswer((*passthrough, *ours), choice, ignored=len(ignored))
        return out

    def handle(self, args: Obj) -> Obj:
        """ExtenderPreemptionArgs (shape-checked) -> ExtenderPreemptionResult. A pod that asks for no
        vGPU resource gets kube-scheduler's proposal back unchanged; an unparseable request keeps no
        node."""
        t0 = time.perf_counter()
        pod = args.get("Pod") or {}
        victims = proposed(args)
        if not pod_asks(pod, self.cache.config.resource_names):
            return meta_result(victims)
        try:
            answers = self.answer(pod, victims)
        except RequestError as e:
            log.info("preemption: pod request invalid; no node kept", extra={"pod": pod_key(pod), "error": str(e)})
            self.metrics.nodes.labels(outcome="dropped").inc(len(victims))
            return meta_result({})
        kept: dict[str, tuple[list[str], int]] = {}
        names = {info.uid: key for key, info in self.cache.pods.items()}
        for node, a in answers.items():
            if a.uids:
                kept[node] = (list(a.uids), victims[node][1])
                self.metrics.nodes.labels(outcome="kept").inc()
                if a.choice is not None:
                    self.metrics.victims.inc(len(a.choice.added))
            else:
                self.metrics.nodes.labels(outcome="dropped").inc()
            log.info("preemption", extra={"pod": pod_key(pod), "node": node,
                                          "outcome": "kept" if a.uids else "dropped",
                                          "error": answer_text(a) if not a.uids else None,
                                          "victims": [names.get(u, u) for u in a.uids]})
        self.metrics.seconds.observe(time.perf_counter() - t0)
        return meta_result(kept)
