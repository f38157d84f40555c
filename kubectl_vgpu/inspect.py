"""``kubectl vgpu inspect``: per node and per GPU, what is booked (memory, cores, slots) and by whom.

Everything comes from the two annotations of our protocol, decoded by the domain codec: the node
inventory (``kube-vgpu.io/node-inventory``) and each pod's allocation (``kube-vgpu.io/allocation``).
Pods in phase Succeeded or Failed hold nothing (the scheduler releases them); terminating pods
still hold their GPUs. Output: an 80-column table, or JSON with ``-o json``, or with ``--format
gpushare`` the table layout of Alibaba gpushare's ``kubectl inspect gpushare`` (:func:`render_gpushare`),
for operators and scripts that read that one.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from kube_vgpu.codec import decode_inventory, read_allocation
from kube_vgpu.config import Config
from kube_vgpu.cordon import cordoned_tokens, is_cordoned
from kube_vgpu.errors import CodecError
from kube_vgpu.model import GPUDevice
from kube_vgpu.resources import ANN_BIND_PHASE, ANN_NODE_INVENTORY
from kube_vgpu.views import NodeView, PodView

from .cluster import Cluster
from .text import safe

WIDTH = 80


@dataclass
class Share:
    """One container's booking on one GPU."""

    container: str
    init: bool
    memory_mib: int
    cores: int


@dataclass
class PodOnGpu:
    """A pod's collapsed usage of one GPU (init containers folded in) and its per-container shares."""

    namespace: str
    name: str
    memory_mib: int
    cores: int
    slots: int
    phase: str
    bind_phase: str
    shares: list[Share] = field(default_factory=list)


@dataclass
class GpuRow:
    device: GPUDevice
    pods: list[PodOnGpu] = field(default_factory=list)
    cordoned: bool = False  #: an admin cordoned it (kube_vgpu/cordon.py): no new pods

    @property
    def memory(self) -> int:
        return sum(p.memory_mib for p in self.pods)

    @property
    def cores(self) -> int:
        return sum(p.cores for p in self.pods)

    @property
    def slots(self) -> int:
        return sum(p.slots for p in self.pods)


@dataclass
class NodeReport:
    name: str
    gpus: list[GpuRow]
    heartbeat: float
    age: float | None
    stale: bool
    problem: str | None = None  # inventory missing/invalid while pods hold GPUs there
    orphans: list[str] = field(default_factory=list)  # pods booked on GPUs not in the inventory
    address: str = "unknown"  #: the node's InternalIP (status.addresses), as gpushare's inspect shows it


@dataclass
class Report:
    nodes: list[NodeReport]
    warnings: list[str]
    source: str


def _internal_ip(node: NodeView) -> str:
    """The node's ``InternalIP`` from ``status.addresses``, or ``unknown``. Never raises."""
    addrs = node.status.get("addresses")
    for a in addrs if isinstance(addrs, list) else []:
        if isinstance(a, dict) and a.get("type") == "InternalIP" and isinstance(a.get("address"), str):
            return str(a["address"])
    return "unknown"


def build(cluster: Cluster, config: Config | None = None) -> Report:
    """Decode every node inventory and pod allocation into per-GPU rows."""
    cfg = config or Config()
    warnings = list(cluster.warnings)
    nodes: dict[str, NodeReport] = {}
    for n in sorted(map(NodeView, cluster.nodes), key=lambda n: n.name):
        name = n.name
        text = n.annotations.get(ANN_NODE_INVENTORY)
        if text is None:
            continue
        try:
            inv = decode_inventory(text)
        except CodecError as e:
            nodes[name] = NodeReport(name, [], 0.0, None, True, problem=f"invalid inventory: {e}")
            continue
        age = cluster.now - inv.heartbeat if cluster.now else None
        stale = age is not None and age > cfg.scheduling.inventory_stale_seconds
        gpus: list[GpuRow] = []
        seen: dict[str, int] = {}
        cordon = cordoned_tokens(n.annotations)
        for d in inv.devices:
            if d.uuid in seen:
                warnings.append(f"node {name}: inventory lists GPU {d.uuid} twice (index {seen[d.uuid]} and "
                                f"{d.index}); only index {seen[d.uuid]} is shown")
                continue
            seen[d.uuid] = d.index
            gpus.append(GpuRow(d, cordoned=is_cordoned(d, cordon)))
        gpus.sort(key=lambda g: g.device.index)
        nodes[name] = NodeReport(name, gpus, inv.heartbeat, age, stale, address=_internal_ip(n))
    for p in sorted(map(PodView, cluster.pods), key=lambda p: (p.namespace, p.name)):
        if not p.holds_gpus:
            continue
        phase = p.phase or "Pending"
        key = p.key
        try:
            alloc = read_allocation(p)
        except CodecError as e:
            warnings.append(f"pod {key}: {e}")
            continue
        if alloc is None:
            continue
        node = nodes.get(alloc.node)
        if node is None:
            node = nodes[alloc.node] = NodeReport(alloc.node, [], 0.0, None, True,
                                                  problem="no vGPU inventory on this node")
        by_uuid = {g.device.uuid: g for g in node.gpus}
        bind_phase = str(p.annotations.get(ANN_BIND_PHASE) or "")
        for uuid, (mem, cores, slots) in sorted(alloc.usage().items()):
            row = by_uuid.get(uuid)
            if row is None:
                node.orphans.append(f"{key} on {uuid}")
                continue
            shares = [Share(c.name, c.init, d.memory_mib, d.cores)
                      for c in alloc.containers for d in c.devices if d.uuid == uuid]
            row.pods.append(PodOnGpu(p.namespace, p.name,
                                     mem, cores, slots, phase, bind_phase, shares))
    for node in nodes.values():
        for g in node.gpus:
            d = g.device
            over = [f"{what} {used} of {total}" for what, used, total in (
                ("memory MiB", g.memory, d.memory_mib), ("cores %", g.cores, d.cores), ("slots", g.slots, d.split))
                if used > total]
            if over:
                warnings.append(f"node {node.name} GPU {d.index} ({d.uuid}): booked beyond its inventory: "
                                f"{', '.join(over)} (by {', '.join(f'{p.namespace}/{p.name}' for p in g.pods)})")
    return Report(sorted(nodes.values(), key=lambda n: n.name), warnings, cluster.source)


