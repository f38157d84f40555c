"""``kube-vgpu replay`` (alias ``kube-vgpu simulate``): replay a whole workload trace under each
placement policy, FGD-artifact style. Offline: no cluster is read. (``kubectl vgpu what-if`` asks
where one pod would go on a live cluster.)

Procedure (the FGD artifact's, see docs/placement.md): pods sorted by name, shuffled with the seed,
topped up to ``inflate`` x GPU capacity by sampling the trace with replacement, no departures; a
pod that fits nowhere fails and is skipped. After each pod we record *arrived* (GPU milli requested
so far, failed pods included, / capacity) and *allocation* (GPU milli placed / capacity), and sample
allocation at every integer arrived percent 0..130.

With no arguments it replays the built-in synthetic cluster and workload under every policy.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kube_vgpu.model import PodRequest
from kube_vgpu.placement import ClusterState, Engine, TaskShape, typical_shapes
from kube_vgpu.policyregistry import NODE_POLICIES, NODE_POLICY_SPECS, replay_policies

from .dra import placer
from .synthetic import synthetic_nodes, synthetic_pods
from .trace import TraceNode, TracePod, load_nodes, load_pods

#: the replay's policy names -> (node policy, GPU policy), from the policy registry
POLICIES: dict[str, tuple[str, str]] = replay_policies()
#: replayed when no --policy is given: every node policy with its replay GPU policy
DEFAULT_POLICIES: tuple[str, ...] = NODE_POLICIES
#: the FGD artifact's policy labels, for --against
ARTIFACT_NAMES = {s.name: s.artifact_label for s in NODE_POLICY_SPECS if s.artifact_label}
REPORT_POINTS = (80, 90, 95, 100, 110, 120, 130)
MAX_PCT = 130


@dataclass
class ReplayResult:
    """One replay: allocation % at each integer arrived % (NaN where not reached), counts, timing.

    latencies: per-pod decision time in seconds (only when requested).
    """

    policy: str
    seed: int
    capacity_gpus: int
    curve: np.ndarray
    pods: int
    failed: int
    seconds: float
    latencies: np.ndarray = field(default_factory=lambda: np.zeros(0))


def arrival_order(pods: Sequence[TracePod], seed: int, inflate: float, capacity_milli: int) -> list[TracePod]:
    """Sorted by name, shuffled with ``seed``, then topped up by sampling with replacement until
    the next pod would push the total GPU request past ``inflate`` x capacity."""
    rng = np.random.default_rng(seed)
    base = sorted(pods, key=lambda p: p.name)
    order = [base[i] for i in rng.permutation(len(base))]
    total = sum(p.total_milli for p in order)
    limit = inflate * capacity_milli
    k = 0
    while True:
        p = base[int(rng.integers(len(base)))]
        if total + p.total_milli > limit:
            break
        total += p.total_milli
        order.append(TracePod(f"{p.name}-r{k}", p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_spec,
                              _renamed(p.request, f"{p.name}-r{k}")))
        k += 1
    return order


def _renamed(req: PodRequest, name: str) -> PodRequest:
    return PodRequest(namespace=req.namespace, name=name, app=req.app, init=req.init,
                      constraints=req.constraints, cpu_milli=req.cpu_milli, memory_mib=req.memory_mib,
                      gpu_spec=req.gpu_spec)


def build_state(nodes: Sequence[TraceNode]) -> ClusterState:
    """A ClusterState with the GPU nodes (CPU and host memory modelled)."""
    st = ClusterState()
    for n in nodes:
        st.set_node(n.name, n.devices, n.cpu_milli, n.memory_mib)
    return st


def shapes_of(pods: Sequence[TracePod]) -> list[TaskShape]:
    """FGD's typical task shapes of a workload (before inflation)."""
    return typical_shapes((p.cpu_milli, p.gpu_milli, p.num_gpu, p.gpu_spec) for p in pods)


