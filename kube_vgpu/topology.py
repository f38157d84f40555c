"""GPU interconnect: how well two GPUs of a node talk to each other, and the best-connected set.

The device plugin reads NVML's topology (``nvmlDeviceGetTopologyCommonAncestor``) and NVLink
(``nvmlDeviceGetNvLinkState`` / ``nvmlDeviceGetNvLinkRemotePciInfo``) and publishes, per GPU of the
node inventory, a rank to every GPU of the node (``links``, by position in the inventory). Higher
is better:

====================  =====================================================================
rank                  the two GPUs are connected through
====================  =====================================================================
``NVLINK + n``        ``n`` NVLink links (11 for one link, 12 for two, ...)
``PCIE_SWITCH`` (4)   one PCIe switch (NVML ``SINGLE``) or several (``MULTIPLE``)
``HOST_BRIDGE`` (3)   the CPU's host bridge (NVML ``HOSTBRIDGE``)
``NUMA`` (2)          the same NUMA node (NVML ``NODE``)
``SYSTEM`` (1)        across NUMA nodes (NVML ``SYSTEM``)
``UNKNOWN`` (0)       not known (no topology published, or the same GPU)
====================  =====================================================================

Placement of a container asking for 2 or more GPUs prefers, among the GPUs its policy allows, the
set whose weakest pair is best connected (then the best total), in the policy's order otherwise
(:func:`best_connected`). Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

UNKNOWN, SYSTEM, NUMA, HOST_BRIDGE, PCIE_SWITCH = 0, 1, 2, 3, 4
NVLINK = 10
#: the most pair ranks :func:`best_connected` reads (candidate sets x pairs per set when it compares
#: every set exactly; starts x GPUs x count when it grows sets greedily). The pod's GPU count and
#: ``kube-vgpu.io/gpu-link`` are the tenant's: the work per node must stay bounded whatever they ask.
MAX_PAIR_READS = 20_000
#: NVML's nvmlGpuTopologyLevel_t -> rank
_NVML_LEVEL = {10: PCIE_SWITCH, 20: PCIE_SWITCH, 30: HOST_BRIDGE, 40: NUMA, 50: SYSTEM}


def rank_of(nvml_level: int | None, nvlinks: int = 0) -> int:
    """The rank of a GPU pair from NVML's common-ancestor level and its NVLink link count."""
    if nvlinks > 0:
        return NVLINK + nvlinks
    return _NVML_LEVEL.get(nvml_level, UNKNOWN) if nvml_level is not None else UNKNOWN


#: the interconnect a pod can require for a multi-GPU container (annotation ``kube-vgpu.io/gpu-link``):
#: class name -> the least rank every pair of its GPUs must have
LINK_CLASSES = {"nvlink": NVLINK + 1, "pcie-switch": PCIE_SWITCH, "host-bridge": HOST_BRIDGE, "numa": NUMA}


def link_class(rank: int) -> str:
    """The name of the best link class ``rank`` reaches (``"system"``, ``"unknown"`` below ``numa``)."""
    for name, least in LINK_CLASSES.items():  # best first
        if rank >= least:
            return name
    return "system" if rank == SYSTEM else "unknown"


def weakest(links: Sequence[Sequence[int]], chosen: Sequence[int]) -> int:
    """The rank of the worst-connected pair of ``chosen`` (:data:`UNKNOWN` for fewer than two)."""
    return _key(links, chosen)[0]


def _key(links: Sequence[Sequence[int]], chosen: Sequence[int]) -> tuple[int, int]:
    pairs = [links[a][b] for a, b in combinations(chosen, 2)]
    return (min(pairs), sum(pairs)) if pairs else (0, 0)


def best_connected(ordered: Sequence[int], count: int, links: Sequence[Sequence[int]]) -> list[int]:
    """``count`` GPUs out of ``ordered`` (node GPU positions, the policy's order): the set whose
    weakest pair has the highest rank, then the highest total, then the earliest in the policy's
    order. ``links[a][b]``: rank between positions a and b (:data:`UNKNOWN` everywhere: the first
    ``count`` in order). Every set is compared exactly while that reads at most
    :data:`MAX_PAIR_READS` pair ranks; beyond, a set is grown greedily from each of the first starts
    in the policy's order that the same budget allows (at least one)."""
    ordered = list(ordered)
    if count < 2 or len(ordered) <= count or not links:
        return ordered[:count]
    n = len(ordered)
    best: list[int] | None = None
    best_key: tuple[int, int] | None = None
    if _sets(n, count) * (count * (count - 1) // 2) <= MAX_PAIR_READS:
        for c in combinations(ordered, count):  # in policy order, earliest first
            k = _key(links, c)
            if best_key is None or k > best_key:
                best, best_key = list(c), k
    else:
        pos = {g: i for i, g in enumerate(ordered)}
        for start in ordered[:max(1, MAX_PAIR_READS // (n * count))]:
            chosen, k = _greedy(ordered, start, count, links, pos)
            if best_key is None or k > best_key:
                best, best_key = chosen, k
    assert best is not None
    return sorted(best, key=ordered.index)


def _sets(n: int, k: int) -> int:
    out = 1
    for i in range(k):
        out = out * (n - i) // (i + 1)
    return out


def _greedy(ordered: list[int], start: int, count: int, links: Sequence[Sequence[int]],
            pos: dict[int, int]) -> tuple[list[int], tuple[int, int]]:
    """The set grown from ``start`` (each step: the GPU whose weakest link to the set is best, the
    earliest in order on a tie) and its (weakest pair, total). Reads fewer than ``n * count`` ranks:
    each GPU's weakest link and total to the set are kept as the set grows."""
    chosen = [start]
    row = links[start]
    worst: dict[int, int] = {}
    total: dict[int, int] = {}
    for g in ordered:
        if g != start:
            worst[g] = total[g] = row[g]
    low, tot = -1, 0
    while len(chosen) < count:
        nxt = max(worst, key=lambda g: (worst[g], -pos[g]))
        low = worst[nxt] if low < 0 else min(low, worst[nxt])
        tot += total[nxt]
        chosen.append(nxt)
        del worst[nxt], total[nxt]
        row = links[nxt]
        for g in worst:
            v = row[g]
            total[g] += v
            if v < worst[g]:
                worst[g] = v
    return chosen, (low, tot)
