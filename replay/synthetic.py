"""The built-in synthetic cluster and workload for ``kube-vgpu replay`` with no arguments.

Seeded, and shaped like the public Alibaba v2023 statistics (node mix by model and GPU count; pod
mix 13% CPU-only, 38% GPU-sharing with the trace's common shares, 48% one whole GPU, 1% multi-GPU),
scaled down so every policy replays in seconds. No trace data is embedded: only these summary
proportions.
"""

from __future__ import annotations

import numpy as np

from .trace import TraceNode, TracePod, make_devices, make_request

#: (model, GPUs per node, share of nodes, CPU millicores, host MiB)
NODE_MIX = [
    ("G2", 8, 0.45, 96_000, 786_432),
    ("T4", 2, 0.32, 64_000, 262_144),
    ("P100", 2, 0.11, 64_000, 262_144),
    ("G3", 8, 0.04, 96_000, 786_432),
    ("V100M16", 4, 0.04, 96_000, 393_216),
    ("V100M32", 8, 0.04, 96_000, 786_432),
]
#: common GPU shares (milli) of sharing pods with their relative frequency
SHARE_MIX = [(810, 0.35), (470, 0.24), (320, 0.11), (650, 0.08), (230, 0.05), (460, 0.04),
             (590, 0.03), (160, 0.03), (550, 0.03), (220, 0.02), (110, 0.02)]


def synthetic_nodes(n_nodes: int = 150, seed: int = 7) -> list[TraceNode]:
    """A seeded cluster of ``n_nodes`` nodes following NODE_MIX."""
    rng = np.random.default_rng(seed)
    shares = np.array([m[2] for m in NODE_MIX])
    picks = rng.choice(len(NODE_MIX), size=n_nodes, p=shares / shares.sum())
    out = []
    for i, k in enumerate(sorted(picks.tolist())):
        model, gpus, _, cpu, mem = NODE_MIX[k]
        name = f"syn-node-{i:04d}"
        out.append(TraceNode(name, cpu, mem, make_devices(name, gpus, model)))
    return out


def synthetic_pods(nodes: list[TraceNode], load: float = 0.98, seed: int = 11) -> list[TracePod]:
    """A seeded workload whose GPU request totals ``load`` x the cluster's GPUs."""
    rng = np.random.default_rng(seed)
    capacity = sum(len(n.devices) for n in nodes) * 1000
    share_m = np.array([s for s, _ in SHARE_MIX])
    share_p = np.array([p for _, p in SHARE_MIX])
    share_p = share_p / share_p.sum()
    pods: list[TracePod] = []
    total = 0
    i = 0
    while total < load * capacity:
        r = rng.random()
        if r < 0.133:
            num, milli = 0, 0
            cpu = int(rng.choice([4_000, 8_000, 16_000, 32_000]))
        elif r < 0.511:
            num, milli = 1, int(rng.choice(share_m, p=share_p))
            cpu = int(rng.choice([4_000, 6_000, 8_000, 12_000]))
        elif r < 0.991:
            num, milli = 1, 1000
            cpu = int(rng.choice([8_000, 12_000, 16_000]))
        else:
            num, milli = int(rng.choice([2, 4, 8])), 1000
            cpu = 8_000 * num
        mem = cpu * 2 // 1000 * 1024
        name = f"syn-pod-{i:05d}"
        pods.append(TracePod(name, cpu, mem, num, milli, (), make_request(name, cpu, mem, num, milli, ())))
        total += num * milli
        i += 1
    return pods
