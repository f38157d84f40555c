"""The chart's webhook registration: which requests its matchConditions send (evaluated with
cel-python the way kube-apiserver hands them over: ``request`` as JSON without empty fields), the
default failurePolicy, the NetworkPolicy, and the listener limits passed to the webhook."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from webhook.server import build_parser

from .conftest import Renderer, find, find_all
from .test_render import option_values
from .vap import evaluate

FULL = "kv-kube-vgpu"
NS = "gpu-system"
EXTENDER = f"system:serviceaccount:{NS}:{FULL}-extender"
DEVICE_PLUGIN = f"system:serviceaccount:{NS}:{FULL}-device-plugin"
TENANT = "system:serviceaccount:team-a:default"


def webhook(renderer: Renderer, values: dict[str, Any] | None = None, kube: str = "1.31.0") -> dict[str, Any]:
    (wh,) = find(renderer.render(values, kube), "MutatingWebhookConfiguration")["webhooks"]
    return wh


def pod(limits: dict[str, str] | None = None, requests: dict[str, str] | None = None, init: bool = False,
        annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if limits:
        res["limits"] = limits
    if requests:
        res["requests"] = requests
    c = {"name": "c", "image": "x", "resources": res}
    meta: dict[str, Any] = {"name": "p", "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    spec: dict[str, Any] = {"containers": [{"name": "app", "image": "x"}]}
    spec["initContainers" if init else "containers"] = [c] + ([] if init else [{"name": "side", "image": "y"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def sent(wh: dict[str, Any], op: str, obj: dict[str, Any], old: dict[str, Any] | None = None,
         user: str | None = TENANT, sub: str = "") -> bool:
    """True if the API server would call the webhook (every matchCondition true). A CEL error fails
    the test: with failurePolicy Fail it would refuse the request."""
    from celpy import json_to_cel
    req: dict[str, Any] = {"uid": "u", "operation": op, "namespace": "team-a",
                           "kind": {"group": "", "version": "v1", "kind": "Pod"},
                           "resource": {"group": "", "version": "v1", "resource": "pods"},
                           "userInfo": {"username": user} if user else {}}
    if sub:  # omitted when empty, as in the JSON the API server converts
        req["subResource"] = sub
    act = {"request": json_to_cel(req), "object": json_to_cel(obj), "oldObject": json_to_cel(old)}
    for mc in wh["matchConditions"]:
        got = evaluate(mc["expression"], act)
        assert isinstance(got, bool) or type(got).__name__ == "BoolType", f"{mc['name']}: {got!r}"
        if not got:
            return False
    return True


@pytest.fixture(scope="module")
def wh(renderer: Renderer) -> dict[str, Any]:
    return webhook(renderer)


# --- CREATE ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"limits": {"nvidia.com/gpumem": "4000"}},
    {"limits": {"nvidia.com/gpu": "1"}},  # bare gpu: sent whatever webhook.mutateBareGpu says
    {"requests": {"nvidia.com/gpucores": "30"}},
    {"limits": {"nvidia.com/gpumem-percentage": "50", "cpu": "1"}},
    {"requests": {"nvidia.com/priority": "1"}},
    {"limits": {"nvidia.com/gpu": "1"}, "init": True},  # init containers and sidecars
])
def test_create_of_pod_naming_our_resources_is_sent(wh: dict[str, Any], kwargs: dict[str, Any]) -> None:
    assert sent(wh, "CREATE", pod(**kwargs))


@pytest.mark.parametrize("p", [pod(), pod(limits={"cpu": "1", "memory": "1Gi"}),
                               pod(limits={"example.com/gpu": "1"}, labels={"app": "x"}, annotations={})])
def test_create_of_other_pods_is_not_sent(wh: dict[str, Any], p: dict[str, Any]) -> None:
    assert not sent(wh, "CREATE", p)


@pytest.mark.parametrize("where", ["annotations", "labels"])
def test_create_with_kube_vgpu_keys_is_sent(wh: dict[str, Any], where: str) -> None:
    """A forged allocation on a pod without a GPU request still reaches the webhook (removed there)."""
    forged = {"kube-vgpu.io/allocation": "{}"} if where == "annotations" else {"kube-vgpu.io/node": "n1"}
    assert sent(wh, "CREATE", pod(**{where: forged}))


def test_custom_resource_names_are_matched(renderer: Renderer) -> None:
    values = option_values("custom-resource-names")
    names = values["config"]["resourceNames"]
    wh = webhook(renderer, values)
    assert sent(wh, "CREATE", pod(limits={names["gpumem"]: "1000"}))
    if names["gpumem"] != "nvidia.com/gpumem":
        assert not sent(wh, "CREATE", pod(limits={"nvidia.com/gpumem": "1000"}))


# --- UPDATE ---------------------------------------------------------------------------------------------

BOUND = pod(limits={"nvidia.com/gpumem": "4000"},
            annotations={"kube-vgpu.io/allocation": "{}", "kube-vgpu.io/bind-phase": "success"},
            labels={"kube-vgpu.io/node": "n1", "app": "x"})


def _edit(change: str) -> dict[str, Any]:
    new = copy.deepcopy(BOUND)
    meta = new["metadata"]
    if change == "change":
        meta["annotations"]["kube-vgpu.io/allocation"] = '{"forged": true}'
    elif change == "add":
        meta["annotations"]["kube-vgpu.io/allocation-signature"] = "v1:k:x"
    elif change == "remove":
        del meta["annotations"]["kube-vgpu.io/bind-phase"]
    elif change == "remove-all":
        del meta["annotations"]
    elif change == "label":
        meta["labels"]["kube-vgpu.io/node"] = "n2"
    return new


@pytest.mark.parametrize("change", ["change", "add", "remove", "remove-all", "label"])
def test_update_touching_kube_vgpu_keys_is_sent(wh: dict[str, Any], change: str) -> None:
    assert sent(wh, "UPDATE", _edit(change), BOUND)
    assert sent(wh, "UPDATE", _edit(change), BOUND, user=None)  # no user name: not a system user
    # adding to a pod that had no annotations at all
    plain = pod()
    assert sent(wh, "UPDATE", {**plain, "metadata": {**plain["metadata"], "labels": {"kube-vgpu.io/node": "n"}}},
                plain)


def test_update_leaving_kube_vgpu_keys_alone_is_not_sent(wh: dict[str, Any]) -> None:
    new = copy.deepcopy(BOUND)
    new["metadata"]["labels"]["app"] = "y"
    new["metadata"]["annotations"]["team"] = "a"
    assert not sent(wh, "UPDATE", new, BOUND)
    assert not sent(wh, "UPDATE", pod(labels={"a": "b"}), pod())


@pytest.mark.parametrize("user", [EXTENDER, DEVICE_PLUGIN])
def test_system_users_writes_are_not_sent(wh: dict[str, Any], user: str) -> None:
    assert not sent(wh, "UPDATE", _edit("change"), BOUND, user=user)


def test_admin_listed_system_users_are_not_sent_either(renderer: Renderer) -> None:
    wh = webhook(renderer, {"config": {"webhook": {"systemUsers": ["system:serviceaccount:ops:fixer"]}}})
    assert not sent(wh, "UPDATE", _edit("change"), BOUND, user="system:serviceaccount:ops:fixer")
    assert not sent(wh, "UPDATE", _edit("change"), BOUND, user=EXTENDER)
    assert sent(wh, "UPDATE", _edit("change"), BOUND, user=TENANT)


def test_ephemeral_containers_of_vgpu_pods_are_sent(wh: dict[str, Any]) -> None:
    new = copy.deepcopy(BOUND)
    new["spec"]["ephemeralContainers"] = [{"name": "dbg", "image": "busybox"}]
    assert sent(wh, "UPDATE", new, BOUND, sub="ephemeralcontainers")
    assert sent(wh, "UPDATE", new, BOUND, sub="ephemeralcontainers", user=EXTENDER)
    other = pod()
    dbg = copy.deepcopy(other)
    dbg["spec"]["ephemeralContainers"] = [{"name": "dbg", "image": "busybox"}]
    assert not sent(wh, "UPDATE", dbg, other, sub="ephemeralcontainers")


# --- the rest of the registration ----------------------------------------------------------------------

@pytest.mark.parametrize("kube,present", [("1.25.0", False), ("1.27.9", False), ("1.28.0", True),
                                          ("1.30.2", True), ("1.34.0", True)])
def test_match_conditions_only_where_served(renderer: Renderer, kube: str, present: bool) -> None:
    wh = webhook(renderer, kube=kube)
    assert ("matchConditions" in wh) is present
    assert wh["failurePolicy"] == "Fail"


def test_failure_policy_can_be_relaxed_by_the_admin(renderer: Renderer) -> None:
    assert webhook(renderer, {"webhook": {"failurePolicy": "Ignore"}})["failurePolicy"] == "Ignore"


def test_network_policy(renderer: Renderer) -> None:
    docs = renderer.render()
    np = find(docs, "NetworkPolicy", f"{FULL}-webhook")
    dep = find(docs, "Deployment", f"{FULL}-webhook")
    assert np["metadata"]["namespace"] == NS
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8443, "protocol": "TCP"}] and "from" not in rule
    peers = [{"ipBlock": {"cidr": "10.0.0.0/24"}}, {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    docs = renderer.render({"webhook": {"port": 9443, "networkPolicy": {"from": peers}}})
    (rule,) = find(docs, "NetworkPolicy", f"{FULL}-webhook")["spec"]["ingress"]
    assert rule == {"ports": [{"port": 9443, "protocol": "TCP"}], "from": peers}
    assert not find_all(renderer.render({"webhook": {"networkPolicy": {"enabled": False}}}), "NetworkPolicy")


def test_listener_limits_and_protected_paths_reach_the_webhook(renderer: Renderer) -> None:
    values = {"webhook": {"limits": {"maxConnections": 64, "tlsHandshakeTimeoutSeconds": 3, "idleTimeoutSeconds": 4,
                                     "headerTimeoutSeconds": 5, "bodyTimeoutSeconds": 6,
                                     "keepAliveTimeoutSeconds": 120}},
              "devicePlugin": {"shimHostDir": "/opt/vgpu-shim", "cacheHostDir": "/var/cache/vgpu"}}
    dep = find(renderer.render(values), "Deployment", f"{FULL}-webhook")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["args"][1:])
    assert (args.max_connections, args.tls_handshake_timeout, args.idle_timeout, args.header_timeout,
            args.body_timeout, args.keepalive_timeout) == (64, 3.0, 4.0, 5.0, 6.0, 120.0)
    assert {"/opt/vgpu-shim", "/var/cache/vgpu", "/var/lib/kubelet/device-plugins"} <= set(args.protected_host_path)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MALLOC_ARENA_MAX"] == "2" and env["MALLOC_MMAP_THRESHOLD_"] == "131072"


@pytest.mark.parametrize(("values", "message"), [
    ({"webhook": {"limits": {"maxConnections": 0}}}, "webhook.limits.maxConnections"),
    ({"webhook": {"limits": {"headerTimeoutSeconds": 0}}}, "webhook.limits.headerTimeoutSeconds"),
    ({"webhook": {"objectSelectorExpressions": [{"key": "a", "operator": "Exists"}]}}, "objectSelectorExpressions"),
    ({"config": {"webhook": {"allowDisableControlNamespaces": ["Not_A_Namespace"]}}},
     "config.webhook.allowDisableControlNamespaces"),
    ({"config": {"webhook": {"protectedHostPaths": ["relative/path"]}}}, "config.webhook.protectedHostPaths"),
])
def test_bad_webhook_values_fail_with_schema_message(renderer: Renderer, values: dict[str, Any], message: str) -> None:
    r = renderer.template(values)
    assert r.returncode != 0 and message in r.stderr, r.stderr
