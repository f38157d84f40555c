"""A hostile tenant with ordinary namespace rights, playing paths around the scheduler (round 4).

Each test plays one attack against the real component (the webhook over real HTTPS with the
API server's AdmissionReview shape) and asserts what the tenant gets.

Squatting kubelet's vGPU slots: the device plugin advertises ``nvidia.com/gpu`` slots
(``devices.splitCount`` per GPU) and kubelet hands them to any pod bound to the node. A pod the
kube-vgpu scheduler did not place is refused at PreStartContainer (no signed record), so it never
runs, but kubelet keeps its slots while the pod lives. The extender does not see such a pod (it
watches only its own scheduler's pods), keeps binding pods to the node, and kubelet rejects them
(``UnexpectedAdmissionError``): a tenant starves every other tenant of the node's GPUs without
using them. The way in is a pod that reaches a node without the extender: a preset
``spec.nodeName`` with another scheduler's name (``webhook.foreignSchedulers: leave``, the
default), or a bare ``nvidia.com/gpu`` that is left alone (``webhook.mutateBareGpu: false``).

Holding the extender's event loop with a pod annotation: ``nvidia.com/use-gpuuuid`` and
``nvidia.com/nouse-gpuuuid`` (HAMi's keys, the tenant's own) take a comma-separated list; an
annotation of 256 KiB holds about 6,500 uuids. The vectorised fit compared every GPU of the
fleet with every listed uuid (``np.isin`` on object arrays is a loop over the list): over a second
of the extender's event loop per filter on 1,000 nodes of 8 GPUs, during which no other pod is
filtered or bound; varying the list defeats the decision cache. Counted, not timed. On the
reference fit (a per-pod ``fgd`` policy or ``gpu-link`` annotation sends the pod there) every GPU
was checked against every entry of each list, uuids and GPU types alike: a uuid is now looked up
once per GPU on both fits (a set), a uuid list holds at most 1024 entries (HAMi's users name the
cards of a whole pool) and a GPU type list, matched entry by entry, at most 64, else the pod is
refused naming the annotation.

Inflating the extender's answer: an invalid value in a tenant's annotation (a 250,000-character
``hami.io/gpu-scheduler-policy``, set by an UPDATE the webhook never sees) was quoted whole in the
failure text of every node: a 250 MB ``/filter`` answer for 1,000 nodes and seconds of the event
loop. Error texts now quote at most 120 characters of a value and name its length.

Marking a running pod finished: a tenant granted ``pods/status`` (some clusters do) sets its
running pod's ``status.phase`` to ``Failed``. The extender releases a finished pod's booking at once
and places other pods on its GPUs, while kubelet tears the pod down through its termination grace
period, which the tenant chose (an hour, say): its containers keep using the GPUs nobody books. The
chart's ``<fullname>-system-metadata`` admission policy (CEL evaluated with cel-python, as the
chart tests do) lets only kubelets and the control plane mark a pod of our scheduler finished.

Asking the NVIDIA runtime for every GPU through a mount: a runtime configured to take device lists
as volume mounts (``accept-nvidia-visible-devices-as-volume-mounts``, the NVIDIA device plugin's
``volume-mounts`` strategy) exposes the GPUs named by mounts of ``/dev/null`` under
``/var/run/nvidia-container-devices``. A tenant's vGPU pod mounts a ``hostPath`` ``/dev/null`` at
``/var/run/nvidia-container-devices/all`` in a sidecar (no shim there) or in its GPU container:
the same request as ``NVIDIA_VISIBLE_DEVICES=all``, which the webhook denies. Denied alike now.

Growing a booked pod in place (defended by the API server, played to keep it so): with
``pods/resize`` a tenant patches its bound pod's ``nvidia.com/gpumem`` from 1000 to 20000, or
adds ``nvidia.com/gpucores``; kube-apiserver refuses every resource but cpu and memory there.

Annotations are mutable: the tenant creates a small pod and patches the annotation while the pod
is pending (the webhook is consulted on UPDATE only for system-owned keys), so the extender is
the place that must hold.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from certs import pki, store
from kube_vgpu.config import Config, WebhookConfig, replace
from kube_vgpu.model import GPUDevice
from kube_vgpu.placement import fit, vector
from kube_vgpu.placement.state import ClusterState
from kube_vgpu.podspec import parse_pod
from kube_vgpu.quantity import parse_whole
from tests.chart import vap
from tests.chart.conftest import Renderer, find, helm, renderer  # noqa: F401 - fixtures
from tests.e2e.conftest import SKIP_REASON, have_control_plane
from tests.e2e.test_e2e_policies import cluster  # noqa: F401 - the e2e test's control plane fixture
from tests.webhook.wh_helpers import Client, base_pod, review_of
from webhook.server import BackgroundServer, WebhookServer

_SCHED_TESTS = str(Path(__file__).resolve().parents[1] / "scheduler")
if _SCHED_TESTS not in sys.path:  # the scheduler tests' builders (capture-shaped Node/Pod JSON)
    sys.path.insert(0, _SCHED_TESTS)
from vgpu_sched_util import Extender, filter_args, node_obj, offline_service, pod_obj, run  # noqa: E402

TENANT = "system:serviceaccount:team-a:default"
NODE = "gpu-node-1"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    store.write_files(d, pki.create_bundle(pki.service_dns_names("kube-vgpu-webhook", "kube-vgpu"), ["127.0.0.1"]))
    return d


def _serve(cfg: Config, tls: Path) -> Iterator[Client]:
    srv = WebhookServer(cfg, str(tls / "tls.crt"), str(tls / "tls.key"), host="127.0.0.1", port=0)
    with BackgroundServer(srv) as bg:
        c = Client(bg.port, tls / "ca.crt")
        yield c
        c.close()


@pytest.fixture(scope="module")
def default_hook(tls: Path) -> Iterator[Client]:
    """The webhook with the default config (foreignSchedulers: leave, mutateBareGpu: true)."""
    yield from _serve(Config(), tls)


@pytest.fixture(scope="module")
def bare_left_alone(tls: Path) -> Iterator[Client]:
    """The webhook with ``mutateBareGpu: false`` (a bare ``nvidia.com/gpu`` keeps its scheduler)."""
    yield from _serve(replace(Config(), webhook=replace(WebhookConfig(), mutate_bare_gpu=False)), tls)


def create(client: Client, pod: dict[str, Any]) -> dict[str, Any]:
    pod["metadata"]["namespace"] = "team-a"
    rev = review_of(pod)
    rev["request"]["namespace"] = "team-a"
    rev["request"]["userInfo"] = {"username": TENANT, "groups": ["system:serviceaccounts"]}
    return client.review(rev)["response"]


@pytest.mark.parametrize("limits", [
    {"nvidia.com/gpu": "10"},                                           # every slot of one GPU
    {"nvidia.com/gpu": "8", "nvidia.com/gpumem": "1000"},
    {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "100"},
], ids=["bare-slots", "slots-and-memory", "slots-and-cores"])
@pytest.mark.parametrize("scheduler", ["no-such-scheduler", "volcano"])
def test_a_preset_node_name_under_another_schedulers_name_cannot_squat_slots(
        default_hook: Client, limits: dict[str, str], scheduler: str) -> None:
    """The tenant names another scheduler (which passes the pod through untouched) and presets
    ``spec.nodeName``: kubelet would hand the pod the slots at once. Denied, naming the field."""
    pod = base_pod({"limits": dict(limits)}, schedulerName=scheduler, nodeName=NODE)
    resp = create(default_hook, pod)
    assert resp["allowed"] is False, resp
    assert resp["status"]["code"] == 403
    msg = resp["status"]["message"]
    assert f"spec.nodeName={NODE!r} is preset" in msg and "allowed: empty" in msg, msg


def test_a_preset_node_name_on_a_bare_gpu_pod_left_alone_cannot_squat_slots(bare_left_alone: Client) -> None:
    """With ``mutateBareGpu: false`` a bare ``nvidia.com/gpu`` pod keeps its scheduler and spec;
    with a preset ``spec.nodeName`` it would still take the node's slots. Denied."""
    pod = base_pod({"limits": {"nvidia.com/gpu": "10"}}, nodeName=NODE)
    resp = create(bare_left_alone, pod)
    assert resp["allowed"] is False and resp["status"]["code"] == 403, resp
    assert f"spec.nodeName={NODE!r} is preset" in resp["status"]["message"]


