"""Signed allocation records: HMAC-SHA256 over what the vGPU system writes on a pod, so that a
tenant who can edit its own pods can neither forge, alter nor replay a record.

Two records, each a pod annotation holding ``v1:<key id>:<base64url HMAC-SHA256, no padding>``:

* ``kube-vgpu.io/allocation-signature`` (written by the scheduler extender at bind) over the pod
  uid, the node, the ``kube-vgpu.io/bind-time`` value and the exact ``kube-vgpu.io/allocation``
  bytes;
* ``kube-vgpu.io/progress-signature`` (written by the device plugin with its progress) over the pod
  uid, the allocation signature, the ``kube-vgpu.io/bind-phase`` value and the
  ``kube-vgpu.io/allocated-containers`` value.

The signed message is a domain-separation prefix (one per record kind, so a signature of one kind
never verifies as the other), then the key id and each field as an 8-byte big-endian length
followed by the field's UTF-8 bytes (no two field lists give the same message). An absent
annotation is signed as the empty string. :func:`sign_allocation`, :func:`verify_allocation`,
:func:`sign_progress` and :func:`verify_progress` are pure (no I/O) and never raise for any input:
a malformed value is a failed :class:`VerifyResult` with a reason.

Keys: a directory (the chart mounts the Secret ``<release>-signing-keys`` at
``/etc/kube-vgpu/signing``) holding ``active`` (the key id that signs, ``[a-z0-9-]{1,32}``) and one
``key.<kid>`` per key (at least 32 raw bytes, at most 4096). Every key present verifies; only the
active one signs. Names starting with ``.`` are ignored (a mounted Secret's ``..data`` links), so
are dangling links (a Secret update in progress); any other file is an error. :class:`KeyDir`
loads the directory and reloads it when its files change (:meth:`KeyDir.refresh` reads the few
small files, meant for a periodic loop); an invalid directory keeps the last good key ring.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import resources as res

log = logging.getLogger("kube_vgpu.signing")

VERSION = "v1"
ACTIVE_FILE = "active"
KEY_PREFIX = "key."
KID_PATTERN = r"[a-z0-9-]{1,32}"
_KID = re.compile(rf"^{KID_PATTERN}$")
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096
_DIGEST_B64 = re.compile(r"^[A-Za-z0-9_-]{43}$")  # 32 bytes, base64url without padding

DOMAIN_ALLOCATION = b"kube-vgpu.io/allocation-signature\x00v1\x00"
DOMAIN_PROGRESS = b"kube-vgpu.io/progress-signature\x00v1\x00"

#: ``VerifyResult.code`` values (also the metric label of rejected records)
OK = "ok"
MISSING = "missing"
MALFORMED = "malformed"
UNKNOWN_KEY = "unknown-key"
MISMATCH = "mismatch"


class SigningKeyError(ValueError):
    """The key directory is unusable; ``path`` names the file (or directory) at fault."""

    def __init__(self, path: str | os.PathLike[str], message: str):
        super().__init__(f"{os.fspath(path)}: {message}")
        self.path = os.fspath(path)


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Signing keys: ``keys`` maps key id -> secret (bytes); ``active`` is the id that signs.
    Raises SigningKeyError (path ``(key ring)``) when a key id or key is not allowed."""

    active: str
    keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        for kid, key in self.keys.items():
            if not _KID.match(kid):
                raise SigningKeyError("(key ring)", f"key id {kid!r} is not allowed; allowed: {KID_PATTERN}")
            if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise SigningKeyError("(key ring)", f"key {kid!r} has {len(key)} bytes; allowed: "
                                                    f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES}")
        if self.active not in self.keys:
            raise SigningKeyError("(key ring)", f"active key id {self.active!r} has no key; keys: "
                                                f"{', '.join(sorted(self.keys)) or 'none'}")

    def current(self) -> KeyRing:
        """This ring (a :class:`KeySource` that never changes)."""
        return self

    @property
    def kids(self) -> tuple[str, ...]:
        """The key ids present, sorted."""
        return tuple(sorted(self.keys))

    @classmethod
    def generate(cls, kid: str = "ephemeral") -> KeyRing:
        """A ring with one fresh random 32-byte key (records it signs verify only in this process)."""
        return cls(kid, {kid: secrets.token_bytes(32)})