# -- rendering ------------------------------------------------------------------------------------

def _pct(part: int, whole: int) -> str:
    return f"{part * 100 // whole}%" if whole > 0 else "-"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(max(seconds, 0))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _cut(text: str, width: int) -> str:
    """Fit a table cell: ``text`` sanitised, cut to ``width`` with a trailing ``~``."""
    text = safe(text)
    return text if len(text) <= width else text[: width - 1] + "~"


def _wrap(text: str, indent: str) -> list[str]:
    """A message in full (sanitised), wrapped at WIDTH; continuation lines indented."""
    return textwrap.wrap(safe(text), WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=True, break_on_hyphens=False) or [indent.rstrip()]


def _short_uuid(uuid: str) -> str:
    uuid = safe(uuid)
    return uuid if len(uuid) <= 12 else uuid[:12]


def _totals(report: Report) -> dict[str, int]:
    t = {"nodes": 0, "gpus": 0, "memory_mib": 0, "memory_total_mib": 0, "cores": 0, "cores_total": 0,
         "slots": 0, "slots_total": 0, "pods": 0}
    pods: set[str] = set()
    for n in report.nodes:
        if n.gpus:
            t["nodes"] += 1
        for g in n.gpus:
            t["gpus"] += 1
            t["memory_mib"] += g.memory
            t["memory_total_mib"] += g.device.memory_mib
            t["cores"] += g.cores
            t["cores_total"] += g.device.cores
            t["slots"] += g.slots
            t["slots_total"] += g.device.split
            pods.update(f"{p.namespace}/{p.name}" for p in g.pods)
    t["pods"] = len(pods)
    return t


ROW = "{idx:>3}  {uuid:<12}  {model:<15}  {mem:>20}  {cores:>8}  {slots:>6}  {pods:>4}"


def render_table(report: Report, details: bool = False) -> str:
    """The human table; every line is at most 80 characters."""
    out: list[str] = []
    for n in report.nodes:
        head = f"NODE {n.name}"
        if n.gpus:
            head += f"  {len(n.gpus)} GPU{'s' if len(n.gpus) != 1 else ''}, heartbeat {_age(n.age)} ago"
            if n.stale:
                head += " (STALE)"
        out.append(_cut(head, WIDTH))
        if n.problem:
            out += _wrap(f"! {n.problem}", "  ")
        if n.gpus:
            out.append(ROW.format(idx="GPU", uuid="UUID", model="MODEL", mem="MEMORY MiB",
                                  cores="CORES %", slots="SLOTS", pods="PODS"))
        for g in n.gpus:
            d = g.device
            mem = f"{g.memory}/{d.memory_mib} {_pct(g.memory, d.memory_mib):>4}"
            model = _cut(d.model.removeprefix("NVIDIA "), 15)
            out.append(ROW.format(idx=d.index, uuid=_short_uuid(d.uuid), model=model, mem=mem,
                                  cores=f"{g.cores}/{d.cores}", slots=f"{g.slots}/{d.split}",
                                  pods=len(g.pods)))
            if not d.healthy:
                out.append("       ! unhealthy: not offered to new pods")
            if g.cordoned:
                out.append("       ! cordoned: not offered to new pods (kubectl vgpu uncordon)")
            if details:
                for p in g.pods:
                    state = "" if p.phase == "Running" else f" [{p.phase}{'/' + p.bind_phase if p.bind_phase else ''}]"
                    for s in p.shares:
                        who = _cut(f"{p.namespace}/{p.name}/{s.container}{' (init)' if s.init else ''}{state}", 54)
                        out.append(f"       {who:<54}{s.memory_mib:>10} MiB {s.cores:>3}%")
        for o in n.orphans:
            out += _wrap(f"! booked on a GPU missing from the inventory: {o}", "  ")
        out.append("")
    t = _totals(report)
    if not report.nodes:
        out.append("No node has a kube-vgpu inventory (is the device plugin running?).")
        out.append("")
    out.append(_cut(f"CLUSTER  {t['gpus']} GPUs on {t['nodes']} nodes, {t['pods']} pods", WIDTH))
    out.append(_cut(f"  memory {t['memory_mib']}/{t['memory_total_mib']} MiB "
                    f"({_pct(t['memory_mib'], t['memory_total_mib'])})  "
                    f"cores {t['cores']}/{t['cores_total']}% ({_pct(t['cores'], t['cores_total'])})  "
                    f"slots {t['slots']}/{t['slots_total']}", WIDTH))
    if report.warnings:
        out.append("")
        for w in report.warnings:
            out += _wrap(f"warning: {w}", "")
    return "\n".join(out) + "\n"


