"""Each component's RBAC is exactly the API calls its code makes.

The calls are recorded, not listed by hand: every public method of the component's API layer
(``scheduler.kube.KubeAPI``, ``deviceplugin.kube.ApiKubeClient``, the only modules of those packages
that import the Kubernetes client) is run against the fake API server, which logs each request;
the extender's leader election runs in the mode and with the Lease the chart configures; and a real
extender (SchedulerService) schedules a pod and reports an unschedulable one over HTTP. Every
recorded request must be allowed by the roles the rendered chart binds to the component's
ServiceAccount, evaluated like the RBAC authorizer does, and every rule those roles grant must be
used by some request.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest

from kube_vgpu.resources import ANN_NODE_INVENTORY, LABEL_NODE
from tests.fakeapi import FakeKubeAPI

from .conftest import NAMESPACE, ROOT, Renderer, find, find_all
from .test_chart import FULL, containers
from .test_render import option_values

OWN_LEASE = {"scheduler": {"extender": {"leaderElect": True}}}
MODES = {"off": {}, "follow": option_values("ha"), "own": OWN_LEASE}


@dataclass(frozen=True)
class Call:
    """One API request as the RBAC authorizer sees it."""

    verb: str
    group: str
    resource: str  #: with subresource: "pods/binding"
    namespace: str  #: "" for cluster-scoped resources and all-namespace lists/watches
    name: str  #: "" for list, watch and create (of a top-level resource)

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {self.group or 'core'}/{self.resource}{' ' + self.name if self.name else ''}{where}"


def recorded(api: FakeKubeAPI) -> set[Call]:
    out = set()
    for r in api.request_log:
        if not r.verb:
            continue
        parts = r.path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        resource = r.resource.split(".", 1)[0]
        top_level_create = r.verb == "create" and "/" not in resource
        name = "" if r.verb in ("list", "watch") or top_level_create else (r.name or "")
        out.add(Call(r.verb, group, resource, r.namespace or "", name))
    return out


# -- the chart's roles, evaluated like the RBAC authorizer ----------------------------------------

@dataclass(frozen=True)
class Grant:
    """One (verb, group, resource, resourceName) a rule grants, in ``namespace`` ("" = cluster-wide)."""

    role: str
    namespace: str
    verb: str
    group: str
    resource: str
    resource_name: str  #: "" = any

    def allows(self, c: Call) -> bool:
        return (self.verb == c.verb and self.group == c.group and self.resource == c.resource
                and (not self.namespace or self.namespace == c.namespace)
                and (not self.resource_name or self.resource_name == c.name))

    def __str__(self) -> str:
        scope = f" in {self.namespace}" if self.namespace else ""
        return (f"{self.verb} {self.group or 'core'}/{self.resource}"
                f"{' named ' + self.resource_name if self.resource_name else ''}{scope} ({self.role})")


def grants(docs: list[dict[str, Any]], sa: str, namespace: str = NAMESPACE) -> list[Grant]:
    """What the chart's bindings give ServiceAccount ``sa``. Fails on a binding to a role the chart
    does not render (its rules could not be checked)."""
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in find_all(docs, "Role") + find_all(docs, "ClusterRole")}
    out: list[Grant] = []
    for b in find_all(docs, "RoleBinding") + find_all(docs, "ClusterRoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == namespace
                   for s in b["subjects"]):
            continue
        scope = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
        ref = b["roleRef"]
        key = (ref["kind"], scope if ref["kind"] == "Role" else "", ref["name"])
        assert key in roles, f"{sa} is bound to {ref['kind']} {ref['name']}, which the chart does not render"
        for rule in roles[key]["rules"]:
            for g in rule["apiGroups"]:
                for res in rule["resources"]:
                    for v in rule["verbs"]:
                        for rn in rule.get("resourceNames") or [""]:
                            out.append(Grant(ref["name"], scope, v, g, res, rn))
    return out


def check(docs: list[dict[str, Any]], sa: str, calls: Iterable[Call]) -> None:
    """Every call allowed, every grant used."""
    calls = set(calls)
    given = grants(docs, sa)
    denied = sorted(str(c) for c in calls if not any(g.allows(c) for g in given))
    unused = sorted(str(g) for g in given if not any(g.allows(c) for c in calls))
    assert not denied, f"{sa} lacks RBAC for calls its code makes: {denied}"
    assert not unused, f"{sa} is granted what its code never calls: {unused}"


# -- the API layers -------------------------------------------------------------------------------

def test_only_the_api_layers_import_the_kubernetes_client() -> None:
    """So running their methods covers every call the component can make."""
    offenders = []
    for pkg, allowed in (("scheduler", {"kube.py"}), ("deviceplugin", {"kube.py", "dra_publish.py"})):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m == "kubernetes" or m.startswith("kubernetes.") for m in mods) and f.name not in allowed:
                    offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"Kubernetes client used outside the API layer (extend test_rbac.py): {offenders}"


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


@pytest.fixture
def fake() -> Iterable[FakeKubeAPI]:
    api = FakeKubeAPI(auto_create_namespaces=True, bookmark_interval=0.2)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _pod(name: str, ns: str = "team-a", node: str | None = None, **limits: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulerName": "kube-vgpu-scheduler",
                            "containers": [{"name": "c", "image": "busybox",
                                            "resources": {"limits": {k: str(v) for k, v in limits.items()}}}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def _drain(resp: Any) -> None:
    from kubernetes.watch.watch import iter_resp_lines
    for _ in iter_resp_lines(resp):
        pass
    resp.release_conn()


async def _drain_lines(k: Any, f: FakeKubeAPI) -> None:
    try:
        for kind, selector in (("nodes", None), ("pods", LABEL_NODE), ("resourcequotas", None)):
            async for _ in k.watch_lines(kind, f.resource_version, 1, selector):
                pass
    finally:
        await k.aclose()


async def _bind_async(k: Any, f: FakeKubeAPI) -> None:
    pod = f.create_object("pods", _pod("p-loop"), namespace="team-a")
    try:
        await k.create_binding_async("team-a", "p-loop", pod["metadata"]["uid"], "n1",
                                     pod["metadata"]["resourceVersion"])
    finally:
        await k.aclose()


#: how to run each public method of scheduler.kube.KubeAPI once (a new method must be added here,
#: and so gets checked against the chart)
EXTENDER_METHODS: dict[str, Callable[[Any, FakeKubeAPI], None]] = {
    "get_pod": lambda k, f: k.get_pod("team-a", "p"),
    "patch_pod_metadata": lambda k, f: k.patch_pod_metadata("team-a", "p", "", {"a": "b"}, {LABEL_NODE: "n1"}),
    "remove_pod_metadata": lambda k, f: k.remove_pod_metadata("team-a", "p", "", ["a"], [LABEL_NODE]),
    "create_binding": lambda k, f: k.create_binding("team-a", "p", f.get_object("pods", "p", "team-a")["metadata"]["uid"],
                                                    "n1", f.get_object("pods", "p", "team-a")["metadata"]["resourceVersion"]),
    "list_objects": lambda k, f: (k.list_objects("nodes"), k.list_objects("pods", LABEL_NODE),
                                  k.list_objects("resourcequotas")),
    "create_binding_async": lambda k, f: asyncio.run(_bind_async(k, f)),
    "watch_lines": lambda k, f: asyncio.run(_drain_lines(k, f)),
    "aclose": lambda k, f: asyncio.run(k.aclose()),
    "watch_objects": lambda k, f: (_drain(k.watch_objects("nodes", f.resource_version, 1)),
                                   _drain(k.watch_objects("pods", f.resource_version, 1, LABEL_NODE)),
                                   _drain(k.watch_objects("resourcequotas", f.resource_version, 1))),
    "get_lease": lambda k, f: k.get_lease(NAMESPACE, "l"),
    "create_lease": lambda k, f: k.create_lease(NAMESPACE, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                            "metadata": {"name": "l", "namespace": NAMESPACE}}),
    "replace_lease": lambda k, f: k.replace_lease(NAMESPACE, "l", k.get_lease(NAMESPACE, "l")),
}


def _extender_api_calls(fake: FakeKubeAPI) -> set[Call]:
    from scheduler.kube import KubeAPI
    missing = _public_methods(KubeAPI) - set(EXTENDER_METHODS)
    assert not missing, f"KubeAPI methods not exercised here (add them to EXTENDER_METHODS): {sorted(missing)}"
    fake.create_object("nodes", {"metadata": {"name": "n1"}})
    fake.create_object("pods", _pod("p"), namespace="team-a")
    k = KubeAPI(fake.api_client())
    fake.clear_requests()
    for name in sorted(EXTENDER_METHODS, key=lambda n: n == "create_binding"):  # bind last
        EXTENDER_METHODS[name](k, fake)
    return recorded(fake)


def _lease_calls(docs: list[dict[str, Any]], fake: FakeKubeAPI) -> set[Call]:
    """Run the leader election the rendered extender args ask for (two rounds) and record it."""
    from scheduler.kube import KubeAPI
    from scheduler.leader import LeaseElector, LeaseFollower
    args = containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]["args"]
    opts = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--lease-") or
                a.startswith("--leader-elect-mode="))
    if "leader-elect-mode" not in opts:  # no election (--leader-elect=false): no Lease calls
        return set()
    k = KubeAPI(fake.api_client())

    def blocking(fn: Callable[..., Any], *a: Any) -> Any:
        return fn(*a)
    fake.clear_requests()
    if opts["leader-elect-mode"] == "follow":
        follower = LeaseFollower(k, opts["lease-namespace"], opts["lease-name"], "host", run_blocking=blocking)
        follower.check()
        fake.create_object("leases", {"metadata": {"name": opts["lease-name"]}, "spec": {
            "holderIdentity": "host_1", "leaseDurationSeconds": 15,
            "renewTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}}, namespace=opts["lease-namespace"])
        assert follower.check()
    else:
        elector = LeaseElector(k, opts["lease-namespace"], opts["lease-name"], "me", run_blocking=blocking)
        assert elector.try_acquire_or_renew() and elector.try_acquire_or_renew()
    return recorded(fake)


def _service_calls(fake: FakeKubeAPI) -> set[Call]:
    """A real extender: sync, schedule and bind a vGPU pod, reject an unschedulable one (kube-scheduler
    posts the FailedScheduling event; the extender posts none)."""
    sys.path.insert(0, str(ROOT / "tests" / "scheduler"))
    try:
        from vgpu_sched_util import Extender, bind_args, filter_args, node_obj, pod_obj, run, wait_until
    finally:
        sys.path.remove(str(ROOT / "tests" / "scheduler"))
    from kube_vgpu.config import Config
    from scheduler.kube import KubeAPI
    from scheduler.service import Options, SchedulerService

    fake.clear_requests()
    node = fake.create_object("nodes", node_obj("node-0", 1))
    assert ANN_NODE_INVENTORY in node["metadata"]["annotations"]

    def create(name: str, mib: int) -> dict[str, Any]:
        p = pod_obj(name, ns="team-b", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": mib})
        p["metadata"] = {k: v for k, v in p["metadata"].items() if k not in ("uid", "resourceVersion")}
        return fake.create_object("pods", p, namespace="team-b")
    fits, huge = create("fits", 1000), create("huge", 999999)

    async def go() -> None:
        svc = SchedulerService(Config(), KubeAPI(fake.api_client()), Options(sync_wait=5.0))
        async with Extender(svc) as ext:
            await asyncio.wait_for(svc.synced.wait(), 10)
            _, res = await ext.post("/filter", filter_args(huge, [node]))
            assert res["NodeNames"] == [] or res["NodeNames"] is None, res
            _, res = await ext.post("/filter", filter_args(fits, [node]))
            assert res["NodeNames"] == ["node-0"], res
            _, b = await ext.post("/bind", bind_args(fits, "node-0"))
            assert b["Error"] == "", b
            await wait_until(lambda: svc.metrics.registry.get_sample_value(
                "kube_vgpu_scheduler_filter_rejections_total", {"reason": "insufficient_memory"}) == 1.0,
                timeout=10)
    run(go)
    assert (fake.get_object("pods", "fits", "team-b") or {})["spec"].get("nodeName") == "node-0"
    assert fake.errors == []
    return recorded(fake)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_extender_rbac_is_exactly_its_calls(renderer: Renderer, fake: FakeKubeAPI, mode: str) -> None:
    docs = renderer.render(MODES[mode])
    args = containers(find(docs, "Deployment", f"{FULL}-scheduler"))["extender"]["args"]
    assert any(a.startswith("--leader-elect-mode=") for a in args) == (mode != "off")
    api_calls = _extender_api_calls(fake)
    leases = {c for c in api_calls if c.resource == "leases"}
    base = api_calls - leases
    assert leases, "the lease methods made no lease calls"
    lease_calls = _lease_calls(docs, fake)
    assert {c.resource for c in lease_calls} <= {"leases"}
    check(docs, f"{FULL}-extender", base | lease_calls)


def test_running_extender_stays_within_its_api_layer(renderer: Renderer, fake: FakeKubeAPI) -> None:
    """What a live extender sends is a subset of what its API layer can send (which the chart grants)."""
    service = _service_calls(fake)
    verbs = {(c.verb, c.group, c.resource) for c in service}
    # a bind is one Binding carrying the record (pods are patched only to fence a lost Binding or
    # to re-sign after a key rotation: the method table above covers those)
    assert {("list", "", "nodes"), ("watch", "", "nodes"), ("list", "", "pods"), ("watch", "", "pods"),
            ("list", "", "resourcequotas"), ("watch", "", "resourcequotas"), ("create", "", "pods/binding")} <= verbs
    assert not any(c.resource == "events" for c in service)  # kube-scheduler posts FailedScheduling
    docs = renderer.render()
    given = grants(docs, f"{FULL}-extender")
    denied = sorted(str(c) for c in service if not any(g.allows(c) for g in given))
    assert not denied, denied


#: how to run each public method of deviceplugin.kube.ApiKubeClient once
DEVICE_PLUGIN_METHODS: dict[str, Callable[[Any, FakeKubeAPI], None]] = {
    "list_node_pods": lambda k, f: k.list_node_pods("n1"),
    "list_objects": lambda k, f: k.list_objects("pods", field_selector="spec.nodeName=n1"),
    "watch_objects": lambda k, f: _drain(k.watch_objects("pods", f.resource_version, 1,
                                                         field_selector="spec.nodeName=n1")),
    "patch_pod_annotations": lambda k, f: k.patch_pod_annotations("team-a", "p", {"kube-vgpu.io/bind-phase": "success"}),
    "patch_node_annotations": lambda k, f: k.patch_node_annotations("n1", {ANN_NODE_INVENTORY: "{}"}),
}


def test_device_plugin_rbac_is_exactly_its_calls(renderer: Renderer, fake: FakeKubeAPI) -> None:
    from deviceplugin.kube import ApiKubeClient
    missing = _public_methods(ApiKubeClient) - set(DEVICE_PLUGIN_METHODS)
    assert not missing, f"ApiKubeClient methods not exercised here (add them to DEVICE_PLUGIN_METHODS): {sorted(missing)}"
    fake.create_object("nodes", {"metadata": {"name": "n1"}})
    fake.create_object("pods", _pod("p"), namespace="team-a")
    k = ApiKubeClient(api_client=fake.api_client())
    fake.clear_requests()
    for fn in DEVICE_PLUGIN_METHODS.values():
        fn(k, fake)
    calls = recorded(fake)
    assert calls
    check(renderer.render(), f"{FULL}-device-plugin", calls)


def test_webhook_has_no_api_access(renderer: Renderer) -> None:
    assert grants(renderer.render(), f"{FULL}-webhook") == []


def test_check_catches_missing_and_extra_grants(renderer: Renderer) -> None:
    """The comparison itself: a call the roles do not allow, and a grant nothing uses, both fail."""
    docs = renderer.render()
    sa = f"{FULL}-device-plugin"
    calls = {Call("patch", "", "nodes", "", "n1"), Call("list", "", "pods", "", ""),
             Call("watch", "", "pods", "", ""), Call("patch", "", "pods", "team-a", "p")}
    check(docs, sa, calls)
    with pytest.raises(AssertionError, match="lacks RBAC.*delete core/pods"):
        check(docs, sa, calls | {Call("delete", "", "pods", "team-a", "p")})
    with pytest.raises(AssertionError, match="never calls.*patch core/nodes"):
        check(docs, sa, calls - {Call("patch", "", "nodes", "", "n1")})
    # resourceNames: a Lease of another name is not allowed
    own = renderer.render(OWN_LEASE)
    lease = Call("get", "coordination.k8s.io", "leases", NAMESPACE, f"{FULL}-extender")
    assert any(g.allows(lease) for g in grants(own, f"{FULL}-extender"))
    other = Call("get", "coordination.k8s.io", "leases", NAMESPACE, "kube-scheduler")
    assert not any(g.allows(other) for g in grants(own, f"{FULL}-extender"))
    assert not any(g.allows(Call("get", "coordination.k8s.io", "leases", "default", f"{FULL}-extender"))
                   for g in grants(own, f"{FULL}-extender"))


def test_extender_identity_holds_no_kube_scheduler_rights(renderer: Renderer) -> None:
    """The extender container's token is not kube-scheduler's: pod deletion, pods/status and the
    control-plane scheduler's roles stay with kube-scheduler."""
    for mode in MODES.values():
        docs = renderer.render(mode)
        names = {g.role for g in grants(docs, f"{FULL}-extender")}
        assert names <= {f"{FULL}-extender"}, names
