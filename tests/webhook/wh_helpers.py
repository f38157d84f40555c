"""Helpers for the webhook tests: pods and AdmissionReviews in the shape of the captured
``admission.k8s.io/v1`` AdmissionReview (shared/reference/captures/mutate.json), and an aiohttp
client that trusts a given CA."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
import uuid
from pathlib import Path
from typing import Any

import aiohttp

CAPTURE = Path(__file__).resolve().parents[2] / ".." / "shared" / "reference" / "captures" / "mutate.json"

# The capture's envelope, kept here as data so the tests run where shared/ is absent.
_ENVELOPE: dict[str, Any] = {
    "kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
    "request": {
        "uid": "4efe4e4f-66d1-4087-ac0b-a48473ea3225",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "name": "fixture-pod", "namespace": "default", "operation": "CREATE",
        "userInfo": {"username": "admin", "uid": "admin-uid", "groups": ["system:masters", "system:authenticated"]},
        "object": None, "oldObject": None, "dryRun": False,
        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1", "fieldManager": "kubectl-create",
                    "fieldValidation": "Strict"},
    },
}


def base_pod(resources: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """A pod as the API server sends it after defaulting (the capture's pod, resources replaced)."""
    pod: dict[str, Any] = {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": "fixture-pod", "namespace": "default"},
        "spec": {
            "volumes": [{"name": "kube-api-access-9wjzm", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}], "defaultMode": 420}}],
            "containers": [{
                "name": "c", "image": "busybox", "resources": resources if resources is not None else {},
                "volumeMounts": [{"name": "kube-api-access-9wjzm", "readOnly": True,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "Always"}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "serviceAccount": "default", "securityContext": {},
            "schedulerName": "default-scheduler", "priority": 0, "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority"},
        "status": {}}
    pod["spec"].update(spec)
    return pod


def limits(**kv: Any) -> dict[str, Any]:
    """``resources`` with the given limits; keys gpu/gpumem/pct/cores/priority map to nvidia.com names."""
    names = {"gpu": "nvidia.com/gpu", "gpumem": "nvidia.com/gpumem", "pct": "nvidia.com/gpumem-percentage",
             "cores": "nvidia.com/gpucores", "priority": "nvidia.com/priority"}
    return {"limits": {names.get(k, k): v for k, v in kv.items()}}


def review_of(pod: dict[str, Any], api_version: str = "admission.k8s.io/v1") -> dict[str, Any]:
    r = copy.deepcopy(_ENVELOPE)
    r["apiVersion"] = api_version
    r["request"]["uid"] = str(uuid.uuid4())
    r["request"]["object"] = pod
    return r


def decode_patch(resp: dict[str, Any]) -> list[dict[str, Any]]:
    p = resp["response"].get("patch")
    if p is None:
        return []
    assert resp["response"]["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(p))


def client_ctx(ca_file: Path | str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.check_hostname = True
    return ctx


class Client:
    """An aiohttp client on its own event loop, for synchronous tests (keeps connections alive)."""

    def __init__(self, port: int, ca_file: Path | str, host: str = "127.0.0.1"):
        self.base = f"https://{host}:{port}"
        self.loop = asyncio.new_event_loop()
        self.ssl = client_ctx(ca_file)
        self.session = self.loop.run_until_complete(self._session())

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ssl))

    async def _req(self, method: str, path: str, data: bytes | None, headers: dict[str, str] | None
                   ) -> tuple[int, bytes, dict[str, str]]:
        async with self.session.request(method, self.base + path, data=data, headers=headers) as r:
            return r.status, await r.read(), dict(r.headers)

    def request(self, method: str, path: str, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        return self.loop.run_until_complete(self._req(method, path, data, headers))

    def review(self, review: dict[str, Any]) -> dict[str, Any]:
        status, body, _ = self.request("POST", "/mutate", json.dumps(review).encode(),
                                       {"Content-Type": "application/json"})
        assert status == 200, body
        return json.loads(body)

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()
