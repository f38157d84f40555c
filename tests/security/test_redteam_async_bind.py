"""Red-team tests of the extender's Binding sent from its event loop
(:class:`kube_vgpu.kubeapi.AsyncJSONClient`, :meth:`scheduler.bindcycle.BindCycle.write`), against
the fake kube-apiserver over real HTTP. The attacker can call ``/bind`` directly (the port has no
caller authentication) and the API server's answers can be lost. Every test ends with the books
equal to the cluster (``check_books``) and checks that no Binding of one attempt was sent twice.

Requests are held inside the fake API server with threading events (its hooks run on its own
thread); the tests wait on those events and on the bind calls, never on wall-clock sleeps."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from bind_support import bind, check_books, create_nodes, create_pod, extender, pod_obj
from vgpu_sched_util import wait_until

from kube_vgpu.resources import ANN_ALLOCATION
from tests.fakeapi import FakeKubeAPI

GPU_MIB = 24576
WAIT = 30.0  #: the longest a test waits for an event before failing (a bound, not a sleep)


def pod(fake: FakeKubeAPI, name: str, mib: int = 16000) -> dict[str, Any]:
    """A pod asking for ``mib`` of one GPU: two of them never fit one 24576 MiB GPU."""
    return create_pod(fake, pod_obj(name, limits={"nvidia.com/gpumem": mib}))


def bindings(fake: FakeKubeAPI, name: str) -> int:
    """How many Bindings of pod ``name`` the fake received."""
    return sum(1 for r in fake.request_log if r.method == "POST" and r.path.endswith(f"/pods/{name}/binding"))


class Gates:
    """Holds the Bindings of one pod inside the fake API server (before they are applied): the
    ``n``-th (from 1) until :meth:`open` ``(n)``; :meth:`wait` ``(n)`` returns once it got there."""

    def __init__(self, fake: FakeKubeAPI, name: str, count: int = 2):
        self.name, self.seen = name, 0
        self.arrived = [threading.Event() for _ in range(count)]
        self.release = [threading.Event() for _ in range(count)]
        fake.add_hook(self.hook)

    async def hook(self, info: Any) -> None:
        if info.verb != "create" or info.resource != "pods/binding" or info.name != self.name:
            return
        self.seen += 1
        n = self.seen - 1
        if n < len(self.arrived):
            self.arrived[n].set()
            await asyncio.get_running_loop().run_in_executor(None, self.release[n].wait, WAIT)

    async def wait(self, n: int) -> None:
        assert await asyncio.to_thread(self.arrived[n - 1].wait, WAIT), f"Binding {n} of {self.name} never came"

    def open(self, n: int) -> None:
        self.release[n - 1].set()

    def open_all(self) -> None:
        for e in self.release:
            e.set()


def test_second_bind_of_a_pod_while_its_binding_is_in_flight_is_refused(fake: FakeKubeAPI) -> None:
    """Attack: while the extender's Binding of pod ``a`` is in flight, POST /bind for ``a`` again
    (a replayed or forged request). Before the fix the second bind dropped the first one's booking
    and booked again; the first Binding then landed, the second got 409 and released its booking,
    and the events of the pod, seen while a bind was writing, were ignored: ``a`` ran with a signed
    record that nothing booked, so a second 16000 MiB pod fit the same 24576 MiB GPU. Now the
    second bind is refused without writing anything, and the books match the cluster."""
    create_nodes(fake, 1)
    a, b = pod(fake, "a"), pod(fake, "b")
    gates = Gates(fake, "a")

    async def go() -> None:
        async with extender(fake) as ext:
            svc = ext.svc
            await wait_until(lambda: svc.cache.pod_to_bind("default/a", a["metadata"]["uid"]) is not None)
            first = asyncio.create_task(bind(ext, a))
            await gates.wait(1)
            replay = asyncio.create_task(bind(ext, a))  # while the first Binding is held in the server
            # the replay is answered, or its own Binding is held too (then the first lands first)
            await wait_until(lambda: replay.done() or gates.arrived[1].is_set())
            gates.open(1)
            assert await first == ""
            gates.open(2)
            second = await replay
            assert second != "" and "in progress" in second, second
            assert bindings(fake, "a") == 1  # the replay wrote nothing
            assert "default/a" in svc.cache.state.bookings
            # the GPU is taken: the second pod must not fit
            err = await bind(ext, b)
            assert err != "", "a second 16000 MiB pod was placed on the 24576 MiB GPU"
            await wait_until(lambda: (svc.cache.pods.get("default/a") is not None
                                      and svc.cache.pods["default/a"].bound))
            check_books(fake, svc)

    asyncio.run(go())
    got = fake.get_object("pods", "a", "default")
    assert got is not None and got["spec"]["nodeName"] == "node-0" and ANN_ALLOCATION in got["metadata"]["annotations"]
