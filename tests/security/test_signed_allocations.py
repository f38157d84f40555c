"""Allocation records only the vGPU system can write: the signing primitives (kube_vgpu/signing.py)
and the hostile tenant's attacks on the extender's books, each played over the real protocol (the
extender's HTTP app, the in-process fake kube-apiserver over HTTP with the official client).

A tenant can create and edit its own pods, annotations and labels included; it can neither forge,
alter nor replay a record, so it can neither reserve GPUs nor free the GPUs its pods use."""

from __future__ import annotations

import base64
import itertools
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bind_support import bind, create_nodes, create_pod, extender
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from vgpu_sched_util import KEYS, Extender, filter_args, node_obj, pod_obj, run, write_keys
from vgpu_sched_util import wait_until as _wait_until

from kube_vgpu.codec import decode_allocation, encode_allocation
from kube_vgpu.config import load_config_text
from kube_vgpu.model import ContainerAllocation, DeviceBooking, PodAllocation
from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_BIND_TIME,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    BIND_SUCCESS,
    DEFAULT_SCHEDULER_NAME,
    LABEL_NODE,
)
from kube_vgpu.signing import (
    MALFORMED,
    MISMATCH,
    MISSING,
    UNKNOWN_KEY,
    KeyDir,
    KeyRing,
    SigningKeyError,
    load_key_dir,
    resign_record,
    sign_allocation,
    sign_progress,
    verify_allocation,
    verify_progress,
    verify_record,
    verify_record_progress,
)
from tests.fakeapi import FakeKubeAPI


async def eventually(cond: Callable[[], bool]) -> None:
    """Wait for ``cond`` (background work of the components; a generous bound for a loaded machine)."""
    await _wait_until(cond, timeout=60)


K1 = KeyRing("k1", {"k1": b"1" * 32})
TEXT = encode_allocation(PodAllocation("gpu-1", (ContainerAllocation("c", False, (
    DeviceBooking("GPU-a", 1000, 10),)),), 100.0))
FIELDS = ("uid-1", "gpu-1", "100", TEXT)

# ---------------------------------------------------------------------------------------------
# signing primitives (pure)


def test_sign_and_verify_round_trip_and_value_form() -> None:
    sig = sign_allocation(K1, *FIELDS)
    kind, kid, mac = sig.split(":")
    assert (kind, kid, len(mac)) == ("v1", "k1", 43)
    assert len(base64.urlsafe_b64decode(mac + "=")) == 32
    v = verify_allocation(K1, sig, *FIELDS)
    assert v and v.ok and v.kid == "k1" and v.code == "ok"
    assert sign_allocation(K1, *FIELDS) == sig  # deterministic: the same record signs the same
    psig = sign_progress(K1, "uid-1", sig, BIND_SUCCESS, "c")
    assert verify_progress(K1, psig, "uid-1", sig, BIND_SUCCESS, "c").ok


def _other(value: str, data: st.DataObject) -> str:
    return data.draw(st.text(max_size=40).filter(lambda s: s != value))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.tuples(st.text(max_size=40), st.text(max_size=40), st.text(max_size=20), st.text(max_size=300)),
       which=st.integers(0, 3), data=st.data())
def test_any_change_of_any_allocation_field_breaks_verification(fields: tuple[str, str, str, str], which: int,
                                                                data: st.DataObject) -> None:
    sig = sign_allocation(K1, *fields)
    assert verify_allocation(K1, sig, *fields).ok
    changed = list(fields)
    changed[which] = _other(fields[which], data)
    v = verify_allocation(K1, sig, *changed)
    assert not v.ok and v.code == MISMATCH and "allocation signature invalid" in v.reason
    # the same fields never verify as a progress record (domain separation)
    assert not verify_progress(K1, sig, *fields).ok


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.tuples(st.text(max_size=40), st.text(max_size=60), st.text(max_size=12), st.text(max_size=60)),
       which=st.integers(0, 3), data=st.data())
def test_any_change_of_any_progress_field_breaks_verification(fields: tuple[str, str, str, str], which: int,
                                                              data: st.DataObject) -> None:
    sig = sign_progress(K1, *fields)
    assert verify_progress(K1, sig, *fields).ok
    changed = list(fields)
    changed[which] = _other(fields[which], data)
    assert verify_progress(K1, sig, *changed).code == MISMATCH
    assert not verify_allocation(K1, sig, *fields).ok