def to_json(report: Report) -> dict[str, Any]:
    """The machine-readable report (``-o json``)."""
    nodes = []
    for n in report.nodes:
        gpus = []
        for g in n.gpus:
            d = g.device
            gpus.append({
                "index": d.index, "uuid": d.uuid, "model": d.model, "healthy": d.healthy, "numa": d.numa,
                "cordoned": g.cordoned,
                "memoryMiB": {"allocated": g.memory, "total": d.memory_mib},
                "cores": {"allocated": g.cores, "total": d.cores},
                "slots": {"allocated": g.slots, "total": d.split},
                "pods": [{"namespace": p.namespace, "name": p.name, "phase": p.phase, "bindPhase": p.bind_phase,
                          "memoryMiB": p.memory_mib, "cores": p.cores, "slots": p.slots,
                          "containers": [{"name": s.container, "init": s.init, "memoryMiB": s.memory_mib,
                                          "cores": s.cores} for s in p.shares]} for p in g.pods],
            })
        nodes.append({"name": n.name, "heartbeat": n.heartbeat, "heartbeatAgeSeconds": n.age, "stale": n.stale,
                      "problem": n.problem, "orphans": n.orphans, "gpus": gpus})
    t = _totals(report)
    return {"source": report.source, "nodes": nodes, "warnings": report.warnings,
            "total": {"nodes": t["nodes"], "gpus": t["gpus"], "pods": t["pods"],
                      "memoryMiB": {"allocated": t["memory_mib"], "total": t["memory_total_mib"]},
                      "cores": {"allocated": t["cores"], "total": t["cores_total"]},
                      "slots": {"allocated": t["slots"], "total": t["slots_total"]}}}


# -- gpushare's layout ----------------------------------------------------------------------------
#
# AliyunContainerService/gpushare-device-plugin cmd/inspect (``kubectl inspect gpushare``) prints
# through Go's text/tabwriter (minwidth 0, tabwidth 0, padding 2, pad with spaces, no flags):
#
#   NAME<TAB>IPADDRESS<TAB>GPU0(Allocated/Total)<TAB>...GPU Memory(GiB)
#   <node><TAB><InternalIP or unknown><TAB><used>/<total><TAB>...<used>/<total of the node>
#   <dashes: the first node row's length before alignment, tabs included, + 20>
#   Allocated/Total GPU Memory In Cluster:
#   <used>/<total> (<percent, truncated>%)<TAB>
#
# and with -d, per node: "NAME:<TAB>node", "IPADDRESS:<TAB>ip", a blank line, "NAME<TAB>NAMESPACE<TAB>
# GPU0(Allocated)<TAB>...", one row per pod, "Allocated :<TAB>n (p%)<TAB>", "Total :<TAB>n <TAB>",
# dashes (the node's pod rows' length + 10), and at the end, after two blank lines,
# "Allocated/Total GPU Memory In Cluster:<TAB>used/total (p%)<TAB>". gpushare's columns are GPU
# indexes 0..max-1 ("0/0" where a node has no such GPU). Its PENDING column (pods bound to a node
# but to no GPU yet) never appears: a kube-vgpu allocation always names its GPUs.

#: MiB per unit of the gpushare table
GPUSHARE_UNITS = {"GiB": 1024, "MiB": 1}


