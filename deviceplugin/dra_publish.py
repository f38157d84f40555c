"""Publish a node's GPUs as DRA ResourceSlices (``resource.k8s.io/v1``) and keep them current.

:class:`SlicePublisher` owns the pool named after its node for the driver
:data:`kube_vgpu.dra.DRIVER_NAME`: the slices :func:`kube_vgpu.dra.slices.resource_slices` builds.

* :meth:`SlicePublisher.publish` lists the pool's slices (field selector ``spec.nodeName`` and
  ``spec.driver``), and when they already say what the devices say, writes nothing (idempotent: a
  restart, a resync or a repeated call costs one list). Otherwise it bumps the pool generation,
  creates or replaces every slice (optimistic concurrency: a 409 re-reads and starts over) and then
  deletes slices the pool no longer needs, so consumers never see a generation without its slices.
* Unhealthy GPUs carry the NoSchedule device taint :data:`kube_vgpu.dra.TAINT_UNHEALTHY`
  (DRADeviceTaints, on by default in 1.36). A server with that gate off drops taints without an
  error: the publisher reads the written slice back, notices, and from then on leaves unhealthy GPUs
  out of the pool instead (``device_taints=False`` forces that from the start).
* Every slice has an ownerReference to the Node (its current UID), so the garbage collector
  deletes the slices when the Node goes; :meth:`SlicePublisher.remove` deletes them on purpose
  (uninstall, node drain).

API calls (the chart's RBAC for the node component): ``get`` nodes; ``list``, ``create``,
``update``, ``delete`` resourceslices. Errors from the API server propagate as
``kubernetes.client.ApiException`` (or urllib3 errors): a caller retries the whole call later,
which is safe because every call starts from what the server holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kube_vgpu.dra import DRIVER_NAME
from kube_vgpu.dra.slices import capacity_dropped, resource_slices, same_content, taints_dropped
from kube_vgpu.kubeapi import api_error_text, is_conflict, is_not_found, read_json
from kube_vgpu.model import GPUDevice
from kube_vgpu.views import ListView, NodeView, ObjectView

log = logging.getLogger("kube_vgpu.deviceplugin.dra_publish")

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceslices"
#: Conflicts (someone else wrote the pool between our list and our write) retried in one call.
MAX_CONFLICT_RETRIES = 5

Obj = dict[str, Any]


class PublishError(Exception):
    """Publishing could not finish: the Node does not exist, or the pool kept changing under us."""


def _name(s: Obj) -> str:
    """A ResourceSlice's ``metadata.name``."""
    return ObjectView(s).name


def _devices(s: Obj) -> list[Any]:
    """A ResourceSlice's ``spec.devices`` (empty when absent)."""
    return list(ObjectView(s).spec.get("devices") or ())


def _generation(s: Obj) -> int:
    try:
        return int((ObjectView(s).spec.get("pool") or {}).get("generation") or 0)
    except (TypeError, ValueError):
        return 0


