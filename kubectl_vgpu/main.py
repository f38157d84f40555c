"""``kubectl-vgpu``: a kubectl plugin (``kubectl vgpu ...``) for kube-vgpu clusters.

Commands::

    kubectl vgpu inspect [-d] [-o table|json] [--format kube-vgpu|gpushare] [--kubeconfig F] [--context C]
                         [--snapshot FILE]
    kubectl vgpu what-if -f POD.yaml [--snapshot FILE] [--policy P]... [-o table|json]

``what-if`` (old name ``simulate``, still accepted) asks where one pod would go on a live cluster
(or a snapshot of one); the offline replay of a whole workload trace is ``kube-vgpu replay``.
Both are read-only. Exit codes: 0 ok, 1 the cluster or a file could not be read, 2 usage or an
invalid pod/config, 3 (what-if) the pod fits nowhere under any policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kube_vgpu.cliflags import add_kubeconfig_flag
from kube_vgpu.config import NODE_POLICIES, Config, load_config
from kube_vgpu.errors import ConfigError, RequestError, yaml_problem

from .cluster import Cluster, ClusterError, load_live, load_snapshot
from .text import safe


def _err(message: str) -> None:
    """One line on stderr, control characters escaped (messages quote cluster and file data)."""
    print(safe(f"kubectl vgpu: {message}"), file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kubectl vgpu", description="Inspect and simulate kube-vgpu GPU sharing.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--snapshot", metavar="FILE",
                       help='recorded cluster JSON {"nodes": NodeList, "pods": PodList, "resourcequotas": '
                            'ResourceQuotaList (optional)} instead of the live API')
        add_kubeconfig_flag(p, in_cluster_first=False)
        p.add_argument("--context", help="kubeconfig context")
        p.add_argument("--config", metavar="FILE",
                       help="kube-vgpu policy file (config.yaml of the chart's ConfigMap; default: built-in)")
        p.add_argument("-o", "--output", choices=["table", "json"], default="table")

    ins = sub.add_parser("inspect", help="per node and GPU: allocated/total memory, cores, slots and pods")
    common(ins)
    ins.add_argument("-d", "--details", action="store_true", help="list each pod's share per container")
    ins.add_argument("--format", choices=["kube-vgpu", "gpushare"], default="kube-vgpu",
                     help="table layout: ours, or gpushare's 'kubectl inspect gpushare' (GPU memory in GiB, or MiB "
                          "with compat.gpushareMemoryUnit: MiB in --config); -o json ignores it")

    for verb, what in (("cordon", "mark one GPU of a node unschedulable: running pods stay, new pods avoid it"),
                       ("uncordon", "make a cordoned GPU schedulable again")):
        cp = sub.add_parser(verb, help=what)
        cp.add_argument("node", metavar="NODE")
        cp.add_argument("gpu", metavar="GPU", help="the GPU's NVML index or uuid, or the start of its uuid as kubectl vgpu inspect shows it")
        add_kubeconfig_flag(cp, in_cluster_first=False)
        cp.add_argument("--context", help="kubeconfig context")

    quo = sub.add_parser("quota", help="per namespace with a GPU quota: memory and cores booked against each "
                                       "ResourceQuota hard value (percentages resolved)")
    common(quo)

    sim = sub.add_parser("what-if", aliases=["simulate"],
                         help="where each policy would place one pod on this cluster, and why not elsewhere "
                              "(dry run; alias: simulate; a whole-trace replay is 'kube-vgpu replay')")
    common(sim)
    sim.add_argument("-f", "--filename", required=True, metavar="POD.yaml", help="a Pod manifest ('-' = stdin)")
    sim.add_argument("--policy", action="append", choices=list(NODE_POLICIES),
                     help="policy to evaluate (repeatable; default: all)")
    return ap


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.snapshot:
        return load_snapshot(args.snapshot)
    return load_live(args.kubeconfig, args.context)


def _config(args: argparse.Namespace) -> Config:
    """The policy file of --config (else the defaults). Raises ValueError naming the file and,
    for an invalid file, the key or the YAML error's line and column."""
    if not args.config:
        return Config()
    try:
        return load_config(args.config)
    except OSError as e:
        raise ValueError(f"--config {args.config}: cannot read: {e.strerror or e}") from e
    except ConfigError as e:  # a YAML error included: one line, where and what
        raise ValueError(f"--config {args.config}: {e}") from e


def _read_pod(name: str) -> dict[str, Any]:
    text = sys.stdin.read() if name == "-" else Path(name).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    pods = [d for d in docs if isinstance(d, dict) and d.get("kind", "Pod") == "Pod"]
    if len(pods) != 1:
        others = sorted({str(d.get("kind")) if isinstance(d, dict) else type(d).__name__
                         for d in docs if not (isinstance(d, dict) and d.get("kind", "Pod") == "Pod")})
        found = f"found {len(pods)} Pods" + (f" and {', '.join(others)}" if others else "")
        raise ValueError(f"{name}: expected exactly one Pod manifest (kind: Pod), {found}")
    return pods[0]


def _inspect(args: argparse.Namespace) -> int:
    from . import inspect

    cfg = _config(args)
    report = inspect.build(_cluster(args), cfg)
    if args.output == "json":
        print(json.dumps(inspect.to_json(report), indent=2))
    elif args.format == "gpushare":
        sys.stdout.write(inspect.render_gpushare(report, details=args.details, unit=cfg.compat.gpushare_memory_unit))
    else:
        sys.stdout.write(inspect.render_table(report, details=args.details))
    return 0


def _quota(args: argparse.Namespace) -> int:
    from . import quota

    cluster = _cluster(args)
    for w in cluster.warnings:
        _err(f"warning: {w}")
    rows = quota.build(cluster, _config(args))
    if args.output == "json":
        print(json.dumps(quota.to_json(rows), indent=2))
    else:
        sys.stdout.write(quota.render_table(rows))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from kube_vgpu.podspec import parse_pod

    from . import simulate

    cfg = _config(args)
    try:
        manifest = _read_pod(args.filename)
    except OSError as e:
        _err(f"cannot read {args.filename}: {e.strerror or e}")
        return 1
    except yaml.YAMLError as e:
        _err(f"cannot read {args.filename}: not valid YAML: {yaml_problem(e)}")
        return 1
    pod = parse_pod(manifest, cfg)
    if not pod.has_gpu:
        _err(f"pod {pod.key} asks for no vGPU resource ({', '.join(cfg.resource_names.all()[:4])})")
        return 2
    cluster = _cluster(args)
    for w in cluster.warnings:  # skipped objects: the simulation ran without them
        _err(f"warning: {w}")
    sim = simulate.simulate(cluster, pod, cfg, args.policy)
    if args.output == "json":
        print(json.dumps(simulate.to_json(sim), indent=2))
    else:
        sys.stdout.write(simulate.render_table(sim))
    return 0 if any(r.node for r in sim.results) else 3


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kubectl-vgpu`` console script."""
    ap = _parser()
    args = ap.parse_args(list(argv) if argv is not None else None)
    if not args.command:
        ap.print_help()
        return 2
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command in ("cordon", "uncordon"):
            from .cordon import set_cordon

            print(set_cordon(args.node, args.gpu, args.command == "cordon", args.kubeconfig, args.context))
            return 0
        return _quota(args) if args.command == "quota" else _simulate(args)
    except ClusterError as e:
        _err(f"{e}")
        return 1
    except (ConfigError, RequestError, ValueError) as e:
        _err(f"{e}")
        return 2
    except OSError as e:
        _err(f"{e}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
