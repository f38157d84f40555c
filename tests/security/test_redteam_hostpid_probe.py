"""Red team: the shim's host-pid learning and its memory probe (docs/shim.md "Host pids").

A process learns the pid NVML gives it by listing NVML's processes before and after its first context
creation; when several new pids appear it allocates a probe of a size it draws and keeps the pid whose
memory rose by that much. The pid drives the SM limiter: a wrong one makes the limiter count another
tenant's work as this process's (it is starved next to a busy neighbour, or runs unlimited next to an
idle one). These tests play a hostile neighbour and a tenant's own odd-but-legal use of the driver
(threads on two GPUs, fork, retried learning, a context current in the thread) against it, on the fake
driver and NVML (tests/fakes). Each process here is a separate container as the shim sees it (its own
accounting file); no PID namespace is needed: the shim's fallback is then the pid it sees, which is
also the truth, so any other pid it reports learning is a neighbour's.
"""

from __future__ import annotations

import queue
import re
import subprocess
import threading
from pathlib import Path

import pytest

from tests.libvgpu.shim_helpers import MIB, Toolchain, program_fixtures

SRC = Path(__file__).resolve().parent / "hostpid_redteam.c"
BEFORE = "processes on the device before this process's first context"
LEARNED = re.compile(r"NVML reports this process as pid (\d+)")
WAIT_S = 60  # a bound for a hung process, never a timing assumption: every wait is for an event


built, built_asan, any_build = program_fixtures(SRC, "hp-redteam")


class Proc:
    """A program under the shim, driven line by line: ``cmd`` writes a command and returns the reply on
    stdout; ``wait_err`` waits for the n-th stderr line (the shim's log) matching a pattern."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.p.pid
        self.out: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.out.put(line.rstrip("\n"))
        self.out.put("<eof>")

    def _pump_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            with self.cond:
                self.err.append(line)
                self.cond.notify_all()
        with self.cond:
            self.err.append("<eof>")
            self.cond.notify_all()

    def log(self) -> str:
        with self.cond:
            return "".join(self.err)

    def wait_err(self, needle: str, nth: int = 1) -> None:
        """Until the shim has logged ``needle`` ``nth`` times (AssertionError if the process ends first)."""
        with self.cond:
            ok = self.cond.wait_for(lambda: sum(needle in line for line in self.err) >= nth
                                    or "<eof>" in self.err, timeout=WAIT_S)
            assert ok and sum(needle in line for line in self.err) >= nth, (needle, "".join(self.err))

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def reply(self) -> str:
        r = self.out.get(timeout=WAIT_S)
        assert r != "<eof>", self.log()
        return r

    def cmd(self, line: str) -> str:
        self.send(line)
        return self.reply()

    def close(self) -> str:
        """Close stdin, wait for the exit (asserting 0) and return the rest of stdout."""
        assert self.p.stdin is not None
        self.p.stdin.close()
        rc = self.p.wait(timeout=WAIT_S)
        rest = []
        while (r := self.out.get(timeout=WAIT_S)) != "<eof>":
            rest.append(r)
        assert rc == 0, (rc, rest, self.log())
        return "\n".join(rest)


class Node:
    """One simulated GPU node: its state file, and the processes started on it (each its own container)."""

    def __init__(self, build: tuple[Toolchain, Path], tmp: Path, gpus: int = 1, memory_mib: int = 143771) -> None:
        self.tc, self.prog = build
        self.tmp = tmp
        self.state = tmp / "gpu.state"
        self.config = tmp / "gpus.conf"
        self.config.write_text("".join(f"gpu index={i} memory_mib={memory_mib}\n" for i in range(gpus)))
        self.procs: list[Proc] = []

    def start(self, name: str, *argv: str, **env: str) -> Proc:
        """``name`` names the container (its accounting file): processes of one container share it."""
        e = self.tc.env(FAKE_GPU_STATE=str(self.state), FAKE_NVML_CONFIG=str(self.config), LIBVGPU_LOG_LEVEL="4",
                        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.tmp / f"{name}.cache"), **env)
        p = Proc([str(self.prog), *argv], e)
        self.procs.append(p)
        return p

    def neighbour(self, name: str, dev: int = 0, kind: str = "hold", **env: str) -> Proc:
        """A neighbour container that creates a context on ``dev`` and holds it; returned once it has."""
        p = self.start(name, kind, str(dev), **env)
        assert p.reply().startswith("ready rc=0"), p.log()
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.p.poll() is None:
                if p.p.stdin and not p.p.stdin.closed:
                    p.p.stdin.close()
                try:
                    p.p.wait(timeout=WAIT_S)
                except subprocess.TimeoutExpired:  # a hung process: the test has failed already
                    p.p.kill()
                    p.p.wait()


def learned(p: Proc) -> list[int]:
    return [int(m) for m in LEARNED.findall(p.log())]


def together(node: Node, tenant_env: dict[str, str], neighbour_env: dict[str, str] | None = None
             ) -> tuple[Proc, Proc]:
    """A tenant and a neighbour container whose first contexts come up together (the fake holds the
    tenant's until both are listed, and the neighbour starts after the tenant listed NVML's processes,
    so the tenant sees both pids appear); returned once the tenant's context exists."""
    t = node.start("tenant", "steps", **tenant_env)
    t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
    t.send("ctx 0")
    t.wait_err(BEFORE, 1)
    n1 = node.neighbour("n1", 0, "hold", **(neighbour_env or {}))
    assert t.reply() == "ok ctx rc=0 current_is_new=1"
    return t, n1


