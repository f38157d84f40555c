"""Tests of the fake Kubernetes API (tests/fakeapi), driven through the official kubernetes client."""

from __future__ import annotations

import json
import threading
import time

import pytest
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.fakeapi import FakeKubeAPI


def pod(name: str, ns: str = "default", labels: dict | None = None, gpus: int | None = None, **spec) -> dict:
    c: dict = {"name": "main", "image": "busybox:1.36"}
    if gpus is not None:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"containers": [c], **spec},
    }


def node(name: str, labels: dict | None = None, gpus: int = 2) -> dict:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "status": {
            "capacity": {"nvidia.com/gpu": str(gpus), "cpu": "8"},
            "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def bind(v1: client.CoreV1Api, name: str, node_name: str, ns: str = "default", **meta):
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, **meta},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_name}}
    # the real apiserver answers a Status, which the client cannot turn into a V1Binding: read it raw
    return v1.create_namespaced_pod_binding(name, ns, body, _preload_content=False)


@pytest.fixture
def api():
    with FakeKubeAPI() as fake:
        yield fake


@pytest.fixture
def v1(api):
    c = api.api_client()
    yield client.CoreV1Api(c)
    c.close()


# ---------------------------------------------------------------------------- CRUD


def test_pod_crud(api, v1):
    created = v1.create_namespaced_pod("default", pod("p1", labels={"app": "x"}, gpus=1))
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.status.phase == "Pending"
    assert created.spec.scheduler_name == "default-scheduler"
    # requests default to limits, like the real defaulting
    assert created.spec.containers[0].resources.requests == {"nvidia.com/gpu": "1"}

    got = v1.read_namespaced_pod("p1", "default")
    assert got.metadata.resource_version == created.metadata.resource_version

    got.metadata.labels["app"] = "y"
    updated = v1.replace_namespaced_pod("p1", "default", got)
    assert updated.metadata.labels == {"app": "y"}
    assert int(updated.metadata.resource_version) > int(created.metadata.resource_version)

    deleted = v1.delete_namespaced_pod("p1", "default")
    assert deleted.metadata.name == "p1"  # pods return the deleted object
    with pytest.raises(ApiException) as ei:
        v1.read_namespaced_pod("p1", "default")
    st = status_of(ei.value)
    assert ei.value.status == 404
    assert st["kind"] == "Status" and st["reason"] == "NotFound" and st["code"] == 404
    assert st["message"] == 'pods "p1" not found'


def test_create_existing_is_already_exists(v1):
    v1.create_namespaced_pod("default", pod("p1"))
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("default", pod("p1"))
    assert ei.value.status == 409 and status_of(ei.value)["reason"] == "AlreadyExists"


def test_generate_name(v1):
    body = pod("ignored")
    body["metadata"] = {"generateName": "job-"}
    p = v1.create_namespaced_pod("default", body)
    assert p.metadata.name.startswith("job-") and len(p.metadata.name) == 9


def test_node_crud_and_status_subresource(api, v1):
    n = v1.create_node(node("n1"))
    assert n.status.capacity["nvidia.com/gpu"] == "2"  # node status is kept on create
    n.status.capacity["nvidia.com/gpu"] = "4"
    n.metadata.labels["gpu"] = "yes"
    n2 = v1.replace_node("n1", n)
    assert n2.metadata.labels["gpu"] == "yes"
    assert n2.status.capacity["nvidia.com/gpu"] == "2"  # main resource ignores status
    n3 = v1.patch_node_status("n1", {"status": {"capacity": {"nvidia.com/gpu": "4"}}})
    assert n3.status.capacity["nvidia.com/gpu"] == "4"
    assert [x.metadata.name for x in v1.list_node().items] == ["n1"]
    out = v1.delete_node("n1")  # a Status (the client hands it back as a dict or a V1Status)
    assert (out["status"] if isinstance(out, dict) else out.status) == "Success"
    assert v1.list_node().items == []


def test_conflict_on_stale_resource_version(v1):
    v1.create_node(node("n1"))
    a = v1.read_node("n1")
    b = v1.read_node("n1")
    a.metadata.annotations = {"x": "1"}
    v1.replace_node("n1", a)
    b.metadata.annotations = {"x": "2"}
    with pytest.raises(ApiException) as ei:
        v1.replace_node("n1", b)
    st = status_of(ei.value)
    assert ei.value.status == 409
    assert st["kind"] == "Status" and st["reason"] == "Conflict" and st["code"] == 409
    assert "the object has been modified" in st["message"]
    # a patch carrying a stale resourceVersion conflicts too
    with pytest.raises(ApiException) as ei:
        v1.patch_node("n1", {"metadata": {"resourceVersion": b.metadata.resource_version,
                                          "annotations": {"x": "3"}}})
    assert ei.value.status == 409
    # without a resourceVersion the update is unconditional
    b.metadata.resource_version = None
    assert v1.replace_node("n1", b).metadata.annotations == {"x": "2"}


