"""The DRA plugin's checkpoint: which claims are prepared, and what they were granted.

One JSON file (``<state-dir>/checkpoint.json``), rewritten atomically (temporary file, fsync,
rename, fsync of the directory) after every change, read once at start. A prepare repeated after a
restart gives the same answer and rewrites the claim's files from it (kubelet repeats
NodePrepareResources for the pods it runs after it restarts), also when the API server cannot be
asked; a claim allocated anew since (another allocation fingerprint) is prepared again.

Format (``version`` 1)::

    {"version": 1, "node": "<node>",
     "claims": {"<claim uid>": {"namespace": ..., "name": ...,
                                "devices": [{"requests": [...], "pool": ..., "device": ...,
                                             "cdi_ids": [...], "share_id": ... or null}],
                                "bookings": [{"uuid": ..., "memory_mib": ..., "cores": ...}],
                                "nodes": {"<device>": [[container path, host path], ...]},
                                "allocation": "<sha-256 of the allocation's results>"}}}

A file that cannot be read as this format raises :class:`CheckpointError` at start: the plugin does
not guess which claims are prepared (it would otherwise answer a later prepare differently, or
leave files nobody removes); the admin inspects the file and removes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kube_vgpu.model import DeviceBooking

from .cdi import atomic_write, check_uid

VERSION = 1
FILE_NAME = "checkpoint.json"


class CheckpointError(ValueError):
    """The checkpoint file is unreadable or not of the expected format (message names the path and
    the field)."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim as answered to kubelet."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A prepared claim: identity, the devices answered, the bookings written to its limits file,
    and the device nodes of each GPU (device name -> (container path, host path) pairs)."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    bookings: tuple[DeviceBooking, ...]
    nodes: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    #: fingerprint of the claim's allocation when it was prepared
    #: (:func:`deviceplugin.dra.plugin.allocation_fingerprint`; "" when unknown)
    allocation: str = ""


def _encode(c: PreparedClaim) -> dict[str, Any]:
    return {"namespace": c.namespace, "name": c.name,
            "devices": [{"requests": list(d.requests), "pool": d.pool, "device": d.device,
                         "cdi_ids": list(d.cdi_ids), "share_id": d.share_id} for d in c.devices],
            "bookings": [{"uuid": b.uuid, "memory_mib": b.memory_mib, "cores": b.cores} for b in c.bookings],
            "nodes": {dev: [list(p) for p in pairs] for dev, pairs in c.nodes}, "allocation": c.allocation}


def _decode(uid: str, o: Any, where: str) -> PreparedClaim:
    try:
        check_uid(uid)
        devices = tuple(PreparedDevice(tuple(str(r) for r in d["requests"]), str(d["pool"]), str(d["device"]),
                                       tuple(str(i) for i in d["cdi_ids"]),
                                       None if d.get("share_id") is None else str(d["share_id"]))
                        for d in o["devices"])
        bookings = tuple(DeviceBooking(str(b["uuid"]), int(b["memory_mib"]), int(b["cores"])) for b in o["bookings"])
        nodes = tuple((str(dev), tuple((str(p[0]), str(p[1])) for p in pairs))
                      for dev, pairs in dict(o.get("nodes") or {}).items())
        return PreparedClaim(str(o["namespace"]), str(o["name"]), uid, devices, bookings, nodes,
                             str(o.get("allocation") or ""))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{where}: claims[{uid!r}] is malformed ({type(e).__name__}: {e}); "
                              f"allowed: the version {VERSION} format written by this plugin") from None


class Checkpoint:
    """The prepared claims, persisted in ``<state_dir>/checkpoint.json``. Not thread-safe: the
    plugin calls it under its own lock."""

    def __init__(self, state_dir: str, node: str):
        self.path = os.path.join(state_dir, FILE_NAME)
        self.node = node
        self.claims: dict[str, PreparedClaim] = {}

    def load(self) -> None:
        """Read the file (absent: no claims). Raises CheckpointError for an unreadable or malformed
        file, or one written for another node."""
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = f.read()
        except FileNotFoundError:
            self.claims = {}
            return
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot be read: {e}") from None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: not JSON ({e}); allowed: the version {VERSION} format") from None
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            got = doc.get("version") if isinstance(doc, dict) else type(doc).__name__
            raise CheckpointError(f"{self.path}: version={got!r}; allowed: {VERSION}")
        if doc.get("node") != self.node:
            raise CheckpointError(f"{self.path}: node={doc.get('node')!r}; allowed: {self.node!r} (this node)")
        claims = doc.get("claims")
        if not isinstance(claims, dict):
            raise CheckpointError(f"{self.path}: claims is {type(claims).__name__}; allowed: an object")
        self.claims = {uid: _decode(uid, o, self.path) for uid, o in claims.items()}

    def save(self) -> None:
        """Write the file atomically. Raises OSError."""
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        doc = {"version": VERSION, "node": self.node,
               "claims": {uid: _encode(c) for uid, c in sorted(self.claims.items())}}
        atomic_write(self.path, json.dumps(doc, indent=1, sort_keys=True) + "\n", 0o600)

    def put(self, claim: PreparedClaim) -> None:
        """Record ``claim`` and save. Raises OSError (the record is dropped again)."""
        old = self.claims.get(claim.uid)
        self.claims[claim.uid] = claim
        try:
            self.save()
        except OSError:
            if old is None:
                self.claims.pop(claim.uid, None)
            else:
                self.claims[claim.uid] = old
            raise

    def drop(self, uid: str) -> None:
        """Forget claim ``uid`` (no-op when unknown) and save. Raises OSError (the record is kept)."""
        old = self.claims.pop(uid, None)
        if old is None:
            return
        try:
            self.save()
        except OSError:
            self.claims[uid] = old
            raise
