"""Shared by the bind attack and unknown-outcome tests: an extender served over real HTTP against
the in-process fake kube-apiserver, and the books-vs-cluster accounting every test ends with."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

_SCHED_TESTS = str(Path(__file__).resolve().parents[1] / "scheduler")
if _SCHED_TESTS not in sys.path:  # the scheduler tests' builders (capture-shaped Node/Pod JSON)
    sys.path.insert(0, _SCHED_TESTS)

from vgpu_sched_util import Extender, bind_args, node_obj, pod_obj  # noqa: E402

from kube_vgpu.codec import decode_allocation  # noqa: E402
from kube_vgpu.config import Config, load_config_text  # noqa: E402
from kube_vgpu.resources import ANN_ALLOCATION  # noqa: E402
from scheduler.kube import KubeAPI  # noqa: E402
from scheduler.service import Options, SchedulerService  # noqa: E402
from tests.fakeapi import FakeKubeAPI  # noqa: E402

__all__ = ["Extender", "bind_args", "node_obj", "pod_obj", "NO_HANDOVER", "extender", "create_nodes",
           "create_pod", "bind", "writes", "check_books"]

#: hand-over off: these tests are about bind outcomes, not about admission order on a node
NO_HANDOVER = load_config_text("apiVersion: kube-vgpu.io/v1\nscheduling: {bindHandoverSeconds: 0}\n")


@asynccontextmanager
async def extender(fake: FakeKubeAPI, config: Config = NO_HANDOVER, timeout: float = 10.0,
                   **opts: Any) -> AsyncIterator[Extender]:
    """A SchedulerService against ``fake`` (API calls time out after ``timeout`` s), served over
    HTTP, its caches synced. ``opts``: Options fields (and ``keys``, a shared signing key ring)."""
    keys = opts.pop("keys", None)
    o = Options(sync_wait=5.0, unknown_retry=opts.pop("unknown_retry", (0.05, 0.2)), **opts)
    svc = SchedulerService(config, KubeAPI(fake.api_client(), timeout=timeout), o,
                           **({"keys": keys} if keys is not None else {}))
    async with Extender(svc) as ext:
        await asyncio.wait_for(svc.synced.wait(), 10)
        yield ext


def create_nodes(fake: FakeKubeAPI, n: int, gpus: int = 1, **kw: Any) -> list[dict[str, Any]]:
    """Nodes ``node-0`` .. with our inventory (24576 MiB GPUs unless ``mem`` says otherwise)."""
    return [fake.create_object("nodes", node_obj(f"node-{i}", gpus, **kw)) for i in range(n)]


def create_pod(fake: FakeKubeAPI, pod: dict[str, Any]) -> dict[str, Any]:
    """Create ``pod`` (uid and resourceVersion are the server's); returns it as stored."""
    pod = dict(pod)
    pod["metadata"] = {k: v for k, v in pod["metadata"].items() if k not in ("uid", "resourceVersion")}
    return fake.create_object("pods", pod)


async def bind(ext: Extender, pod: dict[str, Any], node: str = "node-0") -> str:
    """POST /bind for ``pod`` as kube-scheduler would; returns the Error text ("" = bound)."""
    st, res = await ext.post("/bind", bind_args(pod, node))
    assert st == 200 and set(res) == {"Error"}, (st, res)
    return str(res["Error"])


def writes(fake: FakeKubeAPI) -> list[tuple[str, str]]:
    """The writes the fake received since its request log was last cleared (leases excluded)."""
    return [(r.method, r.path) for r in fake.request_log
            if r.method in ("POST", "PUT", "PATCH", "DELETE") and "/leases" not in r.path and "/events" not in r.path]


def check_books(fake: FakeKubeAPI, svc: SchedulerService) -> dict[str, int]:
    """0 overcommitted GPUs and 0 leaked bookings: what the extender books per GPU (MiB) is exactly
    what the live, bound pods' allocation records say, every booking belongs to such a pod, no
    GPU holds more than its memory, and no unbound pod carries a record (a record that books
    nothing). Returns the booked MiB per GPU uuid."""
    want: dict[str, int] = {}
    keys = set()
    for p in fake.objects("pods"):
        ann = p["metadata"].get("annotations") or {}
        text = ann.get(ANN_ALLOCATION)
        key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        if not text:
            continue
        assert p["spec"].get("nodeName"), f"pod {key} is not bound but carries an allocation record"
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        keys.add(key)
        for uuid, (mib, _, _) in decode_allocation(text).usage().items():
            want[uuid] = want.get(uuid, 0) + mib
    assert set(svc.cache.state.bookings) == keys, (set(svc.cache.state.bookings), keys)
    got: dict[str, int] = {}
    for n in svc.cache.state.node_list:
        for i, d in enumerate(n.devices):
            booked = d.memory_mib - n.free_mem[i]
            assert 0 <= booked <= d.memory_mib, f"GPU {d.uuid} overcommitted: {booked} of {d.memory_mib} MiB"
            if booked:
                got[d.uuid] = booked
    assert got == want, (got, want)
    assert not svc.cache.unresolved and not svc.cache.inflight
    return got