class KeySource(Protocol):
    """Anything that gives the current key ring (:class:`KeyRing` itself, or :class:`KeyDir`)."""

    def current(self) -> KeyRing: ...


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of a verification: ``ok``; ``code`` (OK, MISSING, MALFORMED, UNKNOWN_KEY, MISMATCH);
    ``reason``: human-readable, names the annotation; ``kid``: the key id that verified (or was named)."""

    ok: bool
    code: str
    reason: str
    kid: str | None = None

    def __bool__(self) -> bool:
        return self.ok


# ---------------------------------------------------------------------------------------------
# messages, sign, verify (pure)

def _field(value: str) -> bytes:
    b = value.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates; never raise
    return len(b).to_bytes(8, "big") + b


def _message(domain: bytes, kid: str, fields: tuple[str, ...]) -> bytes:
    return domain + _field(kid) + b"".join(_field(f) for f in fields)


def _mac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _sign(ring: KeyRing, domain: bytes, fields: tuple[str, ...]) -> str:
    kid = ring.active
    mac = _mac(ring.keys[kid], _message(domain, kid, fields))
    return f"{VERSION}:{kid}:{base64.urlsafe_b64encode(mac).rstrip(b'=').decode('ascii')}"


def _verify(ring: KeyRing, value: object, domain: bytes, fields: tuple[str, ...], what: str) -> VerifyResult:
    if value is None or value == "":
        return VerifyResult(False, MISSING, f"{what} missing")
    if not isinstance(value, str):
        return VerifyResult(False, MALFORMED, f"{what} malformed: not a string")
    parts = value.split(":")
    if len(parts) != 3 or parts[0] != VERSION or not _KID.match(parts[1]) or not _DIGEST_B64.match(parts[2]):
        shown = value if len(value) <= 80 else value[:77] + "..."
        return VerifyResult(False, MALFORMED, f"{what} malformed: {shown!r}; expected "
                                              f"{VERSION}:<key id {KID_PATTERN}>:<43 base64url characters>")
    kid = parts[1]
    key = ring.keys.get(kid)
    if key is None:
        return VerifyResult(False, UNKNOWN_KEY, f"{what} invalid: unknown key id {kid!r} (keys present: "
                                                f"{', '.join(ring.kids)})", kid)
    got = base64.urlsafe_b64decode(parts[2] + "=")
    if base64.urlsafe_b64encode(got)[:43].decode("ascii") != parts[2]:  # spare low bits set: one form only
        return VerifyResult(False, MALFORMED, f"{what} malformed: the MAC is not in canonical base64url form", kid)
    if not hmac.compare_digest(got, _mac(key, _message(domain, kid, fields))):
        return VerifyResult(False, MISMATCH, f"{what} invalid: does not match the record (edited, or copied "
                                             f"from another pod or node)", kid)
    return VerifyResult(True, OK, "ok", kid)


def _s(v: object) -> str:
    return v if isinstance(v, str) else ""


def sign_allocation(ring: KeyRing, uid: str, node: str, bind_time: str, allocation_text: str) -> str:
    """The ``kube-vgpu.io/allocation-signature`` value for a record: pod ``uid``, ``node`` it is
    bound to, the exact ``kube-vgpu.io/bind-time`` text and ``kube-vgpu.io/allocation`` text, signed
    with the ring's active key."""
    return _sign(ring, DOMAIN_ALLOCATION, (uid, node, bind_time, allocation_text))


def verify_allocation(ring: KeyRing, signature: object, uid: str, node: str, bind_time: object,
                      allocation_text: object) -> VerifyResult:
    """Check an allocation signature against the pod's uid, node, bind-time and allocation texts
    (absent annotations as None or ""). Never raises."""
    return _verify(ring, signature, DOMAIN_ALLOCATION, (_s(uid), _s(node), _s(bind_time), _s(allocation_text)),
                   "allocation signature")


