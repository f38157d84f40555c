"""``kube-vgpu certs signing-keys ensure``: create and rotate the allocation signing keys.

The keys live in a Secret (``--secret NAMESPACE/NAME``; the chart's ``<fullname>-signing-keys``,
mounted read-only into the extender and the device plugin) or, for running the components by hand,
in a directory (``--dir``). Layout, as :mod:`kube_vgpu.signing` reads it: ``active`` holds the key
id that signs; one ``key.<kid>`` per key holds 32 random bytes (``secrets.token_bytes``). Every key
present verifies; only the active one signs.

Key ids carry their creation time (UTC): ``k<YYYYMMDD>-<HHMMSS>-<6 hex>``, e.g.
``k20261201-031700-ab12cd``, so every age below is read from the ids themselves.

One run (idempotent; the chart runs it as a pre-install/pre-upgrade hook and from a CronJob):

1. No keys (or no usable key): create one and make it active at once (nothing can have signed yet).
2. A *staged* key (newer than the active one) at least ``--activate-after-seconds`` old becomes
   active. Staging first and activating on a later run gives every mounted copy time to receive
   the new key before anything it signs has to verify (kubelet refreshes a mounted Secret within
   about a minute or two).
3. No staged key and the active key at least ``--rotate-after-days`` old: stage a new key.
4. A *retired* key (older than the active one) is removed once its successor is at least
   ``--keep-old-days`` old **and** no pod's ``kube-vgpu.io/allocation-signature`` or
   ``kube-vgpu.io/progress-signature`` annotation names it (all pods are listed, read-only; if
   that list fails the key stays). A record whose key is gone would no longer verify, so its
   booking would be dropped: keys are only removed when nothing needs them.

Entries that the reader would refuse (a name other than ``active`` / ``key.<kid>``, a key id not
matching ``[a-z0-9-]{1,32}``, a key outside 32..4096 bytes) are removed, and logged. Writes carry
the Secret's ``resourceVersion``: a concurrent writer makes the update fail with 409 Conflict, and
the run re-reads and plans again.

Exit codes: 0 done, 1 Kubernetes/IO error, 2 usage error. One JSON summary line on stdout
(``{"changes": [...], "active": kid, "keys": [...], "kept": {kid: reason}}``), logs on stderr.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kube_vgpu import jsonlog
from kube_vgpu.cliflags import add_kubeconfig_flag, add_level_flag
from kube_vgpu.resources import ANN_ALLOCATION_SIGNATURE, ANN_PROGRESS_SIGNATURE
from kube_vgpu.signing import ACTIVE_FILE, KEY_PREFIX, KID_PATTERN, MAX_KEY_BYTES, MIN_KEY_BYTES, VERSION
from kube_vgpu.views import ListView, ObjectView

from .job import atomic_write, run_job

log = logging.getLogger("kube_vgpu.certs.signing_keys")

KEY_BYTES = 32
_KID = re.compile(rf"^{KID_PATTERN}$")
_DATED_KID = re.compile(r"^k(\d{8})-(\d{6})-[0-9a-f]{6}$")
SECRET_LABELS = {"app.kubernetes.io/managed-by": "kube-vgpu-signing-keys", "app.kubernetes.io/part-of": "kube-vgpu"}


def new_kid(now: datetime) -> str:
    """A fresh key id for a key created at ``now`` (UTC): ``k<YYYYMMDD>-<HHMMSS>-<6 random hex>``."""
    return f"k{now.astimezone(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def kid_created(kid: str) -> datetime | None:
    """The creation time a key id carries, or None for an id not made by :func:`new_kid`."""
    m = _DATED_KID.match(kid)
    if not m:
        return None
    try:
        return datetime.strptime(m.group(1) + m.group(2), "%Y%m%d%H%M%S").replace(tzinfo=UTC)
    except ValueError:
        return None


def signature_kid(value: object) -> str | None:
    """The key id a signature annotation (``v1:<kid>:<mac>``) names, or None if it names none."""
    if not isinstance(value, str):
        return None
    parts = value.split(":")
    if len(parts) != 3 or parts[0] != VERSION or not _KID.match(parts[1]):
        return None
    return parts[1]


@dataclass(frozen=True)
class Policy:
    """When to stage, activate and remove keys (see the module docstring)."""

    rotate_after: timedelta = timedelta(days=90)
    activate_after: timedelta = timedelta(seconds=600)
    keep_old: timedelta = timedelta(days=30)


@dataclass
class Plan:
    """What one run changes: ``entries`` is the new content (file/data name -> bytes)."""

    entries: dict[str, bytes]
    changes: list[str] = field(default_factory=list)
    #: retired keys old enough to go, if no pod's signature names them
    removable: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def active(self) -> str:
        return self.entries[ACTIVE_FILE].decode("ascii")

    @property
    def kids(self) -> list[str]:
        return sorted(n[len(KEY_PREFIX):] for n in self.entries if n.startswith(KEY_PREFIX))


def _age_key(kid: str) -> tuple[int, datetime, str]:
    """Sort key: dated ids by creation time (oldest first), undated ids before them, by name."""
    created = kid_created(kid)
    return (1, created, kid) if created else (0, datetime.min.replace(tzinfo=UTC), kid)


def plan(current: dict[str, bytes] | None, policy: Policy, now: datetime) -> Plan:
    """Decide the next content of the key ring from ``current`` (None: it does not exist).
    Pure apart from the random bytes of new keys. Removing ``removable`` keys is left to the caller
    (it needs the pod list)."""
    entries: dict[str, bytes] = {}
    p = Plan(entries)
    keys: dict[str, bytes] = {}
    active: str | None = None
    for name, value in sorted((current or {}).items()):
        if name == ACTIVE_FILE:
            text = value.decode("ascii", "replace").strip()
            if _KID.match(text):
                active = text
            else:
                p.changes.append(f"dropped active key id {text[:40]!r}: not allowed ({KID_PATTERN})")
            continue
        kid = name[len(KEY_PREFIX):] if name.startswith(KEY_PREFIX) else None
        if kid is None or not _KID.match(kid):
            p.changes.append(f"dropped {name!r}: only {ACTIVE_FILE!r} and {KEY_PREFIX}<kid {KID_PATTERN}> are allowed")
        elif not MIN_KEY_BYTES <= len(value) <= MAX_KEY_BYTES:
            p.changes.append(f"dropped key {kid}: {len(value)} bytes, allowed {MIN_KEY_BYTES}..{MAX_KEY_BYTES}")
        else:
            keys[kid] = value

    def add_key() -> str:
        kid = new_kid(now)
        while kid in keys:
            kid = new_kid(now)
        keys[kid] = secrets.token_bytes(KEY_BYTES)
        return kid

    if not keys:
        active = add_key()
        p.changes.append(f"created key {active} (active)" if current is None
                         else f"created key {active} (active): no usable key was present")
    elif active not in keys:
        was = active
        active = max(keys, key=_age_key)
        p.changes.append(f"activated key {active}: the active key id {was!r} had no key")
    assert active is not None

    # staged: dated keys newer than the active one (all dated keys when the active id is undated)
    born = kid_created(active)
    newer = sorted((k for k in keys if k != active and (c := kid_created(k)) is not None and (born is None or c > born)),
                   key=_age_key)
    if newer:
        staged = newer[-1]
        created = kid_created(staged)
        if created is not None and now - created >= policy.activate_after:
            active = staged
            p.changes.append(f"activated key {staged}")
    elif born is None or now - born >= policy.rotate_after:
        staged = add_key()
        created = kid_created(staged)
        if policy.activate_after <= timedelta(0):
            active = staged
            p.changes.append(f"created key {staged} (active)")
        else:
            p.changes.append(f"staged key {staged}")

    # retired: every key older than the active one; its successor is the next newer key
    born = kid_created(active)
    created_at = sorted(c for k in keys if (c := kid_created(k)) is not None)
    for kid in sorted(keys):
        if kid == active:
            continue
        created = kid_created(kid)
        if created is None:
            p.kept[kid] = "key id carries no creation time; remove it by hand when nothing needs it"
            continue
        if born is None or created >= born:
            continue  # staged, not retired
        successor = next(c for c in created_at if c > created)  # exists: the active key is newer
        if now - successor >= policy.keep_old:
            p.removable.append(kid)
        else:
            p.kept[kid] = f"retired {successor.isoformat()}, kept until {(successor + policy.keep_old).isoformat()}"
    entries[ACTIVE_FILE] = active.encode("ascii")
    for kid, key in keys.items():
        entries[KEY_PREFIX + kid] = key
    return p


def referenced_kids(pods: Iterable[dict[str, Any]]) -> set[str]:
    """Key ids named by the signature annotations of ``pods`` (API JSON)."""
    out: set[str] = set()
    for pod in pods:
        ann = ObjectView(pod).annotations
        for key in (ANN_ALLOCATION_SIGNATURE, ANN_PROGRESS_SIGNATURE):
            kid = signature_kid(ann.get(key))
            if kid:
                out.add(kid)
    return out


# --- stores --------------------------------------------------------------------------------------

class Conflict(Exception):
    """The stored key ring changed (or appeared) since it was read."""


class SecretStore:
    """The key ring as a Secret's ``data`` (official client; RBAC: secrets get, create, update)."""

    def __init__(self, core: Any, namespace: str, name: str):
        self.core, self.namespace, self.name = core, namespace, name
        self._secret: Any = None

    def read(self) -> dict[str, bytes] | None:
        """The Secret's entries, or None if it does not exist. Raises ApiException, ValueError."""
        from kubernetes.client.rest import ApiException

        try:
            self._secret = self.core.read_namespaced_secret(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                self._secret = None
                return None
            raise
        return {k: base64.b64decode(v) for k, v in (self._secret.data or {}).items()}

    def write(self, entries: dict[str, bytes]) -> None:
        """Create the Secret, or replace its data guarded by the resourceVersion read last.
        Raises Conflict (409), ApiException."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        data: dict[str, bytes | str] = {k: base64.b64encode(v).decode() for k, v in sorted(entries.items())}
        try:
            if self._secret is None:
                body = client.V1Secret(api_version="v1", kind="Secret", type="Opaque", data=data,
                                       metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace,
                                                                    labels=dict(SECRET_LABELS)))
                self.core.create_namespaced_secret(self.namespace, body)
            else:
                self._secret.data = data
                self.core.replace_namespaced_secret(self.name, self.namespace, self._secret)
        except ApiException as e:
            if e.status == 409:
                raise Conflict(f"secret {self.namespace}/{self.name} changed meanwhile") from e
            raise

    def describe(self) -> str:
        return f"secret {self.namespace}/{self.name}"


class DirStore:
    """The key ring as files in a directory (``active`` written last, each file replaced atomically,
    mode 0600; removed keys are unlinked after ``active`` names another key)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def read(self) -> dict[str, bytes] | None:
        if not self.path.is_dir():
            return None
        out = {n: (self.path / n).read_bytes() for n in sorted(os.listdir(self.path))
               if not n.startswith(".") and (self.path / n).is_file()}
        return out or None

    def write(self, entries: dict[str, bytes]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        old = set(self.read() or {})
        for name, value in sorted(entries.items(), key=lambda kv: kv[0] == ACTIVE_FILE):
            p = self.path / name
            if p.is_file() and p.read_bytes() == value:
                continue
            atomic_write(p, value, 0o600)
        for name in old - set(entries):
            (self.path / name).unlink(missing_ok=True)

    def describe(self) -> str:
        return f"directory {self.path}"


def list_all_pods(core: Any, page: int = 500) -> Iterable[dict[str, Any]]:
    """Every pod (API JSON), ``page`` at a time. Raises ApiException."""
    cont: str | None = None
    while True:
        kw: dict[str, Any] = {"limit": page, "_preload_content": False}
        if cont:
            kw["_continue"] = cont
        body = ListView(json.loads(core.list_pod_for_all_namespaces(**kw).data))
        yield from body.items
        cont = body.continue_token
        if not cont:
            return


def ensure(store: Any, policy: Policy, now: Callable[[], datetime],
           pods: Callable[[], Iterable[dict[str, Any]]] | None, attempts: int = 5) -> dict[str, Any]:
    """One run against ``store`` (steps 1-4 of the module docstring). ``pods``: lists every pod
    (None: retired keys are removed without looking at pods). Returns the summary.
    Raises Conflict after ``attempts`` conflicting writes, ApiException, OSError."""
    for attempt in range(attempts):
        current = store.read()
        p = plan(current, policy, now())
        if p.removable:
            if pods is None:
                refs: set[str] | None = set()
            else:
                try:
                    refs = referenced_kids(pods())
                except Exception as e:  # noqa: BLE001 - unsure whether a key is needed: keep it
                    log.warning("could not list pods; keeping retired keys", extra={"error": f"{type(e).__name__}: {e}"})
                    refs = None
            for kid in p.removable:
                if refs is None:
                    p.kept[kid] = "pods could not be listed"
                elif kid in refs:
                    p.kept[kid] = "a pod's signature names it"
                else:
                    del p.entries[KEY_PREFIX + kid]
                    p.changes.append(f"removed key {kid}")
        if current != p.entries:
            try:
                store.write(p.entries)
            except Conflict:
                if attempt == attempts - 1:
                    raise
                log.info("key ring changed meanwhile; reading it again")
                continue
        for c in p.changes:
            log.info(c, extra={"key": store.describe()})
        return {"changes": p.changes, "active": p.active, "keys": p.kids, "kept": p.kept}
    raise AssertionError("unreachable")


# --- command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kube-vgpu certs signing-keys",
                                description="create and rotate the allocation signing keys")
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser("ensure", help="create the key ring if absent; stage, activate and remove keys as due")
    where = e.add_mutually_exclusive_group(required=True)
    where.add_argument("--secret", metavar="NAMESPACE/NAME", help="the key Secret (created if absent)")
    where.add_argument("--dir", help="a key directory instead of a Secret (running the components by hand)")
    e.add_argument("--rotate-after-days", type=float, default=90.0,
                   help="stage a new key when the active one is this many days old (default 90)")
    e.add_argument("--activate-after-seconds", type=float, default=600.0,
                   help="a staged key becomes active at the first run this many seconds after it was "
                        "staged (default 600; 0 activates a new key at once)")
    e.add_argument("--keep-old-days", type=float, default=30.0,
                   help="remove a retired key this many days after its successor was created, and only "
                        "when no pod's signature names it (default 30)")
    e.add_argument("--no-pod-check", action="store_true",
                   help="remove retired keys without listing pods (only for a --dir that no cluster uses)")
    add_kubeconfig_flag(e)
    add_level_flag(e)
    return p


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"kube-vgpu certs signing-keys: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, api: Any = None, now: Callable[[], datetime] | None = None) -> dict[str, Any]:
    """``ensure`` with parsed ``args``. ``api``: an ApiClient (built from --kubeconfig when None and
    the cluster is needed). Raises ApiException, ConfigException, OSError, Conflict."""
    from . import main as certs_main

    policy = Policy(rotate_after=timedelta(days=args.rotate_after_days),
                    activate_after=timedelta(seconds=args.activate_after_seconds),
                    keep_old=timedelta(days=args.keep_old_days))
    core: Any = None
    if args.secret or (args.kubeconfig and not args.no_pod_check):
        from kubernetes import client
        core = client.CoreV1Api(api or certs_main.api_client(args.kubeconfig))
    store: Any
    if args.secret:
        ns, name = args.secret.split("/")
        store = SecretStore(core, ns, name)
    else:
        store = DirStore(args.dir)
    pods: Callable[[], Iterable[dict[str, Any]]] | None = None
    if not args.no_pod_check:
        if core is None:
            def pods() -> Iterable[dict[str, Any]]:
                raise RuntimeError("no cluster to list pods from (give --kubeconfig, or --no-pod-check)")
        else:
            def pods() -> Iterable[dict[str, Any]]:
                return list_all_pods(core)
    return ensure(store, policy, now or (lambda: datetime.now(UTC)), pods)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``kube-vgpu certs signing-keys ...``). Returns 0 on success, 1 on errors, 2 on
    usage errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    jsonlog.setup(args.log_level)
    if args.secret is not None:
        parts = args.secret.split("/")
        if len(parts) != 2 or not all(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", x) for x in parts):
            return _usage_error(parser, f"--secret {args.secret!r}: expected NAMESPACE/NAME (lowercase DNS names)")
    if args.rotate_after_days <= 0:
        return _usage_error(parser, f"--rotate-after-days {args.rotate_after_days:g}: must be > 0")
    if args.activate_after_seconds < 0:
        return _usage_error(parser, f"--activate-after-seconds {args.activate_after_seconds:g}: must be >= 0")
    if args.keep_old_days < 0:
        return _usage_error(parser, f"--keep-old-days {args.keep_old_days:g}: must be >= 0")
    if args.activate_after_seconds >= args.rotate_after_days * 86400:
        return _usage_error(parser, f"--activate-after-seconds {args.activate_after_seconds:g} must be shorter "
                                    f"than --rotate-after-days {args.rotate_after_days:g} (in seconds)")
    return run_job(run, args, log, "signing keys failed")  # ApiException, ConfigException, OSError, Conflict


if __name__ == "__main__":
    raise SystemExit(main())