def test_noop_update_keeps_resource_version(v1):
    n = v1.create_node(node("n1"))
    again = v1.replace_node("n1", n)
    assert again.metadata.resource_version == n.metadata.resource_version


# ---------------------------------------------------------------------------- binding


def test_binding_sets_node_name_and_conflicts_when_bound(api, v1):
    v1.create_node(node("n1"))
    v1.create_namespaced_pod("default", pod("p1", gpus=1))
    resp = bind(v1, "p1", "n1", annotations={"vgpu.example/devices": "GPU-0"})
    assert resp.status == 201
    assert json.loads(resp.data)["status"] == "Success"
    p = v1.read_namespaced_pod("p1", "default")
    assert p.spec.node_name == "n1"
    assert p.metadata.annotations["vgpu.example/devices"] == "GPU-0"  # binding annotations are copied
    assert any(c.type == "PodScheduled" and c.status == "True" for c in p.status.conditions)
    with pytest.raises(ApiException) as ei:
        bind(v1, "p1", "n2")
    st = status_of(ei.value)
    assert ei.value.status == 409 and st["reason"] == "Conflict"
    assert 'already assigned to node "n1"' in st["message"]
    with pytest.raises(ApiException) as ei:
        bind(v1, "nope", "n1")
    assert ei.value.status == 404
    assert ("POST", "/api/v1/namespaces/default/pods/p1/binding") in api.requests


def test_binding_uid_precondition_and_bindings_collection(v1):
    v1.create_namespaced_pod("default", pod("p1"))
    with pytest.raises(ApiException) as ei:
        bind(v1, "p1", "n1", uid="not-the-uid")
    assert ei.value.status == 409
    body = {"metadata": {"name": "p1"}, "target": {"kind": "Node", "name": "n1"}}
    resp = v1.create_namespaced_binding("default", body, _preload_content=False)
    assert resp.status == 201
    assert v1.read_namespaced_pod("p1", "default").spec.node_name == "n1"


def test_pod_spec_is_immutable_except_via_binding(v1):
    v1.create_namespaced_pod("default", pod("p1"))
    with pytest.raises(ApiException) as ei:
        v1.patch_namespaced_pod("p1", "default", {"spec": {"nodeName": "n1"}})
    assert ei.value.status == 422 and status_of(ei.value)["reason"] == "Invalid"


# ---------------------------------------------------------------------------- list + selectors


def test_list_with_label_and_field_selectors(api, v1):
    api.create_object("namespaces", {"metadata": {"name": "other"}})
    v1.create_namespaced_pod("default", pod("a", labels={"app": "web", "tier": "1"}))
    v1.create_namespaced_pod("default", pod("b", labels={"app": "db"}))
    v1.create_namespaced_pod("other", pod("c", ns="other", labels={"app": "web"}))
    bind(v1, "a", "n1")
    v1.patch_namespaced_pod_status("b", "default", {"status": {"phase": "Running"}})

    def names(**kw):
        return sorted(p.metadata.name for p in v1.list_pod_for_all_namespaces(**kw).items)

    assert names() == ["a", "b", "c"]
    assert names(label_selector="app=web") == ["a", "c"]
    assert names(label_selector="app==web,tier=1") == ["a"]
    assert names(label_selector="app!=web") == ["b"]
    assert names(label_selector="tier") == ["a"]
    assert names(label_selector="!tier") == ["b", "c"]
    assert names(label_selector="app in (db, web),tier notin (2)") == ["a", "b", "c"]
    assert names(label_selector="app notin (web)") == ["b"]
    assert names(field_selector="spec.nodeName=n1") == ["a"]
    assert names(field_selector="spec.nodeName=") == ["b", "c"]
    assert names(field_selector="spec.nodeName!=n1") == ["b", "c"]
    assert names(field_selector="status.phase=Running") == ["b"]
    assert names(field_selector="metadata.name=c") == ["c"]
    assert names(field_selector="metadata.namespace=other") == ["c"]
    assert names(field_selector="status.phase!=Running,metadata.namespace=default") == ["a"]
    assert [p.metadata.name for p in v1.list_namespaced_pod("other").items] == ["c"]
    lst = v1.list_namespaced_pod("default")
    assert int(lst.metadata.resource_version) == int(api.resource_version)
    with pytest.raises(ApiException) as ei:
        v1.list_namespaced_pod("default", field_selector="spec.bogus=x")
    assert ei.value.status == 400
    with pytest.raises(ApiException) as ei:
        v1.list_namespaced_pod("default", label_selector="a in (b")
    assert ei.value.status == 400


def test_raw_list_shape(api):
    api.create_object("pods", pod("p1"))
    c = api.api_client()
    resp = client.CoreV1Api(c).list_namespaced_pod("default", _preload_content=False)
    body = json.loads(resp.data)
    assert body["kind"] == "PodList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == api.resource_version
    assert [i["metadata"]["name"] for i in body["items"]] == ["p1"]
    c.close()


