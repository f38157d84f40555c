"""Bind throughput through a real control plane: vGPU pods against plain pods.

Needs ``KUBE_BIN_DIR`` (etcd, kube-apiserver, kube-scheduler; see tests/e2e/README.md); without it
prints one skip line and exits 0. Starts etcd + kube-apiserver (no kube-controller-manager), 50 fake
nodes x 8 GPUs, our webhook, extender (``--leader-elect=false``), one device plugin (node 0, with
the fake kubelet of tests/deviceplugin) and kube-scheduler with two profiles: ``default-scheduler``
(plain pods; the extender is asked only about pods naming its resources) and ours. The fake kubelet
loop of tests/e2e plays the kubelet on every node, for both phases alike (each bound pod is marked
Running, as kubelet would), and the device plugin's part on nodes 1-49 for vGPU pods; each phase
has its own loop, running only during that phase, so harness work is the same per pod.

Then, back to back: 200 plain pods, then 200 vGPU pods (``nvidia.com/gpu: 1, nvidia.com/gpumem:
1000``), each created by 16 threads at once; a watch records when each pod is first seen bound.
pods/s = pods / (last bind - first create). Prints both rates, ``vgpu/plain ratio: X``, and for the
vGPU phase: hand-over failures and race failures (the extender's ``binds_total{outcome="handover"}``
and ``{outcome="unschedulable"}``), Warning events on pods that ended up bound, and the extender's
CPU seconds per bound pod (utime + stime of its process from /proc/<pid>/stat). Diagnostics: how long
each phase's creates took, the CPU ms per pod of every process (control plane, components, this
process with the fake kubelet loop) in each phase, and the extender's mean filter/prioritize/bind
handler time (its *_seconds histograms) in the vGPU phase.

Third, unless ``--no-dra``: 200 DRA pods on the same nodes, published as ResourceSlices by
:class:`deviceplugin.dra_publish.SlicePublisher` (one device per GPU, consumable memory and cores),
each pod naming a ResourceClaim (``vgpu.kube-vgpu.io``, ``memory: 1000Mi``, ``cores: 10``) that the
same creating thread makes just before it (so the claim's create counts in the rate; no
kube-controller-manager is running to make claims from templates); ``default-scheduler`` allocates
them (no extender). Prints ``dra pods: ... pods/s`` and ``dra/plain ratio``.

Targets (docs/scheduler.md): vGPU >= 0.8 x plain, 0 hand-over failures, <= 2 race failures per 200
pods, 0 Warning events on bound pods, extender CPU <= 5 ms per pod. Nothing here asserts.

    KUBE_BIN_DIR=/path/to/bin python benchmarks/e2e_throughput.py [--pods 200] [--nodes 50] [--no-dra]

Profiling: with ``KV_BENCH_PYSPY=/tmp/ext.txt`` (and ``py-spy`` on PATH), py-spy samples the extender
during the vGPU phase and writes collapsed stacks there (``--format raw``; CPU figures then include
the sampling overhead); the webhook's and the device plugin's go to the same path + ``.webhook`` and
``.device-plugin``. ``KV_BENCH_PYSPY_ARGS``:
extra py-spy flags (e.g. ``--gil``: only the thread holding the GIL, i.e. Python CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "deviceplugin"))

GPUS, GPU_MEM, SPLIT = 8, 81920, 10
TARGETS = "targets: vgpu/plain >= 0.8, 0 hand-over failures, <= 2 race failures, 0 warnings on bound pods, <= 5 ms CPU/pod"


def uuid_of(node: int, gpu: int) -> str:
    return f"GPU-{node:08d}-b0b0-4000-8000-{gpu:012d}"


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (seconds), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def binds_by_outcome(port: int) -> dict[str, float]:
    """The extender's kube_vgpu_scheduler_binds_total by outcome (its /metrics on --port)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kube_vgpu_scheduler_binds_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(value)
    return out


def cpu_by_process(cp: Any, comps: Any) -> dict[str, float]:
    """CPU seconds so far of every control-plane and component process, and of this benchmark
    process (which also runs the fake kubelet loop)."""
    out = {"benchmark+kubelet": cpu_seconds(os.getpid())}
    for proc in list(cp.procs) + list(comps.procs.values()):
        if proc.p is not None and proc.p.poll() is None:
            out[proc.name] = cpu_seconds(proc.p.pid)
    return out