@settings(max_examples=200)
@given(pos=st.integers(min_value=0), data=st.data())
def test_any_change_of_the_signature_value_breaks_verification(pos: int, data: st.DataObject) -> None:
    sig = sign_allocation(K1, *FIELDS)
    i = pos % len(sig)
    c = data.draw(st.characters(codec="ascii").filter(lambda ch: ch != sig[i]))
    v = verify_allocation(K1, sig[:i] + c + sig[i + 1:], *FIELDS)
    assert not v.ok and v.code in (MALFORMED, UNKNOWN_KEY, MISMATCH)


def test_fields_are_length_prefixed_so_concatenations_differ() -> None:
    a = sign_allocation(K1, "ab", "c", "1", "x")
    assert not verify_allocation(K1, a, "a", "bc", "1", "x").ok
    assert not verify_allocation(K1, a, "abc", "", "1", "x").ok
    assert not verify_allocation(K1, sign_allocation(K1, "u", "n", "1", ""), "u", "n", "", "1").ok


@settings(max_examples=300)
@given(value=st.one_of(st.none(), st.text(max_size=80), st.binary(max_size=40), st.integers(), st.floats(),
                       st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=3), st.text(max_size=3)),
                       st.builds(lambda kid, mac: f"v1:{kid}:{mac}", st.text(max_size=40), st.text(max_size=50))),
       other=st.one_of(st.none(), st.text(max_size=20), st.integers()))
def test_malformed_values_give_a_reason_never_an_exception(value: Any, other: Any) -> None:
    for v in (verify_allocation(K1, value, "u", "n", other, other), verify_progress(K1, value, "u", other, other, other)):
        assert not v.ok and v.reason and v.code in (MISSING, MALFORMED, UNKNOWN_KEY, MISMATCH)


def test_missing_malformed_and_unknown_key_reasons() -> None:
    assert verify_allocation(K1, None, *FIELDS).reason == "allocation signature missing"
    assert verify_allocation(K1, "", *FIELDS).code == MISSING
    v = verify_allocation(K1, "v2:k1:" + "A" * 43, *FIELDS)
    assert v.code == MALFORMED and "expected v1:<key id" in v.reason
    other = KeyRing("k9", {"k9": b"9" * 32})
    v = verify_allocation(K1, sign_allocation(other, *FIELDS), *FIELDS)
    assert v.code == UNKNOWN_KEY and "unknown key id 'k9'" in v.reason and "k1" in v.reason
    # same key id, another secret (a tenant guessing): a mismatch
    assert verify_allocation(K1, sign_allocation(KeyRing("k1", {"k1": b"2" * 32}), *FIELDS), *FIELDS).code == MISMATCH
    # a lone surrogate (JSON can carry one) signs and verifies without raising
    assert verify_allocation(K1, sign_allocation(K1, "u\ud800", "n", "1", "t"), "u\ud800", "n", "1", "t").ok


def test_key_rotation_old_records_verify_while_their_key_is_present() -> None:
    old = KeyRing("old", {"old": b"o" * 32})
    rotated = KeyRing("new", {"old": b"o" * 32, "new": b"n" * 32})
    rec = sign_allocation(old, *FIELDS)
    assert verify_allocation(rotated, rec, *FIELDS).kid == "old"
    fresh = sign_allocation(rotated, *FIELDS)
    assert fresh.startswith("v1:new:") and verify_allocation(rotated, fresh, *FIELDS).ok
    gone = KeyRing("new", {"new": b"n" * 32})
    assert verify_allocation(gone, rec, *FIELDS).code == UNKNOWN_KEY
    assert verify_allocation(gone, fresh, *FIELDS).ok