def test_pagination(v1):
    for i in range(5):
        v1.create_node(node(f"n{i}"))
    first = v1.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"]
    assert first.metadata.remaining_item_count == 3 and first.metadata._continue
    rest = v1.list_node(limit=10, _continue=first.metadata._continue)
    assert [n.metadata.name for n in rest.items] == ["n2", "n3", "n4"]
    assert not rest.metadata._continue


# ---------------------------------------------------------------------------- watch


def _collect(gen, out: list, stop_after: int | None = None):
    for e in gen:
        out.append(e)
        if stop_after is not None and len(out) >= stop_after:
            break


def first_events(func, *args, n: int, **kw) -> list:
    """The first n events of a watch (bounded by a 5 s server-side timeout)."""
    out: list = []
    w = watch.Watch()
    for e in w.stream(func, *args, timeout_seconds=5, **kw):
        out.append(e)
        if len(out) >= n:
            w.stop()
            break
    return out


def test_watch_sees_added_modified_deleted(api, v1):
    v1.create_node(node("n1"))
    rv = v1.list_namespaced_pod("default").metadata.resource_version
    events: list = []
    w = watch.Watch()
    t = threading.Thread(target=_collect, args=(
        w.stream(v1.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=5), events, 3))
    t.start()
    api.wait_for_watch("pods")
    v1.create_namespaced_pod("default", pod("p1", gpus=1))
    bind(v1, "p1", "n1")
    v1.delete_namespaced_pod("p1", "default")
    t.join(5)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "p1"), ("MODIFIED", "p1"), ("DELETED", "p1")]
    assert events[1]["object"].spec.node_name == "n1"
    rvs = [int(e["object"].metadata.resource_version) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3


def test_watch_replays_history_from_resource_version(api, v1):
    v1.create_namespaced_pod("default", pod("p1"))
    rv = api.resource_version
    v1.create_namespaced_pod("default", pod("p2"))
    v1.delete_namespaced_pod("p1", "default")
    events = first_events(v1.list_namespaced_pod, "default", resource_version=rv, n=2)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "p2"), ("DELETED", "p1")]


def test_watch_without_resource_version_starts_with_current_state(v1):
    v1.create_namespaced_pod("default", pod("p1"))
    v1.create_namespaced_pod("default", pod("p2"))
    events = first_events(v1.list_namespaced_pod, "default", n=2)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "p1"), ("ADDED", "p2")]


def test_watch_selectors_and_transitions(api, v1):
    v1.create_namespaced_pod("default", pod("p1", labels={"app": "web"}))
    v1.create_namespaced_pod("default", pod("p2", labels={"app": "db"}))
    rv = api.resource_version
    events: list = []
    t = threading.Thread(target=_collect, args=(watch.Watch().stream(
        v1.list_namespaced_pod, "default", label_selector="app=web", resource_version=rv,
        timeout_seconds=5), events, 3))
    t.start()
    api.wait_for_watch("pods")
    v1.patch_namespaced_pod("p2", "default", {"metadata": {"labels": {"app": "web"}}})  # now matches: ADDED
    v1.patch_namespaced_pod("p1", "default", {"metadata": {"labels": {"app": "db"}}})  # leaves: DELETED
    v1.patch_namespaced_pod("p2", "default", {"metadata": {"labels": {"x": "y"}}})  # MODIFIED
    t.join(5)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "p2"), ("DELETED", "p1"), ("MODIFIED", "p2")]


def test_watch_field_selector_on_node_name(api, v1):
    rv = api.resource_version
    v1.create_namespaced_pod("default", pod("p1"))
    v1.create_namespaced_pod("default", pod("p2"))
    bind(v1, "p2", "n1")
    v1.create_namespaced_pod("default", pod("p3"))
    bind(v1, "p3", "n1")
    events = first_events(v1.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1",
                          resource_version=rv, n=2)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "p2"), ("ADDED", "p3")]


def test_watch_gone_after_expiry(api, v1):
    v1.create_namespaced_pod("default", pod("p1"))
    old_rv = v1.list_namespaced_pod("default").metadata.resource_version
    api.expire_watches()
    # with timeout_seconds the client does not retry: the 410 ERROR event raises at once
    with pytest.raises(ApiException) as ei:
        list(watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=old_rv, timeout_seconds=2))
    assert ei.value.status == 410
    # a relist gives a fresh resourceVersion that can be watched from
    fresh = v1.list_namespaced_pod("default").metadata.resource_version
    assert int(fresh) > int(old_rv)
    v1.create_namespaced_pod("default", pod("p2"))
    events = first_events(v1.list_namespaced_pod, "default", resource_version=fresh, n=1)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "p2")]