def replay(nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy: str, seed: int,
           inflate: float = 1.3, shapes: list[TaskShape] | None = None, record_latency: bool = False,
           progress: bool = False, nodes_to_score: int | None = None) -> ReplayResult:
    """Replay ``pods`` on ``nodes`` under ``policy`` (a key of POLICIES). ``nodes_to_score``:
    kube-scheduler's ``percentageOfNodesToScore`` (0 = adaptive) for the DRA-path models that
    scan a window (replay/dra.py), instead of the model's own. Raises KeyError for an unknown
    policy name, ValueError for a percentage outside 0..100."""
    node_pol, gpu_pol = POLICIES[policy]
    capacity = sum(len(n.devices) for n in nodes) * 1000
    if capacity == 0:
        raise ValueError("the cluster has no GPUs")
    state = build_state(nodes)
    engine = Engine(state, node_pol, gpu_pol, shapes=shapes if shapes is not None else shapes_of(pods))
    place = placer(engine, node_pol, nodes_to_score)
    order = arrival_order(pods, seed, inflate, capacity)
    curve = np.full(MAX_PCT + 1, np.nan)
    lat = np.zeros(len(order)) if record_latency else np.zeros(0)
    arrived = allocated = failed = 0
    curve[0] = 0.0
    next_pct = 1
    t0 = time.perf_counter()
    it: Sequence[TracePod] = order
    tqdm = _tqdm() if progress else None
    if tqdm is not None:
        it = tqdm(order, desc=f"{policy} seed {seed}", unit="pod", leave=False, file=sys.stderr)
    for k, p in enumerate(it):
        t = time.perf_counter() if record_latency else 0.0
        alloc = place(p.request)
        if record_latency:
            lat[k] = time.perf_counter() - t
        arrived += p.total_milli
        if alloc is None:
            failed += 1
        else:
            allocated += p.total_milli
        pct = arrived * 100 / capacity
        while next_pct <= MAX_PCT and pct >= next_pct:
            curve[next_pct] = allocated * 100 / capacity
            next_pct += 1
    # The top-up stops just short of ``inflate`` x capacity: the last state stands for the
    # rounded final arrived percent (130 for the default 1.3), as the artifact's sampling does.
    last = min(MAX_PCT, int(round(arrived * 100 / capacity)))
    while next_pct <= last:
        curve[next_pct] = allocated * 100 / capacity
        next_pct += 1
    return ReplayResult(policy, seed, capacity // 1000, curve, len(order), failed,
                        time.perf_counter() - t0, lat)


#: the plot starts at this arrived % (below it every policy places everything)
ZOOM_FROM = 50


class SimExtraMissing(RuntimeError):
    """The optional ``kube-vgpu[sim]`` packages (matplotlib) are not installed."""


def _tqdm() -> Any:
    """tqdm's progress bar class, or None when the ``sim`` extra is not installed (no bar)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _run(args: tuple[Sequence[TraceNode], Sequence[TracePod], str, int, float, list[TaskShape], int | None]
         ) -> ReplayResult:
    nodes, pods, policy, seed, inflate, shapes, nodes_to_score = args
    return replay(nodes, pods, policy, seed, inflate, shapes, nodes_to_score=nodes_to_score)


def run_all(nodes: Sequence[TraceNode], pods: Sequence[TracePod], policies: Sequence[str], seeds: Sequence[int],
            inflate: float, jobs: int = 1, progress: bool = True, nodes_to_score: int | None = None
            ) -> list[ReplayResult]:
    """Every (policy, seed) replay, in parallel processes when ``jobs`` > 1 (``nodes_to_score``:
    see :func:`replay`)."""
    shapes = shapes_of(pods)
    tasks = [(nodes, pods, pol, s, inflate, shapes, nodes_to_score) for pol in policies for s in seeds]
    results: list[ReplayResult] = []
    bar = None
    tqdm = _tqdm() if progress else None
    if tqdm is not None:
        bar = tqdm(total=len(tasks), desc="replays", unit="run", file=sys.stderr)
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            for r in ex.map(_run, tasks):
                results.append(r)
                if bar:
                    bar.update()
    else:
        for t in tasks:
            results.append(_run(t))
            if bar:
                bar.update()
    if bar:
        bar.close()
    return results


def summarise(results: Sequence[ReplayResult]) -> dict[str, dict[int, tuple[float, float]]]:
    """policy -> arrived % -> (mean, sd) allocation % over seeds (NaN points ignored)."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for pol in dict.fromkeys(r.policy for r in results):
        curves = np.array([r.curve for r in results if r.policy == pol])
        out[pol] = {}
        for x in range(MAX_PCT + 1):
            col = curves[:, x]
            col = col[~np.isnan(col)]
            if len(col):
                out[pol][x] = (float(col.mean()), float(col.std(ddof=1)) if len(col) > 1 else 0.0)
    return out