def test_resigning_a_record_carries_only_a_progress_that_verifies() -> None:
    """After a key rotation the extender signs booked records again (resign_record): the record's
    fields stay exactly as signed, and the device plugin's progress is signed again only when its
    old signature verifies. A tenant who wrote bind-phase/allocated-containers (or a progress
    signature of its own) before the rotation gets nothing signed."""
    old = KeyRing("old", {"old": b"o" * 32})
    new = KeyRing("new", {"old": b"o" * 32, "new": b"n" * 32})
    uid, node, bt, text = "u-1", "node-a", "2026-12-01T00:00:00Z", "v1;node-a;c:0=1000/10"
    sig = sign_allocation(old, uid, node, bt, text)
    ann = {ANN_ALLOCATION: text, ANN_BIND_TIME: bt, ANN_ALLOCATION_SIGNATURE: sig, ANN_BIND_PHASE: BIND_SUCCESS,
           ANN_ALLOCATED_CONTAINERS: "c", ANN_PROGRESS_SIGNATURE: sign_progress(old, uid, sig, BIND_SUCCESS, "c")}
    assert verify_record(new, ann, uid, node).kid == "old"
    assert verify_record_progress(new, ann, uid, sig)
    patch = resign_record(new, ann, uid, node)
    assert set(patch) == {ANN_ALLOCATION_SIGNATURE, ANN_PROGRESS_SIGNATURE}
    after = {**ann, **patch}
    assert verify_record(new, after, uid, node).kid == "new"
    assert not verify_record(new, after, uid, "node-b")  # bound to the node it was signed for only
    assert verify_record_progress(new, after, uid, patch[ANN_ALLOCATION_SIGNATURE]).kid == "new"
    # the tenant's own progress: phase edited after signing, or a signature it made up
    for forged in ({ANN_BIND_PHASE: BIND_ALLOCATING}, {ANN_ALLOCATED_CONTAINERS: "c,d"},
                   {ANN_PROGRESS_SIGNATURE: "v1:old:" + "A" * 43}):
        bad = {**ann, **forged}
        assert not verify_record_progress(new, bad, uid, sig)
        assert set(resign_record(new, bad, uid, node)) == {ANN_ALLOCATION_SIGNATURE}
    # an edited record no longer verifies (the caller resigns only what it booked)
    assert not verify_record(new, {**ann, ANN_ALLOCATION: text + "x"}, uid, node)


def test_key_ring_checks_ids_and_sizes() -> None:
    for kid, key, active, what in [("UP", b"k" * 32, "UP", "key id 'UP'"), ("a", b"k" * 31, "a", "31 bytes"),
                                   ("a", b"k" * 32, "b", "active key id 'b'")]:
        with pytest.raises(SigningKeyError, match=what):
            KeyRing(active, {kid: key})
    assert "k" * 32 not in repr(KeyRing("a", {"a": b"k" * 32}))  # secrets never in logs


# ---------------------------------------------------------------------------------------------
# the key directory


def _keydir(d: Path, keys: dict[str, bytes], active: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for kid, key in keys.items():
        (d / f"key.{kid}").write_bytes(key)
    (d / "active").write_text(active + "\n")
    return d


def test_key_directory_errors_name_the_file_and_what_is_allowed(tmp_path: Path) -> None:
    cases: list[tuple[str, Any, str]] = [
        ("missing-dir", None, "does not exist"),
        ("no-active", lambda d: (d / "key.a").write_bytes(b"k" * 32), "active: missing"),
        ("bad-active", lambda d: (_keydir(d, {"a": b"k" * 32}, "A B")), "active key id 'A B' is not allowed"),
        ("absent-key", lambda d: _keydir(d, {"a": b"k" * 32}, "b"), "names key id 'b' but there is no file key.b"),
        ("short", lambda d: _keydir(d, {"a": b"k" * 16}, "a"), "key.a: key has 16 bytes; allowed: 32..4096"),
        ("long", lambda d: _keydir(d, {"a": b"k" * 5000}, "a"), "key has 4097\\+ bytes"),
        ("stray", lambda d: (_keydir(d, {"a": b"k" * 32}, "a"), (d / "README").write_text("x")),
         "README: not a signing key file; allowed: 'active'"),
        ("bad-kid", lambda d: (_keydir(d, {"a": b"k" * 32}, "a"), (d / "key.Bad").write_bytes(b"k" * 32)),
         "key.Bad: not a signing key file"),
    ]
    for name, make, what in cases:
        d = tmp_path / name
        if make is not None:
            d.mkdir()
            make(d)
        with pytest.raises(SigningKeyError, match=what) as e:
            load_key_dir(d)
        assert str(d) in str(e.value)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SigningKeyError, match="is not a directory"):
        KeyDir(f)


def _secret_mount(d: Path, version: str, keys: dict[str, bytes], active: str) -> None:
    """A directory laid out as kubelet mounts a Secret: the files are links into ``..data``, which
    links to a timestamped directory that an update swaps atomically."""
    ts = d / f"..{version}"
    ts.mkdir(parents=True)
    _keydir(ts, keys, active)
    tmp = d / "..data_tmp"
    tmp.symlink_to(ts.name)
    os.replace(tmp, d / "..data")
    for name in ["active", *(f"key.{k}" for k in keys)]:
        if not (d / name).is_symlink():
            (d / name).symlink_to(f"..data/{name}")