def test_other_schedulers_pods_without_a_node_and_pods_asking_nothing_of_ours_are_still_allowed(
        default_hook: Client, bare_left_alone: Client) -> None:
    """Positive controls: the rule does not deny what it must allow."""
    foreign = create(default_hook, base_pod({"limits": {"nvidia.com/gpu": "1"}}, schedulerName="volcano"))
    assert foreign["allowed"] is True and "patch" not in foreign, foreign
    bare = create(bare_left_alone, base_pod({"limits": {"nvidia.com/gpu": "1"}}))
    assert bare["allowed"] is True and "patch" not in bare, bare
    plain = create(default_hook, base_pod({"limits": {"cpu": "1"}}, nodeName=NODE))
    assert plain["allowed"] is True, plain


class CountedUuid(str):
    """A GPU uuid that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedUuid.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def _pinned_fleet(key: str) -> tuple[ClusterState, Any]:
    """200 nodes x 8 GPUs (counting uuids) and a pod listing 1024 uuids under ``key`` (the most a
    list may hold; two of them real: GPU 3 of n7 and GPU 0 of n150)."""
    cs = ClusterState()
    for n in range(200):
        cs.set_node(f"n{n}", tuple(GPUDevice(uuid=CountedUuid(f"GPU-n{n}-{i}"), index=i, model="NVIDIA A10",
                                             memory_mib=24576, cores=100, split=10) for i in range(8)))
    listed = [f"GPU-absent-{i:05d}" for i in range(1022)] + ["GPU-n7-3", "GPU-n150-0"]
    pod = parse_pod(base_pod({"limits": {"nvidia.com/gpumem": "1000"}}) | {
        "metadata": {"name": "p", "namespace": "team-a", "annotations": {key: ",".join(listed)}}})
    return cs, pod


@pytest.mark.parametrize("key", ["nvidia.com/use-gpuuuid", "nvidia.com/nouse-gpuuuid"])
def test_a_long_uuid_list_costs_one_lookup_per_gpu_on_the_reference_fit(key: str) -> None:
    """The reference fit (a per-pod ``fgd`` policy or ``gpu-link`` sends a pod there) asks per GPU
    whether the pod may use it: 1024 listed uuids cost a few comparisons per GPU (a set lookup),
    not one per listed uuid, and exclude exactly the GPUs the list names."""
    cs, pod = _pinned_fleet(key)
    CountedUuid.compared = 0
    verdict = {(n, d.index): fit._excluded(pod, d) for n in range(200) for d in cs.nodes[f"n{n}"].devices}
    gpus = 200 * 8
    assert CountedUuid.compared <= 4 * gpus, f"{CountedUuid.compared} uuid comparisons for {gpus} GPUs"
    named = {(7, 3), (150, 0)}
    excluded = {k for k, v in verdict.items() if v is not None}
    assert excluded == (named if key == "nvidia.com/nouse-gpuuuid" else set(verdict) - named)
    assert {verdict[k] for k in excluded} == {fit.Code.UUID_EXCLUDED}


@pytest.mark.parametrize("key", ["nvidia.com/use-gpuuuid", "nvidia.com/nouse-gpuuuid"])
def test_a_long_uuid_list_costs_one_lookup_per_gpu(key: str) -> None:
    """200 nodes x 8 GPUs against 1024 listed uuids (the most a list may hold; two of them real):
    the fit looks each GPU up once (at most a few comparisons each, not one per listed uuid), and
    excludes exactly the GPUs the list names."""
    cs, pod = _pinned_fleet(key)
    t = cs.table
    rows = slice(0, t.n)
    CountedUuid.compared = 0
    code = vector._exclusions(t, rows, pod, t.present[rows], t.healthy[rows])
    gpus = 200 * 8
    assert CountedUuid.compared <= 2 * gpus, f"{CountedUuid.compared} uuid comparisons for {gpus} GPUs"
    named = {(7, 3), (150, 0)}
    excluded = {(int(r), int(c)) for r, c in zip(*code.nonzero(), strict=True)}
    if key == "nvidia.com/nouse-gpuuuid":
        assert excluded == named
    else:
        assert excluded == {(r, c) for r in range(200) for c in range(8)} - named


def _filter(nodes: int, annotations: dict[str, str]) -> tuple[dict[str, Any], int]:
    """/filter over HTTP for a pending pod of ours with ``annotations``: the answer and its size in bytes."""
    objs = [node_obj(f"n{i}", 8) for i in range(nodes)]
    pod = pod_obj("p", ns="team-a", annotations=annotations, limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000})

    async def go() -> dict[str, Any]:
        async with Extender(offline_service(objs)) as ext:
            st, res = await ext.post("/filter", filter_args(pod, objs))
            assert st == 200
            return res  # type: ignore[no-any-return]
    res = run(go, 120)
    return res, len(json.dumps(res))


@pytest.mark.parametrize("key", ["hami.io/gpu-scheduler-policy", "kube-vgpu.io/node-scheduler-policy",
                                 "kube-vgpu.io/gpu-link"])
def test_an_invalid_annotation_of_256_kib_is_not_repeated_in_every_nodes_failure(key: str) -> None:
    res, size = _filter(200, {key: "x" * 250_000})
    failed = {**res["FailedNodes"], **res["FailedAndUnresolvableNodes"]}
    assert not res["NodeNames"] and len(failed) == 200, res["Error"]
    assert size <= 200 * 1024, f"a {size}-byte answer for 200 nodes"
    text = next(iter(failed.values()))
    assert key in text and "250000 characters" in text and "allowed:" in text, text


@pytest.mark.parametrize("key,most", [("nvidia.com/use-gputype", 64), ("nvidia.com/nouse-gputype", 64),
                                      ("nvidia.com/use-gpuuuid", 1024), ("nvidia.com/nouse-gpuuuid", 1024)])
def test_a_selector_list_past_its_cap_is_refused_naming_it(key: str, most: int, default_hook: Client) -> None:
    long_list = ",".join(f"GPU-absent-{i:05d}" for i in range(6500))
    res, _ = _filter(20, {key: long_list})
    failed = {**res["FailedNodes"], **res["FailedAndUnresolvableNodes"]}
    assert not res["NodeNames"] and len(failed) == 20
    text = next(iter(failed.values()))
    assert key in text and f"at most {most} entries (this one has 6500)" in text, text
    # at CREATE the webhook says the same, one entry past the cap
    pod = base_pod({"limits": {"nvidia.com/gpumem": "1000"}})
    pod["metadata"]["annotations"] = {key: ",".join(long_list.split(",")[:most + 1])}
    resp = create(default_hook, pod)
    assert resp["allowed"] is False and resp["status"]["code"] == 400, resp
    assert f"at most {most} entries (this one has {most + 1})" in resp["status"]["message"]
    # the cap itself is still a selector: the pod is filtered as usual (these name no GPU of the fleet)
    res, _ = _filter(20, {key: ",".join(long_list.split(",")[:most])})
    assert f"at most {most}" not in json.dumps(res)


def _running_pod(scheduler: str = "kube-vgpu-scheduler") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train", "namespace": "team-a", "uid": "u1"},
            "spec": {"schedulerName": scheduler, "nodeName": "n1", "terminationGracePeriodSeconds": 3600,
                     "containers": [{"name": "c", "image": "cuda",
                                     "resources": {"limits": {"nvidia.com/gpumem": "20000"}}}]},
            "status": {"phase": "Running"}}


def _status_update(renderer: Renderer, user: str, new_phase: str,  # noqa: F811
                   scheduler: str = "kube-vgpu-scheduler") -> vap.Decision:
    pytest.importorskip("celpy", reason="cel-python (a dev dependency) evaluates the policies' CEL")
    policy = find(renderer.render(), "ValidatingAdmissionPolicy", "system-metadata")
    old = _running_pod(scheduler)
    new = {**old, "status": {"phase": new_phase}}
    req = vap.Request("UPDATE", "pods", user, name="train", namespace="team-a", sub_resource="status")
    return vap.decide(policy, req, new, old)


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_a_tenant_with_pods_status_cannot_mark_its_running_vgpu_pod_finished(
        renderer: Renderer, phase: str) -> None:  # noqa: F811
    d = _status_update(renderer, TENANT, phase)
    assert d.matched and d.denied == [
        f"pod status.phase {phase} of a kube-vgpu-scheduler pod is written only by its kubelet or the control "
        f"plane (it releases the GPU booking of the pod while its containers may still run); {TENANT} may not "
        f"set it"], d.denied


def test_kubelets_and_the_control_plane_still_finish_pods(renderer: Renderer) -> None:  # noqa: F811
    """Positive controls: the writers of a pod's phase, and status updates that finish nothing."""
    for user in ("system:node:n1", "system:serviceaccount:kube-system:pod-garbage-collector",
                 "system:kube-controller-manager"):
        assert _status_update(renderer, user, "Failed").allowed, user
    assert _status_update(renderer, TENANT, "Running").allowed
    assert _status_update(renderer, TENANT, "Failed", scheduler="default-scheduler").allowed