def test_a_neighbour_appearing_when_learning_is_retried_is_not_taken(node: Node) -> None:
    # The tenant's first context comes up together with a neighbour's and the probe cannot tell them
    # apart (this driver reports no per-process memory). Its next context is created while another
    # neighbour starts: NVML already lists the tenant (its first context), so the one new pid is the
    # neighbour's. The shim took it as its own: the limiter then counted that neighbour's work.
    t = node.start("tenant", "steps")
    assert t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2").startswith("ok")
    assert t.cmd("env FAKE_NVML_USED_NA 1").startswith("ok")
    t.send("ctx 0")
    t.wait_err(BEFORE, 1)
    node.neighbour("n1")
    assert t.reply() == "ok ctx rc=0 current_is_new=1"
    t.wait_err("could not learn this process's NVML pid")
    assert "a memory probe could not tell them apart" in t.log(), t.log()
    assert learned(t) == [], t.log()
    # retried with per-process memory back: a probe over every listed pid tells its own apart
    assert t.cmd("env FAKE_NVML_USED_NA 0").startswith("ok")
    assert t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 3").startswith("ok")
    t.send("ctx 0")
    t.wait_err(BEFORE, 2)
    n2 = node.neighbour("n2")
    assert t.reply() == "ok ctx rc=0 current_is_new=1"
    t.close()
    assert n2.pid not in learned(t), (n2.pid, t.log())
    assert learned(t) == [t.pid], (t.pid, t.log())


@pytest.mark.parametrize("how", ["ctx", "primary"])
def test_the_probe_leaves_the_threads_current_context_alone(any_build: tuple[Toolchain, Path], tmp_path: Path,
                                                            how: str) -> None:
    # the probe runs in a context it pushes and pops: a context created with cuCtxCreate stays current,
    # a primary context retained while another is current leaves that one current
    node = Node(any_build, tmp_path)
    try:
        t = node.start("tenant", "steps")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
        t.cmd("env FAKE_NVML_USED_NA 1")
        t.send("ctx 0")
        t.wait_err(BEFORE, 1)
        node.neighbour("n1")
        assert t.reply() == "ok ctx rc=0 current_is_new=1"
        t.cmd("env FAKE_NVML_USED_NA 0")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 3")
        t.send(f"{how} 0")
        t.wait_err(BEFORE, 2)
        node.neighbour("n2")
        want = "ok ctx rc=0 current_is_new=1" if how == "ctx" else "ok primary rc=0 current_unchanged=1"
        assert t.reply() == want, t.log()
        if how == "ctx":  # the context stack is as the driver left it: one pop returns to the first context
            assert t.cmd("pop") == "ok pop rc=0 popped_last=1 prev_current=1", t.log()
        t.close()
        assert "a memory probe told its own apart" in t.log(), t.log()
        assert learned(t) == [t.pid], (t.pid, t.log())
    finally:
        node.stop()