def test_key_dir_reloads_a_rotated_secret_mount_and_keeps_the_last_good_ring(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kube_vgpu.signing")
    d = tmp_path / "signing"
    d.mkdir()
    _secret_mount(d, "v1", {"old": b"o" * 32}, "old")
    kd = KeyDir(d)
    assert kd.current().active == "old" and kd.current().kids == ("old",)
    assert kd.refresh() is False  # nothing changed
    rec = sign_allocation(kd.current(), *FIELDS)
    # rotation step 1: the new key is staged, "old" still signs
    _secret_mount(d, "v2", {"old": b"o" * 32, "new": b"n" * 32}, "old")
    assert kd.refresh() and kd.current().kids == ("new", "old") and kd.current().active == "old"
    # step 2: "new" becomes active; records of "old" still verify
    _secret_mount(d, "v3", {"old": b"o" * 32, "new": b"n" * 32}, "new")
    assert kd.refresh() and kd.current().active == "new"
    assert verify_allocation(kd.current(), rec, *FIELDS).kid == "old"
    assert sign_allocation(kd.current(), *FIELDS).startswith("v1:new:")
    # a broken update (active names a key that is not there): the last good ring stays, logged once
    _secret_mount(d, "v4", {"new": b"n" * 32}, "newer")
    assert kd.refresh() is False and kd.current().active == "new" and "newer" in (kd.error or "")
    assert kd.refresh() is False
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "key.newer" in getattr(errors[0], "error", "")
    # fixed: taken, and "old" (removed) no longer verifies
    _secret_mount(d, "v5", {"new": b"n" * 32}, "new")
    assert kd.refresh() and kd.error is None and kd.current().kids == ("new",)
    assert verify_allocation(kd.current(), rec, *FIELDS).code == UNKNOWN_KEY


def test_key_dir_sees_a_same_size_rewrite_in_place(tmp_path: Path) -> None:
    """A hand-kept directory edited in place: ``active`` switched between two ids of the same length
    right after a reload (same inode, same size, possibly the same mtime tick) is still seen."""
    d = _keydir(tmp_path / "keys", {"aa": b"a" * 32, "bb": b"b" * 32}, "aa")
    kd = KeyDir(d)
    for active in ("bb", "aa", "bb"):
        (d / "active").write_text(active + "\n")
        assert kd.refresh() and kd.current().active == active


# ---------------------------------------------------------------------------------------------
# the extender's books under attack (real HTTP, fake kube-apiserver)

NODE_GPUS = 4
FULL = 24576


def _usage(ext: Extender) -> dict[str, int]:
    """Booked MiB per GPU uuid (nonzero only)."""
    out = {}
    for n in ext.svc.cache.state.node_list:
        for i, d in enumerate(n.devices):
            if d.memory_mib - n.free_mem[i]:
                out[d.uuid] = d.memory_mib - n.free_mem[i]
    return out


def _forged(node: str) -> str:
    """A record claiming every GPU of ``node`` in full."""
    return encode_allocation(PodAllocation(node, (ContainerAllocation("c", False, tuple(
        DeviceBooking(f"GPU-{node}-{i:02d}", FULL, 100) for i in range(NODE_GPUS))),), 1.0))


def _tenant_pod(name: str, annotations: dict[str, str], node_label: str, *, scheduler: str = DEFAULT_SCHEDULER_NAME,
                node_name: str | None = None, gpus: int = NODE_GPUS) -> dict[str, Any]:
    p = pod_obj(name, limits={"nvidia.com/gpu": gpus, "nvidia.com/gpumem": 1000}, annotations=annotations)
    p["metadata"]["labels"] = {**(p["metadata"].get("labels") or {}), LABEL_NODE: node_label}
    p["spec"]["schedulerName"] = scheduler
    if node_name:
        p["spec"]["nodeName"] = node_name
    return p


def _rejections(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("kube_vgpu_scheduler_allocation_records_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _running(fake: FakeKubeAPI, name: str) -> None:
    """Play the kubelet: the pod's containers run (container statuses, written only by kubelet)."""
    fake.patch_object("pods", name, {"status": {"phase": "Running", "containerStatuses": [
        {"name": "c", "ready": True, "restartCount": 0, "image": "busybox", "imageID": "",
         "state": {"running": {}}}]}}, "default", subresource="status")


def _seen(ext: Extender, fake: FakeKubeAPI, name: str) -> Any:
    """A condition: the extender's cache has logged (rejected) the pod's current record."""
    uid = fake.get_object("pods", name, "default")["metadata"]["uid"]
    return lambda: uid in ext.svc.cache._rejected


_markers = itertools.count()


async def caught_up(ext: Extender, fake: FakeKubeAPI) -> None:
    """Wait until the extender's pod watch has delivered every change made so far: a marker pod
    created now (labelled, with an unreadable record the cache logs) has been seen (watch order)."""
    m = create_pod(fake, _tenant_pod(f"marker-{next(_markers)}", {ANN_ALLOCATION: "{}"}, "node-0", gpus=1))
    uid = m["metadata"]["uid"]
    await eventually(lambda: uid in ext.svc.cache._rejected)


def test_forged_allocation_on_a_pending_pod_books_nothing_across_a_restart(
        fake_kube_api: FakeKubeAPI, caplog: pytest.LogCaptureFixture) -> None:
    """The reported attack: pending pods of scheduler ``nobody`` carrying a hand-written record and
    the node label blocked every GPU of two nodes. Such pods are not even watched now (the extender
    watches pods by their immutable schedulerName), so the attack is played with pods naming our
    scheduler too. Unsigned, malformed, guessed, foreign-key and replayed-for-another-uid
    signatures: nothing is booked, each pod is logged once with its reason and counted; a fresh
    extender books nothing either, and a legitimate pod fits a whole GPU."""
    fake = fake_kube_api
    caplog.set_level(logging.WARNING, logger="kube_vgpu.cluster")
    nodes = create_nodes(fake, 2, gpus=NODE_GPUS)
    attacker = KeyRing("test-1", {"test-1": b"a tenant's guess at the key 12345"})
    names = []
    for node in ("node-0", "node-1"):
        text = _forged(node)
        for kind, sig in [("none", None), ("junk", "garbage"), ("shaped", "v1:test-1:" + "A" * 43),
                          ("guessed", sign_allocation(attacker, "x", node, "1", text)),
                          ("foreign", sign_allocation(KeyRing("evil", {"evil": b"e" * 32}), "x", node, "1", text)),
                          ("other-uid", sign_allocation(KEYS, "uid-of-someone-else", node, "1", text))]:
            ann = {ANN_ALLOCATION: text, ANN_BIND_PHASE: BIND_ALLOCATING, ANN_BIND_TIME: "1"}
            if sig is not None:
                ann[ANN_ALLOCATION_SIGNATURE] = sig
            name = f"squat-{node}-{kind}"
            create_pod(fake, _tenant_pod(name, ann, node))
            names.append(name)
            create_pod(fake, _tenant_pod(f"nobody-{node}-{kind}", ann, node, scheduler="nobody"))
    legit = pod_obj("legit", limits={"nvidia.com/gpumem": FULL, "nvidia.com/gpucores": 100})

    async def go() -> None:
        for _ in range(2):  # the first extender, then a restarted one
            async with extender(fake, keys=KEYS, filter_best_node=False) as ext:  # every feasible node
                await eventually(lambda: len(ext.svc.cache._rejected) == len(names))  # noqa: B023
                assert ext.svc.cache.state.bookings == {} and _usage(ext) == {}
                _, res = await ext.post("/filter", filter_args(legit, nodes))
                assert sorted(res["NodeNames"]) == ["node-0", "node-1"] and not res["FailedNodes"]
                _, metrics = await ext.get("/metrics")
                assert _rejections(metrics) == {"missing": 2.0, "malformed": 2.0, "mismatch": 6.0, "unknown-key": 2.0}
        logged = {getattr(r, "pod", "") for r in caplog.records if "nothing booked" in r.getMessage()}
        assert logged == {f"default/{n}" for n in names}
        why = {getattr(r, "pod", ""): getattr(r, "error", "") for r in caplog.records}
        assert why["default/squat-node-0-none"] == "allocation signature missing"
        assert "does not match the record" in why["default/squat-node-0-other-uid"]
        assert "unknown key id 'evil'" in why["default/squat-node-1-foreign"]
    run(go)
    # logged once per pod per extender (two extenders), not once per event
    assert sum(1 for r in caplog.records if getattr(r, "pod", "") == "default/squat-node-0-junk") == 2


def test_tenant_edits_or_removes_its_record_after_bind_and_the_booking_stays(fake_kube_api: FakeKubeAPI) -> None:
    """The tenant edits its pod's allocation to 24000 MiB (keeping or dropping the signature), then
    removes the record altogether: the extender keeps exactly the 1000 MiB its own signed record
    booked: a 23000 MiB pod still fits next to it (nothing reserved), a 24000 MiB one does not
    (nothing freed). After a restart, the running pod's own request is booked."""
    fake = fake_kube_api
    create_nodes(fake, 1, gpus=1)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}))
    big = encode_allocation(PodAllocation("node-0", (ContainerAllocation("c", False, (
        DeviceBooking("GPU-node-0-00", 24000, 100),)),), 1.0))
    nodes = [node_obj("node-0", 1)]

    async def fits(ext: Extender, mem: int) -> bool:
        _, res = await ext.post("/filter", filter_args(pod_obj("probe", limits={"nvidia.com/gpumem": mem}), nodes))
        return res["NodeNames"] == ["node-0"]

    async def unchanged(ext: Extender) -> None:
        assert _usage(ext) == {"GPU-node-0-00": 1000}
        assert await fits(ext, 23000) and not await fits(ext, 24000)

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            assert await bind(ext, a) == ""
            await unchanged(ext)
            uid = a["metadata"]["uid"]
            fake.patch_object("pods", "a", {"metadata": {"annotations": {ANN_ALLOCATION: big}}}, "default")
            await eventually(_seen(ext, fake, "a"))
            await unchanged(ext)
            # the same edit re-signed with a guessed key, then the whole record removed
            for ann in ({ANN_ALLOCATION_SIGNATURE: sign_allocation(KeyRing("test-1", {"test-1": b"g" * 32}), uid,
                                                                  "node-0", "1", big)},
                        {ANN_ALLOCATION: None, ANN_ALLOCATION_SIGNATURE: None, ANN_BIND_TIME: None}):
                fake.patch_object("pods", "a", {"metadata": {"annotations": ann}}, "default")
                await caught_up(ext, fake)
                await unchanged(ext)
        _running(fake, "a")
        for ann in ({ANN_ALLOCATION: big}, {ANN_ALLOCATION: None}):  # edited, then removed, before a restart
            fake.patch_object("pods", "a", {"metadata": {"annotations": ann}}, "default")
            async with extender(fake, keys=KEYS) as ext:
                await unchanged(ext)
        # the node label goes too: the extender watches pods by their (immutable) schedulerName,
        # so the running pod is still seen and its request still booked
        fake.patch_object("pods", "a", {"metadata": {"labels": {LABEL_NODE: None}}}, "default")
        assert LABEL_NODE not in (fake.get_object("pods", "a", "default")["metadata"].get("labels") or {})
        async with extender(fake, keys=KEYS) as ext:
            await unchanged(ext)
    run(go)


