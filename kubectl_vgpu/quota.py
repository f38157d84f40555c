"""``kubectl vgpu quota``: per namespace with a GPU quota, what is booked against each hard value.

"Used" is what the scheduler books (kube_vgpu/quota.py): GPU memory in MiB and compute in percent
units after percentages and defaults are resolved, from the pods' allocation records, which is
what a ResourceQuota's own ``status.used`` cannot show for percentage requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kube_vgpu.cluster import ClusterCache
from kube_vgpu.config import Config

from .cluster import Cluster


@dataclass(frozen=True)
class Row:
    """One hard value: namespace, quota name, key as written, used and hard (MiB or percent units)."""

    namespace: str
    quota: str
    key: str
    used: int
    hard: int


def build(cluster: Cluster, config: Config | None = None) -> list[Row]:
    """Rows sorted by namespace, quota, key."""
    cfg = config or Config()
    logging.getLogger("kube_vgpu.cluster").setLevel(logging.ERROR)
    cache = ClusterCache(cfg, clock=lambda: cluster.now)
    cache.replace_nodes(cluster.nodes)
    cache.replace_pods(cluster.pods)
    cache.replace_quotas(cluster.quotas)
    rows = []
    for ns in cache.quotas.namespaces():
        used = cache.namespace_usage(ns)
        for lim in cache.quotas.limits(ns):
            rows.append(Row(ns, lim.quota, lim.key, used.mib if lim.what == "mib" else used.cores, lim.hard))
    return sorted(rows, key=lambda r: (r.namespace, r.quota, r.key))


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [{"namespace": r.namespace, "quota": r.quota, "resource": r.key, "used": r.used, "hard": r.hard}
            for r in rows]


def render_table(rows: list[Row]) -> str:
    """A table; ``(none)`` when no namespace has a GPU quota."""
    if not rows:
        return "no ResourceQuota names a kube-vgpu memory or cores resource\n"
    head = ("NAMESPACE", "QUOTA", "RESOURCE", "USED", "HARD", "USE%")
    body = [(r.namespace, r.quota, r.key, str(r.used), str(r.hard),
             f"{100 * r.used // r.hard}%" if r.hard else "-") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() + "\n"
                   for line in [head, *body])
