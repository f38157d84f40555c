"""How many distinct placement shapes a trace has under each decision-cache key.

The engine caches one decision per (policy, pod shape) and re-evaluates a node for a shape only
when that node changed, so the number of distinct shapes in a workload is the number of cold
(every-node) evaluations it costs. This script reads the Alibaba GPU trace (``openb_pod_list_*.csv``)
and counts the distinct shapes under:

* ``full``: ``pod_shape(pod, host=True)``, the GPU request plus host CPU and memory requests (the
  key the replay uses, where nodes model CPU and memory, and the key the live extender used before
  it keyed on the GPU request alone);
* ``gpu+cpu``: the GPU request plus CPU (what FGD's score reads in the replay; memory only gates fit);
* ``gpu``: ``pod_shape(pod, host=False)``, the GPU request alone (the live extender's key:
  per container GPU count, MiB or percent, cores; constraints; GPU model list).

Usage: ``python benchmarks/trace_shapes.py [TRACE_DIR]`` (default ``../shared/traces/alibaba-gpu-v2023``
next to the repository). Prints a Markdown table: one row per pod list, then all lists together.
Reads the files where they are; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kube_vgpu.placement import pod_shape  # noqa: E402
from replay.trace import load_pods  # noqa: E402

DEFAULT_DIR = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"


def keys(path: Path) -> tuple[int, set[object], set[object], set[object]]:
    """(pods, distinct full keys, distinct gpu+cpu keys, distinct gpu keys) of one pod list."""
    full: set[object] = set()
    gpu_cpu: set[object] = set()
    gpu: set[object] = set()
    pods = load_pods(path)
    for p in pods:
        r = p.request
        full.add(pod_shape(r, host=True))
        g = pod_shape(r, host=False)
        gpu.add(g)
        gpu_cpu.add((g, r.cpu_milli))
    return len(pods), full, gpu_cpu, gpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    a = ap.parse_args(argv)
    files = sorted(a.trace_dir.glob("openb_pod_list_*.csv"))
    if not files:
        print(f"no openb_pod_list_*.csv under {a.trace_dir}", file=sys.stderr)
        return 2
    print("| pod list | pods | full key (GPU + CPU + memory) | GPU + CPU | GPU request only |")
    print("|---|---|---|---|---|")
    tot = [0, set(), set(), set()]  # type: list
    for f in files:
        n, full, gc, g = keys(f)
        tot[0] += n
        for i, s in enumerate((full, gc, g), start=1):
            tot[i] |= s
        print(f"| {f.stem.removeprefix('openb_pod_list_')} | {n:,} | {len(full):,} | {len(gc):,} | {len(g):,} |")
    print(f"| all {len(files)} lists | {tot[0]:,} | {len(tot[1]):,} | {len(tot[2]):,} | {len(tot[3]):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