def test_replaying_another_pods_signed_record_books_nothing(fake_kube_api: FakeKubeAPI) -> None:
    """A tenant copies a victim's valid record, signature and bind-time onto its own pod (pending,
    or with a preset spec.nodeName): the signature binds the victim's uid, so nothing is booked."""
    fake = fake_kube_api
    create_nodes(fake, 1, gpus=1)
    v = create_pod(fake, pod_obj("victim", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}))

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            assert await bind(ext, v) == ""
            ann = fake.get_object("pods", "victim", "default")["metadata"]["annotations"]
            copied = {k: ann[k] for k in (ANN_ALLOCATION, ANN_ALLOCATION_SIGNATURE, ANN_BIND_TIME, ANN_BIND_PHASE)}
            create_pod(fake, _tenant_pod("copy", copied, "node-0", gpus=1))
            create_pod(fake, _tenant_pod("copy-preset", copied, "node-0", gpus=1, node_name="node-0"))
            # the same with a foreign scheduler: not even watched
            create_pod(fake, _tenant_pod("copy-foreign", copied, "node-0", gpus=1, node_name="node-0",
                                         scheduler="default-scheduler"))
            await eventually(_seen(ext, fake, "copy"))
            await eventually(_seen(ext, fake, "copy-preset"))
            assert set(ext.svc.cache.state.bookings) == {"default/victim"}
            assert _usage(ext) == {"GPU-node-0-00": 8000}
            assert ext.svc.cache._rejected[fake.get_object("pods", "copy", "default")["metadata"]["uid"]] == MISMATCH
        async with extender(fake, keys=KEYS) as ext:  # a restart rebuilds the victim's booking only
            assert set(ext.svc.cache.state.bookings) == {"default/victim"}
    run(go)


