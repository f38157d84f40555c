"""The order in which pods became bound to this node, as this plugin observed it.

kubelet admits pods in the order their ``spec.nodeName`` appeared in its pod watch (a watch on
``spec.nodeName=<node>``, i.e. etcd commit order of the Bindings). The ``kube-vgpu.io/bind-time``
annotation is written by the scheduler extender *before* it posts the Binding, so it does not give
that order when binds run concurrently. The plugin therefore runs the same watch and numbers pods as
it first sees them bound (:class:`ArrivalBook`); :mod:`deviceplugin.podmatch` orders pending
containers by these numbers.

* The first listing (the watcher's initial list, or whichever listing comes first) holds pods bound
  before the plugin looked: they get no number (``Arrival.seq is None``) and are ordered by their
  PodScheduled time, then bind time.
* Every pod seen later (watch event, relist after a broken watch, or the plugin's own listings in
  GetPreferredAllocation/Allocate when they are ahead of the watch) gets the next number; several new
  pods in one listing are numbered in the fallback order.
* Deleted pods are forgotten (DELETED events; pods missing from a relist).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kube_vgpu.kubeapi import Reflector
from kube_vgpu.views import PodView

from .kube import PodWatchClient
from .podmatch import Arrival, arrival_key

log = logging.getLogger("kube_vgpu.deviceplugin")


class ArrivalBook:
    """Thread-safe record of :class:`deviceplugin.podmatch.Arrival` per pod uid.

    node: pods whose ``spec.nodeName`` is not this node are ignored. clock: monotonic seconds.
    """

    def __init__(self, node: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self.clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._initialised = False
        self._by_uid: dict[str, Arrival] = {}

    @property
    def initialised(self) -> bool:
        return self._initialised

    def saw(self, pods: Iterable[Mapping[str, Any]], *, complete: bool = False) -> None:
        """Note ``pods`` (API JSON). complete: the pods are a full listing of the node, so known pods
        missing from it are forgotten. The first call marks its pods as the initial list."""
        now = self.clock()
        bound = [v for v in map(PodView, pods) if v.node_name == self.node and v.uid]
        with self._lock:
            if complete:
                present = {v.uid for v in bound}
                for uid in [u for u in self._by_uid if u not in present]:
                    del self._by_uid[uid]
            new = [v for v in bound if v.uid not in self._by_uid]
            new.sort(key=lambda v: arrival_key(v, None))
            for v in new:
                if self._initialised:
                    self._seq += 1
                    self._by_uid[v.uid] = Arrival(self._seq, now)
                else:
                    self._by_uid[v.uid] = Arrival(None, now)
            self._initialised = True

    def forget(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)

    def snapshot(self) -> dict[str, Arrival]:
        with self._lock:
            return dict(self._by_uid)


class PodWatcher:
    """Keeps an :class:`ArrivalBook` current from a watch on the node's pods: the shared
    list+watch loop (:class:`kube_vgpu.kubeapi.Reflector`, in its daemon thread
    ``deviceplugin-podwatch``) on ``spec.nodeName=<node>``. Every (re)list is a complete listing of
    the node; watch events add (ADDED, MODIFIED) or forget (DELETED) pods. After errors it lists again
    after ``retry_seconds``, doubling up to ``max_retry_seconds`` while they persist; :meth:`stop`
    wakes and ends the open watch."""

    def __init__(self, kube: PodWatchClient, book: ArrivalBook, *, watch_timeout: int = 300,
                 retry_seconds: float = 1.0, max_retry_seconds: float = 30.0) -> None:
        self.book = book
        self.synced = threading.Event()
        self.reflector = Reflector(
            kube, "pods", on_replace=lambda items, _rv: book.saw(items, complete=True), on_event=self._event,
            on_synced=self.synced.set, field_selector=f"spec.nodeName={book.node}", watch_timeout=watch_timeout,
            backoff=(retry_seconds, max_retry_seconds), thread_name="deviceplugin-podwatch")

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self.book.saw([obj])
        elif kind == "DELETED":
            self.book.forget(PodView(obj).uid)

    def start(self) -> None:
        self.reflector.start()

    def alive(self) -> bool:
        return self.reflector.alive()

    def stop(self, join: float = 2.0) -> None:
        """Stop the watch thread: wake its blocked read (the thread closes the response itself, see
        :mod:`kube_vgpu.streams`) and join it for up to ``join`` seconds."""
        self.reflector.stop(join)
