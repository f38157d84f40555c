"""libvgpu on a real GPU, in one script: prints one table and exits 1 on any miss (2 if it cannot run).

Usage, from the repository root, on a machine with an NVIDIA driver (root for the SM rows)::

    python3 benchmarks/gpu/gpu_check.py            # under 5 minutes on an H200

Only the Python standard library, gcc and the driver are needed. The shim (``libvgpu/src``) and the
probe program (``gpu_check.c``) are compiled into a temporary directory; the probe reaches
``libcuda.so.1`` and ``libnvidia-ml.so.1`` through ``dlopen`` + ``dlsym`` (no link-time ``-lcuda``),
as the CUDA runtime and PyTorch do.

Environment:

- ``VGPU_CHECK_FAKES=DIR``: run against the test fakes in DIR (``libcuda.so.1``, ``libnvidia-ml.so.1``
  as built by ``tests/fakes/build.py``) instead of the driver; a shared ``FAKE_GPU_STATE`` models one GPU.
  The SM rows are ``n/a`` there unless ``VGPU_CHECK_FAKE_SM=1`` (the fakes model tenants in their own
  PID namespaces, but their timing on a loaded machine is not the GPU's).
- ``VGPU_CHECK_SHIM=FILE``: check this shim instead of compiling ``libvgpu/src``.
- ``VGPU_CHECK_LIMIT_MIB``: the memory limit under test, default 4096.
- ``VGPU_CHECK_SM_SECONDS=WARM,MEASURE``: each SM tenant's warm-up and measured seconds, default ``3,8``
  (the unlimited reference run: a third of the warm-up, 3/8 of the measurement).

Rows (expected value -> measured):

- ``cuGetProcAddress`` without the shim hands out exported symbols' addresses, for every name the shim
  hooks (requested by its base name and by its own name, every CUDA version up to the driver's, with and
  without the per-thread-stream flag), and every hooked name the driver exports is reached that way;
  with the shim, every one of those requests returns the hook of exactly the symbol the driver picked.
- memory limit through ``cuMemAlloc`` (``cudaMalloc``'s driver call), VMM (``cuMemCreate``/``cuMemMap``,
  released while mapped), the NVML view (and ``nvidia-smi`` when installed) inside the limit,
  ``kill -9`` reclaim.
- graph memory nodes, without the shim: after a launch of a graph allocating ``GRAPH_MIB`` (and a stream
  synchronisation) the driver's graph pool (``cuDeviceGetGraphMemAttribute``) reports at least that much used
  and reserved; after ``cuMemFreeAsync`` (or a free node in the graph) less used but the reserve kept; after
  ``cuDeviceGraphMemTrim`` the reserve given back. With the shim: a graph allocating half the limit runs, one
  allocating the whole limit is refused with ``CUDA_ERROR_OUT_OF_MEMORY``.
- module memory: without the shim, a PTX module with a ``GRAPH_MIB`` ``.global`` array (a ``__device__`` array)
  raises NVML's used memory of the process by that much when loaded, and unloading gives it back; with the shim,
  a module holding half the limit is charged until unloaded, one holding 1.5x the limit is refused with
  ``CUDA_ERROR_OUT_OF_MEMORY`` and leaves nothing allocated.
- stacks grown at launch: without the shim, one launch of a PTX kernel with a ``STACK_FRAME`` local array per
  thread grows the context's stack (``cuCtxGetLimit``) to it and NVML's used memory of the process by about
  (frame - old stack) x threads per SM x SMs, kept after the launch; with the shim, a frame whose stack takes a
  quarter of the limit runs and is charged, one taking 1.5x the limit is refused with
  ``CUDA_ERROR_OUT_OF_MEMORY`` and takes nothing.
- VMM, without the shim: unreleased ``cuMemCreate`` memory (mapped or not) stays allocated when its context is
  destroyed, as the driver documents (NVML's used memory, the primary context kept), until it is unmapped and
  released; a handle ``cuMemRetainAllocationHandle`` retained keeps the memory after the first
  ``cuMemRelease``, until the second.
- PyTorch, when ``python3 -c "import torch"`` works with CUDA: the caching allocator and the
  ``cudaMallocAsync`` backend (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``) both get half the
  limit and an out-of-memory error for the whole limit more.
- SM accuracy: two tenants, each in its own PID namespace with its own /proc (``unshare --pid --fork``,
  a fresh proc mount, as a container without hostPID), 30/70 and 30/30,
  each a back-to-back spin-kernel loop; busy % = kernels/s over the unlimited rate; a miss is more than
  ``SM_TOLERANCE`` points from the limit.
- task priority: a priority-0 and a priority-1 tenant (``CUDA_TASK_PRIORITY``), neither with an SM
  limit, the same way: the priority-0 one keeps at least ``PRIO_HIGH_MIN`` % and the priority-1 one
  gives way (at most ``PRIO_LOW_MAX`` %).
- SM accuracy with real workloads, when PyTorch with CUDA is installed: the same 30/70 and 30/30
  mixes with 2048x2048 ``torch.matmul`` in a loop, and replayed from a CUDA Graph of 8 matmuls
  (``torch.cuda.CUDAGraph``: graph launches, not kernel launches, reach the driver).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIM_SRC = ROOT / "libvgpu" / "src"
MIB = 1024 * 1024
SM_TOLERANCE = 5.0  # percentage points
SM_MIXES = ((30, 70), (30, 30))
SM_WARM_S, SM_MEASURE_S = (os.environ.get("VGPU_CHECK_SM_SECONDS") or "3,8").split(",")
#: task priority rows: a priority-0 and a priority-1 tenant, no SM limits, on one GPU
PRIO_HIGH, PRIO_LOW = "SM priority 0 next to 1: the priority-0 tenant", "SM priority 0 next to 1: the priority-1 tenant"
PRIO_HIGH_MIN, PRIO_LOW_MAX = 80.0, 15.0  # busy % of the unlimited rate
TIMEOUT = 120.0  # seconds for any one probe run
#: inherited variables that would change what is checked
SCRUB = ("CUDA_DEVICE_", "CUDA_DISABLE_CONTROL", "GPU_CORE_UTILIZATION_POLICY", "LIBVGPU_", "FAKE_", "LD_PRELOAD")


@dataclass
class Row:
    """One line of the table; ``ok`` None means not applicable."""

    check: str
    expected: str
    measured: str
    ok: bool | None


class Setup:
    """Built probe and shim, and the environments the probe runs in."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.fakes = os.environ.get("VGPU_CHECK_FAKES")
        self.limit = int(os.environ.get("VGPU_CHECK_LIMIT_MIB", "4096")) * MIB
        cc = os.environ.get("CC", "gcc")
        if shutil.which(cc) is None:
            raise SystemExit(f"gpu_check: C compiler {cc!r} not found")
        self.probe = work / "gpu_check"
        _cc([cc, "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SHIM_SRC}", "-o", str(self.probe),
             str(HERE / "gpu_check.c"), "-ldl"])
        given = os.environ.get("VGPU_CHECK_SHIM")
        if given:
            self.shim = Path(given).resolve()
        else:
            self.shim = work / "libvgpu.so"
            _cc([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-fvisibility=hidden",
                 f"-I{SHIM_SRC}", "-o", str(self.shim), *sorted(str(p) for p in SHIM_SRC.glob("*.c")),
                 "-Wl,-Bsymbolic", "-ldl", "-lpthread"])

    def env(self, shim: bool, cache: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment of one probe run: fakes when asked, the shim preloaded when ``shim``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
        env["LIBVGPU_LOG_LEVEL"] = "1"
        if self.fakes:
            env["LD_LIBRARY_PATH"] = f"{self.fakes}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
            env["FAKE_GPU_STATE"] = str(self.work / "gpu.state")
            env["FAKE_CUDA_CTX_MIB"] = "300"
        if shim:
            env["LD_PRELOAD"] = str(self.shim)
            env["CUDA_DEVICE_MEMORY_LIMIT"] = str(self.limit)
            if cache is not None:
                env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(cache)
        env.update(extra)
        return env

    def run(self, args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> dict[str, str]:
        """Run the probe; returns its key=value tokens plus ``rc`` (``error`` holds a failure's output)."""
        try:
            p = subprocess.run([*(prefix or []), str(self.probe), *args], env=env, capture_output=True, text=True,
                               timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return {"rc": "timeout", "error": f"{args[0]} ran over {TIMEOUT:.0f} s"}
        out = parse(p.stdout)
        out["rc"] = str(p.returncode)
        if p.returncode:
            out["error"] = (p.stdout + p.stderr).strip().replace("\n", " | ")[-300:]
        return out


def _cc(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"gpu_check: build failed: {' '.join(cmd)}\n{p.stdout}{p.stderr}")


def parse(text: str) -> dict[str, str]:
    """Every ``key=value`` token of ``text`` (later keys win)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        for tok in line.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                out[k] = v
    return out


def mib(n: int | str) -> str:
    """Bytes as a MiB string."""
    return f"{int(n) / MIB:.0f} MiB"


# ----------------------------------------------------------------------------------------- rows
def procaddr_rows(s: Setup) -> list[Row]:
    """cuGetProcAddress: the driver's answers are exported addresses; the shim's are the same symbols' hooks."""

    def lines(shim: bool) -> tuple[dict[str, bool], dict[tuple[str, str, str], dict[str, str]], str]:
        p = subprocess.run([str(s.probe), "procaddr"], env=s.env(shim), capture_output=True, text=True,
                           timeout=TIMEOUT)
        hooked: dict[str, bool] = {}
        answers: dict[tuple[str, str, str], dict[str, str]] = {}
        for line in p.stdout.splitlines():
            kv = parse(line)
            if line.startswith("H "):
                hooked[kv["name"]] = kv["exported"] == "1"
            elif line.startswith("P "):
                answers[(kv["req"], kv["ver"], kv["flags"])] = kv
        err = "" if p.returncode == 0 and answers else f"probe exit {p.returncode}: {(p.stdout + p.stderr)[-200:]}"
        return hooked, answers, err

    hooked, drv, err = lines(False)
    if err:
        return [Row("cuGetProcAddress (driver)", "runs", err, False)]
    not_exported = [a for a in drv.values() if a["exported"] != "1"]
    reached = {a["sym"] for a in drv.values()}
    unreached = sorted(n for n, exp in hooked.items() if exp and n not in reached)
    rows = [
        Row("cuGetProcAddress (driver): exported addresses", f"{len(drv)} answers all exported",
            f"{len(drv) - len(not_exported)} exported"
            + (f"; not: {', '.join(a['req'] + '@' + a['ver'] + '->' + a['sym'] for a in not_exported[:4])}"
               if not_exported else ""), not not_exported),
        Row("cuGetProcAddress reaches every hooked name", f"{sum(hooked.values())} exported hooked names",
            f"{sum(hooked.values()) - len(unreached)} reached" + (f"; not: {', '.join(unreached[:6])}"
                                                                   if unreached else ""), not unreached),
    ]
    _, shim, err = lines(True)
    if err:
        rows.append(Row("cuGetProcAddress (shim): hook of the driver's symbol", "runs", err, False))
        return rows
    shim_lib = s.shim.name
    bad = []
    for key, a in drv.items():
        b = shim.get(key)
        want_lib = shim_lib if a["sym"] in hooked else a["lib"]
        if b is None or b["sym"] != a["sym"] or b["lib"] != want_lib:
            got = "none" if b is None else f"{b['sym']} in {b['lib']}"
            bad.append(f"{key[0]}@{key[1]}/f{key[2]}: {got}, want {a['sym']} in {want_lib}")
    extra = sorted(set(shim) - set(drv))
    bad += [f"{k[0]}@{k[1]}/f{k[2]}: answer the driver did not give" for k in extra]
    rows.append(Row("cuGetProcAddress (shim): hook of the driver's symbol", f"{len(drv)} answers match",
                    f"{len(drv) - len(bad)} match" + (f"; {'; '.join(bad[:3])}" if bad else ""), not bad))
    return rows


def memory_rows(s: Setup) -> list[Row]:
    """cuMemAlloc, VMM and the NVML view under the limit."""
    rows: list[Row] = []
    m = s.run(["mem", str(s.limit // MIB)], s.env(True, s.work / "mem.cache"))
    lim = s.limit
    if "total" not in m:
        rows.append(Row("cuMemAlloc under the limit", "runs", m.get("error", "no output"), False))
    else:
        tot, dev = int(m["total"]), int(m["devtotal"])
        view_ok = tot <= lim and dev == tot and int(m["free"]) <= tot
        rows.append(Row("cuMemGetInfo / cuDeviceTotalMem", f"total {mib(lim)} (or less)",
                        f"total {mib(tot)}, device {mib(dev)}, free {mib(m['free'])}", view_ok))
        rows.append(Row("cuMemAlloc: half the limit, then all of it", "0 then 2 (OUT_OF_MEMORY)",
                        f"{m['half']} then {m['all_more']}", m["half"] == "0" and m["all_more"] == "2"))
    v = s.run(["vmm", str(s.limit // MIB)], s.env(True, s.work / "vmm.cache"))
    want = {"create": "0", "map": "0", "release": "0", "while_mapped": "2", "unmap": "0", "after_unmap": "0"}
    got = " ".join(f"{k}={v.get(k, '?')}" for k in want)
    rows.append(Row("VMM: 60% mapped, released while mapped", "second 60% refused until unmapped", got,
                    all(v.get(k) == w for k, w in want.items())))
    rows += nvml_rows(s)
    return rows


def _holder(s: Setup, cache: Path, mib_: int) -> tuple[subprocess.Popen[str], str]:
    """Start a probe that allocates ``mib_`` MiB and waits; returns it and its ``held=`` rc."""
    p = subprocess.Popen([str(s.probe), "hold", str(mib_)], env=s.env(True, cache), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()  # blocks until the allocation is done (or the probe died)
    return p, parse(line).get("held", "none")


def nvml_rows(s: Setup) -> list[Row]:
    """NVML (and nvidia-smi) under the shim while another process of the container holds memory."""
    cache = s.work / "nvml.cache"
    hold = s.limit // MIB // 4
    p, held = _holder(s, cache, hold)
    try:
        n = s.run(["nvml"], s.env(True, cache))
        rows: list[Row] = []
        if "nvml_total" not in n:
            rows.append(Row("NVML memory inside the limit", "runs", n.get("error", "no output"), False))
        else:
            tot, used = int(n["nvml_total"]), int(n["nvml_used"])
            rows.append(Row("NVML memory inside the limit", f"total {mib(s.limit)}, used >= {hold} MiB held",
                            f"total {mib(tot)}, used {mib(used)} (held rc {held})",
                            held == "0" and tot == s.limit and hold * MIB <= used <= tot))
        smi = shutil.which("nvidia-smi")
        if s.fakes or smi is None:
            rows.append(Row("nvidia-smi inside the limit", "-", "fakes" if s.fakes else "nvidia-smi not installed",
                            None))
        else:
            q = subprocess.run([smi, "-i", "0", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
                               env=s.env(True, cache), capture_output=True, text=True, timeout=TIMEOUT)
            try:
                t_mib, u_mib = (int(x) for x in q.stdout.strip().splitlines()[0].split(","))
                ok = t_mib == s.limit // MIB and hold <= u_mib <= t_mib
                rows.append(Row("nvidia-smi inside the limit", f"total {s.limit // MIB} MiB",
                                f"total {t_mib} MiB, used {u_mib} MiB", ok))
            except (ValueError, IndexError):
                rows.append(Row("nvidia-smi inside the limit", "runs", (q.stdout + q.stderr)[-200:], False))
        return rows
    finally:
        p.kill()
        p.wait()


def reclaim_rows(s: Setup) -> list[Row]:
    """kill -9 of a process holding 60% of the limit gives its memory back to the next process."""
    cache = s.work / "kill.cache"
    part = s.limit // MIB * 6 // 10
    p, held = _holder(s, cache, part)
    while_alive = s.run(["alloc", str(part)], s.env(True, cache)).get("alloc", "none")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    after = s.run(["alloc", str(part)], s.env(True, cache)).get("alloc", "none")
    return [Row(f"kill -9 reclaim ({part} MiB twice)", "held 0, 2 while alive, 0 after kill -9",
                f"held {held}, {while_alive} while alive, {after} after", (held, while_alive, after) == ("0", "2", "0"))]


TORCH_PROBE = """
import sys, torch
lim = int(sys.argv[1])
assert torch.cuda.is_available()
a = torch.empty(lim // 2, dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(lim, dtype=torch.uint8, device="cuda")
    print("more=allowed")
except torch.cuda.OutOfMemoryError:
    print("more=oom")
"""


GRAPH_MIB = 1024  # MiB: each graph memory and VMM driver check's allocation
#: graph memory and VMM rows (the driver's behaviour the shim's accounting relies on)
GRAPH_LAUNCH = "graph memory: a launch fills the graph pool"
GRAPH_FREE_ASYNC = "graph memory: cuMemFreeAsync keeps the reserve, trim gives it back"
GRAPH_FREE_NODE = "graph memory: a free node keeps the reserve, trim gives it back"
GRAPH_LIMIT = "graph memory under the limit: half, then all of it"
VMM_CTX = "VMM: cuMemCreate memory outlives its context until released"
VMM_RETAIN = "VMM: a retained handle lives until its own cuMemRelease"
#: module memory rows: a module's __device__ globals are device memory the driver allocates when it is loaded
MOD_DRIVER = "module: a __device__ array is allocated at load, freed at unload"
MOD_LIMIT = "module under the limit: half charged, 1.5x refused"
#: stack rows: a kernel needing more local memory per thread than the stack makes the driver grow it at launch
STACK_FRAME = 64 * 1024  # bytes per thread of the driver check's kernel
STACK_DRIVER = "stack: a big-frame launch grows and keeps the context's stack"
STACK_LIMIT = "stack under the limit: a quarter charged, 1.5x refused"


def _num(kv: dict[str, str], key: str) -> int | None:
    """An integer token of a probe's output; None when missing, unreadable or NVML's "cannot tell" (~0)."""
    try:
        v = int(kv[key])
    except (KeyError, ValueError):
        return None
    return None if v < 0 or v >= 2**64 - 1 else v


def graph_rows(s: Setup) -> list[Row]:
    """Graph memory nodes: what the driver reports for its graph pool (cuDeviceGetGraphMemAttribute) around a
    launch, a free and cuDeviceGraphMemTrim, without the shim; then under the shim, a graph allocating half the
    limit runs and one allocating the whole limit is refused with CUDA_ERROR_OUT_OF_MEMORY."""
    n = GRAPH_MIB * MIB
    g = s.run(["graphmem", str(GRAPH_MIB)], s.env(False))
    rows: list[Row] = []
    keys = ("launched_used", "launched_reserved", "freed_used", "freed_reserved", "trimmed_reserved",
            "fn_launched_used", "fn_launched_reserved", "fn_trimmed_reserved")
    v = {k: _num(g, k) for k in keys}
    missing = [k for k, x in v.items() if x is None]
    if g["rc"] != "0" or missing:
        err = g.get("error") or f"unreadable: {', '.join(missing)}"
        rows += [Row(name, "runs", err, False) for name in (GRAPH_LAUNCH, GRAPH_FREE_ASYNC, GRAPH_FREE_NODE)]
    else:
        r = {k: x or 0 for k, x in v.items()}

        def nv(tag: str) -> str:
            x = _num(g, f"{tag}_nvml")
            return "NVML n/a" if x is None else f"NVML {mib(x)}"

        rows.append(Row(GRAPH_LAUNCH, f"launch 0; used and reserved >= {GRAPH_MIB} MiB",
                        f"launch {g.get('launch')}; used {mib(r['launched_used'])}, reserved "
                        f"{mib(r['launched_reserved'])} ({nv('base')} before, {nv('launched')})",
                        g.get("launch") == "0" and r["launched_used"] >= n and r["launched_reserved"] >= n))
        rows.append(Row(GRAPH_FREE_ASYNC, f"freed: used < {GRAPH_MIB} MiB, reserved >= {GRAPH_MIB} MiB; trimmed: "
                        f"reserved < {GRAPH_MIB} MiB",
                        f"free {g.get('free_async')}: used {mib(r['freed_used'])}, reserved {mib(r['freed_reserved'])};"
                        f" trim {g.get('trim')}: reserved {mib(r['trimmed_reserved'])} ({nv('trimmed')})",
                        g.get("free_async") == "0" and g.get("trim") == "0" and r["freed_used"] < n
                        and r["freed_reserved"] >= n and r["trimmed_reserved"] < n))
        rows.append(Row(GRAPH_FREE_NODE, f"launched: used < {GRAPH_MIB} MiB, reserved >= {GRAPH_MIB} MiB; "
                        f"trimmed: reserved < {GRAPH_MIB} MiB",
                        f"launch {g.get('fn_launch')}: used {mib(r['fn_launched_used'])}, reserved "
                        f"{mib(r['fn_launched_reserved'])}; trim {g.get('fn_trim')}: reserved "
                        f"{mib(r['fn_trimmed_reserved'])} ({nv('fn_trimmed')})",
                        g.get("fn_launch") == "0" and g.get("fn_trim") == "0" and r["fn_launched_used"] < n
                        and r["fn_launched_reserved"] >= n and r["fn_trimmed_reserved"] < n))
    lim = s.run(["graphlimit", str(s.limit // MIB)], s.env(True, s.work / "graph.cache"))
    if "graph_half" not in lim:
        rows.append(Row(GRAPH_LIMIT, "runs", lim.get("error", "no output"), False))
    else:
        rows.append(Row(GRAPH_LIMIT, "0 then 2 (OUT_OF_MEMORY)",
                        f"{lim['graph_half']} then {lim['graph_all']} (charged {mib(lim['charged_after_half'])} "
                        "after the first)", (lim["graph_half"], lim["graph_all"]) == ("0", "2")))
    return rows


def vmm_driver_rows(s: Setup) -> list[Row]:
    """Without the shim (NVML's used memory of the GPU): unreleased cuMemCreate memory (one handle mapped, one
    not) stays allocated when the context it was made in is destroyed (the driver documents that cuCtxDestroy does
    not free it; the shim keeps charging it) and goes once unmapped and released; a handle retained with
    cuMemRetainAllocationHandle keeps its memory until the second cuMemRelease."""
    n, tol = GRAPH_MIB * MIB, GRAPH_MIB * MIB // 4
    rows: list[Row] = []
    c = s.run(["vmmctx", str(GRAPH_MIB)], s.env(False))
    before, held, destroyed, released = (_num(c, k) for k in ("nvml_before", "nvml_held", "nvml_destroyed",
                                                              "nvml_released"))
    if c["rc"] != "0" or before is None or held is None or destroyed is None or released is None:
        rows.append(Row(VMM_CTX, "runs", c.get("error") or "NVML used memory unreadable", False))
    else:
        rows.append(Row(VMM_CTX, f"NVML +{GRAPH_MIB} MiB after cuCtxDestroy, back after release (within "
                        f"{tol // MIB} MiB)",
                        f"destroy {c.get('destroy')}; NVML before {mib(before)}, held {mib(held)}, destroyed "
                        f"{mib(destroyed)}, released {mib(released)} (unmap {c.get('unmap')}, releases "
                        f"{c.get('release_mapped')}/{c.get('release_unmapped')})",
                        c.get("destroy") == "0" and held >= before + n - tol and destroyed >= before + n - tol
                        and released <= before + tol))
    r = s.run(["retain", str(GRAPH_MIB)], s.env(False))
    vals = [_num(r, k) for k in ("nvml_base", "nvml_unmapped", "nvml_released_once", "nvml_released_twice")]
    if r["rc"] != "0" or any(x is None for x in vals):
        rows.append(Row(VMM_RETAIN, "runs", r.get("error") or "NVML used memory unreadable", False))
    else:
        base, unmapped, once, twice = (x or 0 for x in vals)
        rows.append(Row(VMM_RETAIN, f"+{GRAPH_MIB} MiB after the first release, back (within {tol // MIB} MiB) after "
                        "the second",
                        f"retain {r.get('retain')} (same handle {r.get('same_handle')}); NVML +{mib(unmapped - base)}"
                        f" unmapped, +{mib(once - base)} after release 1 ({r.get('release1')}), "
                        f"{mib(twice - base) if twice >= base else '-' + mib(base - twice)} after release 2 "
                        f"({r.get('release2')})",
                        (r.get("retain"), r.get("release1"), r.get("release2")) == ("0", "0", "0")
                        and unmapped >= base + n - tol and once >= base + n - tol and twice <= base + tol))
    return rows


def module_rows(s: Setup) -> list[Row]:
    """Module memory: without the shim, loading a PTX module with a ``GRAPH_MIB`` ``.global`` array (a
    ``__device__`` array) raises NVML's used memory of the process by at least that much and unloading gives it
    back (within a quarter of it); under the shim, a module holding half the limit is loaded and charged
    (``cuMemGetInfo``'s used memory rises by at least that much, and falls back at unload), and one holding 1.5x the
    limit is refused with ``CUDA_ERROR_OUT_OF_MEMORY``, leaving the process's NVML figure where it was."""
    n, tol = GRAPH_MIB * MIB, GRAPH_MIB * MIB // 4
    rows: list[Row] = []
    d = s.run(["modmem", str(GRAPH_MIB)], s.env(False))
    before, loaded, unloaded = (_num(d, k) for k in ("own_before", "own_loaded", "own_unloaded"))
    if d["rc"] != "0" or before is None or loaded is None or unloaded is None:
        rows.append(Row(MOD_DRIVER, "runs", d.get("error") or "NVML per-process used memory unreadable", False))
    else:
        rows.append(Row(MOD_DRIVER, f"load 0; NVML (this process) +{GRAPH_MIB} MiB loaded, back within "
                        f"{tol // MIB} MiB unloaded",
                        f"load {d.get('module_load')}, unload {d.get('module_unload')}; NVML before {mib(before)}, "
                        f"loaded {mib(loaded)}, unloaded {mib(unloaded)} (GPU: {d.get('dev_before')} -> "
                        f"{d.get('dev_loaded')} -> {d.get('dev_unloaded')} bytes)",
                        (d.get("module_load"), d.get("module_unload")) == ("0", "0") and loaded >= before + n
                        and unloaded <= before + tol))
    lim = s.run(["modlimit", str(s.limit // MIB)], s.env(True, s.work / "mod.cache"))
    used = [_num(lim, k) for k in ("used_before", "used_half", "used_unloaded")]
    own0, own1 = _num(lim, "own_before"), _num(lim, "own_after_big")
    if "mod_half" not in lim or any(x is None for x in used):
        rows.append(Row(MOD_LIMIT, "runs", lim.get("error", "no output"), False))
    else:
        u0, u1, u2 = (x or 0 for x in used)
        half = s.limit // 2
        leak_ok = own0 is None or own1 is None or own1 <= own0 + tol  # NVML may not tell
        rows.append(Row(MOD_LIMIT, f"0 (charged +{mib(half)}, back at unload) then 2 (OUT_OF_MEMORY), nothing left",
                        f"{lim['mod_half']} (charged +{mib(u1 - u0) if u1 >= u0 else '0 MiB'}, "
                        f"{mib(u2)} after unload) then {lim['mod_big']}; NVML (this process) {lim.get('own_before')} "
                        f"-> {lim.get('own_after_big')} bytes",
                        (lim["mod_half"], lim["mod_unload"], lim["mod_big"]) == ("0", "0", "2") and u1 >= u0 + half
                        and u2 <= u0 and leak_ok))
    return rows


def stack_rows(s: Setup) -> list[Row]:
    """Stacks grown at launch: without the shim, one launch of a kernel with a ``STACK_FRAME`` local array per
    thread reports that local size (``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``), leaves the context's stack size at
    least that (``cuCtxGetLimit``) and NVML's used memory of the process at least half of (frame - old stack) x
    threads per SM x SMs higher; under the shim, a frame taking a quarter of the limit runs and is charged
    (``cuMemGetInfo``'s used memory rises by frame x threads x SMs), one taking 1.5x the limit is refused with
    ``CUDA_ERROR_OUT_OF_MEMORY``, the process's NVML figure within 256 MiB of where it was."""
    rows: list[Row] = []
    d = s.run(["stack", str(STACK_FRAME)], s.env(False))
    nums = {k: _num(d, k) for k in ("local", "sms", "threads", "stack_before", "stack_after", "own_before",
                                    "own_after")}
    if d["rc"] != "0" or any(v is None for v in nums.values()):
        rows.append(Row(STACK_DRIVER, "runs", d.get("error") or "a figure unreadable (NVML per-process?)", False))
    else:
        n = {k: v or 0 for k, v in nums.items()}
        grow = max(STACK_FRAME - n["stack_before"], 0) * n["sms"] * n["threads"]
        rows.append(Row(STACK_DRIVER, f"launch 0; local >= {STACK_FRAME}; stack >= it; NVML +>= {mib(grow // 2)}",
                        f"launch {d.get('stack_launch')}; local {n['local']}; stack {n['stack_before']} -> "
                        f"{n['stack_after']}; NVML (this process) {mib(n['own_before'])} -> {mib(n['own_after'])}",
                        d.get("stack_launch") == "0" and n["local"] >= STACK_FRAME
                        and n["stack_after"] >= STACK_FRAME and n["own_after"] >= n["own_before"] + grow // 2))
    lim = s.run(["stacklimit", str(s.limit // MIB)], s.env(True, s.work / "stack.cache"))
    used = [_num(lim, k) for k in ("used_before", "used_small", "frame_small")]
    if "stack_small" not in lim or any(x is None for x in used):
        rows.append(Row(STACK_LIMIT, "runs", lim.get("error", "no output"), False))
    else:
        u0, u1, frame = (x or 0 for x in used)
        threads = (_num(d, "sms") or 0) * (_num(d, "threads") or 0)
        own1, own2 = _num(lim, "own_small"), _num(lim, "own_big")
        tol = 256 * MIB
        leak_ok = own1 is None or own2 is None or own2 <= own1 + tol  # NVML may not tell
        rows.append(Row(STACK_LIMIT, f"0 (charged +{mib(frame * threads)}) then 2 (OUT_OF_MEMORY), nothing taken",
                        f"{lim['stack_small']} (charged +{mib(u1 - u0) if u1 >= u0 else '0 MiB'}) then "
                        f"{lim['stack_big']}; NVML (this process) {lim.get('own_small')} -> {lim.get('own_big')} "
                        "bytes",
                        (lim["stack_small"], lim["stack_big"]) == ("0", "2") and threads > 0
                        and u1 >= u0 + frame * threads and leak_ok))
    return rows


def _torch_python(s: Setup) -> tuple[str | None, str]:
    """(python3 that imports torch with CUDA, "") or (None, why the PyTorch rows are n/a)."""
    py = shutil.which("python3")
    if s.fakes or py is None:
        return None, "fakes" if s.fakes else "python3 not installed"
    have = subprocess.run([py, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True,
                          timeout=TIMEOUT, env=s.env(False))
    return (py, "") if have.returncode == 0 else (None, "torch with CUDA not installed")


def torch_rows(s: Setup) -> list[Row]:
    """PyTorch's caching allocator and its cudaMallocAsync backend under the limit (n/a without torch)."""
    names = ("PyTorch caching allocator", "PyTorch cudaMallocAsync backend")
    py, why = _torch_python(s)
    if py is None:
        return [Row(n, "-", why, None) for n in names]
    rows: list[Row] = []
    for name, conf in zip(names, ("", "backend:cudaMallocAsync"), strict=True):
        env = s.env(True, s.work / f"torch{len(rows)}.cache")
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        p = subprocess.run([py, "-c", TORCH_PROBE, str(s.limit)], env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        got = parse(p.stdout).get("more", f"exit {p.returncode}: {p.stderr.strip()[-200:]}")
        rows.append(Row(name, "half the limit ok, the whole limit more -> OutOfMemoryError",
                        "as expected" if got == "oom" else got, p.returncode == 0 and got == "oom"))
    return rows


def _tenants(s: Setup, tag: str, envs: list[dict[str, str]], cmd: list[str] | None = None) -> list[dict[str, str]]:
    """Runs one spin-loop tenant per env at once, each as a container without hostPID (its own PID namespace
    and /proc; the fakes, which model the driver, find host pids in the host's /proc, kept at FAKE_HOST_PROC),
    each with its own accounting file; returns each one's parsed output ("error" on failure)."""
    ns = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--", "sh", "-c",
          '{ [ -z "$FAKE_HOST_PROC" ] || { mkdir -p "$FAKE_HOST_PROC" && mount --bind /proc "$FAKE_HOST_PROC"; }; } '
          '&& mount -t proc proc /proc && exec "$@"', "sh"]
    if os.geteuid() != 0:
        ns[1:1] = ["--user", "--map-root-user"]
    procs = []
    for i, extra in enumerate(envs):
        env = s.env(True, s.work / f"{tag}-{i}.cache", **extra)
        if s.fakes:
            env["FAKE_HOST_PROC"] = str(s.work / f"hostproc-{tag}-{i}")
        procs.append(subprocess.Popen([*ns, *(cmd or [str(s.probe), "spin", SM_WARM_S, SM_MEASURE_S])], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        kv = parse(out)
        if "kernels_per_s" not in kv:
            kv["error"] = out.strip()[-200:]
        results.append(kv)
    return results


TORCH_SM = """
import sys, time, torch
mode, warm, secs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
n = 2048
a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
c = torch.empty(n, n, device="cuda")
def step():
    torch.matmul(a, b, out=c)
run, per = step, 1
if mode == "graph":  # a CUDA Graph of 8 matmuls, replayed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()  # cuBLAS sets up its workspace before the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            step()
    run, per = g.replay, 8
def loop(t):
    k, end = 0, time.perf_counter() + t
    while time.perf_counter() < end:
        for _ in range(4):
            run()
        torch.cuda.synchronize()
        k += 4 * per
    return k
loop(warm)
t0 = time.perf_counter()
k = loop(secs)
print(f"kernels_per_s={k / (time.perf_counter() - t0)}")
"""
#: SM accuracy with real workloads (PyTorch): a matmul loop and a CUDA Graph replay of matmuls
TORCH_SM_MODES = (("matmul", "a matmul loop"), ("graph", "a CUDA Graph replay"))


def torch_sm_rows(s: Setup) -> list[Row]:
    """The SM mixes of :data:`SM_MIXES` with PyTorch tenants (2048x2048 matmuls in a loop, and replayed
    from a CUDA Graph), each in its own PID namespace: busy % of the unlimited rate against the limit."""
    names = [f"SM {a}/{b} {what}: tenant {i + 1} at {lim}%" for _, what in TORCH_SM_MODES for a, b in SM_MIXES
             for i, lim in enumerate((a, b))]
    py, why = _torch_python(s)
    if py is None:
        return [Row(n, "-", why, None) for n in names]
    if shutil.which("unshare") is None:
        return [Row(n, "-", "unshare not installed", False) for n in names]
    rows: list[Row] = []
    for mode, what in TORCH_SM_MODES:
        base = subprocess.run([py, "-c", TORCH_SM, mode, "2", "4"], env=s.env(False), capture_output=True, text=True,
                              timeout=TIMEOUT)
        rate = float(parse(base.stdout).get("kernels_per_s", "0") or 0)
        for mix in SM_MIXES:
            label = [f"SM {mix[0]}/{mix[1]} {what}: tenant {i + 1} at {lim}%" for i, lim in enumerate(mix)]
            if rate <= 0:
                rows += [Row(n, "-", f"unlimited run failed: {base.stderr.strip()[-200:]}", False) for n in label]
                continue
            got = _tenants(s, f"torch-{mode}-{mix[0]}-{mix[1]}", [{"CUDA_DEVICE_SM_LIMIT": str(lim)} for lim in mix],
                           [py, "-c", TORCH_SM, mode, "3", "8"])
            for name, lim, kv in zip(label, mix, got, strict=True):
                if "error" in kv:
                    rows.append(Row(name, f"{lim} ± {SM_TOLERANCE:.0f} %", f"failed: {kv['error']}", False))
                    continue
                busy = 100.0 * float(kv["kernels_per_s"]) / rate
                rows.append(Row(name, f"{lim} ± {SM_TOLERANCE:.0f} %", f"{busy:.1f} %",
                                abs(busy - lim) <= SM_TOLERANCE))
    return rows


def sm_rows(s: Setup) -> list[Row]:
    """Two tenants in separate PID namespaces; each one's busy % against its limit. Then task priority: a
    priority-0 and a priority-1 tenant without SM limits; the priority-1 one gives way."""
    names = [f"SM {a}/{b}: tenant {i + 1} at {lim}%" for a, b in SM_MIXES for i, lim in enumerate((a, b))]
    names += [PRIO_HIGH, PRIO_LOW]
    if s.fakes and not os.environ.get("VGPU_CHECK_FAKE_SM"):
        return [Row(n, "-", "fakes (VGPU_CHECK_FAKE_SM=1 runs them)", None) for n in names]
    if shutil.which("unshare") is None:
        return [Row(n, "-", "unshare not installed", False) for n in names]
    base = s.run(["spin", f"{float(SM_WARM_S) / 3:g}", f"{float(SM_MEASURE_S) * 3 / 8:g}"], s.env(False))
    if "kernels_per_s" not in base:
        return [Row(n, "-", f"unlimited run failed: {base.get('error', '')}", False) for n in names]
    rate = float(base["kernels_per_s"])
    rows: list[Row] = []
    for mix in SM_MIXES:
        got = _tenants(s, f"sm{mix[0]}-{mix[1]}", [{"CUDA_DEVICE_SM_LIMIT": str(lim)} for lim in mix])
        for i, (lim, kv) in enumerate(zip(mix, got, strict=True)):
            name = f"SM {mix[0]}/{mix[1]}: tenant {i + 1} at {lim}%"
            if "error" in kv:
                rows.append(Row(name, f"{lim} ± {SM_TOLERANCE:.0f}", f"failed: {kv['error']}", False))
                continue
            busy = 100.0 * float(kv["kernels_per_s"]) / rate
            rows.append(Row(name, f"{lim} ± {SM_TOLERANCE:.0f} %", f"{busy:.1f} %", abs(busy - lim) <= SM_TOLERANCE))
    got = _tenants(s, "prio", [{"CUDA_TASK_PRIORITY": "0"}, {"CUDA_TASK_PRIORITY": "1"}])
    for name, kv, expect, ok in ((PRIO_HIGH, got[0], f">= {PRIO_HIGH_MIN:.0f} %", lambda b: b >= PRIO_HIGH_MIN),
                                 (PRIO_LOW, got[1], f"<= {PRIO_LOW_MAX:.0f} %", lambda b: b <= PRIO_LOW_MAX)):
        if "error" in kv:
            rows.append(Row(name, expect, f"failed: {kv['error']}", False))
            continue
        busy = 100.0 * float(kv["kernels_per_s"]) / rate
        rows.append(Row(name, expect, f"{busy:.1f} %", ok(busy)))
    return rows


def table(rows: list[Row]) -> str:
    """The result table as aligned text."""
    head = ("check", "expected", "measured", "result")
    cells = [(r.check, r.expected, r.measured, "n/a" if r.ok is None else "PASS" if r.ok else "MISS") for r in rows]
    w = [max(len(c[i]) for c in [head, *cells]) for i in range(4)]
    fmt = " | ".join(f"{{:{n}}}" for n in w)
    return "\n".join([fmt.format(*head), "-+-".join("-" * n for n in w), *(fmt.format(*c) for c in cells)])


def main() -> int:
    """Build, run every check, print the table; 0 when nothing missed, 1 otherwise."""
    with tempfile.TemporaryDirectory(prefix="vgpu-check-") as tmp:
        s = Setup(Path(tmp))
        rows = (procaddr_rows(s) + memory_rows(s) + reclaim_rows(s) + graph_rows(s) + vmm_driver_rows(s)
                + module_rows(s) + stack_rows(s) + torch_rows(s) + sm_rows(s) + torch_sm_rows(s))
    print(f"libvgpu GPU check ({'fakes in ' + s.fakes if s.fakes else 'driver'}; limit {mib(s.limit)})")
    print(table(rows))
    missed = [r for r in rows if r.ok is False]
    print(f"{len(missed)} miss(es)" if missed else "all checks passed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