def test_watch_expiry_closes_open_stream_and_retry_gets_410(api, v1):
    rv = v1.list_namespaced_pod("default").metadata.resource_version
    result: dict = {}
    events: list = []

    def run():
        try:
            # no timeout_seconds: the client resumes after a closed stream and after one 410
            for e in watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=rv):
                events.append(e)
        except ApiException as exc:
            result["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    api.wait_for_watch("pods")
    v1.create_namespaced_pod("default", pod("p1"))
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    api.expire_watches()
    t.join(5)
    assert not t.is_alive()
    assert [e["type"] for e in events] == ["ADDED"]
    assert result["exc"].status == 410
    assert "too old resource version" in result["exc"].reason


def test_watch_bookmarks(api, v1):
    api.bookmark_interval = 0.1
    rv = api.resource_version
    events = first_events(v1.list_namespaced_pod, "default", resource_version=rv, allow_watch_bookmarks=True, n=2)
    assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
    assert events[0]["raw_object"]["metadata"]["resourceVersion"] == rv


def test_watch_timeout_is_honoured(v1):
    start = time.monotonic()
    assert list(watch.Watch().stream(v1.list_node, timeout_seconds=1)) == []
    assert 0.8 < time.monotonic() - start < 3


# ---------------------------------------------------------------------------- patch


def test_merge_patch_node_annotations(v1):
    v1.create_node({"metadata": {"name": "n1", "annotations": {"keep": "1", "drop": "2"}}})
    patched = v1.patch_node(
        "n1",
        {"metadata": {"annotations": {"drop": None, "new": "3", "nested.example/x": "y"}}},
        _content_type="application/merge-patch+json",
    )
    assert patched.metadata.annotations == {"keep": "1", "new": "3", "nested.example/x": "y"}
    # the client's default for a dict body is a strategic merge patch: maps merge the same way
    patched = v1.patch_node("n1", {"metadata": {"annotations": {"keep": None}}})
    assert patched.metadata.annotations == {"new": "3", "nested.example/x": "y"}


def test_strategic_merge_patch_merges_containers_by_name(v1):
    body = pod("p1")
    body["spec"]["containers"].append({"name": "side", "image": "busybox:1.36"})
    v1.create_namespaced_pod("default", body)
    p = v1.patch_namespaced_pod("p1", "default", {"spec": {"containers": [{"name": "side", "image": "alpine:3"}]}})
    assert [(c.name, c.image) for c in p.spec.containers] == [("main", "busybox:1.36"), ("side", "alpine:3")]
    # merge patch replaces lists (and here that changes more than images: rejected like the real server)
    with pytest.raises(ApiException) as ei:
        v1.patch_namespaced_pod("p1", "default", {"spec": {"containers": [{"name": "side", "image": "a:1"}]}},
                                _content_type="application/merge-patch+json")
    assert ei.value.status == 422


def test_json_patch(v1):
    v1.create_node({"metadata": {"name": "n1", "labels": {"a": "1"}}})
    patched = v1.patch_node("n1", [
        {"op": "test", "path": "/metadata/labels/a", "value": "1"},
        {"op": "add", "path": "/metadata/annotations", "value": {"k~1": "v"}},
        {"op": "replace", "path": "/metadata/labels/a", "value": "2"},
    ])
    assert patched.metadata.labels == {"a": "2"}
    assert patched.metadata.annotations == {"k~1": "v"}
    with pytest.raises(ApiException) as ei:
        v1.patch_node("n1", [{"op": "test", "path": "/metadata/labels/a", "value": "1"}])
    assert ei.value.status == 422


def test_pod_status_patch_keeps_spec(v1):
    v1.create_namespaced_pod("default", pod("p1"))
    p = v1.patch_namespaced_pod_status("p1", "default", {"status": {"phase": "Running"},
                                                         "spec": {"nodeName": "sneaky"}})
    assert p.status.phase == "Running" and p.spec.node_name is None
    # status written through the main resource is ignored
    p = v1.patch_namespaced_pod("p1", "default", {"status": {"phase": "Failed"}})
    assert p.status.phase == "Running"


# ---------------------------------------------------------------------------- delete


def test_finalizers_delay_deletion(api, v1):
    body = pod("p1")
    body["metadata"]["finalizers"] = ["example.com/hold"]
    v1.create_namespaced_pod("default", body)
    v1.delete_namespaced_pod("p1", "default")
    p = v1.read_namespaced_pod("p1", "default")
    assert p.metadata.deletion_timestamp is not None
    v1.patch_namespaced_pod("p1", "default", {"metadata": {"finalizers": None}},
                            _content_type="application/merge-patch+json")
    assert api.get_object("pods", "p1") is None


def test_graceful_pod_deletion_option():
    with FakeKubeAPI(graceful_pod_deletion=True) as api:
        c = api.api_client()
        v1 = client.CoreV1Api(c)
        v1.create_namespaced_pod("default", pod("p1"))
        v1.create_namespaced_pod("default", pod("p2"))
        bind(v1, "p1", "n1")
        v1.delete_namespaced_pod("p1", "default")
        v1.delete_namespaced_pod("p2", "default")  # unbound: immediate
        assert api.get_object("pods", "p2") is None
        assert v1.read_namespaced_pod("p1", "default").metadata.deletion_timestamp is not None
        v1.delete_namespaced_pod("p1", "default", grace_period_seconds=0)
        assert api.get_object("pods", "p1") is None
        c.close()


def test_delete_preconditions(v1):
    p = v1.create_namespaced_pod("default", pod("p1"))
    with pytest.raises(ApiException) as ei:
        v1.delete_namespaced_pod("p1", "default", body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="other")))
    assert ei.value.status == 409
    v1.delete_namespaced_pod("p1", "default", body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=p.metadata.uid)))