def cpu_delta(a: dict[str, float], b: dict[str, float], pods: int) -> str:
    """ms of CPU per pod by process between snapshots ``a`` and ``b``, largest first."""
    d = sorted(((b[k] - a.get(k, 0.0)) * 1000 / max(1, pods), k) for k in b)
    return ", ".join(f"{k} {v:.1f}" for v, k in reversed(d)) + f"; total {sum(v for v, _ in d):.1f}"


def handler_seconds(port: int) -> dict[str, tuple[float, float]]:
    """The extender's filter/prioritize/bind handler histograms: verb -> (sum seconds, count)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for verb in ("filter", "prioritize", "bind"):
            for part, i in (("_sum ", 0), ("_count ", 1)):
                if line.startswith(f"kube_vgpu_scheduler_{verb}_seconds{part}"):
                    out.setdefault(verb, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def plain_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{
        "name": "main", "image": "busybox", "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}}


def vgpu_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{
        "name": "main", "image": "busybox",
        "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"}}}]}}


def dra_claim(name: str) -> dict[str, Any]:
    """A ResourceClaim for 1000 MiB and 10% of one GPU of the kube-vgpu DRA driver."""
    from kube_vgpu.dra import CAPACITY_CORES, CAPACITY_MEMORY, DEVICE_CLASS

    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DEVICE_CLASS,
                "capacity": {"requests": {CAPACITY_MEMORY: "1000Mi", CAPACITY_CORES: "10"}}}}]}}}


def dra_pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
        "containers": [{"name": "main", "image": "busybox", "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"}, "claims": [{"name": "gpu"}]}}]}}


def publish_dra(api: Any, names: list[str]) -> None:
    """The chart's DeviceClass, and every node's GPUs as ResourceSlices (as the node component does)."""
    from kubernetes import client

    from deviceplugin.dra_publish import SlicePublisher
    from kube_vgpu.dra import DEVICE_CLASS, DRIVER_NAME
    from kube_vgpu.model import GPUDevice

    client.CustomObjectsApi(api).create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER_NAME}'"}}]}})
    for n, name in enumerate(names):
        SlicePublisher(api, name).publish([GPUDevice(uuid=uuid_of(n, i), index=i, model="NVIDIA H200",
                                                     memory_mib=GPU_MEM) for i in range(GPUS)])


class BindWatch:
    """Watches a namespace's pods; records the monotonic time each pod is first seen bound."""

    def __init__(self, core: Any, ns: str, want: int) -> None:
        self.core, self.ns, self.want = core, ns, want
        self.bound: dict[str, float] = {}
        self.done = threading.Event()
        self._rv = core.list_namespaced_pod(ns).metadata.resource_version  # before any create
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        rv = self._rv
        while not self.done.is_set():
            w = watch.Watch()
            for ev in w.stream(self.core.list_namespaced_pod, self.ns, resource_version=rv, timeout_seconds=60):
                p = ev["object"]
                rv = p.metadata.resource_version
                if p.spec.node_name and p.metadata.name not in self.bound:
                    self.bound[p.metadata.name] = time.monotonic()
                    if len(self.bound) >= self.want:
                        self.done.set()
                        w.stop()