def test_key_rotation_keeps_bookings_and_signs_again_with_the_active_key(fake_kube_api: FakeKubeAPI,
                                                                         tmp_path: Path) -> None:
    """Records signed with the old key verify while it is present; new binds use the active key;
    after the switch the extender signs the old records again, so the old key can go: a restart
    without it still books every pod."""
    fake = fake_kube_api
    create_nodes(fake, 1, gpus=2)
    d = _keydir(tmp_path / "keys", {"old": b"o" * 32}, "old")
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}))
    b = create_pod(fake, pod_obj("b", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 5000}))

    def sig(name: str) -> str:
        return str(fake.get_object("pods", name, "default")["metadata"]["annotations"][ANN_ALLOCATION_SIGNATURE])

    async def go() -> None:
        keys = KeyDir(d)
        async with extender(fake, keys=keys, config_poll=0.05) as ext:
            assert await bind(ext, a) == ""
            assert sig("a").startswith("v1:old:")
            _keydir(d, {"old": b"o" * 32, "new": b"n" * 32}, "old")  # staged
            await eventually(lambda: keys.current().kids == ("new", "old"))
            _keydir(d, {"old": b"o" * 32, "new": b"n" * 32}, "new")  # activated
            await eventually(lambda: keys.current().active == "new")
            assert set(ext.svc.cache.state.bookings) == {"default/a"}
            await eventually(lambda: sig("a").startswith("v1:new:"))  # signed again, same record
            assert await bind(ext, b) == ""
            assert sig("b").startswith("v1:new:")
            usage = _usage(ext)
            assert sorted(usage.values()) == [3000, 5000]
        for f in d.glob("key.old"):
            f.unlink()
        async with extender(fake, keys=KeyDir(d)) as ext:
            assert set(ext.svc.cache.state.bookings) == {"default/a", "default/b"}
            assert _usage(ext) == usage
    run(go)


