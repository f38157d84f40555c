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

from .kube import PodStream, PodWatchClient
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
        bound = [p for p in pods if (p.get("spec") or {}).get("nodeName") == self.node
                 and (p.get("metadata") or {}).get("uid")]
        with self._lock:
            if complete:
                present = {p["metadata"]["uid"] for p in bound}
                for uid in [u for u in self._by_uid if u not in present]:
                    del self._by_uid[uid]
            new = [p for p in bound if p["metadata"]["uid"] not in self._by_uid]
            new.sort(key=lambda p: arrival_key(p, None))
            for p in new:
                if self._initialised:
                    self._seq += 1
                    self._by_uid[p["metadata"]["uid"]] = Arrival(self._seq, now)
                else:
                    self._by_uid[p["metadata"]["uid"]] = Arrival(None, now)
            self._initialised = True

    def forget(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)

    def snapshot(self) -> dict[str, Arrival]:
        with self._lock:
            return dict(self._by_uid)


class PodWatcher:
    """Keeps an :class:`ArrivalBook` current from a watch on the node's pods (a daemon thread).

    List, then watch from the list's resourceVersion; on any error or the end of a watch, list again
    (after errors: ``retry_seconds``, doubling up to ``max_retry_seconds`` while they persist).
    :meth:`stop` closes the open watch.
    """

    def __init__(self, kube: PodWatchClient, book: ArrivalBook, *, watch_timeout: int = 300,
                 retry_seconds: float = 1.0, max_retry_seconds: float = 30.0) -> None:
        self.kube = kube
        self.book = book
        self.watch_timeout = watch_timeout
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._stream: PodStream | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deviceplugin-podwatch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, join: float = 2.0) -> None:
        """Stop the watch thread: wake its blocked read (:meth:`PodStream.wake`; the thread closes
        the stream itself, see :mod:`kube_vgpu.streams`) and join it for up to ``join`` seconds."""
        self._stop.set()
        s = self._stream
        if s is not None:
            s.wake()
        if self._thread is not None:
            self._thread.join(timeout=join)

    def _run(self) -> None:
        node = self.book.node
        delay = self.retry_seconds
        while not self._stop.is_set():
            try:
                pods, rv = self.kube.list_node_pods_rv(node)
                self.book.saw(pods, complete=True)
                self.synced.set()
                stream = self.kube.watch_node_pods(node, rv, self.watch_timeout)
                self._stream = stream
                try:
                    if self._stop.is_set():
                        break
                    for etype, obj in stream:
                        delay = self.retry_seconds
                        if etype in ("ADDED", "MODIFIED"):
                            self.book.saw([obj])
                        elif etype == "DELETED":
                            self.book.forget((obj.get("metadata") or {}).get("uid", ""))
                        elif etype == "ERROR":
                            log.info("pod watch ended", extra={"reason": str(obj.get("message", obj))})
                            break
                        if self._stop.is_set():
                            break
                finally:
                    stream.close()  # this thread's own stream: closing never waits on a reader
            except Exception as e:  # noqa: BLE001 - any API failure: list again after a pause
                if self._stop.is_set():
                    break
                log.warning("pod watch failed, listing again", extra={"node": node, "retry_s": round(delay),
                                                                      "error": str(e)})
                self._stop.wait(delay)
                delay = min(delay * 2, self.max_retry_seconds)
            finally:
                self._stream = None