def run_phase(core: Any, ns: str, make: Any, n: int, timeout: float) -> tuple[float, float, set[str]]:
    """Create ``n`` pods (16 threads) and wait until all are bound. Returns (pods/s, seconds, bound)."""
    bw = BindWatch(core, ns, n)
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda i: core.create_namespaced_pod(ns, make(f"p-{i:03d}")), range(n)))
    created = time.monotonic() - t0
    bw.done.wait(timeout)
    print(f"  {ns}: {n} creates took {created:.2f} s")
    got = dict(bw.bound)
    if len(got) < n:
        print(f"  only {len(got)}/{n} bound after {timeout:.0f} s")
    took = (max(got.values()) - t0) if got else float("inf")
    return (len(got) / took if got else 0.0), took, set(got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each phase's binds")
    ap.add_argument("--no-dra", action="store_true", help="skip the DRA phase")
    ap.add_argument("--all-feasible-nodes", action="store_true",
                    help="run the extender with --filter-best-node=false (filter answers every feasible node, "
                         "prioritize scores them)")
    args = ap.parse_args()
    if not os.environ.get("KUBE_BIN_DIR"):
        print("e2e_throughput: skipped (set KUBE_BIN_DIR to kube-apiserver, kube-scheduler and etcd binaries)")
        return 0
    from dp_helpers import FakeKubelet
    from kubernetes import client, config

    from tests.e2e.cluster import (
        SCHEDULER_NAME,
        Components,
        ControlPlane,
        KubeletLoop,
        create_gpu_nodes,
        create_namespace,
        wait_for,
    )

    work = Path(tempfile.mkdtemp(prefix="kv-e2e-bench-"))
    sockdir = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
    cp = ControlPlane(work, controller_manager=False)
    comps = Components(cp, work)
    fk: FakeKubelet | None = None
    loop: KubeletLoop | None = None
    try:
        cp.start()
        assert cp.kubeconfig is not None
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        core: Any = client.CoreV1Api(api)
        adm: Any = client.AdmissionregistrationV1Api(api)
        # the chart's defaults: the policy file names only the scheduler
        comps.policy.write_text(f"apiVersion: kube-vgpu.io/v1\nschedulerName: {SCHEDULER_NAME}\n")
        names = [f"bench-node-{i:02d}" for i in range(args.nodes)]
        create_gpu_nodes(core, names, GPUS, GPU_MEM, SPLIT, uuid_of)
        for ns in ("bench-plain", "bench-vgpu", "bench-dra"):
            create_namespace(core, ns)
        _, fk = comps.start_gpu_node(names[0], sockdir, [uuid_of(0, i) for i in range(GPUS)], GPU_MEM)
        comps.start_webhook()
        adm.create_mutating_webhook_configuration(comps.webhook_configuration("bench-vgpu"))
        comps.start_extender(*(["--filter-best-node=false"] if args.all_feasible_nodes else []))
        comps.start_kube_scheduler(plain_profile=True)
        plain_loop = KubeletLoop(core, "bench-plain", names[0], fk, comps.signing_keys)
        loop = KubeletLoop(core, "bench-vgpu", names[0], fk, comps.signing_keys)
        probe = vgpu_pod("probe")
        wait_for(lambda: core.create_namespaced_pod("bench-vgpu", probe, dry_run="All").spec.scheduler_name
                 == SCHEDULER_NAME, 60, "the webhook configuration in effect")

        ext = comps.procs["extender"]
        assert ext.p is not None
        idle0, t_idle0 = cpu_seconds(ext.p.pid), time.monotonic()
        all0 = cpu_by_process(cp, comps)
        plain_loop.start()
        plain_rate, plain_s, _ = run_phase(core, "bench-plain", plain_pod, args.pods, args.timeout)
        print(f"  CPU ms per plain pod by process: {cpu_delta(all0, cpu_by_process(cp, comps), args.pods)}")
        plain_loop.stop()
        loop.start()
        print(f"plain pods: {args.pods} in {plain_s:.2f} s = {plain_rate:.1f} pods/s", flush=True)
        print(f"extender CPU during the plain phase (not asked about plain pods): "
              f"{(cpu_seconds(ext.p.pid) - idle0) / (time.monotonic() - t_idle0) * 1000:.0f} ms/s")
        spy = None
        if os.environ.get("KV_BENCH_PYSPY"):  # opt-in: py-spy samples the extender during the vGPU phase
            spy = subprocess.Popen(["py-spy", "record", *os.environ.get("KV_BENCH_PYSPY_ARGS", "").split(), "--format", "raw", "-r", "250", "--pid",
                                    str(ext.p.pid), "-o", os.environ["KV_BENCH_PYSPY"]])
            wh = comps.procs["webhook"].p
            assert wh is not None
            spy_wh = subprocess.Popen(["py-spy", "record", *os.environ.get("KV_BENCH_PYSPY_ARGS", "").split(), "--format", "raw", "-r", "250", "--pid",
                                       str(wh.pid), "-o", os.environ["KV_BENCH_PYSPY"] + ".webhook"])
            dp = comps.procs["device-plugin"].p
            assert dp is not None
            spy_dp = subprocess.Popen(["py-spy", "record", *os.environ.get("KV_BENCH_PYSPY_ARGS", "").split(), "--format", "raw", "-r", "250", "--pid",
                                       str(dp.pid), "-o", os.environ["KV_BENCH_PYSPY"] + ".device-plugin"])
            time.sleep(2)  # let it attach
        cpu0, binds0 = cpu_seconds(ext.p.pid), binds_by_outcome(comps.extender_port)
        lat0 = handler_seconds(comps.extender_port)
        all0 = cpu_by_process(cp, comps)
        vgpu_rate, vgpu_s, bound = run_phase(core, "bench-vgpu", vgpu_pod, args.pods, args.timeout)
        print(f"  CPU ms per vGPU pod by process: {cpu_delta(all0, cpu_by_process(cp, comps), args.pods)}")
        cpu1, binds1 = cpu_seconds(ext.p.pid), binds_by_outcome(comps.extender_port)
        lat1 = handler_seconds(comps.extender_port)
        if spy is not None:
            for sp in (spy, spy_wh, spy_dp):
                sp.send_signal(signal.SIGINT)
                sp.wait(timeout=30)
        print(f"vgpu pods: {args.pods} in {vgpu_s:.2f} s = {vgpu_rate:.1f} pods/s", flush=True)

        delta = {k: binds1.get(k, 0.0) - binds0.get(k, 0.0) for k in set(binds0) | set(binds1)}
        warnings = [e for e in core.list_namespaced_event("bench-vgpu").items
                    if e.type == "Warning" and e.involved_object.name in bound]
        print(f"vgpu/plain ratio: {vgpu_rate / plain_rate if plain_rate else 0.0:.2f}")
        print(f"hand-over failures: {delta.get('handover', 0.0):.0f}")
        print(f"race (unschedulable) bind failures: {delta.get('unschedulable', 0.0):.0f}")
        print(f"extender binds by outcome: {dict(sorted((k, int(v)) for k, v in delta.items() if v))}")
        print(f"Warning events on bound pods: {len(warnings)}"
              + (f" (first: {warnings[0].reason}: {(warnings[0].message or '')[:160]})" if warnings else ""))
        print(f"extender CPU per bound pod: {(cpu1 - cpu0) / max(1, len(bound)) * 1000:.1f} ms "
              f"({cpu1 - cpu0:.2f} s for {len(bound)} pods)")
        means = []
        for verb, (s1, n1) in sorted(lat1.items()):
            s0, n0 = lat0.get(verb, (0.0, 0.0))
            if n1 > n0:
                means.append(f"{verb} {(s1 - s0) / (n1 - n0) * 1000:.1f} ms x {n1 - n0:.0f}")
        print(f"extender handler time, mean (server side): {', '.join(means)}")
        if loop.errors:
            print(f"fake kubelet errors: {len(loop.errors)} (first: {loop.errors[0][:200]})")
        if not args.no_dra:
            loop.stop()
            publish_dra(api, names)
            dra_loop = KubeletLoop(core, "bench-dra", names[0], fk, comps.signing_keys)
            dra_loop.start()
            claims = client.CustomObjectsApi(api)

            def make_dra(name: str) -> dict[str, Any]:
                claims.create_namespaced_custom_object("resource.k8s.io", "v1", "bench-dra", "resourceclaims",
                                                       dra_claim(name))
                return dra_pod(name)
            all0 = cpu_by_process(cp, comps)
            dra_rate, dra_s, _ = run_phase(core, "bench-dra", make_dra, args.pods, args.timeout)
            print(f"  CPU ms per DRA pod by process: {cpu_delta(all0, cpu_by_process(cp, comps), args.pods)}")
            dra_loop.stop()
            print(f"dra pods: {args.pods} in {dra_s:.2f} s = {dra_rate:.1f} pods/s", flush=True)
            print(f"dra/plain ratio: {dra_rate / plain_rate if plain_rate else 0.0:.2f}")
        print(TARGETS)
        return 0
    finally:
        if loop is not None:
            loop.stop()
        comps.stop()
        if fk is not None:
            fk.stop()
        cp.stop()
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