def format_table(results: Sequence[ReplayResult], against: dict[str, dict[int, float]] | None = None) -> str:
    """A text table: allocation % at REPORT_POINTS per policy, and unallocated GPUs at 100%."""
    summ = summarise(results)
    cap = results[0].capacity_gpus if results else 0
    head = f"{'policy':<18}" + "".join(f"{x:>8}%" for x in REPORT_POINTS) + f"{'unalloc@100':>13}"
    lines = [head, "-" * len(head)]

    def row(label: str, alloc: dict[int, float]) -> str:
        out = f"{label:<18}" + "".join(f"{alloc[x]:>9.2f}" if x in alloc else f"{'-':>9}" for x in REPORT_POINTS)
        return out + (f"{(100 - alloc[100]) * cap / 100:>13.0f}" if 100 in alloc else "")

    for pol, pts in summ.items():
        lines.append(row(pol, {x: v[0] for x, v in pts.items()}))
        if against and pol in against:
            lines.append(row("  published", against[pol]))
    return "\n".join(lines)


def load_expected(path: str | Path, workload: str) -> dict[str, dict[int, float]]:
    """Published mean allocation % per our policy name and arrived %, read from either the FGD
    artifact's own per-seed file (``experiments/analysis/expected_results/analysis_allo_discrete.csv``:
    ``workload,sc_policy,tune,seed,total_gpus,0..130``; averaged over its seeds here) or a summary
    of it with ``workload,sc_policy,arrived_pct,alloc_pct_mean`` columns.

    Raises OSError (unreadable), KeyError (neither layout), ValueError (a number that is not one,
    naming the line, the column and the value)."""
    inv = {v: k for k, v in ARTIFACT_NAMES.items()}
    sums: dict[str, dict[int, list[float]]] = {}

    def number(row: dict[str, str], column: str, line: int) -> float:
        try:
            return float(row[column])
        except (TypeError, ValueError):
            raise ValueError(f"{path} line {line}: column {column} is {row[column]!r}, not a number") from None

    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        per_seed = "seed" in fields and "100" in fields
        if not {"workload", "sc_policy"} <= set(fields) or (
                not per_seed and not {"arrived_pct", "alloc_pct_mean"} <= set(fields)):
            raise KeyError(f"{path}: columns {', '.join(fields[:6])}{', ...' if len(fields) > 6 else ''}: expected "
                           "the FGD artifact's analysis_allo_discrete.csv (workload,sc_policy,tune,seed,total_gpus,"
                           "0..130) or workload,sc_policy,arrived_pct,alloc_pct_mean")
        for row in reader:
            if row["workload"] != workload or row["sc_policy"] not in inv:
                continue
            pol = sums.setdefault(inv[row["sc_policy"]], {})
            if per_seed:
                for x in REPORT_POINTS:
                    if row.get(str(x)):
                        pol.setdefault(x, []).append(number(row, str(x), reader.line_num))
            else:
                arrived = number(row, "arrived_pct", reader.line_num)
                if arrived != int(arrived):
                    raise ValueError(f"{path} line {reader.line_num}: column arrived_pct is "
                                     f"{row['arrived_pct']!r}, not a whole percent")
                pol.setdefault(int(arrived), []).append(number(row, "alloc_pct_mean", reader.line_num))
    return {p: {x: sum(v) / len(v) for x, v in pts.items()} for p, pts in sums.items()}