@pytest.mark.e2e
def test_real_api_server_refuses_a_tenant_marking_its_vgpu_pod_failed(request: pytest.FixtureRequest) -> None:
    """On a real kube-apiserver with the chart's admission policies (the control plane of
    tests/e2e/test_e2e_policies.py): a tenant holding ``pods/status`` cannot mark its running pod
    of our scheduler Failed; the control plane's pod garbage collector can. The CEL type-checks."""
    if not have_control_plane():
        pytest.skip(SKIP_REASON)
    import subprocess

    import yaml
    from kubernetes import client, utils

    from tests.e2e import test_e2e_policies as ep
    from tests.e2e.cluster import ROOT, helm_binary, wait_for

    c = request.getfixturevalue("cluster")
    admin = c["admin"]
    core: Any = client.CoreV1Api(admin)
    r = subprocess.run([helm_binary(), "template", ep.RELEASE, str(ROOT / "charts" / "kube-vgpu"), "--namespace",
                        ep.NS, "--kube-version", c["version"]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for d in yaml.safe_load_all(r.stdout):
        if d and d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding") \
                and d["metadata"]["name"] == f"{ep.FULL}-system-metadata":
            utils.create_from_dict(admin, d)
    for ns in ("team-a", "kube-system"):
        try:
            core.create_namespace({"metadata": {"name": ns}})
        except client.ApiException as e:
            if e.status != 409:
                raise
    rbac: Any = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role("team-a", {"metadata": {"name": "tenant"}, "rules": [
        {"apiGroups": [""], "resources": ["pods", "pods/status"],
         "verbs": ["get", "list", "create", "update", "patch", "delete"]}]})
    core.create_namespaced_service_account("team-a", {"metadata": {"name": "tenant"}})
    rbac.create_namespaced_role_binding("team-a", {"metadata": {"name": "tenant"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": "team-a"}]})
    core.create_namespaced_service_account("kube-system", {"metadata": {"name": "pod-garbage-collector"}})
    rbac.create_cluster_role_binding({"metadata": {"name": "pgc"}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": "pod-garbage-collector", "namespace": "kube-system"}]})
    tenant = client.CoreV1Api(ep._as(c, ep._token(core, "team-a", "tenant"), "tenant4"))
    pgc = client.CoreV1Api(ep._as(c, ep._token(core, "kube-system", "pod-garbage-collector"), "pgc4"))

    for name in ("train", "other"):
        core.create_namespaced_pod("team-a", {**_running_pod(), "metadata": {"name": name}})
        core.patch_namespaced_pod_status(name, "team-a", {"status": {"phase": "Running"}})

    def refused() -> bool:
        try:
            tenant.patch_namespaced_pod_status("train", "team-a", {"status": {"phase": "Failed"}}, dry_run="All")
        except client.ApiException as e:
            return e.status == 403
        return False
    wait_for(refused, 60, "the admission policy in effect")
    msg = ep._forbidden(tenant.patch_namespaced_pod_status, "train", "team-a", {"status": {"phase": "Failed"}})
    assert "pod status.phase Failed of a kube-vgpu-scheduler pod is written only by its kubelet" in msg, msg
    assert core.read_namespaced_pod("train", "team-a").status.phase == "Running"
    pgc.patch_namespaced_pod_status("other", "team-a", {"status": {"phase": "Failed"}})
    assert core.read_namespaced_pod("other", "team-a").status.phase == "Failed"
    if c["cp"].has_controller_manager:
        adm = client.AdmissionregistrationV1Api(admin)
        pol = wait_for(lambda: ep._checked(adm, f"{ep.FULL}-system-metadata"), 60, "the policy type-checked")
        warnings = pol.status.type_checking.expression_warnings if pol.status.type_checking else None
        assert not warnings, [(w.field_ref, w.warning) for w in warnings or []]


def _device_list_mount(pod: dict[str, Any], path: str, key: str = "containers", i: int = 0) -> dict[str, Any]:
    pod["spec"]["volumes"].append({"name": "devnull", "hostPath": {"path": "/dev/null", "type": "CharDevice"}})
    pod["spec"][key][i].setdefault("volumeMounts", []).append({"name": "devnull", "mountPath": path})
    return pod


@pytest.mark.parametrize("path", ["/var/run/nvidia-container-devices/all", "/var/run/nvidia-container-devices",
                                  "/run/nvidia-container-devices/GPU-0", "//var/run/./nvidia-container-devices/0/"])
def test_a_device_list_mount_is_denied_like_visible_devices_in_every_container(
        default_hook: Client, path: str) -> None:
    gpu = _device_list_mount(base_pod({"limits": {"nvidia.com/gpumem": "1000"}}), path)
    sidecar = base_pod({"limits": {"nvidia.com/gpumem": "1000"}})
    sidecar["spec"]["containers"].append({"name": "helper", "image": "cuda"})
    _device_list_mount(sidecar, path, i=1)
    for pod, field in ((gpu, "container 'c': volumeMounts[1].mountPath"),
                       (sidecar, "container 'helper': volumeMounts[0].mountPath")):
        resp = create(default_hook, pod)
        assert resp["allowed"] is False and resp["status"]["code"] == 403, resp
        msg = resp["status"]["message"]
        assert f"{field}={path!r} is not allowed" in msg and "allowUserVisibleDevices" in msg, msg


def test_a_device_list_mount_through_an_ephemeral_container_is_denied(default_hook: Client) -> None:
    old = base_pod({"limits": {"nvidia.com/gpumem": "1000"}})
    old["metadata"]["namespace"] = "team-a"
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "cuda", "volumeMounts": [
        {"name": "kube-api-access-9wjzm", "mountPath": "/var/run/nvidia-container-devices/all"}]}]
    rev = review_of(new)
    rev["request"].update(operation="UPDATE", oldObject=old, namespace="team-a", subResource="ephemeralcontainers",
                          userInfo={"username": TENANT, "groups": ["system:authenticated"]})
    resp = default_hook.review(rev)["response"]
    assert resp["allowed"] is False and "ephemeral container 'debug'" in resp["status"]["message"], resp


def test_ordinary_mounts_under_run_are_still_allowed(default_hook: Client) -> None:
    pod = base_pod({"limits": {"nvidia.com/gpumem": "1000"}})
    pod["spec"]["volumes"].append({"name": "run", "emptyDir": {}})
    pod["spec"]["containers"][0]["volumeMounts"] += [{"name": "run", "mountPath": "/var/run"},
                                                     {"name": "run", "mountPath": "/run/app", "subPath": "app"}]
    assert create(default_hook, pod)["allowed"] is True


@pytest.mark.e2e
def test_real_api_server_refuses_resizing_a_vgpu_request_in_place(request: pytest.FixtureRequest) -> None:
    """``pods/resize`` of a bound vGPU pod: the vGPU limits cannot grow (or appear) in place; cpu can."""
    if not have_control_plane():
        pytest.skip(SKIP_REASON)
    from kubernetes import client

    c = request.getfixturevalue("cluster")
    api = c["admin"]
    core: Any = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": "team-r"}})
        core.create_namespaced_service_account("team-r", {"metadata": {"name": "default"}})
    except client.ApiException as e:
        if e.status != 409:
            raise
    res = {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000", "cpu": "1", "memory": "100Mi"}}
    core.create_namespaced_pod("team-r", {"metadata": {"name": "p"}, "spec": {"nodeName": "n-resize", "containers": [
        {"name": "c", "image": "cuda", "resources": res}]}})

    def resize(ops: list[dict[str, Any]]) -> tuple[int, str]:
        prm = api.param_serialize(method="PATCH", resource_path="/api/v1/namespaces/team-r/pods/p/resize", body=ops,
                                  header_params={"Content-Type": "application/json-patch+json",
                                                 "Accept": "application/json"}, auth_settings=["BearerToken"])
        raw = api.call_api(*prm)
        raw.read()
        return raw.status, raw.data.decode()

    path = "/spec/containers/0/resources/{}/nvidia.com~1{}"
    for op, name, value in (("replace", "gpumem", "20000"), ("add", "gpucores", "100")):
        status, body = resize([{"op": op, "path": path.format(part, name), "value": value}
                               for part in ("limits", "requests")])
        assert status == 422 and "only cpu and memory resources are mutable" in body, (name, status, body)
    got = core.read_namespaced_pod("p", "team-r").spec.containers[0].resources.limits
    assert parse_whole(got["nvidia.com/gpumem"]) == 1000 and "nvidia.com/gpucores" not in got  # "1k" as stored
