"""Where the certificates live: a ``kubernetes.io/tls`` Secret, PEM files, and the caBundle of a
MutatingWebhookConfiguration. Kubernetes calls go through the official ``kubernetes`` client.

Secret layout (``core/v1 Secret``, base64 ``data``): ``tls.crt``, ``tls.key``, ``ca.crt``.
Files (``--out-dir``): ``ca.crt``, ``tls.crt``, ``tls.key`` (0600), each replaced atomically.
caBundle: ``admissionregistration.k8s.io/v1 MutatingWebhookConfiguration``
``webhooks[*].clientConfig.caBundle`` (base64 of PEM), written by GET then a JSONPatch (the
chart's RBAC: secrets get/create/update; mutatingwebhookconfigurations get/patch).
"""

from __future__ import annotations

import base64
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from .job import atomic_write
from .pki import Bundle

SECRET_TYPE = "kubernetes.io/tls"
KEYS = ("ca.crt", "tls.crt", "tls.key")


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _bundle_from(get: dict[str, bytes]) -> Bundle | None:
    if not all(k in get for k in KEYS):
        return None
    return Bundle(ca_crt=get["ca.crt"], tls_crt=get["tls.crt"], tls_key=get["tls.key"])


# --- files -------------------------------------------------------------------------------------

def read_files(out_dir: str | Path) -> Bundle | None:
    """The bundle in ``out_dir``, or None if any file is missing."""
    d = Path(out_dir)
    try:
        return _bundle_from({k: (d / k).read_bytes() for k in KEYS})
    except FileNotFoundError:
        return None


def write_files(out_dir: str | Path, bundle: Bundle) -> bool:
    """Write the bundle; files already holding the same bytes are left alone. Returns True if any
    file changed. The key is written first, so a watcher sees the new pair complete on tls.crt."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    changed = False
    for name, data, mode in (("ca.crt", bundle.ca_crt, 0o644), ("tls.key", bundle.tls_key, 0o600),
                             ("tls.crt", bundle.tls_crt, 0o644)):
        p = d / name
        try:
            if p.read_bytes() == data:
                continue
        except FileNotFoundError:
            pass
        atomic_write(p, data, mode)
        changed = True
    return changed


# --- Secret ------------------------------------------------------------------------------------

def read_secret(core: client.CoreV1Api, namespace: str, name: str) -> tuple[Bundle | None, bool]:
    """(bundle or None, whether the Secret exists). Raises ApiException for errors other than 404."""
    try:
        s = core.read_namespaced_secret(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None, False
        raise
    data = s.data or {}
    try:
        decoded = {k: base64.b64decode(v) for k, v in data.items() if k in KEYS}
    except ValueError:
        return None, True
    return _bundle_from(decoded), True


def _secret_body(namespace: str, name: str, bundle: Bundle, resource_version: str | None = None,
                 secret_type: str = SECRET_TYPE) -> client.V1Secret:
    return client.V1Secret(
        api_version="v1", kind="Secret", type=secret_type,
        metadata=client.V1ObjectMeta(name=name, namespace=namespace, resource_version=resource_version,
                                     labels={"app.kubernetes.io/managed-by": "kube-vgpu-certs"}),
        data={"ca.crt": _b64(bundle.ca_crt), "tls.crt": _b64(bundle.tls_crt), "tls.key": _b64(bundle.tls_key)})


def create_secret(core: client.CoreV1Api, namespace: str, name: str, bundle: Bundle) -> bool:
    """Create the Secret. Returns False (nothing written) if it appeared meanwhile (409)."""
    try:
        core.create_namespaced_secret(namespace, _secret_body(namespace, name, bundle))
    except ApiException as e:
        if e.status == 409:
            return False
        raise
    return True


def replace_secret(core: client.CoreV1Api, namespace: str, name: str, bundle: Bundle) -> None:
    """Overwrite the Secret's three keys (other keys and labels kept). Retries on 409."""
    for attempt in range(5):
        cur = core.read_namespaced_secret(name, namespace)
        data = dict(cur.data or {})
        data.update({"ca.crt": _b64(bundle.ca_crt), "tls.crt": _b64(bundle.tls_crt),
                     "tls.key": _b64(bundle.tls_key)})
        cur.data = data
        try:
            core.replace_namespaced_secret(name, namespace, cur)
            return
        except ApiException as e:
            if e.status != 409 or attempt == 4:
                raise


# --- caBundle ----------------------------------------------------------------------------------

def read_ca_bundle(adm: client.AdmissionregistrationV1Api, name: str) -> list[bytes]:
    """The caBundle (PEM) of each webhook of the configuration, in order (b"" where unset).

    Raises ApiException (404 if the configuration does not exist)."""
    cfg = adm.read_mutating_webhook_configuration(name)
    out = []
    for w in cfg.webhooks or []:
        cb = w.client_config.ca_bundle if w.client_config else None
        out.append(base64.b64decode(cb) if cb else b"")
    return out


def patch_ca_bundle(adm: client.AdmissionregistrationV1Api, name: str, ca_pem: bytes) -> bool:
    """Set ``caBundle`` of every webhook in the configuration to ``ca_pem``.

    One JSONPatch (RFC 6902, ``application/json-patch+json``; RBAC verbs ``get`` and ``patch``):
    per webhook a ``test`` of its name (so a concurrent edit that reorders the list fails with 422
    instead of patching the wrong entry) and an ``add`` of ``clientConfig.caBundle``. Re-read and
    retried on 409/422. Returns True if anything changed. Raises ApiException (404: no such config).
    """
    want = _b64(ca_pem)
    for attempt in range(5):
        cfg = adm.read_mutating_webhook_configuration(name)
        ops: list[dict[str, object]] = []
        for i, w in enumerate(cfg.webhooks or []):
            if w.client_config is not None and w.client_config.ca_bundle == want:
                continue
            ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": w.name})
            if w.client_config is None:
                ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {"caBundle": want}})
            else:
                ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": want})
        if not ops:
            return False
        try:
            adm.patch_mutating_webhook_configuration(name, ops, _content_type="application/json-patch+json")
            return True
        except ApiException as e:
            if e.status not in (409, 422) or attempt == 4:
                raise
    return False