def test_unsigned_records_are_adopted_only_under_the_upgrade_cutoff(fake_kube_api: FakeKubeAPI,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """scheduling.adoptUnsignedBefore: an unsigned record (as a pre-upgrade extender wrote it) of a
    pod bound, naming this scheduler and created before the cutoff is booked (checked against its
    request) and signed; one created after it, unbound, or of another scheduler is not."""
    fake = fake_kube_api
    caplog.set_level(logging.INFO, logger="kube_vgpu.cluster")
    create_nodes(fake, 1, gpus=4)
    cutoff = "2026-06-01T00:00:00Z"
    cfg = load_config_text(f"scheduling: {{bindHandoverSeconds: 0, adoptUnsignedBefore: '{cutoff}'}}")

    def old_pod(name: str, gpu: int, created: datetime, *, bound: bool = True, scheduler: str = "kube-vgpu-scheduler",
                mem: int = 2000) -> None:
        text = encode_allocation(PodAllocation("node-0", (ContainerAllocation("c", False, (
            DeviceBooking(f"GPU-node-0-{gpu:02d}", mem, 0),)),), 1.0))
        p = _tenant_pod(name, {ANN_ALLOCATION: text, ANN_BIND_PHASE: BIND_SUCCESS, ANN_BIND_TIME: "1",
                               ANN_ALLOCATED_CONTAINERS: "c"}, "node-0", scheduler=scheduler, gpus=1)
        p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "2000"
        clock = fake.store.clock
        fake.store.clock = lambda: created
        try:
            create_pod(fake, p)
        finally:
            fake.store.clock = clock
        if bound:
            client.CoreV1Api(fake.api_client()).create_namespaced_pod_binding(
                name, "default", {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                                  "target": {"apiVersion": "v1", "kind": "Node", "name": "node-0"}},
                _preload_content=False)

    before = datetime(2026, 5, 1, tzinfo=UTC)
    after = datetime(2026, 7, 1, tzinfo=UTC)
    old_pod("adopted", 0, before)
    old_pod("adopted-edited", 1, before, mem=500)  # an old edit below the request: the request is booked
    old_pod("too-new", 2, after)
    old_pod("unbound", 3, before, bound=False)
    old_pod("foreign", 3, before, scheduler="default-scheduler")

    def signed(name: str) -> bool:
        p = fake.get_object("pods", name, "default")
        ann = p["metadata"]["annotations"]
        return verify_allocation(KEYS, ann.get(ANN_ALLOCATION_SIGNATURE), p["metadata"]["uid"], "node-0",
                                 ann.get(ANN_BIND_TIME), ann[ANN_ALLOCATION]).ok

    async def go() -> None:
        async with extender(fake, config=cfg, keys=KEYS) as ext:
            assert set(ext.svc.cache.state.bookings) == {"default/adopted", "default/adopted-edited"}
            assert _usage(ext) == {"GPU-node-0-00": 2000, "GPU-node-0-01": 2000}
            await eventually(lambda: signed("adopted") and signed("adopted-edited"))
            assert not any(signed(n) for n in ("too-new", "unbound", "foreign"))
            why = {getattr(r, "pod", ""): getattr(r, "error", "") for r in caplog.records}
            assert "not adopted: created 2026-07-01T00:00:00Z" in why["default/too-new"]
            assert "not adopted: the pod is not bound" in why["default/unbound"]
            assert "default/foreign" not in why  # another scheduler's pods are not watched at all
        # signed now: a restart without the option still books them
        async with extender(fake, keys=KEYS) as ext:
            assert set(ext.svc.cache.state.bookings) == {"default/adopted", "default/adopted-edited"}
    run(go)


def test_tenant_written_progress_is_ignored(fake_kube_api: FakeKubeAPI) -> None:
    """bind-phase / allocated-containers count only with the device plugin's progress signature: a
    tenant writing ``success`` (or a progress signature made with another key) on its just-bound pod
    changes nothing the extender books, and the device plugin still sees the pod as just bound
    (its container is still pending); the plugin's own signed progress is taken."""
    from deviceplugin.podmatch import pending_containers, trusted_view

    fake = fake_kube_api
    create_nodes(fake, 1, gpus=2)
    a = create_pod(fake, pod_obj("a", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}))

    def plugin_sees_pending() -> bool:
        views, refused = trusted_view([fake.get_object("pods", "a", "default")], "node-0", KEYS)
        assert not refused
        return [c.pod for c in pending_containers(views, "node-0")] == ["a"]

    async def go() -> None:
        async with extender(fake, keys=KEYS) as ext:
            assert await bind(ext, a) == ""
            cache = ext.svc.cache
            booked = cache.state.bookings["default/a"].allocation
            for forged in ({ANN_BIND_PHASE: BIND_SUCCESS, ANN_ALLOCATED_CONTAINERS: "c"},
                           {ANN_PROGRESS_SIGNATURE: sign_progress(KeyRing("test-1", {"test-1": b"g" * 32}),
                                                                  a["metadata"]["uid"], "x", BIND_SUCCESS, "c")}):
                fake.patch_object("pods", "a", {"metadata": {"annotations": forged}}, "default")
                await caught_up(ext, fake)
                assert cache.state.bookings["default/a"].allocation == booked
                assert plugin_sees_pending()
            ann = fake.get_object("pods", "a", "default")["metadata"]["annotations"]
            done = sign_progress(KEYS, a["metadata"]["uid"], ann[ANN_ALLOCATION_SIGNATURE], BIND_SUCCESS, "c")
            fake.patch_object("pods", "a", {"metadata": {"annotations": {ANN_PROGRESS_SIGNATURE: done}}}, "default")
            await caught_up(ext, fake)
            assert not plugin_sees_pending()
            assert cache.state.bookings["default/a"].allocation == booked
    run(go)


