"""A stand-in for the node's device plugin in the bind tests: after each Binding it marks the pod's
device allocation done (``kube-vgpu.io/bind-phase: success`` and every GPU container in
``kube-vgpu.io/allocated-containers``), as the real one does once kubelet has called Allocate for
all of them. Binds never wait for it: it only moves pods past ``allocating`` like a node would."""

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
    ``marked``: pod name -> time.monotonic() when it was marked. Use as a context manager."""

    def __init__(self, fake: FakeKubeAPI, delay: float = 0.02, hold: set[str] | None = None):
        self.fake = fake
        self.delay = delay
        self.hold = set(hold or ())
        self.marked: dict[str, float] = {}
        self._due: list[tuple[float, int, str, str, float]] = []
        self._cv = threading.Condition()
        self._stop = False
        self._n = 0
        self._thread = threading.Thread(target=self._run, name="fake-device-plugin", daemon=True)
        fake.add_hook(self._hook)  # the fake keeps hooks; ours does nothing once stopped

    def _hook(self, info: Any) -> None:
        if self._stop or info.verb != "create" or info.resource != "pods/binding" or not info.name:
            return
        now = time.monotonic()
        with self._cv:
            self._n += 1
            heapq.heappush(self._due, (now + self.delay, self._n, info.namespace or "default", info.name,
                                       now + 5.0))
            self._cv.notify()

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