def tabwriter(text: str, padding: int = 2) -> str:
    """``text`` aligned as Go's ``text/tabwriter.NewWriter(w, 0, 0, padding, ' ', 0)`` prints it.

    Cells are tab-terminated; the text after a line's last tab is not part of any column. A column
    block is a run of consecutive lines that have a cell in that column; its width is the widest
    cell + padding.
    """
    lines = [line.split("\t") for line in text.split("\n")]
    out: list[str] = []

    def write(widths: list[int], line0: int, line1: int) -> None:
        for i in range(line0, line1):
            for j, cell in enumerate(lines[i]):
                out.append(cell + " " * (widths[j] - len(cell)) if j < len(widths) else cell)
            if i + 1 < len(lines):
                out.append("\n")

    def fmt(widths: list[int], line0: int, line1: int) -> None:
        column = len(widths)
        this = line0
        while this < line1:
            if column >= len(lines[this]) - 1:
                this += 1
                continue
            write(widths, line0, this)
            line0 = this
            width = 0
            while this < line1 and column < len(lines[this]) - 1:
                width = max(width, len(lines[this][column]) + padding)
                this += 1
            fmt(widths + [width], line0, this)
            line0 = this
        write(widths, line0, line1)

    fmt([], 0, len(lines))
    return "".join(out)


def _gpushare_cells(report: Report, per: int) -> list[tuple[NodeReport, dict[int, tuple[int, int]]]]:
    """Per node with GPUs: {GPU index: (allocated, total)} in units of ``per`` MiB (allocated rounded
    up, so a share is never shown smaller than it is; total rounded down, as gpushare's device plugin
    counts whole units)."""
    out = []
    for n in report.nodes:
        cells = {g.device.index: (-(-g.memory // per), g.device.memory_mib // per) for g in n.gpus}
        if sum(t for _, t in cells.values()) > 0:
            out.append((n, cells))
    return out


def _go_pct(used: int, total: int) -> int:
    return int(used / total * 100) if total > 0 else 0  # gpushare: int64(float64 ratio * 100)


def render_gpushare(report: Report, details: bool = False, unit: str = "GiB") -> str:
    """The report in gpushare's ``kubectl inspect gpushare`` layout (see the comment above);
    ``unit``: GiB or MiB (gpushare's device plugin ``--memory-unit``). Raises KeyError for another unit."""
    per = GPUSHARE_UNITS[unit]
    nodes = _gpushare_cells(report, per)
    used_all = sum(a for _, c in nodes for a, _ in c.values())
    total_all = sum(t for _, c in nodes for _, t in c.values())
    if details:
        return _gpushare_details(nodes, per, used_all, total_all)
    width = max((max(c) + 1 for _, c in nodes), default=0)
    buf = "NAME\tIPADDRESS\t" + "".join(f"GPU{i}(Allocated/Total)\t" for i in range(width))
    buf += f"GPU Memory({unit})\n"
    rule = 0
    for n, cells in nodes:
        row = f"{safe(n.name)}\t{safe(n.address)}\t"
        row += "".join("{}/{}\t".format(*cells[i]) if i in cells else "0/0\t" for i in range(width))
        row += f"{sum(a for a, _ in cells.values())}/{sum(t for _, t in cells.values())}\n"
        rule = rule or len(row) + 20
        buf += row
    buf += "-" * rule + "\n"
    buf += "Allocated/Total GPU Memory In Cluster:\n"
    buf += f"{used_all}/{total_all} ({_go_pct(used_all, total_all)}%)\t\n"
    return tabwriter(buf)


def _gpushare_details(nodes: list[tuple[NodeReport, dict[int, tuple[int, int]]]], per: int, used_all: int,
                      total_all: int) -> str:
    buf = ""
    rule = 0
    for n, cells in nodes:
        count = max(cells) + 1
        buf += f"\nNAME:\t{safe(n.name)}\nIPADDRESS:\t{safe(n.address)}\n\n"
        buf += "NAME\tNAMESPACE\t" + "".join(f"GPU{i}(Allocated)\t" for i in range(count)) + "\n"
        pods: dict[tuple[str, str], dict[int, int]] = {}
        for g in n.gpus:
            for p in g.pods:
                pods.setdefault((p.namespace, p.name), {})[g.device.index] = p.memory_mib
        rows = ""
        for (ns, name), mem in sorted(pods.items()):
            rows += f"{safe(name)}\t{safe(ns)}\t" + "".join(f"{-(-mem.get(i, 0) // per)}\t" for i in range(count))
            rows += "\n"
        rule = rule or len(rows) + 10
        buf += rows
        used = sum(a for a, _ in cells.values())
        total = sum(t for _, t in cells.values())
        buf += f"Allocated :\t{used} ({_go_pct(used, total)}%)\t\nTotal :\t{total} \t\n" + "-" * rule + "\n"
    buf += f"\n\nAllocated/Total GPU Memory In Cluster:\t{used_all}/{total_all} ({_go_pct(used_all, total_all)}%)\t\n"
    return tabwriter(buf)
