"""Placement-engine benchmark: published-number reproduction, replay time, decision
latency and peak RSS. Prints numbers; asserts nothing (see tests for correctness).

  python benchmarks/simulate_bench.py [--seeds 10] [--trace ../shared/traces/alibaba-gpu-v2023]

1. The default Alibaba trace replayed under every policy with 10 seeds (42-51), allocation at
   80..130% arrived beside the published FGD-artifact means.
2. One full default-trace replay under FGD, timed (target <= 60 s on a 2-core machine).
3. Per-pod decision latency p50/p99 under FGD on the 1,213-node trace cluster (target <= 5 ms) and
   on a synthetic 5,000-node x 8-GPU cluster (target <= 20 ms).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay import main as sim  # noqa: E402
from replay.synthetic import synthetic_pods  # noqa: E402
from replay.trace import TraceNode, load_nodes, load_pods, make_devices  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"
DEFAULT_EXPECTED = ROOT.parent / "shared" / "traces" / "fgd-atc23-expected-results" / "fgd_expected_summary.csv"


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--big-pods", type=int, default=12000, help="pods replayed on the 5,000-node cluster")
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"trace not found at {args.trace}; skipping trace benchmarks")
        return 0
    nodes = load_nodes(args.trace / "openb_node_list_gpu_node.csv")
    pods = load_pods(args.trace / "openb_pod_list_default.csv")

    print(f"== 1. default trace, {args.seeds} seeds, every policy (allocation % at arrived %) ==")
    t0 = time.perf_counter()
    results = sim.run_all(nodes, pods, ["fgd", "fgd-bestfit", "bestfit", "dotprod", "binpack", "spread"],
                          list(range(42, 42 + args.seeds)), 1.3, jobs=args.jobs, progress=False)
    against = sim.load_expected(DEFAULT_EXPECTED, "openb_pod_list_default") if DEFAULT_EXPECTED.exists() else None
    print(sim.format_table(results, against))
    summ = sim.summarise(results)
    if against:
        for pol, lim in (("fgd", 0.3), ("bestfit", 0.5)):
            ours, ref = summ[pol][100][0], against[pol][100]
            verdict = "within" if abs(ours - ref) <= lim else "OUTSIDE"
            print(f"{pol}: {ours:.2f}% at 100% arrived vs published {ref:.2f}% "
                  f"(diff {ours - ref:+.2f}, {verdict} +-{lim})")
        fb = summ["fgd-bestfit"][100][0]
        print(f"fgd-bestfit: {fb:.2f}% at 100% arrived; goal >= 95.5%; "
              f"unallocated GPUs {(100 - fb) * 62.12:.0f} vs published FGD {(100 - against['fgd'][100]) * 62.12:.0f}")
    print(f"({len(results)} replays in {time.perf_counter() - t0:.1f} s with {args.jobs} processes)")

    print("\n== 2. one full default-trace replay under FGD ==")
    r = sim.replay(nodes, pods, "fgd", 42, 1.3, record_latency=True)
    print(f"{r.pods} pods ({r.failed} failed) in {r.seconds:.1f} s (target <= 60 s)")
    print("\n== 3. per-pod decision latency ==")
    print(f"trace cluster ({len(nodes)} nodes, {sum(len(n.devices) for n in nodes)} GPUs), FGD: "
          f"p50 {pct(r.latencies, 50):.3f} ms, p99 {pct(r.latencies, 99):.3f} ms, "
          f"max {pct(r.latencies, 100):.1f} ms (target p99 <= 5 ms)")

    big = [TraceNode(f"big-{i:05d}", 96_000, 786_432, make_devices(f"big-{i:05d}", 8, "G2")) for i in range(5000)]
    big_pods = synthetic_pods(big, load=1.0, seed=5)[: args.big_pods]
    rb = sim.replay(big, big_pods, "fgd", 42, 1.0, shapes=sim.shapes_of(big_pods), record_latency=True)
    print(f"synthetic 5,000 nodes x 8 GPUs, FGD, {rb.pods} pods: p50 {pct(rb.latencies, 50):.3f} ms, "
          f"p99 {pct(rb.latencies, 99):.3f} ms, max {pct(rb.latencies, 100):.1f} ms (target p99 <= 20 ms)")
    rb2 = sim.replay(big, big_pods, "binpack", 42, 1.0, record_latency=True)
    print(f"synthetic 5,000 nodes x 8 GPUs, binpack: p50 {pct(rb2.latencies, 50):.3f} ms, "
          f"p99 {pct(rb2.latencies, 99):.3f} ms")
    print(f"\npeak RSS {sim.peak_rss_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
