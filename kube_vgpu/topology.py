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
#: the most candidate sets :func:`best_connected` compares exactly; beyond it, a greedy choice
MAX_SETS = 5000
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
    ``count`` in order). Up to :data:`MAX_SETS` sets are compared exactly; beyond, the set is grown
    greedily from each start."""
    ordered = list(ordered)
    if count < 2 or len(ordered) <= count or not links:
        return ordered[:count]
    best: list[int] | None = None
    best_key: tuple[int, int] | None = None
    n = len(ordered)
    if _sets(n, count) <= MAX_SETS:
        candidates = (list(c) for c in combinations(ordered, count))  # in policy order, earliest first
    else:
        candidates = (_greedy(ordered, start, count, links) for start in ordered)
    for chosen in candidates:
        k = _key(links, chosen)
        if best_key is None or k > best_key:
            best, best_key = chosen, k
    assert best is not None
    return sorted(best, key=ordered.index)


def _sets(n: int, k: int) -> int:
    out = 1
    for i in range(k):
        out = out * (n - i) // (i + 1)
    return out


def _greedy(ordered: list[int], start: int, count: int, links: Sequence[Sequence[int]]) -> list[int]:
    chosen = [start]
    rest = [g for g in ordered if g != start]
    while len(chosen) < count:
        nxt = max(rest, key=lambda g: (min(links[g][c] for c in chosen), -ordered.index(g)))
        chosen.append(nxt)
        rest.remove(nxt)
    return chosen