def sign_progress(ring: KeyRing, uid: str, allocation_signature: str, bind_phase: str,
                  allocated_containers: str) -> str:
    """The ``kube-vgpu.io/progress-signature`` value: pod ``uid``, its allocation signature (ties
    the progress to one bind), the bind-phase and allocated-containers texts."""
    return _sign(ring, DOMAIN_PROGRESS, (uid, allocation_signature, bind_phase, allocated_containers))


def verify_progress(ring: KeyRing, signature: object, uid: str, allocation_signature: object,
                    bind_phase: object, allocated_containers: object) -> VerifyResult:
    """Check a progress signature (absent annotations as None or ""). Never raises."""
    return _verify(ring, signature, DOMAIN_PROGRESS,
                   (_s(uid), _s(allocation_signature), _s(bind_phase), _s(allocated_containers)),
                   "progress signature")



# ---------------------------------------------------------------------------------------------
# the same, over a pod's annotations (which annotation holds which signed field: here only)

def verify_record(ring: KeyRing, annotations: Mapping[str, object], uid: str, node: str) -> VerifyResult:
    """:func:`verify_allocation` of the record in a pod's ``annotations`` (signature, bind-time and
    allocation texts) for pod ``uid`` bound to ``node``. Never raises."""
    return verify_allocation(ring, annotations.get(res.ANN_ALLOCATION_SIGNATURE), uid, node,
                             annotations.get(res.ANN_BIND_TIME), annotations.get(res.ANN_ALLOCATION))


def verify_record_progress(ring: KeyRing, annotations: Mapping[str, object], uid: str,
                           allocation_signature: object) -> VerifyResult:
    """:func:`verify_progress` of the progress in a pod's ``annotations`` (its signature, bind-phase
    and allocated-containers texts), tied to ``allocation_signature``. Never raises."""
    return verify_progress(ring, annotations.get(res.ANN_PROGRESS_SIGNATURE), uid, allocation_signature,
                           annotations.get(res.ANN_BIND_PHASE), annotations.get(res.ANN_ALLOCATED_CONTAINERS))


def resign_record(ring: KeyRing, annotations: Mapping[str, object], uid: str, node: str) -> dict[str, str]:
    """The annotations that sign a pod's record again with the ring's active key (the caller has
    verified the record it books): a new allocation signature over the same uid, ``node``,
    bind-time and allocation texts, and a new progress signature only when the old one verifies
    against the old allocation signature (an unverified progress is left unsigned: it stays
    untrusted)."""
    sig = sign_allocation(ring, uid, node, _s(annotations.get(res.ANN_BIND_TIME)),
                          _s(annotations.get(res.ANN_ALLOCATION)))
    patch = {res.ANN_ALLOCATION_SIGNATURE: sig}
    old = annotations.get(res.ANN_ALLOCATION_SIGNATURE)
    if old and verify_record_progress(ring, annotations, uid, old).ok:
        patch[res.ANN_PROGRESS_SIGNATURE] = sign_progress(ring, uid, sig, _s(annotations.get(res.ANN_BIND_PHASE)),
                                                          _s(annotations.get(res.ANN_ALLOCATED_CONTAINERS)))
    return patch

# ---------------------------------------------------------------------------------------------
# the key directory

def _allowed() -> str:
    return (f"allowed: {ACTIVE_FILE!r} (the active key id) and {KEY_PREFIX}<kid> files "
            f"(kid {KID_PATTERN}, {MIN_KEY_BYTES}..{MAX_KEY_BYTES} raw bytes); names starting with '.' are ignored")


def _entries(path: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith("."))
    except FileNotFoundError:
        raise SigningKeyError(path, "signing key directory does not exist") from None
    except NotADirectoryError:
        raise SigningKeyError(path, "is not a directory (--signing-keys-dir takes the key directory)") from None
    except OSError as e:
        raise SigningKeyError(path, f"cannot list the signing key directory: {e.strerror or e}") from None


