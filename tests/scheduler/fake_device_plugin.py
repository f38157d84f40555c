"""A stand-in for the node's device plugin in the bind tests: after each Binding it marks the pod's
device allocation done (``kube-vgpu.io/bind-phase: success`` and every GPU container in
``kube-vgpu.io/allocated-containers``), as the real one does once kubelet has called Allocate for
all of them. Without it, binds of same-size pods to one node wait for the hand-over."""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any

from vgpu_sched_util import KEYS

from kube_vgpu.codec import decode_allocation
from kube_vgpu.resources import (
    ANN_ALLOCATED_CONTAINERS,
    ANN_ALLOCATION,
    ANN_ALLOCATION_SIGNATURE,
    ANN_BIND_PHASE,
    ANN_PROGRESS_SIGNATURE,
    BIND_ALLOCATING,
    BIND_SUCCESS,
)
from kube_vgpu.signing import KeyRing, sign_progress
from tests.fakeapi import FakeKubeAPI


def mark_allocated(fake: FakeKubeAPI, name: str, namespace: str = "default", keys: KeyRing = KEYS) -> bool:
    """Play the device plugin for one pod now: True if it was bound and ``allocating``. The
    progress is signed with ``keys`` (the extender trusts only signed progress)."""
    p = fake.get_object("pods", name, namespace)
    if p is None or not (p.get("spec") or {}).get("nodeName"):
        return False
    ann = p["metadata"].get("annotations") or {}
    if ann.get(ANN_BIND_PHASE) != BIND_ALLOCATING or ANN_ALLOCATION not in ann:
        return False
    names = ",".join(c.name for c in decode_allocation(ann[ANN_ALLOCATION]).containers if c.devices)
    sig = sign_progress(keys, p["metadata"]["uid"], ann.get(ANN_ALLOCATION_SIGNATURE, ""), BIND_SUCCESS, names)
    fake.patch_object("pods", name, {"metadata": {"annotations": {
        ANN_BIND_PHASE: BIND_SUCCESS, ANN_ALLOCATED_CONTAINERS: names, ANN_PROGRESS_SIGNATURE: sig}}}, namespace)
    return True


class FakeDevicePlugin:
    """Marks every pod bound through ``fake`` allocated ``delay`` s after its Binding request,
    except pods named in ``hold`` (they stay ``allocating`` until :func:`mark_allocated`).
    ``marked``: pod name -> time.monotonic() when it was marked. ``violations``: (pod, other pod)
    for each Binding made while another pod on the node still had a pending GPU container of the
    same GPU count (what the hand-over prevents). Use as a context manager."""

    def __init__(self, fake: FakeKubeAPI, delay: float = 0.02, hold: set[str] | None = None):
        self.fake = fake
        self.delay = delay
        self.hold = set(hold or ())
        self.marked: dict[str, float] = {}
        self.violations: list[tuple[str, str]] = []
        self._due: list[tuple[float, int, str, str, float]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._n = 0
        self._thread = threading.Thread(target=self._run, name="fake-device-plugin", daemon=True)
        fake.add_hook(self._hook)  # the fake keeps hooks; ours does nothing once stopped

    def _hook(self, info: Any) -> None:
        if self._stop or info.verb != "create" or info.resource != "pods/binding" or not info.name:
            return
        self._check(info.namespace or "default", info.name)
        now = time.monotonic()
        with self._cv:
            self._n += 1
            heapq.heappush(self._due, (now + self.delay, self._n, info.namespace or "default", info.name,
                                       now + 5.0))
            self._cv.notify()

    @staticmethod
    def _pending(p: dict[str, Any]) -> tuple[str, set[int]]:
        """(annotated node, GPU counts of containers not yet allocated) of an allocating pod."""
        ann = p["metadata"].get("annotations") or {}
        if ann.get(ANN_BIND_PHASE) != BIND_ALLOCATING or ANN_ALLOCATION not in ann \
                or p["metadata"].get("deletionTimestamp") or (p.get("status") or {}).get("phase") in ("Succeeded",
                                                                                                       "Failed"):
            return "", set()
        done = set((ann.get(ANN_ALLOCATED_CONTAINERS) or "").split(","))
        a = decode_allocation(ann[ANN_ALLOCATION])
        return a.node, {len(c.devices) for c in a.containers if c.devices and c.name not in done}

    def _check(self, ns: str, name: str) -> None:
        me = self.fake.get_object("pods", name, ns)
        if me is None:
            return
        node, counts = self._pending(me)
        if not counts:
            return
        for p in self.fake.objects("pods"):
            other = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            if other == f"{ns}/{name}" or p["spec"].get("nodeName") != node:
                continue
            if self._pending(p)[1] & counts:
                self.violations.append((f"{ns}/{name}", other))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(0.005 if self._due else 0.1)
                if self._stop:
                    return
                due, n, ns, name, give_up = heapq.heappop(self._due)
            if name in self.hold:
                continue
            if mark_allocated(self.fake, name, ns):
                self.marked[name] = time.monotonic()
            elif time.monotonic() < give_up:  # the Binding is still being processed: look again
                with self._cv:
                    heapq.heappush(self._due, (time.monotonic() + 0.01, n, ns, name, give_up))

    def __enter__(self) -> FakeDevicePlugin:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)
