"""Object store with kube-apiserver semantics (resourceVersion, conflicts, finalizers, watch history).

Everything here is synchronous and guarded by one re-entrant lock, so the HTTP layer (running on its
own event loop thread) and tests (calling the helpers on FakeKubeAPI from the main thread) can share
it. Stored objects are never mutated in place: every write stores a fresh dict, so snapshots kept in
the watch history stay valid.
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import random
import re
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from .matching import FieldSelector, LabelSelector, lookup_path
from .patching import PatchError, json_patch, merge_patch, strategic_merge_patch

JSON = dict[str, Any]

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Gone",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An error the server answers with a `Status` object."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: JSON | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else REASONS.get(code, "")
        self.details = details
        self.headers = headers or {}

    def status(self) -> JSON:
        st: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            st["details"] = self.details
        st["code"] = self.code
        return st


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    create_on_update: bool = False
    return_deleted: bool = False
    field_labels: frozenset[str] = frozenset()
    short_names: tuple[str, ...] = ()
    has_status: bool = False

    @property
    def key(self) -> str:
        """`pods`, `nodes`, `leases.coordination.k8s.io` (kubectl's resource.group spelling)."""
        return self.plural if not self.group else f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return self.version if not self.group else f"{self.group}/{self.version}"

    @property
    def singular(self) -> str:
        return self.kind.lower()

    def details(self, name: str, **extra: Any) -> JSON:
        d: JSON = {"name": name}
        if self.group:
            d["group"] = self.group
        d["kind"] = self.plural
        d.update(extra)
        return d

    def allowed_fields(self) -> frozenset[str]:
        base = {"metadata.name"}
        if self.namespaced:
            base.add("metadata.namespace")
        return frozenset(base | set(self.field_labels))


_POD_FIELDS = frozenset(
    {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    }
)
_CORE_EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
_EVENTS_V1_FIELDS = frozenset(
    {
        "regarding.kind",
        "regarding.namespace",
        "regarding.name",
        "regarding.uid",
        "regarding.apiVersion",
        "regarding.resourceVersion",
        "regarding.fieldPath",
        "reason",
        "reportingController",
        "type",
    }
)

DEFAULT_RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "pods", "Pod", True, frozenset({"status", "binding"}), return_deleted=True,
                 field_labels=_POD_FIELDS, short_names=("po",), has_status=True),
    ResourceType("", "v1", "nodes", "Node", False, frozenset({"status"}),
                 field_labels=frozenset({"spec.unschedulable"}), short_names=("no",), has_status=True),
    ResourceType("", "v1", "namespaces", "Namespace", False, frozenset({"status"}),
                 field_labels=frozenset({"status.phase"}), short_names=("ns",), has_status=True),
    ResourceType("", "v1", "secrets", "Secret", True, field_labels=frozenset({"type"})),
    ResourceType("", "v1", "resourcequotas", "ResourceQuota", True, frozenset({"status"}), short_names=("quota",),
                 has_status=True),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)),
    ResourceType("", "v1", "services", "Service", True, frozenset({"status"}), short_names=("svc",), has_status=True),
    ResourceType("", "v1", "events", "Event", True, create_on_update=True, field_labels=_CORE_EVENT_FIELDS,
                 short_names=("ev",)),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, create_on_update=True,
                 field_labels=_EVENTS_V1_FIELDS, short_names=("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, create_on_update=True),
    ResourceType("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
                 "MutatingWebhookConfiguration", False),
    ResourceType("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations",
                 "ValidatingWebhookConfiguration", False),
    ResourceType("apps", "v1", "daemonsets", "DaemonSet", True, frozenset({"status"}), short_names=("ds",),
                 has_status=True),
    ResourceType("apps", "v1", "deployments", "Deployment", True, frozenset({"status"}), short_names=("deploy",),
                 has_status=True),
    # Dynamic Resource Allocation (stored only: no allocator, no claim controller)
    ResourceType("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False,
                 field_labels=frozenset({"spec.nodeName", "spec.driver"})),
    ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, frozenset({"status"}),
                 has_status=True),
    ResourceType("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
)


def now_rfc3339(clock: Callable[[], datetime]) -> str:
    return clock().astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_GEN_CHARS = "bcdfghjklmnpqrstvwxz2456789"