def test_a_tenants_threads_on_two_gpus_do_not_mix_up_the_listing(any_build: tuple[Toolchain, Path],
                                                                  tmp_path: Path) -> None:
    # One thread creates the tenant's first context on GPU 0 (it comes up together with a neighbour's);
    # meanwhile a second thread starts a context on GPU 1, where another neighbour runs. The second
    # thread wrote the device to list into the shared state before waiting for the first thread: the
    # first then listed GPU 1's processes after its creation and took the neighbour there as its own.
    node = Node(any_build, tmp_path, gpus=2)
    try:
        on_gpu1 = node.neighbour("n-gpu1", dev=1)
        t = node.start("tenant", "steps")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
        assert t.cmd("bgctx 0") == "ok bgctx"
        t.wait_err(BEFORE, 1)
        assert t.cmd("blockedctx 1") == "ok blockedctx"  # the second thread waits on the first
        on_gpu0 = node.neighbour("n-gpu0", dev=0)
        assert t.cmd("join") == "ok join n=2 own_current=2"
        t.close()
        assert on_gpu1.pid not in learned(t) and on_gpu0.pid not in learned(t), t.log()
        assert learned(t) == [t.pid], (t.pid, t.log())
    finally:
        node.stop()


def test_fork_while_a_thread_learns_does_not_hang_the_child(node: Node) -> None:
    # A thread is inside its first context creation (learning its pid, which holds a lock until it
    # ends) when another thread forks. The child inherited that lock held by a thread it does not
    # have: its own first context creation waited for ever.
    t = node.start("tenant", "steps")
    t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
    assert t.cmd("bgctx 0") == "ok bgctx"
    t.wait_err(BEFORE, 1)
    t.send("fork")
    node.neighbour("n1")  # lets the learning thread finish
    assert t.reply() == "ok fork exited=1 status=0 signal=0", t.log()  # signal 14: alarm, the child hung
    assert t.cmd("join") == "ok join n=1 own_current=1"
    t.close()


def test_the_probe_fits_under_the_limit_with_the_contexts_cost(node: Node) -> None:
    # The probe was made before the new context's cost was charged: a tenant whose context already
    # took most of its limit held context + probe (up to 32 MiB more than its limit) during the probe.
    limit, ctx = 64, 60
    env = {"CUDA_DEVICE_MEMORY_LIMIT": f"{limit}m", "LIBVGPU_CONTEXT_COST": f"{ctx}m", "FAKE_CUDA_CTX_MIB": str(ctx)}
    t, _ = together(node, env, {"FAKE_CUDA_CTX_MIB": str(ctx)})
    peak = t.cmd("peak 0")
    # the probe's memory and its charge are both gone: the tenant is charged its context alone
    assert t.cmd("meminfo") == f"ok meminfo rc=0 used={ctx * MIB} total={limit * MIB}", t.log()
    t.close()
    assert "new pids around this process's context creation" in t.log(), t.log()
    m = re.fullmatch(r"ok peak bytes=(\d+)", peak)
    assert m and ctx * MIB <= int(m.group(1)) <= limit * MIB, (peak, t.log())
    assert all(p == t.pid for p in learned(t)), t.log()