def load_key_dir(path: str | os.PathLike[str]) -> KeyRing:
    """Read a key directory (format in the module docstring). Raises SigningKeyError naming the
    file and what is allowed."""
    d = Path(path)
    keys: dict[str, bytes] = {}
    active: str | None = None
    for name in _entries(d):
        f = d / name
        if name == ACTIVE_FILE:
            try:
                raw = f.read_bytes()[: MAX_KEY_BYTES + 1]
            except FileNotFoundError:  # a dangling link
                continue
            except OSError as e:
                raise SigningKeyError(f, f"cannot read: {e.strerror or e}") from None
            active = raw.decode("ascii", "replace").strip()
            if not _KID.match(active):
                raise SigningKeyError(f, f"active key id {active[:40]!r} is not allowed; allowed: {KID_PATTERN}")
            continue
        kid = name[len(KEY_PREFIX):] if name.startswith(KEY_PREFIX) else None
        if kid is None or not _KID.match(kid):
            raise SigningKeyError(f, f"not a signing key file; {_allowed()}")
        try:
            with open(f, "rb") as fh:
                key = fh.read(MAX_KEY_BYTES + 1)
        except FileNotFoundError:  # a dangling link: a mounted Secret update is removing this key
            continue
        except IsADirectoryError:
            raise SigningKeyError(f, "is a directory, not a key file") from None
        except OSError as e:
            raise SigningKeyError(f, f"cannot read: {e.strerror or e}") from None
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise SigningKeyError(f, f"key has {len(key)}{'+' if len(key) > MAX_KEY_BYTES else ''} bytes; "
                                     f"allowed: {MIN_KEY_BYTES}..{MAX_KEY_BYTES} raw random bytes")
        keys[kid] = key
    if active is None:
        raise SigningKeyError(d / ACTIVE_FILE, f"missing: the directory must name its signing key; {_allowed()}")
    if active not in keys:
        raise SigningKeyError(d / ACTIVE_FILE, f"names key id {active!r} but there is no file "
                                               f"{KEY_PREFIX}{active}; keys present: {', '.join(sorted(keys)) or 'none'}")
    return KeyRing(active, keys)


def _dir_signature(path: Path) -> tuple[tuple[str, int, int, str], ...] | None:
    """What changes when any file of the directory changes: per name, inode, size and a digest of
    the first MAX_KEY_BYTES + 1 bytes (symlinks followed, so a mounted Secret's atomic swap shows;
    contents read, since a file rewritten in place within one timestamp tick keeps its mtime).
    None if the directory cannot be listed. Reads a few small files: cheap enough to poll."""
    try:
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    except OSError:
        return None
    out = []
    for n in names:
        try:
            with open(path / n, "rb") as f:
                st = os.fstat(f.fileno())
                digest = hashlib.sha256(f.read(MAX_KEY_BYTES + 1)).hexdigest() if st.st_size <= (1 << 20) else ""
        except OSError:
            out.append((n, -1, -1, ""))
            continue
        out.append((n, st.st_ino, st.st_size, digest))
    return tuple(out)


class KeyDir:
    """The key ring of a directory, reloaded by :meth:`refresh` when its files change.

    Raises SigningKeyError from the constructor when the directory is unusable (the components
    refuse to start). Not thread-safe for concurrent :meth:`refresh` calls; :meth:`current` may be
    called from any thread (it reads one reference).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        sig = _dir_signature(self.path)
        self._ring = load_key_dir(self.path)
        self._sig = sig
        self.error: str | None = None  #: why the last reload failed (None: the ring is current)

    def current(self) -> KeyRing:
        """The last good key ring."""
        return self._ring

    def refresh(self) -> bool:
        """Reload if the directory changed since the last look. Returns True when a new ring was
        taken. An invalid directory keeps the last good ring, logs the error once per change and
        sets :attr:`error`."""
        sig = _dir_signature(self.path)
        if sig == self._sig:
            return False
        try:
            ring = load_key_dir(self.path)
        except SigningKeyError as e:
            if str(e) != self.error:
                log.error("signing keys not reloaded; keeping the last good key ring",
                          extra={"error": str(e), "key": e.path})
            self.error = str(e)
            if _dir_signature(self.path) == sig:
                self._sig = sig  # look again only when the files change again
            return False
        if _dir_signature(self.path) == sig:
            self._sig = sig  # else: changed while loading; load again next time
        changed = ring != self._ring
        self._ring = ring
        self.error = None
        if changed:
            log.info("signing keys reloaded", extra={"key": f"active={ring.active} keys={','.join(ring.kids)}"})
        return changed