def write_outputs(results: Sequence[ReplayResult], out: Path, against: dict[str, dict[int, float]] | None = None,
                  workload: str = "") -> tuple[Path, Path]:
    """Write ``allocation.csv`` (policy,seed,arrived_pct,alloc_pct,unallocated_gpus) and the plot
    ``allocation.png`` / ``allocation.svg`` (mean allocation vs arrived from ZOOM_FROM %, one line
    per policy, the published values of ``against`` as markers, a title naming ``workload`` and the
    seeds) into ``out``. Raises SimExtraMissing (after the CSV) without matplotlib."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "allocation.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["policy", "seed", "arrived_pct", "alloc_pct", "unallocated_gpus"])
        for r in results:
            for x in range(MAX_PCT + 1):
                if not np.isnan(r.curve[x]):
                    a = float(r.curve[x])
                    w.writerow([r.policy, r.seed, x, f"{a:.3f}", f"{(100 - a) * r.capacity_gpus / 100:.1f}"])
    try:
        import matplotlib
    except ImportError as e:
        raise SimExtraMissing(f"wrote {csv_path}; the plot needs matplotlib: pip install 'kube-vgpu[sim]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = out / "allocation.png"
    summ = summarise(results)
    seeds = len({r.seed for r in results})
    # the policies differ only once the cluster fills up: zoom on arrived >= ZOOM_FROM %, with the
    # y axis from just below the lowest curve there to 100 %
    lows = [pts[x][0] for pts in summ.values() for x in pts if x >= ZOOM_FROM]
    lows += [v for ref in (against or {}).values() for x, v in ref.items() if x >= ZOOM_FROM]
    y0 = max(0.0, float(np.floor(min(lows) / 5) * 5 - 5)) if lows else 0.0
    fig, ax = plt.subplots(figsize=(8, 5))
    colours: dict[str, Any] = {}
    for pol, pts in summ.items():
        xs = [x for x in sorted(pts) if x >= ZOOM_FROM]
        (line,) = ax.plot(xs, [pts[x][0] for x in xs], label=pol, gid=f"policy-{pol}", linewidth=1.6)
        colours[pol] = line.get_color()
    for pol, ref in (against or {}).items():
        if pol in colours:
            xs = [x for x in sorted(ref) if x >= ZOOM_FROM]
            ax.plot(xs, [ref[x] for x in xs], linestyle="none", marker="o", markersize=4, color=colours[pol],
                    label=f"{pol} (published)", gid=f"published-{pol}")
    ax.plot([ZOOM_FROM, 100], [ZOOM_FROM, 100], color="grey", linestyle=":", linewidth=0.8, label="ideal",
            gid="ideal")
    ax.set_title(f"GPU allocation vs. arrived GPU requests: {workload or 'replay'}, mean of {seeds} "
                 f"seed{'s' if seeds != 1 else ''}")
    ax.set_xlabel("arrived GPU requests (% of GPU capacity)")
    ax.set_ylabel("allocated GPUs (% of GPU capacity)")
    ax.set_xlim(ZOOM_FROM, MAX_PCT)
    ax.set_ylim(y0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small", ncol=2 if against else 1)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    fig.savefig(out / "allocation.svg")
    plt.close(fig)
    return csv_path, png


def peak_rss_mib() -> float:
    """Peak resident set size of this process and its finished children, MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


PROG = "kube-vgpu replay"