def test_a_neighbour_mimicking_the_probe_is_never_taken(node: Node) -> None:
    # The neighbour watches NVML and copies, at once, every rise of another process's memory (the
    # probe's size is not secret once allocated). It lists first (newest first). Whatever it catches,
    # the tenant takes only a pid that matched each round and once more: its own, or none.
    t = node.start("tenant", "steps", FAKE_NVML_PROCS_REVERSED="1")
    t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
    t.send("ctx 0")
    t.wait_err(BEFORE, 1)
    m = node.neighbour("mimic", kind="mimic")
    assert t.reply() == "ok ctx rc=0 current_is_new=1"
    t.close()
    out = m.close()
    assert re.search(r"mimicked=\d+", out), out
    assert m.pid not in learned(t), (m.pid, out, t.log())
    assert learned(t) in ([t.pid], []), t.log()


def test_many_threads_creating_contexts_at_once(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # 16 threads create contexts at the same moment while a neighbour's context comes up: one learns
    # (and probes), the others wait for it; every thread keeps its own context current
    node = Node(any_build, tmp_path)
    try:
        t = node.start("tenant", "steps")
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
        t.send("threads 16 0")
        t.wait_err(BEFORE, 1)
        n1 = node.neighbour("n1")
        assert t.reply() == "ok threads n=16 own_current=16", t.log()
        t.close()
        assert n1.pid not in learned(t), t.log()
        assert learned(t) == [t.pid], (t.pid, t.log())
    finally:
        node.stop()


def test_a_perfect_mimic_makes_learning_fail_never_take_its_pid(node: Node) -> None:
    # The strongest neighbour: the fake NVML shows every rise of the tenant's memory on the neighbour at
    # the same moment (FAKE_NVML_TWIN), as one that allocated each drawn size in step would. Both pids
    # match every round, so no single one is left: the tenant learns nothing (and falls back, as
    # documented) rather than the neighbour's pid.
    t, n1 = together(node, {"FAKE_NVML_TWIN": "1"})
    t.close()
    assert "2 new pids around this process's context creation; a memory probe could not tell them apart" in t.log()
    assert learned(t) == [], (n1.pid, t.log())


def test_killed_mid_probe_leaves_no_charge_behind(node: Node) -> None:
    # The tenant is SIGKILLed while its probe is allocated and charged (the fake NVML stalls the listing
    # the probe makes). The container's next process is charged its own context alone: the dead
    # process's context and probe are reclaimed with its slot, and the driver freed the memory.
    limit, ctx = 256, 60
    env = {"CUDA_DEVICE_MEMORY_LIMIT": f"{limit}m", "LIBVGPU_CONTEXT_COST": f"{ctx}m", "FAKE_CUDA_CTX_MIB": str(ctx)}
    t = node.start("tenant", "steps", **env)
    t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
    t.cmd(f"env FAKE_NVML_STALL_ABOVE_MIB {ctx}")  # a listing while more than the context is held
    t.send("ctx 0")
    t.wait_err(BEFORE, 1)
    node.neighbour("n1")
    t.wait_err("fake nvml: listing stalled")  # inside the probe: allocated and charged
    assert "new pids around this process's context creation" not in t.log()  # the probe has not ended
    t.p.kill()
    t.p.wait(timeout=WAIT_S)
    nxt = node.start("tenant", "steps", **env)  # the same container
    assert nxt.cmd("ctx 0") == "ok ctx rc=0 current_is_new=1", nxt.log()
    assert nxt.cmd("meminfo") == f"ok meminfo rc=0 used={ctx * MIB} total={limit * MIB}", nxt.log()
    nxt.close()


def test_a_neighbour_starting_together_is_not_charged_to_the_tenants_context(node: Node) -> None:
    # containers started together on one GPU (or a neighbour that allocates while it sees a new pid
    # appear): the tenant's measured context cost included the neighbour's context (600 MiB for its
    # own 300); it is now what NVML shows the tenant's own pid using
    ctx = 300
    t, _ = together(node, {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "FAKE_CUDA_CTX_MIB": str(ctx)},
                    {"FAKE_CUDA_CTX_MIB": str(ctx)})
    info = t.cmd("meminfo")
    t.close()
    assert info == f"ok meminfo rc=0 used={ctx * MIB} total={4096 * MIB}", (info, t.log())


def test_a_probe_the_driver_refuses_leaves_nothing_charged(any_build: tuple[Toolchain, Path], tmp_path: Path) -> None:
    # the GPU is full (two contexts and 1 MiB left): the probe's allocation fails, its charge is given
    # back, and the tenant learns nothing rather than guessing
    ctx = 300
    node = Node(any_build, tmp_path, memory_mib=2 * ctx + 1)
    try:
        t = node.start("tenant", "steps", CUDA_DEVICE_MEMORY_LIMIT="1g", LIBVGPU_CONTEXT_COST=f"{ctx}m",
                       FAKE_CUDA_CTX_MIB=str(ctx))
        t.cmd("env FAKE_CUDA_CTX_RENDEZVOUS 2")
        t.send("ctx 0")
        t.wait_err(BEFORE, 1)
        n1 = node.neighbour("n1", FAKE_CUDA_CTX_MIB=str(ctx))
        assert t.reply() == "ok ctx rc=0 current_is_new=1"
        assert t.cmd("peak 0") == f"ok peak bytes={ctx * MIB}"  # the driver never gave it the probe
        n1.close()  # then what the GPU has free no longer hides the tenant's charge
        node.start("reaper", "steps").close()  # the fake reclaims an exited process's memory when one starts
        assert t.cmd("meminfo") == f"ok meminfo rc=0 used={ctx * MIB} total={(2 * ctx + 1) * MIB}", t.log()
        t.close()
        assert "2 new pids around this process's context creation; a memory probe could not tell them apart" \
            in t.log(), t.log()
        assert learned(t) == [], t.log()
    finally:
        node.stop()


def test_a_smaller_neighbour_starting_together_does_not_lower_the_tenants_context_cost(node: Node) -> None:
    # the tenant's 500 MiB context comes up with a neighbour's 300 MiB one: the smallest rise (300) is
    # charged while the tenant learns its pid, then its own 500, so a neighbour cannot make a context
    # cheaper than it is
    t, _ = together(node, {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "FAKE_CUDA_CTX_MIB": "500"},
                    {"FAKE_CUDA_CTX_MIB": "300"})
    info = t.cmd("meminfo")
    t.close()
    assert info == f"ok meminfo rc=0 used={500 * MIB} total={4096 * MIB}", (info, t.log())
    # the cost it settles on is its own: measured so at once when the neighbour's context came up after
    # the measurement, else corrected to it once the pid is known (which of the two depends on how the
    # host schedules the two creations)
    costs = re.findall(r"context costs (\d+) bytes( \(this process's own\))?", t.log())
    assert costs and costs[-1][0] == str(500 * MIB), t.log()
    assert costs[-1][1] or len(costs) == 1, t.log()


def test_a_context_whose_pid_stays_unknown_is_charged_the_largest_rise(node: Node) -> None:
    # a perfect mimic keeps the tenant from learning its pid; its context (300 MiB) is then charged
    # the largest rise in NVML's list (the mimic shows the tenant's 300 on top of its own 300), never
    # the smallest, which could be a neighbour's smaller context
    t, _ = together(node, {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "FAKE_NVML_TWIN": "1"})
    info = t.cmd("meminfo")
    t.close()
    assert learned(t) == [], t.log()
    assert info == f"ok meminfo rc=0 used={600 * MIB} total={4096 * MIB}", (info, t.log())
    assert "(the largest rise: this process's pid is not known)" in t.log(), t.log()
