"""``kube-vgpu certs signing-keys ensure`` against the in-process fake kube-apiserver: create,
idempotent re-runs, two-step rotation on an injected clock, removal of old keys only when no pod's
signature names them, concurrent runs, repair of a damaged key ring, and the directory mode. Every
key ring written is read back with the components' reader (kube_vgpu.signing)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from certs import main as certs_main
from certs import signing_keys as sk
from kube_vgpu.resources import ANN_ALLOCATION_SIGNATURE, ANN_PROGRESS_SIGNATURE
from kube_vgpu.signing import KeyRing, load_key_dir

NS, NAME = "kube-system", "kv-kube-vgpu-signing-keys"
T0 = datetime(2026, 12, 1, 3, 17, tzinfo=UTC)


def secret_entries(api: Any) -> dict[str, bytes]:
    s = api.get_object("secrets", NAME, NS)
    assert s is not None, "no key Secret"
    return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def ring(api: Any, tmp_path: Path) -> KeyRing:
    """The Secret as the extender and device plugin see it: mounted as files, read by KeyDir's loader."""
    d = tmp_path / f"mount-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    for k, v in secret_entries(api).items():
        (d / k).write_bytes(v)
    return load_key_dir(d)


def ensure(client: Any, now: datetime, *extra: str) -> dict[str, Any]:
    args = sk.build_parser().parse_args(["ensure", f"--secret={NS}/{NAME}", *extra])
    return sk.run(args, api=client, now=lambda: now)


def writes(api: Any) -> list[tuple[str, int | None]]:
    return [(r.verb, r.status) for r in api.request_log if r.resource == "secrets" and r.verb in ("create", "update")]


def signed_pod(api: Any, name: str, kid: str, key: str = ANN_ALLOCATION_SIGNATURE) -> None:
    api.create_object("pods", {"metadata": {"name": name, "namespace": "default",
                                            "annotations": {key: f"v1:{kid}:{'A' * 43}"}},
                               "spec": {"containers": [{"name": "c", "image": "busybox"}]}}, namespace="default")


# -- the command line ---------------------------------------------------------------------------

