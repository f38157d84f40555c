"""The extender's lean API client (:class:`kube_vgpu.kubeapi.JSONClient`, used by
:class:`scheduler.kube.KubeAPI` for the bind's calls) over real HTTPS with a bearer token, against the
fake kube-apiserver: the same requests, preconditions and error mapping as the generated client, kept-
alive connections, and a Binding whose answer never comes (dropped connection, read timeout) left as an
unknown outcome that the bind settles by reading the pod back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from kube_vgpu.kubeapi import JSONClient, api_error_text, is_conflict, is_not_found, outcome_unknown
from scheduler.bindcycle import write_binding
from scheduler.kube import KubeAPI
from tests.fakeapi import FakeKubeAPI

TOKEN = "jsonclient-token"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(tls=True, token=TOKEN, bookmark_interval=3600) as api:
        yield api


def _pod(fake: FakeKubeAPI, name: str) -> dict[str, Any]:
    return fake.create_object("pods", {"metadata": {"name": name, "namespace": "default"},
                                       "spec": {"containers": [{"name": "c", "image": "busybox"}]}})


def _api(fake: FakeKubeAPI, timeout: float = 10.0, **kw: Any) -> KubeAPI:
    api = KubeAPI(fake.api_client(), timeout=timeout, **kw)
    assert api.http is not None or kw.get("generated_client")
    return api


@pytest.mark.parametrize("generated", [False, True])
def test_bind_calls_over_https_with_token_and_preconditions(fake: FakeKubeAPI, generated: bool) -> None:
    """GET, merge patch (resourceVersion-guarded) and Binding (uid + resourceVersion preconditions,
    annotations copied onto the pod) give the same results through either client."""
    api = _api(fake, generated_client=generated)
    name = f"plain-{int(generated)}"
    pod = _pod(fake, name)
    got = api.get_pod("default", name)
    assert got["metadata"]["uid"] == pod["metadata"]["uid"]
    rv = got["metadata"]["resourceVersion"]
    patched = api.patch_pod_metadata("default", name, rv, {"kube-vgpu.io/x": "1"}, {"l": "v"})
    assert patched["metadata"]["annotations"]["kube-vgpu.io/x"] == "1"
    with pytest.raises(ApiException) as ei:  # the old resourceVersion: the pod changed since
        api.patch_pod_metadata("default", name, rv, {"kube-vgpu.io/x": "2"}, {})
    assert is_conflict(ei.value) and not outcome_unknown(ei.value)
    assert "has been modified" in api_error_text(ei.value)
    with pytest.raises(ApiException) as ei:  # a Binding for another pod of that name (uid precondition)
        api.create_binding("default", name, "another-uid", "node-1", "", {"a": "b"})
    assert is_conflict(ei.value)
    with pytest.raises(ApiException) as ei:  # a stale resourceVersion precondition
        api.create_binding("default", name, pod["metadata"]["uid"], "node-1", rv, {"a": "b"})
    assert is_conflict(ei.value)
    now = patched["metadata"]["resourceVersion"]
    api.create_binding("default", name, pod["metadata"]["uid"], "node-1", now, {"kube-vgpu.io/y": "z"})
    bound = fake.get_object("pods", name, "default")
    assert bound is not None and bound["spec"]["nodeName"] == "node-1"
    assert bound["metadata"]["annotations"]["kube-vgpu.io/y"] == "z"
    removed = api.remove_pod_metadata("default", name, "", ["kube-vgpu.io/x"], ["l"])
    assert "kube-vgpu.io/x" not in removed["metadata"].get("annotations", {})
    with pytest.raises(ApiException) as ei:
        api.get_pod("default", "no-such-pod")
    assert is_not_found(ei.value) and not outcome_unknown(ei.value)
    assert api_error_text(ei.value) == 'API 404: pods "no-such-pod" not found'


def test_requests_carry_the_token_and_reuse_one_connection(fake: FakeKubeAPI) -> None:
    api = _api(fake)
    names = [f"reuse-{i}" for i in range(5)]
    pods = [_pod(fake, n) for n in names]
    api.get_pod("default", names[0])  # the connection is opened (and kept) here
    before = fake.connection_count
    for p in pods:
        m = p["metadata"]
        api.get_pod("default", m["name"])
        api.create_binding("default", m["name"], m["uid"], "node-2", m["resourceVersion"], {"k": "v"})
    assert fake.connection_count == before  # every call on the kept-alive connection
    cfg = fake.configuration()
    cfg.api_key = {"authorization": "wrong"}
    from kubernetes import client
    with pytest.raises(ApiException) as ei:
        JSONClient(client.ApiClient(cfg)).request("GET", "/api/v1/namespaces/default/pods/reuse-0")
    assert ei.value.status == 401 and not outcome_unknown(ei.value)


def test_tls_is_verified(fake: FakeKubeAPI, tmp_path: Any) -> None:
    """A server whose certificate the configured CA did not sign gets no request: an error, never an
    answer."""
    from kubernetes import client

    from tests.fakeapi import FakeKubeAPI as Other

    with Other(tls=True) as other:
        cfg = fake.configuration()
        cfg.host = other.base_url  # trusts only `fake`'s CA
        with pytest.raises((ApiException, urllib3.exceptions.HTTPError)) as ei:
            JSONClient(client.ApiClient(cfg)).request("GET", "/api/v1/namespaces/default/pods")
        assert outcome_unknown(ei.value)
        assert not any(r.path.startswith("/api/v1/namespaces") for r in other.request_log)


def test_names_are_path_encoded(fake: FakeKubeAPI) -> None:
    """A pod name from an unauthenticated /bind body is percent-encoded as the generated client
    does: it never reads another object (or adds a query), it gets an error."""
    api = _api(fake)
    _pod(fake, "victim")
    for name in ("../pods/victim", "victim/binding", "victim?x=1", "victim#x", "%2e%2e"):
        with pytest.raises(ApiException) as ei:
            api.get_pod("default", name)
        assert ei.value.status >= 400 and not outcome_unknown(ei.value), (name, ei.value.status)


@pytest.mark.parametrize("fault", ["reset", "timeout", 504])
def test_binding_without_an_answer_is_unknown_and_settled_by_reading_back(fake: FakeKubeAPI, fault: Any) -> None:
    """The Binding commits but its answer is lost: the client raises an error that
    :func:`outcome_unknown` calls unknown, and the bind reads the pod back and finds it bound with
    its record."""
    api = _api(fake, timeout=1.0)
    name = f"lost-{fault}"
    pod = _pod(fake, name)
    m = pod["metadata"]
    fake.fail_after_commit("create", "pods/binding", fault, name=name)
    with pytest.raises(Exception) as ei:
        api.create_binding("default", name, m["uid"], "node-3", m["resourceVersion"], {"kube-vgpu.io/allocation": "r"})
    assert outcome_unknown(ei.value), repr(ei.value)
    if fault != 504:
        assert not isinstance(ei.value, ApiException) or ei.value.status == 0
    # the same through the bind's write step: settled as bound by the read-back
    name2 = f"lost2-{fault}"
    pod2 = _pod(fake, name2)
    m2 = pod2["metadata"]
    fake.fail_after_commit("create", "pods/binding", fault, name=name2)
    res = write_binding(api, "default", name2, m2["uid"], m2["resourceVersion"],
                        {"kube-vgpu.io/allocation": "record-text"}, "node-3")
    assert res.state == "bound" and res.binding_posted, res


def test_binding_dropped_before_commit_is_fenced_not_released_blindly(fake: FakeKubeAPI) -> None:
    """No answer and nothing committed (the connection is reset before the server applies it): the
    bind does not assume failure from the error; it reads the pod back, fences it (a patch at the
    Binding's resourceVersion precondition, so the lost Binding can never land later) and only then
    reports failure."""
    api = _api(fake, timeout=1.0)
    name = "never-landed"
    pod = _pod(fake, name)
    m = pod["metadata"]
    calls: list[str] = []
    real = api.create_binding

    def dropped(*a: Any, **kw: Any) -> None:
        calls.append("binding")
        raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))

    api.create_binding = dropped  # type: ignore[method-assign]
    res = write_binding(api, "default", name, m["uid"], m["resourceVersion"],
                        {"kube-vgpu.io/allocation": "record-text"}, "node-4")
    api.create_binding = real  # type: ignore[method-assign]
    assert calls == ["binding"] and res.state == "failed", res
    after = fake.get_object("pods", name, "default")
    assert after is not None and after["metadata"]["resourceVersion"] != m["resourceVersion"]  # fenced
    assert after["metadata"]["annotations"]["kube-vgpu.io/bind-phase"] == "failed"
    with pytest.raises(ApiException) as ei:  # the lost Binding, were it to arrive now, is refused
        api.create_binding("default", name, m["uid"], "node-4", m["resourceVersion"], {"kube-vgpu.io/allocation": "r"})
    assert is_conflict(ei.value)