def _parser() -> argparse.ArgumentParser:
    # the module docstring, as plain text for a terminal (no ``literal`` or *emphasis* markup)
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").replace("``", "'").replace("*", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, help="folder with the Alibaba openb CSVs (default: built-in synthetic)")
    p.add_argument("--pods", default="openb_pod_list_default", help="pod list name inside --trace")
    p.add_argument("--nodes", default="openb_node_list_gpu_node", help="node list name inside --trace")
    p.add_argument("--policy", action="append", choices=sorted(POLICIES),
                   help=f"policy to replay (repeatable; default: {', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds, starting at 42 (trace: 10, synthetic: 2)")
    p.add_argument("--inflate", type=float, default=1.3, help="top up arrivals to this x GPU capacity (default 1.3)")
    p.add_argument("--out", type=Path, help="write allocation.csv and allocation.png here")
    p.add_argument("--against", type=Path,
                   help="the FGD artifact's analysis_allo_discrete.csv (or a summary of it): print the "
                        "published numbers beside ours")
    p.add_argument("--nodes-to-score", type=int, default=None, metavar="PCT",
                   help="kube-scheduler's percentageOfNodesToScore for the DRA-path models that scan a window "
                        "(0 = adaptive; default: each model's own, see docs/dra-placement.md)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes (default: CPUs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry. Returns 0, or 2 on bad arguments/input (message on stderr)."""
    args = _parser().parse_args(argv)
    if not 1.0 <= args.inflate <= 3.0:
        print(f"{PROG}: --inflate {args.inflate} is out of range; allowed 1.0..3.0", file=sys.stderr)
        return 2
    if args.seeds is not None and not 1 <= args.seeds <= 1000:
        print(f"{PROG}: --seeds {args.seeds} is out of range; allowed 1..1000", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"{PROG}: --jobs {args.jobs} is out of range; allowed >= 1", file=sys.stderr)
        return 2
    if args.nodes_to_score is not None and not 0 <= args.nodes_to_score <= 100:
        print(f"{PROG}: --nodes-to-score {args.nodes_to_score} is out of range; allowed 0..100", file=sys.stderr)
        return 2
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            probe = args.out / ".kube-vgpu-write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            print(f"{PROG}: --out {args.out} is not a writable folder: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    try:
        if args.trace:
            nodes = load_nodes(args.trace / f"{args.nodes}.csv")
            pods = load_pods(args.trace / f"{args.pods}.csv")
            workload = args.pods
            n_seeds = args.seeds or 10
        else:
            nodes = synthetic_nodes()
            pods = synthetic_pods(nodes)
            workload = "synthetic"
            n_seeds = args.seeds or 2
    except OSError as e:
        # the trace folder holds the artifact's CSVs by their file names (--nodes, --pods)
        print(f"{PROG}: --trace {args.trace}: cannot read {Path(e.filename or '').name or e.filename}: "
              f"{e.strerror or e}; the folder must hold {args.nodes}.csv and {args.pods}.csv "
              "(--nodes, --pods name them)", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if not pods:
        print(f"{PROG}: the pod list is empty", file=sys.stderr)
        return 2
    if not any(n.devices for n in nodes):
        print(f"{PROG}: the node list has no GPUs", file=sys.stderr)
        return 2
    policies = args.policy or list(DEFAULT_POLICIES)
    seeds = list(range(42, 42 + n_seeds))
    # --against is read before the replays, which take minutes on the real trace
    against = None
    if args.against:
        try:
            against = load_expected(args.against, workload)
        except OSError as e:
            print(f"{PROG}: cannot read --against {args.against}: {e.strerror or e}", file=sys.stderr)
            return 2
        except (KeyError, ValueError) as e:
            print(f"{PROG}: cannot read --against {args.against}: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
        if not against:
            print(f"{PROG}: note: --against {args.against} has no published values for workload {workload} "
                  f"and policies {', '.join(ARTIFACT_NAMES.values())}", file=sys.stderr)
    gpus = sum(len(n.devices) for n in nodes)
    print(f"workload {workload}: {len(nodes)} nodes, {gpus} GPUs, {len(pods)} pods; "
          f"policies {', '.join(policies)}; seeds {seeds[0]}..{seeds[-1]}; inflate {args.inflate}")
    t0 = time.perf_counter()
    results = run_all(nodes, pods, policies, seeds, args.inflate, jobs=max(1, args.jobs),
                      progress=not args.no_progress, nodes_to_score=args.nodes_to_score)
    print("\nGPU allocation (% of capacity) at arrived GPU request (% of capacity), mean over seeds")
    print(format_table(results, against))
    failed = {p: sum(r.failed for r in results if r.policy == p) / n_seeds for p in policies}
    print("\nfailed pods per run: " + ", ".join(f"{p} {v:.0f}" for p, v in failed.items()))
    print(f"elapsed {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_mib():.0f} MiB")
    if args.out:
        try:
            c, png = write_outputs(results, args.out, against, workload)
        except SimExtraMissing as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        print(f"wrote {c} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