def test_cli_creates_then_is_idempotent(fake_kube_api: Any, fake_kubeconfig: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["signing-keys", "ensure", f"--secret={NS}/{NAME}", "--kubeconfig", fake_kubeconfig]
    assert certs_main.main(argv) == 0  # through `kube-vgpu certs`
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(first["keys"]) == 1 and first["changes"] == [f"created key {first['active']} (active)"]
    r = ring(fake_kube_api, tmp_path)
    assert r.active == first["active"] and len(r.keys[r.active]) == 32
    assert sk.kid_created(r.active) is not None
    s = fake_kube_api.get_object("secrets", NAME, NS)
    assert s["type"] == "Opaque" and s["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kube-vgpu-signing-keys"
    fake_kube_api.clear_requests()
    assert certs_main.main(argv) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again == {"changes": [], "active": first["active"], "keys": first["keys"], "kept": {}}
    assert writes(fake_kube_api) == []  # nothing written
    assert secret_entries(fake_kube_api) == {"active": r.active.encode(), f"key.{r.active}": r.keys[r.active]}


@pytest.mark.parametrize(("argv", "shown"), [
    (["ensure", "--secret", "no-slash"], "--secret 'no-slash': expected NAMESPACE/NAME"),
    (["ensure", "--secret", "a/B"], "expected NAMESPACE/NAME"),
    (["ensure", "--secret", "a/b", "--rotate-after-days", "0"], "--rotate-after-days 0: must be > 0"),
    (["ensure", "--secret", "a/b", "--keep-old-days", "-1"], "--keep-old-days -1: must be >= 0"),
    (["ensure", "--secret", "a/b", "--activate-after-seconds", "-5"], "--activate-after-seconds -5: must be >= 0"),
    (["ensure", "--secret", "a/b", "--rotate-after-days", "1", "--activate-after-seconds", "86400"],
     "--activate-after-seconds 86400 must be shorter than --rotate-after-days 1"),
])
def test_usage_errors_name_the_flag(argv: list[str], shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sk.main(argv) == 2
    assert shown in capsys.readouterr().err


def test_secret_or_dir_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        sk.main(["ensure"])
    assert e.value.code == 2 and "--secret" in capsys.readouterr().err


def test_api_error_exits_1(fake_kube_api: Any, fake_kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> None:
    fake_kube_api.fail_next("get", "secrets", status=403, count=None)
    assert sk.main(["ensure", f"--secret={NS}/{NAME}", "--kubeconfig", fake_kubeconfig]) == 1
    assert "signing keys failed" in capsys.readouterr().err


# -- rotation -----------------------------------------------------------------------------------

def test_rotation_stages_activates_and_removes_on_schedule(fake_kube_api: Any, fake_kube_client: Any,
                                                           tmp_path: Path) -> None:
    api = fake_kube_api
    first = ensure(fake_kube_client, T0)["active"]
    assert first.startswith("k20261201-031700-")
    assert ensure(fake_kube_client, T0 + timedelta(days=89, hours=23))["changes"] == []
    # due: a new key is staged, the old one still signs
    s = ensure(fake_kube_client, T0 + timedelta(days=90))
    (second,) = set(s["keys"]) - {first}
    assert s["changes"] == [f"staged key {second}"] and s["active"] == first
    r = ring(api, tmp_path)
    assert r.active == first and set(r.keys) == {first, second}
    assert sk.kid_created(second) == T0 + timedelta(days=90)
    # not yet activated: mounted copies may not have the new key yet
    assert ensure(fake_kube_client, T0 + timedelta(days=90, seconds=599))["changes"] == []
    s = ensure(fake_kube_client, T0 + timedelta(days=90, seconds=600))
    assert s["changes"] == [f"activated key {second}"] and s["active"] == second
    assert ring(api, tmp_path).active == second
    assert first in s["kept"] and "kept until 2027-03-31" in s["kept"][first]
    # the retired key stays while a pod's signature names it, past the grace period
    signed_pod(api, "old-record", first, ANN_PROGRESS_SIGNATURE)
    late = T0 + timedelta(days=120, seconds=1)
    s = ensure(fake_kube_client, late)
    assert s["changes"] == [] and s["kept"] == {first: "a pod's signature names it"}
    api.delete_object("pods", "old-record", "default", grace_period_seconds=0)
    s = ensure(fake_kube_client, late)
    assert s["changes"] == [f"removed key {first}"] and s["keys"] == [second]
    r = ring(api, tmp_path)
    assert set(r.keys) == {second} and r.active == second
    # the next rotation 90 days after the second key was made
    s = ensure(fake_kube_client, T0 + timedelta(days=180))
    assert len(s["keys"]) == 2 and s["active"] == second and s["changes"][0].startswith("staged key k20270530-")


def test_pods_not_listable_keeps_retired_keys(fake_kube_api: Any, fake_kube_client: Any) -> None:
    first = ensure(fake_kube_client, T0, "--activate-after-seconds=0")["active"]
    second = ensure(fake_kube_client, T0 + timedelta(days=90), "--activate-after-seconds=0")["active"]
    assert second != first
    fake_kube_api.fail_next("list", "pods", status=403, count=None)
    s = ensure(fake_kube_client, T0 + timedelta(days=200), "--activate-after-seconds=0")
    assert first in s["keys"] and s["kept"][first] == "pods could not be listed"


def test_pod_list_is_paged_and_reads_both_signatures(fake_kube_api: Any, fake_core_v1: Any) -> None:
    for i in range(5):
        signed_pod(fake_kube_api, f"p{i}", f"kid-{i}", ANN_ALLOCATION_SIGNATURE if i % 2 else ANN_PROGRESS_SIGNATURE)
    fake_kube_api.create_object("pods", {"metadata": {"name": "junk", "namespace": "default", "annotations": {
        ANN_ALLOCATION_SIGNATURE: "v2:x:y", ANN_PROGRESS_SIGNATURE: "nonsense"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}, namespace="default")
    fake_kube_api.clear_requests()
    assert sk.referenced_kids(sk.list_all_pods(fake_core_v1, page=2)) == {f"kid-{i}" for i in range(5)}
    assert len([r for r in fake_kube_api.request_log if r.verb == "list"]) == 3


def test_keep_old_counts_from_the_successor(fake_kube_client: Any) -> None:
    first = ensure(fake_kube_client, T0)["active"]
    ensure(fake_kube_client, T0 + timedelta(days=90))
    ensure(fake_kube_client, T0 + timedelta(days=91))  # activated a day after staging
    # 30 days after the successor was created: gone (no pod names it)
    s = ensure(fake_kube_client, T0 + timedelta(days=119, hours=23))
    assert first in s["keys"]
    s = ensure(fake_kube_client, T0 + timedelta(days=120))
    assert first not in s["keys"] and f"removed key {first}" in s["changes"]


# -- concurrency --------------------------------------------------------------------------------

class RacingStore(sk.SecretStore):
    """Before its first write, another run (a second Job) does its whole run."""

    def __init__(self, core: Any, other: Callable[[], Any]):
        super().__init__(core, NS, NAME)
        self.other: Callable[[], Any] | None = other

    def write(self, entries: dict[str, bytes]) -> None:
        if self.other is not None:
            other, self.other = self.other, None
            other()
        super().write(entries)


def test_concurrent_rotations_stage_one_key(fake_kube_api: Any, fake_kube_client: Any, fake_core_v1: Any,
                                            tmp_path: Path) -> None:
    first = ensure(fake_kube_client, T0)["active"]
    due = T0 + timedelta(days=90)
    other: dict[str, Any] = {}
    store = RacingStore(fake_core_v1, lambda: other.update(ensure(fake_kube_client, due)))
    fake_kube_api.clear_requests()
    mine = sk.ensure(store, sk.Policy(), lambda: due, None)
    assert writes(fake_kube_api) == [("update", 200), ("update", 409)]  # the other run won
    assert mine["changes"] == [] and mine["keys"] == other["keys"] and len(mine["keys"]) == 2
    r = ring(fake_kube_api, tmp_path)
    assert r.active == first and len(r.keys) == 2


def test_concurrent_creation_keeps_the_first_ring(fake_kube_api: Any, fake_kube_client: Any, fake_core_v1: Any,
                                                  tmp_path: Path) -> None:
    other: dict[str, Any] = {}
    store = RacingStore(fake_core_v1, lambda: other.update(ensure(fake_kube_client, T0)))
    mine = sk.ensure(store, sk.Policy(), lambda: T0, None)
    assert writes(fake_kube_api) == [("create", 201), ("create", 409)]
    assert mine == {**other, "changes": []}
    assert ring(fake_kube_api, tmp_path).active == other["active"]


def test_endless_conflicts_fail(fake_kube_api: Any, fake_core_v1: Any) -> None:
    fake_kube_api.fail_next("create", "secrets", status=409, count=None)
    with pytest.raises(sk.Conflict):
        sk.ensure(sk.SecretStore(fake_core_v1, NS, NAME), sk.Policy(), lambda: T0, None)


# -- repair -------------------------------------------------------------------------------------

def test_damaged_ring_is_repaired(fake_kube_api: Any, fake_kube_client: Any, tmp_path: Path) -> None:
    good = sk.new_kid(T0)
    data = {"active": b"NOT A KID", f"key.{good}": b"g" * 32, "key.short": b"s" * 31, "key.UPPER": b"u" * 32,
            "notes.txt": b"hello"}
    fake_kube_api.create_object("secrets", {"metadata": {"name": NAME}, "type": "Opaque",
                                            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}},
                                namespace=NS)
    s = ensure(fake_kube_client, T0 + timedelta(days=1))
    assert s["active"] == good and s["keys"] == [good]
    assert any("dropped active key id 'NOT A KID'" in c for c in s["changes"])
    assert any("dropped key short: 31 bytes" in c for c in s["changes"])
    assert any("dropped 'key.UPPER'" in c for c in s["changes"]) and any("dropped 'notes.txt'" in c for c in s["changes"])
    r = ring(fake_kube_api, tmp_path)  # the components' reader accepts it
    assert r.active == good and r.keys[good] == b"g" * 32


def test_ring_without_usable_key_gets_a_new_active_key(fake_kube_api: Any, fake_kube_client: Any,
                                                        tmp_path: Path) -> None:
    fake_kube_api.create_object("secrets", {"metadata": {"name": NAME}, "type": "Opaque",
                                            "data": {"active": base64.b64encode(b"gone").decode()}}, namespace=NS)
    s = ensure(fake_kube_client, T0)
    assert s["changes"] == [f"created key {s['active']} (active): no usable key was present"]
    assert ring(fake_kube_api, tmp_path).active == s["active"]


def test_hand_made_key_ids_are_kept(fake_kube_api: Any, fake_kube_client: Any) -> None:
    fake_kube_api.create_object("secrets", {"metadata": {"name": NAME}, "type": "Opaque", "data": {
        "active": base64.b64encode(b"manual").decode(), "key.manual": base64.b64encode(b"m" * 40).decode()}},
        namespace=NS)
    s = ensure(fake_kube_client, T0)  # its age is unknown: a new key is staged
    (new,) = set(s["keys"]) - {"manual"}
    assert s["active"] == "manual" and s["changes"] == [f"staged key {new}"]
    s = ensure(fake_kube_client, T0 + timedelta(days=400))
    assert s["active"] == new and "manual" in s["keys"] and "remove it by hand" in s["kept"]["manual"]


# -- directory mode and ids ---------------------------------------------------------------------

def test_directory_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "keys"
    base = ["ensure", "--dir", str(d), "--no-pod-check"]
    assert sk.main([*base, "--activate-after-seconds=0"]) == 0
    r = load_key_dir(d)
    assert {p.name for p in d.iterdir()} == {"active", f"key.{r.active}"}
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in d.iterdir())
    assert sk.main(base) == 0
    assert load_key_dir(d) == r
    # rotate and drop the old key at once (no cluster uses this directory)
    args = sk.build_parser().parse_args([*base, "--activate-after-seconds=0", "--keep-old-days=0"])
    later = datetime.now(UTC) + timedelta(days=91)
    s = sk.run(args, now=lambda: later)
    assert s["active"] != r.active and s["keys"] == [s["active"]]
    assert load_key_dir(d).active == s["active"] and not (d / f"key.{r.active}").exists()


def test_directory_mode_without_a_cluster_keeps_old_keys(tmp_path: Path) -> None:
    args = sk.build_parser().parse_args(["ensure", "--dir", str(tmp_path), "--activate-after-seconds=0",
                                         "--keep-old-days=0"])
    first = sk.run(args, now=lambda: T0)["active"]
    s = sk.run(args, now=lambda: T0 + timedelta(days=100))
    assert first in s["keys"] and s["kept"][first] == "pods could not be listed"


def test_key_ids() -> None:
    kid = sk.new_kid(T0)
    assert len(kid) <= 32 and kid.startswith("k20261201-031700-") and sk.kid_created(kid) == T0
    assert sk.kid_created("manual") is None and sk.kid_created("k20261399-000000-abcdef") is None
    assert sk.signature_kid(f"v1:{kid}:{'x' * 43}") == kid
    for bad in (None, 5, "", "v2:k:x", "v1:UPPER:x", "v1:a:b:c"):
        assert sk.signature_kid(bad) is None