_QTY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_SUFFIX = {
    None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(q: Any) -> Decimal | None:
    if isinstance(q, bool):
        return None
    if isinstance(q, (int, float)):
        return Decimal(str(q))
    if not isinstance(q, str):
        return None
    m = _QTY.match(q.strip())
    if not m:
        return None
    try:
        num = Decimal(m.group(1))
    except InvalidOperation:
        return None
    suf = m.group(2)
    if suf and suf[0] in "eE":
        return num * (Decimal(10) ** int(suf[1:]))
    return num * _SUFFIX[suf]


def _is_extended_resource(name: str) -> bool:
    if "/" not in name:
        return False
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False
    return not name.startswith("requests.")


@dataclass
class Event:
    rv: int
    key: str
    type: str  # ADDED | MODIFIED | DELETED
    old: JSON | None
    new: JSON

    @property
    def namespace(self) -> str:
        return (self.new.get("metadata") or {}).get("namespace", "")


@dataclass(eq=False)
class Watcher:
    rtype: ResourceType
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_rv: int = 0
    closed: bool = False

    def deliver(self, ev: Event | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # loop closed
            self.closed = True

    def close(self) -> None:
        self.closed = True
        self.deliver(None)

    def matches(self, obj: JSON | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace", "") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, ev: Event) -> tuple[str, JSON] | None:
        """Map a store event to what this watcher sees (selector transitions, like the watch cache)."""
        if ev.key != self.rtype.key:
            return None
        if ev.type == "ADDED":
            return ("ADDED", ev.new) if self.matches(ev.new) else None
        if ev.type == "DELETED":
            return ("DELETED", ev.new) if self.matches(ev.new) else None
        old_m, new_m = self.matches(ev.old), self.matches(ev.new)
        if old_m and new_m:
            return ("MODIFIED", ev.new)
        if new_m:
            return ("ADDED", ev.new)
        if old_m:
            return ("DELETED", ev.new)
        return None


def field_getter(rtype: ResourceType) -> Callable[[JSON, str], Any]:
    def get(obj: JSON, path: str) -> Any:
        if path in ("spec.unschedulable", "spec.hostNetwork"):
            return bool(lookup_path(obj, path))
        if path == "source" and rtype.kind == "Event" and not rtype.group:
            return lookup_path(obj, "source.component")
        if path == "spec.serviceAccountName" and rtype.kind == "Pod":
            return lookup_path(obj, path) or ""
        return lookup_path(obj, path)

    return get


def _strip_rv(obj: JSON) -> JSON:
    o = copy.deepcopy(obj)
    (o.get("metadata") or {}).pop("resourceVersion", None)
    return o


class Store:
    def __init__(
        self,
        resources: Iterable[ResourceType] = DEFAULT_RESOURCES,
        *,
        history_size: int = 10000,
        namespaces: Iterable[str] = ("default", "kube-system", "kube-public", "kube-node-lease"),
        auto_create_namespaces: bool = False,
        graceful_pod_deletion: bool = False,
        clock: Callable[[], datetime] | None = None,
    ):
        self.lock = threading.RLock()
        self.types: dict[str, ResourceType] = {}
        self.by_path: dict[tuple[str, str, str], ResourceType] = {}
        self.data: dict[str, dict[tuple[str, str], JSON]] = {}
        self.rv = 0
        self.history: deque[Event] = deque()
        self.history_size = history_size
        self.compacted = 0  # watches must start at an RV >= this
        self.watchers: set[Watcher] = set()
        self.auto_create_namespaces = auto_create_namespaces
        self.graceful_pod_deletion = graceful_pod_deletion
        self.clock = clock or (lambda: datetime.now(UTC))
        for rt in resources:
            self.register(rt)
        for ns in namespaces:
            self.create(self.types["namespaces"], "", {"metadata": {"name": ns}})

    # ------------------------------------------------------------------ registry
    def register(self, rt: ResourceType) -> None:
        with self.lock:
            self.types[rt.key] = rt
            self.by_path[(rt.group, rt.version, rt.plural)] = rt
            self.data.setdefault(rt.key, {})

    def resolve(self, name: str) -> ResourceType:
        """`pods`, `pod`, `po`, `Pod`, `leases`, `leases.coordination.k8s.io`, `events.k8s.io/events`."""
        if name in self.types:
            return self.types[name]
        if "/" in name:  # group/plural or group/version/plural
            parts = name.split("/")
            group, plural = parts[0], parts[-1]
            key = plural if group in ("", "core", "v1") else f"{plural}.{group}"
            if key in self.types:
                return self.types[key]
        low = name.lower()
        for rt in self.types.values():  # core first (insertion order), then groups
            if low in (rt.plural, rt.singular) or low in rt.short_names:
                return rt
        raise KeyError(f"unknown resource {name!r}")

    # ------------------------------------------------------------------ helpers
    def _bump(self) -> int:
        self.rv += 1
        return self.rv

    def _commit(self, rt: ResourceType, etype: str, old: JSON | None, new: JSON) -> JSON:
        rv = self._bump()
        new = copy.deepcopy(new)
        new.setdefault("metadata", {})["resourceVersion"] = str(rv)
        meta = new["metadata"]
        k = (meta.get("namespace", ""), meta["name"])
        if etype == "DELETED":
            self.data[rt.key].pop(k, None)
        else:
            self.data[rt.key][k] = new
        ev = Event(rv, rt.key, etype, old, new)
        self.history.append(ev)
        while len(self.history) > self.history_size:
            dropped = self.history.popleft()
            self.compacted = dropped.rv
        for w in list(self.watchers):
            if w.rtype.key == rt.key and not w.closed:
                w.deliver(ev)
        return copy.deepcopy(new)

    def _ns_key(self, rt: ResourceType, namespace: str | None) -> str:
        return (namespace or "") if rt.namespaced else ""

    def _get_stored(self, rt: ResourceType, namespace: str | None, name: str) -> JSON:
        obj = self.data[rt.key].get((self._ns_key(rt, namespace), name))
        if obj is None:
            raise ApiError(404, f'{rt.key} "{name}" not found', details=rt.details(name))
        return obj

    def _check_namespace_exists(self, rt: ResourceType, namespace: str) -> None:
        if not rt.namespaced:
            return
        ns_rt = self.types["namespaces"]
        if ("", namespace) in self.data[ns_rt.key]:
            if (self.data[ns_rt.key][("", namespace)].get("metadata") or {}).get("deletionTimestamp"):
                raise ApiError(
                    403,
                    f'{rt.singular} "..." is forbidden: unable to create new content in namespace '
                    f"{namespace} because it is being terminated",
                )
            return
        if self.auto_create_namespaces:
            self.create(ns_rt, "", {"metadata": {"name": namespace}})
            return
        raise ApiError(404, f'namespaces "{namespace}" not found', details={"name": namespace, "kind": "namespaces"})

    def _invalid(self, rt: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
        msg = "; ".join(f"{f}: {m}" for f, m in causes)
        return ApiError(
            422,
            f'{rt.kind} "{name}" is invalid: {msg}',
            details={
                "name": name,
                **({"group": rt.group} if rt.group else {}),
                "kind": rt.kind,
                "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
            },
            reason="Invalid",
        )

    def _conflict(self, rt: ResourceType, name: str, why: str, sub: str | None = None) -> ApiError:
        what = f"{rt.key}/{sub}" if sub else rt.key
        return ApiError(409, f'Operation cannot be fulfilled on {what} "{name}": {why}', details=rt.details(name))

    def _check_body(self, rt: ResourceType, namespace: str | None, body: Any, url_name: str | None) -> JSON:
        if not isinstance(body, dict):
            raise ApiError(400, f"the body of the request was in an unknown format - expected a {rt.kind} object")
        kind = body.get("kind")
        if kind not in (None, "", rt.kind):
            raise ApiError(
                400, f"the kind of the provided object ({kind}) does not match the kind of the resource ({rt.kind})"
            )
        api_version = body.get("apiVersion")
        if api_version not in (None, "", rt.api_version):
            raise ApiError(
                400,
                f"the API version in the data ({api_version}) does not match the expected API version "
                f"({rt.api_version})",
            )
        meta = body.get("metadata")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be an object")
        for k in ("labels", "annotations"):
            v = meta.get(k)
            if v is not None and (
                not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values())
            ):
                raise ApiError(400, f"metadata.{k} must be a map of string to string")
        _check_shape(rt.kind, body)
        obj = copy.deepcopy(body)
        obj["kind"] = rt.kind
        obj["apiVersion"] = rt.api_version
        obj["metadata"] = copy.deepcopy(meta)
        meta = obj["metadata"]
        if rt.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiError(
                    400, "the namespace of the provided object does not match the namespace sent on the request"
                )
            if namespace:
                meta["namespace"] = namespace
            elif not meta.get("namespace"):
                raise ApiError(400, "the server could not find the requested resource: namespace is required")
        else:
            meta.pop("namespace", None)
        if url_name is not None and meta.get("name") not in (None, "", url_name):
            raise ApiError(
                400, f"the name of the object ({meta.get('name')}) does not match the name on the URL ({url_name})"
            )
        if url_name is not None and not meta.get("name"):
            meta["name"] = url_name
        return obj

    def _validate_name(self, rt: ResourceType, name: str) -> None:
        if rt.kind == "Namespace":
            ok = len(name) <= 63 and bool(_DNS_LABEL.match(name))
            what = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"
        elif rt.kind == "Event":
            ok = len(name) <= 253 and bool(name) and "/" not in name
            what = "may not contain '/'"
        else:
            ok = len(name) <= 253 and bool(_DNS_SUBDOMAIN.match(name))
            what = (
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character"
            )
        if not ok:
            raise self._invalid(rt, name, [("metadata.name", f'Invalid value: "{name}": {what}')])

    # ------------------------------------------------------------------ type specific
    def _prepare_create(self, rt: ResourceType, obj: JSON) -> None:
        if rt.kind == "Pod":
            self._pod_defaults(obj)
            self._validate_pod(obj)
            obj["status"] = {"phase": "Pending", "qosClass": _qos_class(obj.get("spec") or {})}
        elif rt.kind == "Secret":
            _secret_string_data(obj)
            obj.setdefault("type", "Opaque")
        elif rt.kind == "Namespace":
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif rt.kind == "Node":
            spec = obj.setdefault("spec", {})
            spec.pop("configSource", None)

    def _pod_defaults(self, obj: JSON) -> None:
        spec = obj.setdefault("spec", {})
        if not isinstance(spec, dict):
            raise ApiError(400, "spec must be an object")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("securityContext", {})
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
        for cname in ("initContainers", "containers"):
            for c in spec.get(cname) or []:
                if not isinstance(c, dict):
                    continue
                c.setdefault("terminationMessagePath", "/dev/termination-log")
                c.setdefault("terminationMessagePolicy", "File")
                c.setdefault("imagePullPolicy", "IfNotPresent" if ":" in str(c.get("image", "")) and not str(
                    c.get("image", "")).endswith(":latest") else "Always")
                res = c.setdefault("resources", {})
                if isinstance(res, dict) and isinstance(res.get("limits"), dict):
                    req = res.setdefault("requests", {})
                    if isinstance(req, dict):
                        for k, v in res["limits"].items():
                            req.setdefault(k, v)

    def _validate_pod(self, obj: JSON) -> None:
        rt = self.types["pods"]
        name = obj["metadata"].get("name", "")
        spec = obj.get("spec") or {}
        causes: list[tuple[str, str]] = []
        containers = spec.get("containers")
        if not isinstance(containers, list) or not containers:
            causes.append(("spec.containers", "Required value"))
            containers = []
        seen: set[str] = set()
        for cname in ("initContainers", "containers"):
            lst = spec.get(cname) or []
            if not isinstance(lst, list):
                causes.append((f"spec.{cname}", "Invalid value: must be a list"))
                continue
            for i, c in enumerate(lst):
                path = f"spec.{cname}[{i}]"
                if not isinstance(c, dict):
                    causes.append((path, "Invalid value: must be an object"))
                    continue
                n = c.get("name")
                if not n:
                    causes.append((f"{path}.name", "Required value"))
                elif n in seen:
                    causes.append((f"{path}.name", f'Duplicate value: "{n}"'))
                else:
                    seen.add(n)
                if not c.get("image"):
                    causes.append((f"{path}.image", "Required value"))
                res = c.get("resources") or {}
                limits = res.get("limits") or {}
                requests = res.get("requests") or {}
                for qty in list(limits.values()) + list(requests.values()):
                    if parse_quantity(qty) is None:
                        causes.append((f"{path}.resources", f'Invalid value: "{qty}": quantities must match the '
                                       "regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"))
                for rname, qty in requests.items():
                    if not _is_extended_resource(rname):
                        continue
                    if rname not in limits:
                        causes.append((f"{path}.resources.limits",
                                       "Required value: Limit must be set for non overcommitable resources"))
                    elif parse_quantity(limits[rname]) != parse_quantity(qty):
                        causes.append((f"{path}.resources.requests",
                                       f'Invalid value: "{qty}": must be equal to {rname} limit of '
                                       f"{limits[rname]}"))
                    elif (pq := parse_quantity(qty)) is not None and pq != pq.to_integral_value():
                        causes.append((f"{path}.resources.requests[{rname}]",
                                       f'Invalid value: "{qty}": must be an integer'))
        if causes:
            raise self._invalid(rt, name, causes)

    def _validate_pod_update(self, old: JSON, new: JSON) -> None:
        """Pod spec is immutable apart from a few fields (images, tolerations additions, ...)."""
        def strip(spec: JSON | None) -> JSON:
            s = copy.deepcopy(spec or {})
            for cname in ("containers", "initContainers"):
                for c in s.get(cname) or []:
                    if isinstance(c, dict):
                        c.pop("image", None)
            for k in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds", "schedulingGates"):
                s.pop(k, None)
            return s

        if strip(old.get("spec")) != strip(new.get("spec")):
            name = new["metadata"]["name"]
            raise self._invalid(
                self.types["pods"],
                name,
                [("spec", "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                  "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                  "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set "
                  "to 1 if it was previously negative)")],
            )

    # ------------------------------------------------------------------ verbs
    def get(self, rt: ResourceType, namespace: str | None, name: str) -> JSON:
        with self.lock:
            return copy.deepcopy(self._get_stored(rt, namespace, name))

    def list(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
    ) -> tuple[list[JSON], str]:
        with self.lock:
            items = []
            for (ns, _name), obj in sorted(self.data[rt.key].items()):
                if rt.namespaced and namespace and ns != namespace:
                    continue
                meta = obj.get("metadata") or {}
                if labels is not None and not labels.matches(meta.get("labels")):
                    continue
                if fields is not None and not fields.matches(obj):
                    continue
                items.append(copy.deepcopy(obj))
            return items, str(self.rv)

    def create(self, rt: ResourceType, namespace: str | None, body: Any, *, dry_run: bool = False) -> JSON:
        with self.lock:
            obj = self._check_body(rt, namespace, body, None)
            meta = obj["metadata"]
            if meta.get("resourceVersion"):
                raise ApiError(500, "resourceVersion should not be set on objects to be created",
                               reason="InternalError")
            if rt.namespaced:
                self._check_namespace_exists(rt, meta["namespace"])
            if not meta.get("name"):
                gen = meta.get("generateName")
                if not gen:
                    raise self._invalid(rt, "", [("metadata.name", "Required value: name or generateName is required")])
                for _ in range(100):
                    cand = gen + "".join(random.choice(_GEN_CHARS) for _ in range(5))
                    if (self._ns_key(rt, meta.get("namespace")), cand) not in self.data[rt.key]:
                        break
                meta["name"] = cand
            self._validate_name(rt, meta["name"])
            k = (self._ns_key(rt, meta.get("namespace")), meta["name"])
            if k in self.data[rt.key]:
                raise ApiError(409, f'{rt.key} "{meta["name"]}" already exists', reason="AlreadyExists",
                               details=rt.details(meta["name"]))
            for drop in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"):
                meta.pop(drop, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339(self.clock)
            meta["generation"] = 1
            self._prepare_create(rt, obj)
            if dry_run:
                obj["metadata"]["resourceVersion"] = str(self.rv)
                return obj
            return self._commit(rt, "ADDED", None, obj)

    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> JSON:
        with self.lock:
            obj = self._check_body(rt, namespace, body, name)
            key = (self._ns_key(rt, namespace), name)
            old = self.data[rt.key].get(key)
            if old is None:
                if rt.create_on_update and subresource is None:
                    obj["metadata"].pop("resourceVersion", None)
                    return self.create(rt, namespace, obj, dry_run=dry_run)
                raise ApiError(404, f'{rt.key} "{name}" not found', details=rt.details(name))
            rv = obj["metadata"].get("resourceVersion")
            if rv not in (None, ""):
                if not isinstance(rv, str) or not rv.isdigit():
                    raise ApiError(400, f"invalid resourceVersion {rv!r}")
                if rv != old["metadata"]["resourceVersion"]:
                    raise self._conflict(
                        rt, name, "the object has been modified; please apply your changes to the latest "
                        "version and try again")
            return self._apply_update(rt, old, obj, subresource=subresource, dry_run=dry_run)

    def _apply_update(
        self, rt: ResourceType, old: JSON, obj: JSON, *, subresource: str | None, dry_run: bool
    ) -> JSON:
        om, nm = old["metadata"], obj["metadata"]
        for keep in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace",
                     "name"):
            if keep in om:
                nm[keep] = om[keep]
            else:
                nm.pop(keep, None)
        nm.pop("managedFields", None)
        nm.pop("selfLink", None)
        nm["generation"] = om.get("generation", 1)
        if subresource == "status":
            if "spec" in old:
                obj["spec"] = copy.deepcopy(old["spec"])
            else:
                obj.pop("spec", None)
            if "ownerReferences" in om:
                nm["ownerReferences"] = copy.deepcopy(om["ownerReferences"])
            else:
                nm.pop("ownerReferences", None)
        elif rt.has_status:
            if "status" in old:
                obj["status"] = copy.deepcopy(old["status"])
            else:
                obj.pop("status", None)
        if rt.kind == "Pod" and subresource is None:
            self._validate_pod_update(old, obj)
        if rt.kind == "Secret":
            _secret_string_data(obj)
        if om.get("deletionTimestamp"):
            new_fin = set(nm.get("finalizers") or []) - set(om.get("finalizers") or [])
            if new_fin:
                raise self._invalid(rt, nm["name"], [(
                    "metadata.finalizers",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new "
                    f"finalizers {sorted(new_fin)!r}")])
        if subresource is None and old.get("spec") != obj.get("spec") and "spec" in old:
            nm["generation"] = om.get("generation", 1) + 1
        if _strip_rv(old) == _strip_rv(obj):
            return copy.deepcopy(old)  # no-op: kube-apiserver does not bump the resourceVersion
        if dry_run:
            return obj
        out = self._commit(rt, "MODIFIED", old, obj)
        if nm.get("deletionTimestamp") and not nm.get("finalizers") and not nm.get("deletionGracePeriodSeconds"):
            stored = self.data[rt.key][(nm.get("namespace", ""), nm["name"])]
            self._commit(rt, "DELETED", stored, stored)
        return out

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> JSON:
        with self.lock:
            key = (self._ns_key(rt, namespace), name)
            old = self.data[rt.key].get(key)
            if old is None:
                if patch_type == "apply" and subresource is None:
                    if not isinstance(patch, dict):
                        raise ApiError(400, "apply patch must be an object")
                    return self.create(rt, namespace, patch, dry_run=dry_run)
                raise ApiError(404, f'{rt.key} "{name}" not found', details=rt.details(name))
            try:
                if patch_type == "json":
                    new = json_patch(old, patch)
                else:
                    if not isinstance(patch, dict):
                        raise ApiError(400, "the body of the request was in an unknown format - patch must be a "
                                       "JSON object")
                    if patch_type == "strategic":
                        new = strategic_merge_patch(old, patch)
                    else:  # merge, apply
                        new = merge_patch(old, patch)
            except PatchError as exc:
                raise ApiError(exc.code, str(exc)) from exc
            if not isinstance(new, dict):
                raise ApiError(422, "the patch produced something that is not an object")
            meta = new.get("metadata")
            if not isinstance(meta, dict):
                raise ApiError(422, "the patch removed metadata")
            if meta.get("name") != name:
                raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the "
                               f"URL ({name})")
            return self.update(rt, namespace, name, new, subresource=subresource, dry_run=dry_run)

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        options: JSON | None = None,
        *,
        dry_run: bool = False,
    ) -> tuple[int, JSON]:
        """Returns (http status, body)."""
        options = options or {}
        with self.lock:
            old = self._get_stored(rt, namespace, name)
            om = old["metadata"]
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != om.get("uid"):
                raise self._conflict(rt, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in "
                                     f"object meta: {om.get('uid')}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != om.get("resourceVersion"):
                raise self._conflict(rt, name, f"Precondition failed: ResourceVersion in precondition: "
                                     f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                                     f"{om.get('resourceVersion')}")
            grace = options.get("gracePeriodSeconds")
            if grace is not None:
                try:
                    grace = int(grace)
                except (TypeError, ValueError) as exc:
                    raise ApiError(400, f"invalid gracePeriodSeconds {grace!r}") from exc
            if dry_run:
                return 200, copy.deepcopy(old) if rt.return_deleted else self._success(rt, old)
            # graceful pod deletion (kubelet would finish it)
            if (
                rt.kind == "Pod"
                and self.graceful_pod_deletion
                and (old.get("spec") or {}).get("nodeName")
                and (old.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                and grace != 0
            ):
                if grace is None:
                    grace = int((old.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                cur = om.get("deletionGracePeriodSeconds")
                if om.get("deletionTimestamp") is None or (cur is not None and grace < cur):
                    new = copy.deepcopy(old)
                    new["metadata"]["deletionTimestamp"] = now_rfc3339(lambda: self.clock() + timedelta(seconds=grace))
                    new["metadata"]["deletionGracePeriodSeconds"] = grace
                    return 200, self._commit(rt, "MODIFIED", old, new)
                return 200, copy.deepcopy(old)
            if om.get("finalizers"):
                if om.get("deletionTimestamp"):
                    return 202, copy.deepcopy(old)
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = now_rfc3339(self.clock)
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                return 202, self._commit(rt, "MODIFIED", old, new)
            if rt.kind == "Namespace":
                for other in self.types.values():
                    if not other.namespaced:
                        continue
                    for (ns, _oname), obj in list(self.data[other.key].items()):
                        if ns == name:
                            self._commit(other, "DELETED", obj, obj)
            final = self._commit(rt, "DELETED", old, old)
            return 200, final if rt.return_deleted else self._success(rt, final)

    def _success(self, rt: ResourceType, obj: JSON) -> JSON:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": rt.details(obj["metadata"]["name"], uid=obj["metadata"].get("uid")),
        }

    def delete_collection(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector | None,
        fields: FieldSelector | None,
        options: JSON | None = None,
        *,
        dry_run: bool = False,
    ) -> JSON:
        with self.lock:
            items, _ = self.list(rt, namespace, labels, fields)
            for obj in items:
                try:
                    self.delete(rt, obj["metadata"].get("namespace"), obj["metadata"]["name"],
                                {k: v for k, v in (options or {}).items() if k != "preconditions"}, dry_run=dry_run)
                except ApiError:
                    pass
            return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                    "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    def bind(self, namespace: str, name: str, binding: Any, *, dry_run: bool = False) -> JSON:
        rt = self.types["pods"]
        with self.lock:
            if not isinstance(binding, dict):
                raise ApiError(400, "the body of the request was in an unknown format - expected a Binding")
            _check_shape("Binding", binding)
            if binding.get("kind") not in (None, "", "Binding"):
                raise ApiError(400, f"the kind of the provided object ({binding.get('kind')}) does not match "
                               "Binding")
            bmeta = binding.get("metadata") or {}
            if not isinstance(bmeta, dict):
                raise ApiError(400, "metadata must be an object")
            if bmeta.get("name") not in (None, "", name):
                raise ApiError(400, f"the name of the object ({bmeta.get('name')}) does not match the name on the "
                               f"URL ({name})")
            if bmeta.get("namespace") not in (None, "", namespace):
                raise ApiError(
                    400, "the namespace of the provided object does not match the namespace sent on the request"
                )
            target = binding.get("target")
            if not isinstance(target, dict):
                target = {}
            node = target.get("name")
            if not node:
                raise ApiError(
                    422, f'Binding "{name}" is invalid: target.name: Required value',
                    details={"name": name, "kind": "Binding",
                             "causes": [{"reason": "FieldValueRequired", "message": "Required value",
                                         "field": "target.name"}]})
            if target.get("kind") not in (None, "", "Node"):
                raise ApiError(422, f'Binding "{name}" is invalid: target.kind: Not supported: '
                               f'"{target.get("kind")}": supported values: "Node"')
            pod = self._get_stored(rt, namespace, name)
            pm = pod["metadata"]
            if bmeta.get("uid") and bmeta["uid"] != pm.get("uid"):
                raise self._conflict(rt, name, f"Precondition failed: UID in precondition: {bmeta['uid']}, UID in "
                                     f"object meta: {pm.get('uid')}", sub="binding")
            if bmeta.get("resourceVersion") and bmeta["resourceVersion"] != pm.get("resourceVersion"):
                raise self._conflict(rt, name, "the object has been modified; please apply your changes to the "
                                     "latest version and try again", sub="binding")
            if pm.get("deletionTimestamp"):
                raise self._conflict(rt, name, f"pod {name} is being deleted, cannot be assigned to a host",
                                     sub="binding")
            cur = (pod.get("spec") or {}).get("nodeName")
            if cur:
                raise self._conflict(rt, name, f'pod {name} is already assigned to node "{cur}"', sub="binding")
            new = copy.deepcopy(pod)
            new.setdefault("spec", {})["nodeName"] = node
            ann = bmeta.get("annotations")
            if isinstance(ann, dict) and ann:
                new["metadata"].setdefault("annotations", {}).update({k: str(v) for k, v in ann.items()})
            conds = [c for c in (new.setdefault("status", {}).get("conditions") or [])
                     if c.get("type") != "PodScheduled"]
            conds.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                          "lastTransitionTime": now_rfc3339(self.clock)})
            new["status"]["conditions"] = conds
            if not dry_run:
                self._commit(rt, "MODIFIED", pod, new)
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    # ------------------------------------------------------------------ watch
    def register_watch(self, w: Watcher, resource_version: str | None) -> builtins.list[tuple[str, JSON]]:
        """Register a watcher; returns the initial events to send. Raises ApiError(410) if too old."""
        with self.lock:
            initial: list[tuple[str, JSON]] = []
            if resource_version in (None, "", "0"):
                for obj in self.data[w.rtype.key].values():
                    if w.matches(obj):
                        initial.append(("ADDED", obj))
                initial.sort(key=lambda t: int(t[1]["metadata"]["resourceVersion"]))
                w.last_rv = self.rv
            else:
                try:
                    start = int(resource_version)
                except ValueError as exc:
                    raise ApiError(400, f"invalid resource version {resource_version!r}") from exc
                if start < self.compacted:
                    raise ApiError(410, f"too old resource version: {start} ({self.compacted})", reason="Expired")
                for ev in self.history:
                    if ev.rv > start:
                        out = w.translate(ev)
                        if out:
                            initial.append(out)
                w.last_rv = max(start, self.rv)
            self.watchers.add(w)
            return initial

    def unregister_watch(self, w: Watcher) -> None:
        with self.lock:
            self.watchers.discard(w)

    def close_watches(self, key: str | None = None) -> int:
        with self.lock:
            n = 0
            for w in list(self.watchers):
                if key is None or w.rtype.key == key:
                    w.close()
                    self.watchers.discard(w)
                    n += 1
            return n

    def expire(self) -> None:
        """Forget the event history: every resourceVersion issued so far becomes too old to watch from."""
        with self.lock:
            self._bump()
            self.compacted = self.rv
            self.history.clear()
            self.close_watches()


# Expected JSON types of well-known fields: a decoding error in the real server (400 BadRequest,
# "json: cannot unmarshal ..."). Paths use "*" for "each list element" / "each map value".
_STR, _INT, _BOOL, _MAP, _LIST = str, int, bool, dict, list
_META_SHAPE: dict[tuple[str, ...], type] = {
    ("metadata",): _MAP, ("metadata", "name"): _STR, ("metadata", "generateName"): _STR,
    ("metadata", "namespace"): _STR, ("metadata", "resourceVersion"): _STR, ("metadata", "uid"): _STR,
    ("metadata", "labels"): _MAP, ("metadata", "labels", "*"): _STR,
    ("metadata", "annotations"): _MAP, ("metadata", "annotations", "*"): _STR,
    ("metadata", "finalizers"): _LIST, ("metadata", "finalizers", "*"): _STR,
    ("metadata", "ownerReferences"): _LIST, ("metadata", "ownerReferences", "*"): _MAP,
    ("metadata", "generation"): _INT, ("metadata", "deletionGracePeriodSeconds"): _INT,
    ("spec",): _MAP, ("status",): _MAP,
}
_CONTAINER_SHAPE: dict[tuple[str, ...], type] = {
    (): _MAP, ("name",): _STR, ("image",): _STR, ("resources",): _MAP, ("resources", "limits"): _MAP,
    ("resources", "requests"): _MAP, ("env",): _LIST, ("env", "*"): _MAP, ("ports",): _LIST,
    ("command",): _LIST, ("args",): _LIST, ("volumeMounts",): _LIST, ("securityContext",): _MAP,
}
_KIND_SHAPE: dict[str, dict[tuple[str, ...], type]] = {
    "Pod": {
        ("spec", "containers"): _LIST, ("spec", "initContainers"): _LIST, ("spec", "nodeName"): _STR,
        ("spec", "schedulerName"): _STR, ("spec", "tolerations"): _LIST, ("spec", "tolerations", "*"): _MAP,
        ("spec", "nodeSelector"): _MAP, ("spec", "nodeSelector", "*"): _STR, ("spec", "volumes"): _LIST,
        ("spec", "terminationGracePeriodSeconds"): _INT, ("spec", "priority"): _INT,
        ("status", "phase"): _STR, ("status", "conditions"): _LIST, ("status", "conditions", "*"): _MAP,
        ("status", "containerStatuses"): _LIST,
        **{("spec", c, "*") + k: t for c in ("containers", "initContainers") for k, t in _CONTAINER_SHAPE.items()},
    },
    "Node": {
        ("spec", "unschedulable"): _BOOL, ("spec", "taints"): _LIST, ("spec", "taints", "*"): _MAP,
        ("status", "capacity"): _MAP, ("status", "allocatable"): _MAP, ("status", "conditions"): _LIST,
        ("status", "conditions", "*"): _MAP, ("status", "addresses"): _LIST,
    },
    "ConfigMap": {("data",): _MAP, ("data", "*"): _STR, ("binaryData",): _MAP, ("binaryData", "*"): _STR},
    "Secret": {("data",): _MAP, ("data", "*"): _STR, ("stringData",): _MAP, ("stringData", "*"): _STR,
               ("type",): _STR},
    "Lease": {("spec", "holderIdentity"): _STR, ("spec", "leaseDurationSeconds"): _INT,
              ("spec", "leaseTransitions"): _INT},
    "MutatingWebhookConfiguration": {("webhooks",): _LIST, ("webhooks", "*"): _MAP,
                                     ("webhooks", "*", "clientConfig"): _MAP},
    "ValidatingWebhookConfiguration": {("webhooks",): _LIST, ("webhooks", "*"): _MAP,
                                       ("webhooks", "*", "clientConfig"): _MAP},
    "Namespace": {("spec", "finalizers"): _LIST},
    "Event": {("involvedObject",): _MAP, ("regarding",): _MAP, ("count",): _INT},
    "Binding": {("target",): _MAP, ("target", "name"): _STR, ("target", "kind"): _STR},
}
_TYPE_NAMES = {str: "string", int: "integer", bool: "boolean", dict: "object", list: "array"}


def _check_shape(kind: str, obj: Any) -> None:
    shape = {**_META_SHAPE, **_KIND_SHAPE.get(kind, {})}

    def walk(val: Any, path: tuple[str, ...]) -> None:
        want = shape.get(path)
        if want is not None and val is not None:
            ok = isinstance(val, want) and not (want is int and isinstance(val, bool))
            if not ok:
                raise ApiError(400, f"json: cannot unmarshal {type(val).__name__} into Go struct field "
                               f"{kind}.{'.'.join(p for p in path if p != '*')} of type {_TYPE_NAMES[want]}")
        if isinstance(val, dict):
            for k, v in val.items():
                sub = path + (k,)
                if sub in shape or any(p[: len(sub)] == sub for p in shape):
                    walk(v, sub)
                elif path + ("*",) in shape:
                    walk(v, path + ("*",))
        elif isinstance(val, list) and path + ("*",) in shape:
            for v in val:
                walk(v, path + ("*",))

    walk(obj, ())


def _secret_string_data(obj: JSON) -> None:
    import base64

    sd = obj.pop("stringData", None)
    if isinstance(sd, dict):
        data = obj.setdefault("data", {}) or {}
        obj["data"] = data
        for k, v in sd.items():
            data[k] = base64.b64encode(str(v).encode()).decode()


def _qos_class(spec: JSON) -> str:
    containers = [c for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
                  if isinstance(c, dict)]
    any_set = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        lim, req = res.get("limits") or {}, res.get("requests") or {}
        for r in ("cpu", "memory"):
            if r in lim or r in req:
                any_set = True
            if r not in lim or parse_quantity(req.get(r, lim.get(r))) != parse_quantity(lim.get(r)):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"
