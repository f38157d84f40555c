"""Malformed input never gets a 500 or Python's own wording: bodies that are not acceptable JSON get
HTTP 400; pods that are not a valid core/v1 Pod shape get a 400 denial naming the field path; values
the domain rejects (gpumem far beyond any GPU) get the domain's message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wh_helpers import Client, base_pod, limits, review_of

from kube_vgpu.config import Config
from webhook.admission import BadReview, answer, decode_review

CFG = Config()
PYTHON_WORDING = ("object has no attribute", "object is not", "unhashable", "Traceback", "NoneType",
                  "'str'", "'list'", "'dict'", "'int'")

# --- 1. JSON the decoder cannot take ---------------------------------------------------------


def test_deeply_nested_json_is_bad_review() -> None:
    with pytest.raises(BadReview, match="nested deeper"):
        decode_review(b"[" * 100000 + b"]" * 100000)
    with pytest.raises(BadReview, match="nested deeper"):
        decode_review(b'{"a":' * 50000 + b"1" + b"}" * 50000)


def test_deeply_nested_json_over_tls_is_400(client: Client) -> None:
    depth = 30000  # under the fixture's 64 KiB body limit
    status, text, _ = client.request("POST", "/mutate", b"[" * depth + b"]" * depth)
    assert status == 400 and b"nested deeper" in text, text
    assert client.request("GET", "/livez")[0] == 200


def test_huge_integer_is_bad_review() -> None:
    with pytest.raises(BadReview, match="not JSON"):
        decode_review(b"1" * 5000)


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=12)
_POD_SPOTS = [
    ("metadata",), ("metadata", "labels"), ("metadata", "annotations"), ("metadata", "name"),
    ("metadata", "annotations", "nvidia.com/use-gputype"), ("metadata", "labels", "kube-vgpu.io/webhook"),
    ("spec",), ("spec", "containers"), ("spec", "containers", 0), ("spec", "containers", 0, "name"),
    ("spec", "containers", 0, "resources"), ("spec", "containers", 0, "resources", "limits"),
    ("spec", "containers", 0, "resources", "limits", "nvidia.com/gpumem"),
    ("spec", "containers", 0, "resources", "requests"), ("spec", "containers", 0, "volumeMounts"),
    ("spec", "containers", 0, "volumeMounts", 0), ("spec", "containers", 0, "env"),
    ("spec", "containers", 0, "securityContext"), ("spec", "initContainers"), ("spec", "volumes"),
    ("spec", "volumes", 0), ("spec", "schedulerName"), ("spec", "nodeName"),
    ("request",), ("request", "object"), ("request", "uid"), ("request", "kind"), ("request", "operation"),
]


def _plant(review: dict[str, Any], spot: tuple[Any, ...], junk: Any) -> dict[str, Any]:
    node: Any = review if spot[0] == "request" else review["request"]["object"]
    for k in spot[:-1]:
        node = node[k]
    node[spot[-1]] = junk
    return review


@st.composite
def junk_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return json.dumps(draw(_json)).encode()
    pod = base_pod(limits(gpumem="1000", cores="30"))
    pod["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]
    pod["metadata"]["labels"] = {"app": "x"}
    pod["metadata"]["annotations"] = {"a": "b"}
    review = _plant(review_of(pod), draw(st.sampled_from(_POD_SPOTS)), draw(_json))
    body = json.dumps(review).encode()
    if kind == 3:  # cut or corrupt the JSON text
        i = draw(st.integers(0, len(body)))
        body = body[:i] + draw(st.binary(max_size=4)) + body[i + draw(st.integers(0, 4)):]
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=junk_bodies())
def test_junk_to_mutate_is_200_or_400_never_500(client: Client, body: bytes) -> None:
    status, text, _ = client.request("POST", "/mutate", body)
    assert status in (200, 400), (status, text)
    if status == 200:
        resp = json.loads(text)["response"]
        if not resp["allowed"]:
            msg = resp["status"]["message"]
            assert not any(w in msg for w in PYTHON_WORDING), msg


# --- 2. pods that are not a core/v1 Pod shape --------------------------------------------------

def _deny_message(pod: dict[str, Any]) -> str:
    resp, _ = answer(review_of(pod), CFG)
    r = resp["response"]
    assert r["allowed"] is False and r["status"]["code"] == 400 and "patch" not in r, r
    msg: str = r["status"]["message"]
    assert not any(w in msg for w in PYTHON_WORDING), msg
    return msg


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mangle(p: dict[str, Any]) -> None:
        node: Any = p
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return mangle


C0 = ("spec", "containers", 0)


@pytest.mark.parametrize("mangle,field", [
    (_set(("spec", "containers"), ["x"]), "spec.containers[0] must be an object"),
    (_set(("spec", "containers"), [{"name": "ok", "resources": {}}, 7]), "spec.containers[1] must be an object"),
    (_set(("spec", "initContainers"), ["x"]), "spec.initContainers[0] must be an object"),
    (_set(("spec", "containers"), "nope"), "spec.containers must be a list"),
    (_set(("spec",), "x"), "spec must be an object"),
    (_set((*C0, "resources"), "x"), "spec.containers[0].resources must be an object"),
    (_set((*C0, "resources"), {"limits": ["a"]}), "spec.containers[0].resources.limits must be an object"),
    (_set((*C0, "resources"), {"requests": "a"}), "spec.containers[0].resources.requests must be an object"),
    (_set((*C0, "resources"), {"limits": {"nvidia.com/gpumem": ["1"]}}),
     'spec.containers[0].resources.limits["nvidia.com/gpumem"] must be a quantity'),
    (_set((*C0, "resources"), {"limits": {"nvidia.com/gpumem": "1", "cpu": {"x": 1}}}),
     'spec.containers[0].resources.limits["cpu"] must be a quantity'),
    (_set((*C0, "name"), ["c"]), "spec.containers[0].name must be a string"),
    (_set(("metadata", "labels"), ["a"]), "metadata.labels must be an object"),
    (_set(("metadata", "labels"), "x"), "metadata.labels must be an object"),
    (_set(("metadata", "labels"), {"kube-vgpu.io/webhook": ["ignore"]}),
     'metadata.labels["kube-vgpu.io/webhook"] must be a string'),
    (_set(("metadata",), []), "metadata must be an object"),
    (_set(("metadata", "annotations"), {"nvidia.com/use-gputype": ["A100"]}),
     'metadata.annotations["nvidia.com/use-gputype"] must be a string'),
    (_set(("metadata", "annotations"), {"x": 1}), 'metadata.annotations["x"] must be a string'),
    (_set(("metadata", "name"), {}), "metadata.name must be a string"),
    (_set(("spec", "volumes"), "v"), "spec.volumes must be a list"),
    (_set(("spec", "volumes"), ["v"]), "spec.volumes[0] must be an object"),
    (_set(("spec", "volumes"), [{"name": 3}]), "spec.volumes[0].name must be a string"),
    (_set((*C0, "volumeMounts"), {"a": 1}), "spec.containers[0].volumeMounts must be a list"),
    (_set((*C0, "volumeMounts"), ["m"]), "spec.containers[0].volumeMounts[0] must be an object"),
    (_set((*C0, "volumeMounts"), [{"name": "m", "mountPath": ["/dev/shm"]}]),
     "spec.containers[0].volumeMounts[0].mountPath must be a string"),
    (_set((*C0, "env"), "A=1"), "spec.containers[0].env must be a list"),
    (_set((*C0, "env"), [["NVIDIA_VISIBLE_DEVICES", "all"]]), "spec.containers[0].env[0] must be an object"),
    (_set((*C0, "env"), [{"name": "NVIDIA_VISIBLE_DEVICES", "value": ["all"]}]),
     "spec.containers[0].env[0].value must be a string"),
    (_set((*C0, "env"), [{"name": "X", "valueFrom": "y"}]), "spec.containers[0].env[0].valueFrom must be an object"),
    (_set((*C0, "securityContext"), "root"), "spec.containers[0].securityContext must be an object"),
    (_set((*C0, "securityContext"), {"privileged": "true"}),
     "spec.containers[0].securityContext.privileged must be a boolean"),
    (_set(("spec", "schedulerName"), ["kube-vgpu-scheduler"]), "spec.schedulerName must be a string"),
    (_set(("spec", "nodeName"), 5), "spec.nodeName must be a string"),
])
def test_pod_of_wrong_shape_denied_naming_the_field(mangle: Any, field: str) -> None:
    pod = base_pod(limits(gpumem="1000"))
    mangle(pod)
    assert field in _deny_message(pod)


def test_wrong_shape_denied_even_without_vgpu_request() -> None:
    """``containers: ["x"]`` used to be skipped (allowed, no patch) because no dict container asked."""
    pod = base_pod()
    pod["spec"]["containers"].append("x")
    assert "spec.containers[1] must be an object" in _deny_message(pod)


def test_message_escapes_hostile_keys() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["metadata"]["annotations"] = {"\x1b[2J" + "k" * 500: ["v"]}
    msg = _deny_message(pod)
    assert "\x1b" not in msg and "\\u001b[2J" in msg and len(msg) < 300


def test_nulls_are_absent_fields() -> None:
    pod = base_pod(limits(gpumem="1000"))
    pod["metadata"]["labels"] = None
    pod["spec"]["volumes"] = None
    pod["spec"]["containers"][0].update(env=None, volumeMounts=None, securityContext=None)
    resp, _ = answer(review_of(pod), CFG)
    assert resp["response"]["allowed"] is True


# --- 3. values the domain rejects -------------------------------------------------------------

@pytest.mark.parametrize("value", ["1Gi", "5Mi", "1" + "0" * 39])
def test_absurd_gpumem_denied_with_domain_message(value: str) -> None:
    from kube_vgpu.errors import RequestError
    from kube_vgpu.podspec import parse_pod
    with pytest.raises(RequestError) as e:
        parse_pod(base_pod(limits(gpumem=value)), CFG)
    msg = _deny_message(base_pod(limits(gpumem=value)))
    assert msg == str(e.value)
    assert "nvidia.com/gpumem" in msg and "MiB" in msg and value[:20] in msg


def test_long_denial_message_is_clipped() -> None:
    msg = _deny_message(base_pod(limits(gpumem="x" * 100000)))
    assert len(msg) <= 1024 and msg.endswith("...")