class SlicePublisher:
    """Keeps node ``node_name``'s ResourceSlices equal to its GPUs.

    api: a ``kubernetes.client.ApiClient`` (from :func:`kube_vgpu.kubeapi.load_api_client`).
    driver_version: the NVIDIA driver version for the ``driverVersion`` attribute ("" = none).
    device_taints: True taints unhealthy GPUs, False leaves them out, None (default) taints them
    and falls back to leaving them out once the server is seen dropping taints.
    timeout: per-request timeout in seconds.
    """

    def __init__(self, api: Any, node_name: str, *, driver_version: str = "", device_taints: bool | None = None,
                 timeout: float = 10.0) -> None:
        from kubernetes import client

        self.node = node_name
        self.driver_version = driver_version
        self.device_taints = device_taints
        #: False once a written slice came back without allowMultipleAllocations (DRAConsumableCapacity
        #: off: every claim then takes a whole GPU); None until the first write.
        self.consumable_capacity: bool | None = None
        self.timeout = timeout
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ API calls

    def _owner(self) -> Obj:
        """The ownerReference to our Node. Raises PublishError when the Node does not exist."""
        try:
            node = read_json(self._core.read_node(self.node, _preload_content=False, _request_timeout=self.timeout))
        except Exception as e:
            if is_not_found(e):
                raise PublishError(f"node {self.node!r} not found: its ResourceSlices would have no owner") from e
            raise
        uid = NodeView(node).uid
        if not uid:
            raise PublishError(f"node {self.node!r} has no metadata.uid")
        return {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True}

    def current(self) -> list[Obj]:
        """The pool's slices on the server (ours: this node, this driver), sorted by name."""
        body: Any = self._custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, field_selector=f"spec.nodeName={self.node},spec.driver={DRIVER_NAME}",
            _request_timeout=self.timeout)
        items: list[Obj] = [s for s in ListView(body).items if self._ours(s)]  # never trust a server to filter
        return sorted(items, key=_name)

    def _ours(self, s: Obj) -> bool:
        spec = ObjectView(s).spec
        return spec.get("nodeName") == self.node and spec.get("driver") == DRIVER_NAME

    def _write(self, want: Obj, have: Obj | None) -> Obj:
        if have is None:
            out: Any = self._custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, want,
                                                                 _request_timeout=self.timeout)
            return dict(out)
        body = dict(want)
        wv = ObjectView(want)
        body["metadata"] = {**wv.meta, "resourceVersion": ObjectView(have).resource_version}
        out = self._custom.replace_cluster_custom_object(GROUP, VERSION, PLURAL, wv.name, body,
                                                         _request_timeout=self.timeout)
        return dict(out)

    def _delete(self, s: Obj) -> None:
        view = ObjectView(s)
        kw: dict[str, Any] = {"_request_timeout": self.timeout}
        if view.uid:  # only the slice we read, never one recreated meanwhile
            kw["body"] = {"preconditions": {"uid": view.uid}}
        try:
            self._custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, view.name, **kw)
        except Exception as e:
            if not is_not_found(e):
                raise

    # ------------------------------------------------------------------ public

    def publish(self, devices: Sequence[GPUDevice]) -> int:
        """Make the pool say what ``devices`` say (healthy or not). Returns the pool generation now
        in effect (unchanged when nothing needed writing).

        Raises PublishError (no Node, or the pool changed under us :data:`MAX_CONFLICT_RETRIES`
        times), ValueError for devices the API would refuse (kube_vgpu.dra.slices), or the API
        client's error.
        """
        with self._lock:
            for _ in range(MAX_CONFLICT_RETRIES):
                try:
                    gen, again = self._publish_once(devices)
                except Exception as e:
                    if is_conflict(e):
                        log.info("ResourceSlices changed meanwhile; re-reading",
                                 extra={"node": self.node, "error": api_error_text(e)})
                        continue
                    raise
                if not again:
                    return gen
            raise PublishError(f"node {self.node}: the ResourceSlices kept changing during "
                               f"{MAX_CONFLICT_RETRIES} attempts to publish")

    def _publish_once(self, devices: Sequence[GPUDevice]) -> tuple[int, bool]:
        """One list-compare-write pass: (generation in effect, whether to pass again)."""
        owner = self._owner()
        have = self.current()
        by_name = {_name(s): s for s in have}
        cur = max((_generation(s) for s in have), default=0)
        taint = self.device_taints is not False
        want = resource_slices(self.node, devices, pool_generation=cur, driver_version=self.driver_version,
                               taint_unhealthy=taint, owner=owner)
        if (len(have) == len(want) and all(_name(w) in by_name for w in want)
                and all(same_content(by_name[_name(w)], w) for w in want)
                and len({_generation(s) for s in have}) == 1):
            return cur, False
        gen = cur + 1
        want = resource_slices(self.node, devices, pool_generation=gen, driver_version=self.driver_version,
                               taint_unhealthy=taint, owner=owner)
        again = False
        for w in want:
            name, wanted = _name(w), _devices(w)
            got = self._write(w, by_name.get(name))
            if capacity_dropped(got) and wanted:
                if self.consumable_capacity is not False:
                    log.error("the API server dropped allowMultipleAllocations from a ResourceSlice: the "
                              "DRAConsumableCapacity feature gate is off, so each GPU goes whole to one claim",
                              extra={"node": self.node, "slice": name})
                self.consumable_capacity = False
            elif wanted:
                self.consumable_capacity = True
            if self.device_taints is None and taints_dropped(got, w):
                log.warning("the API server dropped the device taints of a ResourceSlice (DRADeviceTaints off): "
                            "unhealthy GPUs are left out of the pool instead", extra={"node": self.node, "slice": name})
                self.device_taints = False
                again = True
            elif self.device_taints is None and any(d.get("taints") for d in wanted):
                self.device_taints = True
        keep = {_name(w) for w in want}
        for s in have:
            if _name(s) not in keep:
                self._delete(s)
        log.info("published the node's GPUs as ResourceSlices",
                 extra={"node": self.node, "gpus": len(devices), "generation": gen})
        return gen, again

    def remove(self) -> int:
        """Delete every ResourceSlice of this node's pool. Returns how many were deleted. Raises the
        API client's error (a caller retries: slices already gone are skipped)."""
        with self._lock:
            have = self.current()
            for s in have:
                self._delete(s)
            if have:
                log.info("removed the node's ResourceSlices", extra={"node": self.node, "slices": len(have)})
            return len(have)

    def run(self, devices: Callable[[], Sequence[GPUDevice]], stop: threading.Event, wake: threading.Event,
            period: float = 60.0, retry: float = 5.0) -> None:
        """Publish ``devices()`` now, whenever ``wake`` is set (a health or inventory change) and every
        ``period`` seconds (a slice someone deleted comes back), until ``stop`` is set; a failed pass is
        logged and retried after ``retry`` seconds. Blocking: run it in a thread; to stop it, set
        ``stop`` and then ``wake``."""
        while not stop.is_set():
            wake.clear()
            try:
                self.publish(devices())
                wait = period
            except Exception as e:  # noqa: BLE001 - logged and retried; the pool is re-read each time
                log.warning("publishing the ResourceSlices failed",
                            extra={"node": self.node, "error": api_error_text(e)})
                wait = retry
            if stop.is_set():
                break
            wake.wait(wait)
