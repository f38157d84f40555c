"""Leader election on a ``coordination.k8s.io/v1`` Lease (client-go's LeaseLock semantics).

The holder renews ``spec.renewTime`` every ``retry_period`` seconds; another candidate takes over
once ``renewTime + leaseDurationSeconds`` has passed. Every write carries the Lease's
``resourceVersion``, so two candidates can never both win one round (the loser gets 409).
A holder that has not renewed for ``renew_deadline`` seconds stops considering itself leader
(before anyone else may take over, since renew_deadline < lease_duration).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from kube_vgpu.kubeapi import api_error_text
from kube_vgpu.views import EMPTY, ObjectView

from .kube import KubeAPI

log = logging.getLogger("kube_vgpu.scheduler.leader")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(s: str | None) -> float:
    if not s:
        return 0.0
    s = s.rstrip("Z")
    fmt = "%Y-%m-%dT%H:%M:%S.%f" if "." in s else "%Y-%m-%dT%H:%M:%S"
    return dt.datetime.strptime(s, fmt).replace(tzinfo=dt.UTC).timestamp()


@dataclass(eq=False)
class _LeaseRole:
    """What both lease kinds share: the Lease they read (``namespace``/``name``), how they call the
    API (``api``, ``run_blocking``: runs a blocking call off the event loop), the round period
    (``retry_period`` seconds), the last holder read, the ``on_change`` callback and the round loop."""

    api: KubeAPI
    namespace: str
    name: str
    _: KW_ONLY
    run_blocking: Callable[..., Any]
    retry_period: float = 2.0
    clock: Callable[[], float] = time.time
    holder: str | None = field(default=None, init=False)
    on_change: Callable[[bool], None] | None = field(default=None, init=False)
    _was_leader: bool = field(default=False, init=False)

    @property
    def is_leader(self) -> bool:
        raise NotImplementedError

    async def _rounds(self, step: Callable[[], bool], failed: str, stop: asyncio.Event,
                      extra: dict[str, Callable[[], Any]]) -> None:
        """Loop until ``stop`` is set: ``step`` (blocking) every ``retry_period`` seconds (an
        exception is logged as ``failed`` at debug level and the next round tries again); each change
        of ``is_leader`` is logged (with ``extra``'s fields, read then) and reported to ``on_change``."""
        while not stop.is_set():
            try:
                await self.run_blocking(step)
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.debug(failed, extra={"error": api_error_text(e)})
            lead = self.is_leader
            if lead != self._was_leader:
                self._was_leader = lead
                log.info("leadership changed", extra={"outcome": "leader" if lead else "follower",
                                                      **{k: f() for k, f in extra.items()}})
                if self.on_change is not None:
                    self.on_change(lead)
            try:
                await asyncio.wait_for(stop.wait(), self.retry_period)
            except TimeoutError:
                pass


@dataclass(eq=False)
class LeaseElector(_LeaseRole):
    """Acquire and hold one Lease. ``is_leader`` is read by the bind handler.

    identity: this replica (pod name + random suffix); lease_duration / renew_deadline /
    retry_period: seconds (client-go defaults 15 / 10 / 2); run_blocking: runs a blocking call off
    the event loop (the service's executor).
    """

    identity: str
    _: KW_ONLY
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    _last_renew: float = field(default=0.0, init=False)

    @property
    def is_leader(self) -> bool:
        """True while our last successful renew is younger than renew_deadline."""
        return self._last_renew > 0 and self.clock() - self._last_renew < self.renew_deadline

    def _spec(self, now: float, transitions: int, acquire: float) -> dict[str, Any]:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": _micro(acquire), "renewTime": _micro(now), "leaseTransitions": transitions}

    def try_acquire_or_renew(self) -> bool:
        """One round (blocking). Returns True if we hold the lease afterwards."""
        now = self.clock()
        lease = self.api.get_lease(self.namespace, self.name)
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, 0, now)}
            self.api.create_lease(self.namespace, body)
            self._last_renew = now
            self.holder = self.identity
            return True
        spec = ObjectView(lease).spec
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        renew = _parse_time(spec.get("renewTime"))
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder and holder != self.identity and now < renew + duration:
            return False
        acquire = _parse_time(spec.get("acquireTime")) if holder == self.identity else now
        if holder != self.identity:
            transitions += 1
        lease["spec"] = self._spec(now, transitions, acquire or now)
        self.api.replace_lease(self.namespace, self.name, lease)
        self._last_renew = now
        self.holder = self.identity
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Loop until ``stop`` is set; steps down (and releases nothing) when stopped."""
        # conflicts and API errors: retry next round
        await self._rounds(self.try_acquire_or_renew, "lease round failed", stop, {})


@dataclass(eq=False)
class LeaseFollower(_LeaseRole):
    """Follow kube-scheduler's own leader election instead of running a second one.

    The extender runs as a sidecar of kube-scheduler and kube-scheduler only calls its own sidecar,
    so the replica that must bind is the one whose kube-scheduler holds *its* Lease. kube-scheduler
    identities are ``<hostname>_<uuid>`` (client-go ``leaderelection``), and the sidecar shares the
    pod's hostname: this replica leads while the Lease ``name`` in ``namespace`` is held, unexpired,
    by an identity starting with ``<hostname>_``. A second, independent Lease could elect a sidecar
    whose kube-scheduler is not the leader, and then every bind would be refused.

    Same interface as :class:`LeaseElector` (``is_leader``, ``holder``, ``on_change``, ``run``).
    """

    hostname: str
    _valid_until: float = field(default=0.0, init=False)

    @property
    def is_leader(self) -> bool:
        """True while kube-scheduler in this pod holds its unexpired Lease (as last read)."""
        return self.clock() < self._valid_until

    def check(self) -> bool:
        """Read the Lease once (blocking). Returns whether this replica leads."""
        now = self.clock()
        lease = self.api.get_lease(self.namespace, self.name)
        spec = ObjectView(lease).spec if lease is not None else EMPTY
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        renew = _parse_time(spec.get("renewTime"))
        duration = float(spec.get("leaseDurationSeconds") or 0)
        ours = bool(holder) and (holder == self.hostname or holder.startswith(self.hostname + "_"))
        # Lead until the Lease would expire, but never longer than two polls past this read.
        self._valid_until = min(renew + duration, now + 2 * self.retry_period) if ours else 0.0
        return self.is_leader

    async def run(self, stop: asyncio.Event) -> None:
        """Poll the Lease every ``retry_period`` seconds until ``stop`` is set."""
        # API errors: leadership lapses by itself
        await self._rounds(self.check, "lease read failed", stop, {"holder": lambda: self.holder})
