"""Node scores for pods that carry DRA claims (the extender's ``/dra-prioritize`` verb).

On the DRA path kube-scheduler's own allocator places a claim's devices first fit by GPU index on
whichever node kube-scheduler's GPU-blind scores prefer (docs/dra-placement.md). With
``--dra-scoring`` the extender ranks the candidate nodes of a pod whose claims ask kube-vgpu's
DeviceClasses with the same placement policy as vGPU pods (``scheduling.nodePolicy``; the scorer
built by :func:`kube_vgpu.placement.policies.make_policy`), applied to the placement the allocator
will make: its first fit by the published GPU order. It only ranks: kube-scheduler's
DynamicResources plugin filters and allocates, and a node where the claims cannot fit scores 0.

What the scores are computed from:

* the GPUs and what allocated claims hold of them: :func:`kube_vgpu.dra.capacity.node_capacity`
  over our driver's ResourceSlices and the ResourceClaims' ``status.allocation`` (written by the
  control plane; a claim allocated and not yet reserved counts as used), kept current by two
  list+watch loops (:class:`kube_vgpu.kubeapi.Reflector` over :class:`DraListWatch`);
* what the pod asks: its claims, looked up **in the pod's namespace only** (``spec.resourceClaims``
  ``resourceClaimName``, or for a template the claim named in ``status.resourceClaimStatuses``,
  which must be owned by the pod), their ``exactly`` requests against our classes
  (:func:`kube_vgpu.dra.capacity.claim_requests`). The claim spec is the tenant's wish: it only
  predicts, nothing is booked from it. Annotations and labels are never read.

A pod without such claims, one whose claims are already allocated, not yet created, or not
predictable (``firstAvailable``, ``allocationMode: All``) gets all zeros: no preference.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np
import urllib3

from kube_vgpu.dra import CAPACITY_CORES, CAPACITY_MEMORY, DEVICE_CLASS, DRIVER_NAME
from kube_vgpu.dra.capacity import (
    ClaimSpecError,
    DraDevice,
    NodeCapacity,
    Share,
    Totals,
    allocated,
    claim_requests,
    claim_shares,
    nodes_of,
    pools,
)
from kube_vgpu.errors import ShapeError
from kube_vgpu.kubeapi import Gone, JSONClient
from kube_vgpu.model import ContainerRequest, GPUDevice, PodRequest
from kube_vgpu.placement.fastpath import normalise_array
from kube_vgpu.placement.fit import ORDER_INDEX, gpu_order
from kube_vgpu.placement.memo import BoundedMemo
from kube_vgpu.placement.policies import Policy, TaskShape, make_policy
from kube_vgpu.placement.state import NodeState
from kube_vgpu.placement.status import FitFailure
from kube_vgpu.policyregistry import GPU_SPREAD
from kube_vgpu.views import ListView, ObjectView, PodView

log = logging.getLogger("kube_vgpu.scheduler.dra")

Obj = dict[str, Any]

#: the kinds watched and their cluster-wide API paths (resource.k8s.io/v1)
PATHS = {"resourceslices": "/apis/resource.k8s.io/v1/resourceslices",
         "resourceclaims": "/apis/resource.k8s.io/v1/resourceclaims"}

#: the most devices (the sum of the counts of all its requests of our classes) a pod's claims may
#: ask and still be predicted: every prediction fits each request on every node state, so a
#: tenant's pod of 32 claims x 32 one-device requests would otherwise hold the extender's event
#: loop (the vGPU path's filter and bind too) for seconds per scoring call
MAX_PREDICTED_DEVICES = 64
#: the most claims a pod may use and still be predicted (each is looked up and read on every call;
#: a pod spec can list thousands)
MAX_PREDICTED_CLAIMS = 32


class WatchError(Exception):
    """A list or watch request of :class:`DraListWatch` was answered with an HTTP error."""


class DraListWatch:
    """:class:`kube_vgpu.kubeapi.ListWatch` for ``resourceslices`` and ``resourceclaims`` (all
    namespaces), over the extender's client connections (:class:`kube_vgpu.kubeapi.JSONClient`:
    same host, TLS and bearer token). Blocking; called from the reflector threads."""

    def __init__(self, api_client: Any, timeout: float = 10.0):
        self.http = JSONClient(api_client, timeout)
        self.configuration = api_client.configuration
        self.base = str(self.configuration.host).rstrip("/")
        #: the generated client's urllib3 pool (host, TLS, proxy), for the streaming watch
        self.pool: urllib3.PoolManager = api_client.rest_client.pool_manager

    @staticmethod
    def _path(kind: str, query: dict[str, str]) -> str:
        path = PATHS.get(kind)
        if path is None:
            raise ValueError(f"kind: {kind!r} is not watched here; allowed: {', '.join(PATHS)}")
        return f"{path}?{urlencode(query, quote_via=quote)}" if query else path

    def list_objects(self, kind: str, label_selector: str | None = None,
                     field_selector: str | None = None) -> tuple[list[Obj], str]:
        """(items, the list's resourceVersion). Raises ApiException / urllib3 errors as JSONClient."""
        q = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        body = ListView(self.http.request("GET", self._path(kind, q)))
        return list(body.items), body.resource_version

    def watch_objects(self, kind: str, resource_version: str, timeout_seconds: int,
                      label_selector: str | None = None, field_selector: str | None = None) -> Any:
        """A watch from ``resource_version`` with bookmarks: the streaming urllib3 response. Raises
        :class:`~kube_vgpu.kubeapi.Gone` for HTTP 410, :class:`WatchError` for other HTTP errors."""
        q = {"watch": "true", "allowWatchBookmarks": "true", "resourceVersion": resource_version,
             "timeoutSeconds": str(timeout_seconds)}
        q.update({k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v})
        cfg = self.configuration
        headers = {"Accept": "application/json"}
        auth = cfg.auth_settings().get("BearerToken")
        if auth and auth.get("value"):
            headers["Authorization"] = str(auth["value"])
        resp = self.pool.request("GET", self.base + self._path(kind, q), headers=headers,
                                      preload_content=False,
                                      timeout=urllib3.Timeout(connect=10, read=timeout_seconds + 30))
        if resp.status >= 400:
            try:
                text = resp.data.decode("utf-8", "replace")[:300]
            finally:
                resp.release_conn()
            if resp.status == 410:
                raise Gone(text)
            raise WatchError(f"watch {kind}: HTTP {resp.status}: {text}")
        return resp


def parse_device_classes(values: Sequence[str]) -> dict[str, str]:
    """``--dra-device-class`` values (``NAME`` or ``NAME=MODEL``) -> {class name: GPU model ("" any)}.
    None given: the chart's default class (:data:`kube_vgpu.dra.DEVICE_CLASS`, any model).
    Raises ValueError naming a value that is not a DNS subdomain (with an optional model)."""
    out: dict[str, str] = {}
    for v in values:
        name, _, model = v.partition("=")
        if not name or len(name) > 253 or not all(
                p and p[0].isalnum() and p[-1].isalnum() and all(c.islower() or c.isdigit() or c == "-" for c in p)
                for p in name.split(".")):
            raise ValueError(f"--dra-device-class {v!r}: allowed: NAME or NAME=MODEL, NAME a DNS subdomain "
                             "(lower-case letters, digits, '-', '.')")
        out[name] = model
    return out or {DEVICE_CLASS: ""}


def _node_state(cap: NodeCapacity, idx: int) -> NodeState:
    """The placement engine's view of one DRA node: one GPU per published device (in the
    allocator's order), free memory / cores / shares after what allocated claims hold. A
    shareable device has as many slots as it has cores (every share consumes at least 1);
    one that is not shareable has 1."""
    devs = tuple(GPUDevice(uuid=d.uuid or f"{cap.pool}/{d.name}", index=d.index if d.index >= 0 else i,
                           model=d.model, memory_mib=d.memory_mib, cores=d.cores,
                           split=max(1, d.cores) if d.shared else 1, healthy=d.healthy)
                 for i, d in enumerate(cap.devices))
    n = NodeState(cap.node, idx, devs)
    for i, (g, u) in enumerate(zip(devs, cap.used, strict=True)):
        n.free_mem[i], n.free_cores[i] = cap.free(i)
        n.free_slots[i] = max(0, g.split - u.shares)
    return n


def pod_request(pod: Mapping[str, Any], claims: Mapping[tuple[str, str], Obj],
                classes: Mapping[str, str]) -> PodRequest | None:
    """What ``pod`` asks of our DeviceClasses through its claims, as one PodRequest (one
    container request per claim request, claims in the pod's order), or None when there is
    nothing to predict (module docstring). ``claims``: the watch cache by (namespace, name)."""
    try:
        view = PodView(pod)
        ns, uid = view.namespace, view.uid
        refs, statuses = view.spec.get("resourceClaims"), view.status.get("resourceClaimStatuses")
    except ShapeError:
        return None
    if not isinstance(refs, list) or not refs or len(refs) > MAX_PREDICTED_CLAIMS:
        return None
    generated = {s.get("name"): s.get("resourceClaimName") for s in statuses or ()
                 if isinstance(s, Mapping)} if isinstance(statuses, list) else {}
    reqs: list[ContainerRequest] = []
    models: set[str] = set()
    seen: set[str] = set()
    for ref in refs:
        if not isinstance(ref, Mapping):
            return None
        template = ref.get("resourceClaimTemplateName")
        name = ref.get("resourceClaimName") if not template else generated.get(ref.get("name"))
        if not isinstance(name, str) or not name:
            return None  # a template's claim not created yet: kube-scheduler waits for it
        if name in seen:
            continue
        seen.add(name)
        claim = claims.get((ns, name))  # the pod's namespace only
        if claim is None:
            return None
        try:
            owners = ObjectView(claim).owner_references
        except ShapeError:
            return None
        if template and not (uid and any(o.get("uid") == uid and o.get("controller") is True for o in owners)):
            return None  # a generated claim must be the pod's own (as kube-scheduler checks)
        if allocated(claim):
            return None  # already placed: nothing to rank
        try:
            wants = claim_requests(claim, classes)
        except ClaimSpecError as e:
            log.debug("claim not predicted", extra={"pod": f"{ns}/{view.name}", "error": str(e)})
            return None
        for r in wants:
            models.add(r.model)
            reqs.append(ContainerRequest(name=r.name, init=False, count=r.count, memory_mib=r.memory_mib or 0,
                                         memory_percent=0 if r.memory_mib else 100,
                                         cores=r.cores if r.cores is not None else 100))
    if not reqs:
        return None
    if sum(r.count for r in reqs) > MAX_PREDICTED_DEVICES:
        log.debug("claims not predicted", extra={"pod": f"{ns}/{view.name}",
                                                 "error": f"more than {MAX_PREDICTED_DEVICES} devices"})
        return None
    spec = tuple(models) if len(models) == 1 and "" not in models else ()
    return PodRequest(namespace=ns, name=view.name, uid=uid, app=tuple(reqs), gpu_spec=spec)


_MALFORMED = "(malformed)"  #: stands in a kept claim for a value of the wrong type (the reader refuses it alike)


def _kept_request(r: object, classes: Mapping[str, str]) -> object:
    """What :func:`kube_vgpu.dra.capacity.claim_requests` reads of one request: its name, whether
    a ``firstAvailable`` entry names one of ``classes``, and an ``exactly`` of ours (class, mode,
    count, capacity requests; an unknown capacity name kept alone, as it is refused)."""
    if not isinstance(r, Mapping):
        return _MALFORMED
    out: Obj = {}
    if isinstance(r.get("name"), str):
        out["name"] = r["name"]
    fa = r.get("firstAvailable")
    if isinstance(fa, list):
        out["firstAvailable"] = [{"deviceClassName": s["deviceClassName"]} for s in fa
                                 if isinstance(s, Mapping) and s.get("deviceClassName") in classes][:1]
    ex = r.get("exactly")
    if isinstance(ex, Mapping) and ex.get("deviceClassName") in classes:
        kept = {k: ex[k] for k in ("deviceClassName", "allocationMode", "count") if k in ex}
        if "capacity" in ex:
            cap = ex["capacity"]
            wants = cap.get("requests") if isinstance(cap, Mapping) else None
            if isinstance(wants, Mapping):
                bad = [k for k in wants if k not in (CAPACITY_MEMORY, CAPACITY_CORES)]
                wants = {bad[0]: None} if bad else dict(wants)
            elif wants is not None:
                wants = _MALFORMED
            kept["capacity"] = {"requests": wants}
        out["exactly"] = kept
    return out


def kept_claim(obj: Obj, classes: Mapping[str, str], driver: str = DRIVER_NAME) -> Obj:
    """The part of a ResourceClaim the scorer reads (:func:`pod_request`, :func:`claim_shares`,
    :func:`allocated`): name, namespace, uid, controller owner references, the requests as
    :func:`_kept_request` keeps them, and ``driver``'s allocation results. A tenant pads a claim
    with megabytes (opaque config, CEL selectors, annotations, many requests of other classes)
    and the extender keeps every claim of the cluster: only these few KB are held. Values of the
    wrong type are kept as a marker the readers refuse in the same way."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    m: Obj = {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}
    owners = meta.get("ownerReferences")
    if isinstance(owners, list):
        m["ownerReferences"] = [
            {"uid": o.get("uid"), "controller": True} if isinstance(o, Mapping) else _MALFORMED
            for o in owners if not isinstance(o, Mapping) or o.get("controller") is True]
    elif owners is not None:
        m["ownerReferences"] = _MALFORMED
    out: Obj = {"metadata": m}
    spec = obj.get("spec")
    if isinstance(spec, Mapping):
        devices = spec.get("devices")
        reqs = devices.get("requests") if isinstance(devices, Mapping) else None
        if isinstance(reqs, list):
            out["spec"] = {"devices": {"requests": [_kept_request(r, classes) for r in reqs]}}
        else:
            out["spec"] = {"devices": {"requests": _MALFORMED}} if reqs is not None else {}
    elif spec is not None:
        out["spec"] = _MALFORMED
    status = obj.get("status")
    if isinstance(status, Mapping):
        alloc = status.get("allocation")
        if isinstance(alloc, Mapping):
            devs = alloc.get("devices")
            results = devs.get("results") if isinstance(devs, Mapping) else None
            alloc = {"devices": {"results": [
                {k: r[k] for k in ("driver", "pool", "device", "consumedCapacity") if k in r}
                for r in results if isinstance(r, Mapping) and r.get("driver") == driver]}} \
                if isinstance(results, list) else {}
        elif alloc is not None:
            alloc = _MALFORMED
        out["status"] = {} if alloc is None else {"allocation": alloc}
    elif status is not None:
        out["status"] = _MALFORMED
    return out


class DraScorer:
    """The extender's view of the DRA path and its node scores.

    classes: our DeviceClasses -> GPU model ("" any) (:func:`parse_device_classes`); driver: the
    driver name whose slices and claim results count. Fed by :meth:`replace` / :meth:`event` (on
    the extender's event loop). What claims hold is kept per device as events come
    (:class:`~kube_vgpu.dra.capacity.Totals`: O(results) per claim event); the pools are read again
    after a slice changes; a node's placement view is rebuilt only when its capacity changed, and
    policy scores are shared by nodes in the same state (memo on the node's signature)."""

    def __init__(self, classes: Mapping[str, str] | None = None, driver: str = DRIVER_NAME,
                 memo_entries: int = 200_000):
        self.classes = dict(classes) if classes else {DEVICE_CLASS: ""}
        self.driver = driver
        self.slices: dict[str, Obj] = {}
        self.claims: dict[tuple[str, str], Obj] = {}
        self.synced: dict[str, bool] = dict.fromkeys(PATHS, False)
        self._pools: dict[str, tuple[str, tuple[DraDevice, ...]]] | None = None
        self._node_pool: dict[str, str] = {}
        self._totals = Totals()
        self._shares: dict[tuple[str, str], tuple[Share, ...]] = {}
        #: node -> (its placement view, that view's signature), valid until its pool changes
        self._states: dict[str, tuple[NodeState, tuple[object, ...]]] = {}
        self._dirty: set[str] = set()  #: pools whose claims changed since their node's view was made
        self._policies: dict[tuple[str, int], Policy] = {}
        #: (policy, request shape, node signature) -> policy score (-inf: does not fit)
        self._memo: BoundedMemo[tuple[object, ...], float] = BoundedMemo(memo_entries, lru=False)

    # -- feeding -----------------------------------------------------------------------------
    def _key(self, kind: str, obj: Obj) -> Any:
        v = ObjectView(obj)
        return v.name if kind == "resourceslices" else (v.namespace, v.name)

    def _set_claim(self, key: tuple[str, str], obj: Obj | None) -> None:
        old = self._shares.pop(key, ())
        self._totals.add(old, -1)
        self.claims.pop(key, None)
        shares = claim_shares(obj, self.driver) if obj is not None else ()
        if obj is not None:
            self.claims[key] = kept_claim(obj, self.classes, self.driver)
        if shares:
            self._shares[key] = shares
            self._totals.add(shares)
        if old != shares:
            self._dirty.update(sh.pool for sh in old + shares)

    def replace(self, kind: str, items: Sequence[Obj], resource_version: str = "") -> None:
        """A (re)list of ``kind`` (``resourceslices`` | ``resourceclaims``): the full set (the
        list's ``resource_version`` is not needed: the reflector watches from it)."""
        store: dict[Any, Obj] = {}
        for o in items:
            try:
                store[self._key(kind, o)] = o
            except ShapeError:
                continue
        if kind == "resourceslices":
            if store != self.slices:  # a periodic relist of unchanged slices keeps every view
                self.slices = store
                self._pools = None
        else:
            old = self._shares
            self.claims, self._shares, self._totals = {}, {}, Totals()
            for key, o in store.items():
                self.claims[key] = kept_claim(o, self.classes, self.driver)
                shares = claim_shares(o, self.driver)
                if shares:
                    self._shares[key] = shares
                    self._totals.add(shares)
            for key in old.keys() | self._shares.keys():  # only pools whose shares differ change
                if old.get(key) != self._shares.get(key):
                    self._dirty.update(sh.pool for sh in old.get(key, ()) + self._shares.get(key, ()))
        self.synced[kind] = True

    def event(self, kind: str, typ: str, obj: Obj) -> None:
        """A watch event (ADDED / MODIFIED / DELETED) of ``kind``."""
        try:
            key = self._key(kind, obj)
        except ShapeError:
            return
        if kind == "resourceslices":
            if typ == "DELETED":
                self.slices.pop(key, None)
            else:
                self.slices[key] = obj
            self._pools = None
        else:
            self._set_claim(key, None if typ == "DELETED" else obj)

    @property
    def ready(self) -> bool:
        """Both kinds have been listed."""
        return all(self.synced.values())

    def _pool_map(self) -> dict[str, tuple[str, tuple[DraDevice, ...]]]:
        if self._pools is None:
            self._pools = pools(self.slices.values(), self.driver)
            self._node_pool = nodes_of(self._pools)
            self._states.clear()
        return self._pools

    def node_capacity(self, name: str) -> NodeCapacity | None:
        """DRA node ``name``'s GPUs and what allocated claims hold, or None without GPUs of ours."""
        by_pool = self._pool_map()
        pname = self._node_pool.get(name)
        if pname is None:
            return None
        return self._totals.capacity(name, pname, by_pool[pname][1])

    def capacity(self) -> dict[str, NodeCapacity]:
        """Per node: GPUs and what allocated claims hold (as :func:`kube_vgpu.dra.capacity.node_capacity`)."""
        self._pool_map()
        return {n: c for n in self._node_pool if (c := self.node_capacity(n)) is not None}

    def _view(self, name: str) -> tuple[NodeState, tuple[object, ...]] | None:
        """(placement view, its signature) of DRA node ``name``; None without GPUs of ours."""
        self._pool_map()
        pname = self._node_pool.get(name)
        if pname is None:
            return None
        hit = self._states.get(name)
        if hit is None or pname in self._dirty:
            cap = self.node_capacity(name)
            assert cap is not None
            n = _node_state(cap, 0)
            hit = self._states[name] = (n, n.signature())
            self._dirty.discard(pname)
        return hit

    def node_state(self, name: str) -> NodeState | None:
        """The placement view of DRA node ``name``, or None when it publishes no GPUs of ours."""
        v = self._view(name)
        return None if v is None else v[0]

    # -- scoring -----------------------------------------------------------------------------
    def policy(self, node_policy: str, shapes: list[TaskShape] | None) -> Policy:
        """``node_policy``'s scorer (the registry's), choosing GPUs as the allocator does: first
        fit in the published order. Raises ValueError as make_policy does."""
        key = (node_policy, id(shapes))
        p = self._policies.get(key)
        if p is None:
            p = make_policy(node_policy, GPU_SPREAD.name, shapes)  # the GPU order is replaced next
            p.order = gpu_order(ORDER_INDEX)
            p.order_kind = ORDER_INDEX
            self._policies = {key: p}  # one policy at a time (config or shapes changed: rebuilt)
            self._memo.clear()
        return p

    def raw_scores(self, pod: Mapping[str, Any], names: Sequence[str], node_policy: str,
                   shapes: list[TaskShape] | None) -> np.ndarray | None:
        """Policy scores (float64, -inf where the claims do not fit or the node publishes no GPUs
        of ours), or None when the pod has nothing to predict."""
        if not self.ready:
            return None
        req = pod_request(pod, self.claims, self.classes)
        if req is None:
            return None
        try:
            pol = self.policy(node_policy, shapes)
        except ValueError as e:
            log.warning("DRA scoring: no policy", extra={"policy": node_policy, "error": str(e)})
            return None
        raw = np.full(len(names), -math.inf, dtype=np.float64)
        shape = (node_policy, tuple((c.count, c.memory_mib, c.memory_percent, c.cores) for c in req.app), req.gpu_spec)
        memo = self._memo
        for k, name in enumerate(names):
            view = self._view(name)
            if view is None:
                continue
            mkey = (shape, view[1])
            v = memo.get(mkey)
            if v is None:
                r = pol.evaluate(view[0], req)
                v = memo.put(mkey, -math.inf if isinstance(r, FitFailure) else r[0])
            raw[k] = v
        return raw

    def scores(self, pod: Mapping[str, Any], names: Sequence[str], node_policy: str,
               shapes: list[TaskShape] | None) -> np.ndarray:
        """HostPriority scores 0..10 (int64) aligned with ``names``: the policy's ranking of the
        nodes where the claims fit, 0 where they do not; all 0 when nothing is predicted. The best
        node (the first of the highest policy score) alone keeps 10: a node that scores less but
        rounds to 10 gets 9, so kube-scheduler's own scores never outvote the policy's choice
        (with the chart's weight) unless the policy scores tie exactly."""
        out = np.zeros(len(names), dtype=np.int64)
        raw = self.raw_scores(pod, names, node_policy, shapes) if len(names) else None
        if raw is None:
            return out
        ok = raw > -math.inf
        if ok.any():
            out[ok] = normalise_array(raw[ok])
            best = int(np.argmax(raw))
            out[(out == out[best]) & (raw < raw[best])] -= 1
        return out


__all__ = ["MAX_PREDICTED_CLAIMS", "MAX_PREDICTED_DEVICES", "PATHS", "DraListWatch", "DraScorer", "WatchError", "kept_claim", "parse_device_classes", "pod_request"]