def test_delete_collection(api, v1):
    v1.create_namespaced_pod("default", pod("a", labels={"x": "1"}))
    v1.create_namespaced_pod("default", pod("b"))
    v1.delete_collection_namespaced_pod("default", label_selector="x=1")
    assert [p["metadata"]["name"] for p in api.objects("pods")] == ["b"]


# ---------------------------------------------------------------------------- other resources


def test_secrets_configmaps_leases_webhooks_events(api):
    c = api.api_client()
    v1 = client.CoreV1Api(c)
    s = v1.create_namespaced_secret("kube-system", {"metadata": {"name": "tls"}, "stringData": {"a": "b"}})
    assert s.data == {"a": "Yg=="} and s.type == "Opaque"
    v1.create_namespaced_config_map("default", {"metadata": {"name": "cm"}, "data": {"k": "v"}})
    assert v1.read_namespaced_config_map("cm", "default").data == {"k": "v"}
    v1.create_namespaced_service_account("default", {"metadata": {"name": "default"}})
    v1.create_namespaced_event("default", {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod",
                                           "name": "p1"}, "reason": "Scheduled"})
    assert [e.metadata.name for e in v1.list_namespaced_event("default",
                                                              field_selector="reason=Scheduled").items] == ["e1"]

    coord = client.CoordinationV1Api(c)
    lease = coord.create_namespaced_lease("kube-system", {"metadata": {"name": "leader"},
                                                          "spec": {"holderIdentity": "a"}})
    lease.spec.holder_identity = "b"
    assert coord.replace_namespaced_lease("leader", "kube-system", lease).spec.holder_identity == "b"
    with pytest.raises(ApiException) as ei:
        coord.replace_namespaced_lease("leader", "kube-system", lease)  # stale
    assert ei.value.status == 409

    adm = client.AdmissionregistrationV1Api(c)
    mwc = {"metadata": {"name": "vgpu"}, "webhooks": [{
        "name": "vgpu.example.com", "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "clientConfig": {"url": "https://127.0.0.1:9443/mutate"}}]}
    adm.create_mutating_webhook_configuration(mwc)
    adm.patch_mutating_webhook_configuration(
        "vgpu", [{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "Q0E="}])
    got = adm.read_mutating_webhook_configuration("vgpu")
    assert got.webhooks[0].client_config.ca_bundle == "Q0E="
    # strategic merge patch merges webhooks by name (what a cert tool does to inject its CA)
    adm.patch_mutating_webhook_configuration(
        "vgpu", {"webhooks": [{"name": "vgpu.example.com", "clientConfig": {"caBundle": "Q0I="}}]})
    got = adm.read_mutating_webhook_configuration("vgpu")
    assert got.webhooks[0].client_config.ca_bundle == "Q0I="
    assert got.webhooks[0].client_config.url == "https://127.0.0.1:9443/mutate"
    assert got.webhooks[0].side_effects == "None"
    assert [m.metadata.name for m in adm.list_mutating_webhook_configuration().items] == ["vgpu"]

    ev = client.EventsV1Api(c)
    ev.create_namespaced_event("default", {"metadata": {"name": "e2"}, "eventTime": "2026-01-01T00:00:00.000000Z",
                                           "reason": "X", "action": "Y", "reportingController": "c",
                                           "reportingInstance": "i"})
    assert [e.metadata.name for e in ev.list_namespaced_event("default").items] == ["e2"]
    c.close()


def test_namespaces(api, v1):
    assert {"default", "kube-system"} <= {n.metadata.name for n in v1.list_namespace().items}
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("missing", pod("p1", ns="missing"))
    assert ei.value.status == 404 and status_of(ei.value)["message"] == 'namespaces "missing" not found'
    v1.create_namespace({"metadata": {"name": "gpu"}})
    v1.create_namespaced_pod("gpu", pod("p1", ns="gpu"))
    v1.delete_namespace("gpu")
    assert api.objects("pods") == []


# ---------------------------------------------------------------------------- robustness + hooks


def test_malformed_bodies_get_400(api):
    import urllib.request

    def send(method, path, data, ctype="application/json"):
        req = urllib.request.Request(api.base_url + path, data=data, method=method,
                                     headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for method, path, data, ctype in [
        ("POST", "/api/v1/namespaces/default/pods", b"{not json", "application/json"),
        ("POST", "/api/v1/namespaces/default/pods", b"[1,2]", "application/json"),
        ("POST", "/api/v1/namespaces/default/pods", b'{"metadata": 5}', "application/json"),
        ("POST", "/api/v1/nodes", b'{"kind": "Pod", "metadata": {"name": "x"}}', "application/json"),
        ("POST", "/api/v1/namespaces/default/pods/p/binding", b"\xff\xfe", "application/json"),
        ("PATCH", "/api/v1/nodes/n1", b"{oops", "application/merge-patch+json"),
    ]:
        code, st = send(method, path, data, ctype)
        assert code == 400, (path, data, st)
        assert st["kind"] == "Status" and st["reason"] == "BadRequest" and st["code"] == 400
    code, st = send("PATCH", "/api/v1/nodes/n1", b"{}", "text/plain")
    assert code == 415
    code, st = send("GET", "/api/v1/frobs", None)
    assert code == 404 and st["kind"] == "Status"
    assert api.errors == []


def test_fail_next_and_request_log(api, v1):
    api.fail_next("create", "pods", status=500)
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("default", pod("p1"))
    assert ei.value.status == 500 and status_of(ei.value)["reason"] == "InternalError"
    v1.create_namespaced_pod("default", pod("p1"))  # only the next one failed
    api.fail_next("create", "pods/binding", status=409, count=2)
    for _ in range(2):
        with pytest.raises(ApiException) as ei:
            bind(v1, "p1", "n1")
        assert ei.value.status == 409
    assert bind(v1, "p1", "n1").status == 201
    # a 429 carries Retry-After (1 s by default), and the client's urllib3 pool retries it by itself
    api.fail_next("list", "*", status=429, headers={"Retry-After": "0"})
    assert v1.list_node().items == []
    assert [i.status for i in api.request_log if i.verb == "list"][-2:] == [429, 200]
    api.fail_next("list", "nodes", status=429, headers={})
    with pytest.raises(ApiException) as ei:
        v1.list_node()
    assert ei.value.status == 429
    api.fail_next("watch", "pods", status=503)
    with pytest.raises(ApiException) as ei:
        list(watch.Watch().stream(v1.list_namespaced_pod, "default", timeout_seconds=1))
    assert ei.value.status == 503
    assert [i.verb for i in api.request_log if i.resource == "pods/binding"] == ["create"] * 3
    assert api.request_log[-1].verb == "watch" and api.request_log[-1].status == 503


def test_latency(api, v1):
    api.add_latency(0.3, verb="get", resource="nodes")
    v1.create_node(node("n1"))
    start = time.monotonic()
    v1.read_node("n1")
    assert time.monotonic() - start >= 0.3
    api.clear_latency()


def test_direct_object_access_emits_events(api, v1):
    rv = api.resource_version
    api.create_object("nodes", node("n1"))
    api.patch_object("nodes", "n1", {"metadata": {"labels": {"a": "b"}}})
    events = first_events(v1.list_node, resource_version=rv, n=2)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
    assert api.objects("nodes")[0]["metadata"]["labels"] == {"a": "b"}


# ---------------------------------------------------------------------------- config


def test_kubeconfig_and_discovery(api, tmp_path):
    path = api.kubeconfig(tmp_path / "kubeconfig")
    c = config.new_client_from_config(config_file=path)
    assert client.VersionApi(c).get_code().git_version == "v1.36.2"
    groups = {g.name for g in client.ApisApi(c).get_api_versions().groups}
    assert {"coordination.k8s.io", "admissionregistration.k8s.io"} <= groups
    res = {r.name for r in client.CoreV1Api(c).get_api_resources().resources}
    assert {"pods", "pods/binding", "pods/status", "nodes", "secrets"} <= res
    c.close()


def test_tls_and_token():
    with FakeKubeAPI(tls=True, token="s3cret") as api:
        assert api.base_url.startswith("https://127.0.0.1:")
        c = api.api_client()
        assert client.CoreV1Api(c).list_namespace().items
        c.close()
        bad = api.configuration()
        bad.api_key = {"authorization": "wrong"}
        c2 = client.ApiClient(bad)
        with pytest.raises(ApiException) as ei:
            client.CoreV1Api(c2).list_namespace()
        assert ei.value.status == 401
        c2.close()


# ---------------------------------------------------------------------------- hardening


def test_concurrent_optimistic_updates_lose_nothing(api):
    c = api.api_client()
    v1 = client.CoreV1Api(c)
    v1.create_namespaced_config_map("default", {"metadata": {"name": "counter"}, "data": {"n": "0"}})
    conflicts = []

    def worker():
        for _ in range(25):
            while True:
                cm = v1.read_namespaced_config_map("counter", "default")
                cm.data["n"] = str(int(cm.data["n"]) + 1)
                try:
                    v1.replace_namespaced_config_map("counter", "default", cm)
                    break
                except ApiException as exc:
                    assert exc.status == 409
                    conflicts.append(1)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert v1.read_namespaced_config_map("counter", "default").data["n"] == "150"
    c.close()


def test_watch_sees_every_write_in_order_under_concurrent_writers(api, v1):
    rv = v1.list_namespaced_config_map("default").metadata.resource_version

    def writer(k):
        for i in range(30):
            api.create_object("configmaps", {"metadata": {"name": f"w{k}-{i}"}})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    events = first_events(v1.list_namespaced_config_map, "default", resource_version=rv, n=90)
    for t in threads:
        t.join()
    rvs = [int(e["object"].metadata.resource_version) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 90
    assert {e["object"].metadata.name for e in events} == {f"w{k}-{i}" for k in range(3) for i in range(30)}


def test_closed_watch_resumes_from_last_resource_version(api, v1):
    rv = v1.list_namespaced_pod("default").metadata.resource_version
    events: list = []
    w = watch.Watch()

    def run():
        for e in w.stream(v1.list_namespaced_pod, "default", resource_version=rv):  # no timeout: resumes
            events.append((e["type"], e["object"].metadata.name))
            if len(events) == 2:
                w.stop()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    api.wait_for_watch("pods")
    v1.create_namespaced_pod("default", pod("p1"))
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert api.close_watches("pods") == 1
    v1.create_namespaced_pod("default", pod("p2"))  # written while the client is between streams
    t.join(5)
    assert events == [("ADDED", "p1"), ("ADDED", "p2")]
    watches = [i for i in api.request_log if i.verb == "watch"]
    assert len(watches) == 2 and watches[1].query["resourceVersion"] != rv


def test_history_window_yields_410(v1):
    with FakeKubeAPI(history_size=3) as small:
        c = small.api_client()
        sv1 = client.CoreV1Api(c)
        rv = small.resource_version
        for i in range(5):
            sv1.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
        with pytest.raises(ApiException) as ei:
            list(watch.Watch().stream(sv1.list_namespaced_config_map, "default", resource_version=rv,
                                      timeout_seconds=1))
        assert ei.value.status == 410
        # the last 3 writes are still in the window
        recent = str(int(small.resource_version) - 3)
        assert len(first_events(sv1.list_namespaced_config_map, "default", resource_version=recent, n=3)) == 3
        c.close()


def test_stop_ends_open_watches_promptly():
    api = FakeKubeAPI()
    api.start()
    c = api.api_client()
    v1 = client.CoreV1Api(c)
    done = threading.Event()

    def run():
        try:
            for _ in watch.Watch().stream(v1.list_node, timeout_seconds=30):
                pass
        except Exception:
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    api.wait_for_watch("nodes")
    start = time.monotonic()
    api.stop()
    assert done.wait(5)
    assert time.monotonic() - start < 3
    c.close()


def test_legacy_watch_path_and_raw_stream_format(api):
    import http.client

    api.create_object("pods", pod("p1"))
    api.create_object("pods", pod("p2"))
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=5)
    conn.request("GET", "/api/v1/watch/namespaces/default/pods/p1?timeoutSeconds=1")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "application/json"
    assert resp.getheader("Transfer-Encoding") == "chunked"
    lines = [json.loads(x) for x in resp.read().splitlines() if x.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"], e["object"]["kind"]) for e in lines] == [
        ("ADDED", "p1", "Pod")]
    conn.close()


def test_patch_edge_cases(api, v1):
    v1.create_node(node("n1"))
    # strategic merge on node status conditions merges by type
    v1.patch_node_status("n1", {"status": {"conditions": [{"type": "DiskPressure", "status": "False"}]}})
    conds = {c.type: c.status for c in v1.read_node("n1").status.conditions}
    assert conds == {"Ready": "True", "DiskPressure": "False"}
    # finalizers merge as a set under strategic merge
    v1.patch_node("n1", {"metadata": {"finalizers": ["a/x"]}})
    v1.patch_node("n1", {"metadata": {"finalizers": ["b/y"]}})
    assert v1.read_node("n1").metadata.finalizers == ["a/x", "b/y"]
    api.patch_object("nodes", "n1", {"metadata": {"finalizers": None}})

    import urllib.request

    def send(data, ctype, path="/api/v1/nodes/n1"):
        req = urllib.request.Request(api.base_url + path, data=data, method="PATCH", headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert send(b"[1]", "application/merge-patch+json") == 400
    assert send(b'{"a": 1}', "application/json-patch+json") == 400
    assert send(b'[{"op": "frobnicate", "path": "/x"}]', "application/json-patch+json") == 422
    assert send(b'[{"op": "remove", "path": "/metadata/nope"}]', "application/json-patch+json") == 422
    assert send(b'{"metadata": {"name": "other"}}', "application/merge-patch+json") == 400
    assert send(b'{"metadata": {"labels": {"a": 1}}}', "application/merge-patch+json") == 400
    assert send(b'{"metadata": null}', "application/merge-patch+json") == 422
    assert send(b"{}", "application/merge-patch+json", "/api/v1/nodes/missing") == 404
    # uid and creationTimestamp cannot be patched away
    before = v1.read_node("n1")
    after = v1.patch_node("n1", {"metadata": {"uid": "x", "creationTimestamp": None}},
                          _content_type="application/merge-patch+json")
    assert after.metadata.uid == before.metadata.uid
    assert after.metadata.creation_timestamp == before.metadata.creation_timestamp
    assert api.errors == []


def test_server_side_apply_is_approximated(api):
    import urllib.request

    body = b"metadata:\n  name: cm1\n  namespace: default\ndata:\n  k: v\n"
    url = api.base_url + "/api/v1/namespaces/default/configmaps/cm1?fieldManager=test"
    req = urllib.request.Request(url, data=body, method="PATCH", headers={"Content-Type": "application/apply-patch+yaml"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 200
    assert api.get_object("configmaps", "cm1", "default")["data"] == {"k": "v"}


def test_finalizers_cannot_be_added_while_deleting(v1):
    v1.create_node({"metadata": {"name": "n1", "finalizers": ["a/x"]}})
    v1.delete_node("n1")
    with pytest.raises(ApiException) as ei:
        v1.patch_node("n1", {"metadata": {"finalizers": ["b/y"]}})
    assert ei.value.status == 422


def test_dry_run_does_not_persist(api, v1):
    rv = api.resource_version
    out = v1.create_namespaced_pod("default", pod("p1"), dry_run="All")
    assert out.metadata.name == "p1" and api.get_object("pods", "p1") is None
    assert api.resource_version == rv


def test_extended_resource_validation(v1):
    bad = pod("p1")
    bad["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "2"}}
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("default", bad)
    assert ei.value.status == 422 and "must be equal to nvidia.com/gpu limit" in status_of(ei.value)["message"]
    bad["spec"]["containers"][0]["resources"] = {"requests": {"nvidia.com/gpu": "1"}}
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("default", bad)
    assert ei.value.status == 422
    nocontainers = {"metadata": {"name": "p2"}, "spec": {"containers": []}}
    with pytest.raises(ApiException) as ei:
        v1.create_namespaced_pod("default", nocontainers)
    assert ei.value.status == 422


def test_garbage_never_crashes_the_server(api):
    import http.client
    import random

    rnd = random.Random(1234)
    paths = ["/api/v1/namespaces/default/pods", "/api/v1/namespaces/default/pods/p1",
             "/api/v1/namespaces/default/pods/p1/binding", "/api/v1/namespaces/default/pods/p1/status",
             "/api/v1/nodes", "/api/v1/nodes/n1", "/apis/coordination.k8s.io/v1/namespaces/default/leases/l",
             "/api/v1/namespaces/default/bindings", "/api/v1/pods?labelSelector=%28%28",
             "/api/v1/pods?fieldSelector=spec", "/api/v1/pods?watch=true&resourceVersion=abc",
             "/api/v1/pods?watch=1&timeoutSeconds=x", "/api/v1/pods?limit=z", "/api/v1/pods?continue=@@",
             "/apis/nope/v1/things", "/api/v1/namespaces/default/pods/p1/bogus/extra/segs"]
    bodies = [b"", b"{", b"null", b"[]", b"123", b'"s"', b'{"metadata": []}', b'{"metadata": {"name": 5}}',
              b'{"metadata": {"name": "p1"}, "spec": []}', b'{"metadata": {"name": "p1"}, "spec": {"containers": [1]}}',
              b'{"target": "n1"}', b'{"metadata": {"name": "p1"}, "target": {"name": ["x"]}}',
              bytes(rnd.randrange(256) for _ in range(64)), b'[{"op": "add"}]']
    ctypes = ["application/json", "application/merge-patch+json", "application/strategic-merge-patch+json",
              "application/json-patch+json", "application/apply-patch+yaml", "text/plain", "application/yaml"]
    api.create_object("pods", pod("p1"))
    api.create_object("nodes", node("n1"))
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=5)
    for _ in range(300):
        method = rnd.choice(["GET", "POST", "PUT", "PATCH", "DELETE"])
        path = rnd.choice(paths)
        conn.request(method, path, body=rnd.choice(bodies), headers={"Content-Type": rnd.choice(ctypes)})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status < 500, (method, path, resp.status, data[:300])
        if resp.status >= 400:
            st = json.loads(data)
            assert st["kind"] == "Status" and st["code"] == resp.status
    conn.close()
    assert api.errors == []


def test_shared_fixtures(fake_kube_api, fake_core_v1, fake_kubeconfig):
    fake_core_v1.create_node({"metadata": {"name": "n1"}})
    assert [n["metadata"]["name"] for n in fake_kube_api.objects("nodes")] == ["n1"]
    c = config.new_client_from_config(config_file=fake_kubeconfig)
    assert [n.metadata.name for n in client.CoreV1Api(c).list_node().items] == ["n1"]
    c.close()