def test_signed_record_is_still_checked_against_the_pods_request() -> None:
    """A record the system signed is still held against the pod's own request (no booking below
    what the pod asks for), as for any record."""
    from kube_vgpu.cluster import ClusterCache
    from kube_vgpu.config import Config

    c = ClusterCache(Config(), keys=KEYS)
    c.on_node("ADDED", node_obj("n1", 2))
    text = encode_allocation(PodAllocation("n1", (ContainerAllocation("c", False, (
        DeviceBooking("GPU-n1-00", 10, 0),)),), 1.0))
    p = pod_obj("p", limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000})
    p["spec"]["nodeName"] = "n1"
    p["metadata"]["annotations"] = {ANN_ALLOCATION: text, ANN_BIND_TIME: "1",
                                    ANN_ALLOCATION_SIGNATURE: sign_allocation(KEYS, p["metadata"]["uid"], "n1", "1", text)}
    c.on_pod("ADDED", p)
    assert c.state.bookings["default/p"].allocation.usage() == {"GPU-n1-00": (4000, 0, 1)}
    assert decode_allocation(text).usage() == {"GPU-n1-00": (10, 0, 1)}


def test_cli_refuses_to_start_without_usable_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kube-vgpu scheduler`` and ``kube-vgpu device-plugin`` need --signing-keys-dir; a bad
    directory is a usage error (2) naming the file and what is allowed."""
    from deviceplugin.main import main as dp_main
    from scheduler.server import main as sched_main

    bad = _keydir(tmp_path / "bad", {"a": b"short"}, "a")
    for main, extra in ((sched_main, []), (dp_main, ["--node-name", "n1"])):
        assert main([*extra, "--signing-keys-dir", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "key.a" in err and "allowed: 32..4096" in err
        with pytest.raises(SystemExit) as e:
            main(extra)
        assert e.value.code == 2 and "--signing-keys-dir" in capsys.readouterr().err
    assert write_keys(tmp_path / "good").is_dir()
