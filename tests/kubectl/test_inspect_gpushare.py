"""``kubectl vgpu inspect --format gpushare``: gpushare's ``kubectl inspect gpushare`` layout.

The reference is gpushare's own output as published in its user guide
(AliyunContainerService/gpushare-scheduler-extender docs/userguide.md, two nodes with one 15 GiB GPU
each, 6 and 3 GiB allocated); the same cluster, booked by kube-vgpu, must print the same table. The
alignment is Go's text/tabwriter's, ported in ``kubectl_vgpu.inspect.tabwriter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kube_vgpu.codec import encode_allocation, encode_inventory
from kube_vgpu.model import ContainerAllocation, DeviceBooking, GPUDevice, NodeInventory, PodAllocation
from kubectl_vgpu import inspect
from kubectl_vgpu.cluster import Cluster
from kubectl_vgpu.main import main

SNAP = str(Path(__file__).parent / "data" / "cluster.json")
T = 1767225600

#: docs/userguide.md of gpushare-scheduler-extender, step 1, verbatim
README = """\
NAME                                IPADDRESS     GPU0(Allocated/Total)  GPU Memory(GiB)
cn-shanghai.i-uf61h64dz1tmlob9hmtb  192.168.0.71  6/15                   6/15
cn-shanghai.i-uf61h64dz1tmlob9hmtc  192.168.0.70  3/15                   3/15
------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
9/30 (30%)
"""


def node(name: str, ip: str, gpus: list[GPUDevice]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {
                "kube-vgpu.io/node-inventory": encode_inventory(NodeInventory(tuple(gpus), T - 5))}},
            "status": {"addresses": [{"type": "Hostname", "address": name}, {"type": "InternalIP", "address": ip}]}}


def pod(ns: str, name: str, node_name: str, bookings: list[tuple[str, int]]) -> dict[str, Any]:
    alloc = PodAllocation(node_name, (ContainerAllocation("main", False, tuple(
        DeviceBooking(u, m, 0) for u, m in bookings)),), T - 60)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "annotations": {"kube-vgpu.io/allocation": encode_allocation(alloc)}},
            "spec": {"nodeName": node_name, "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": "Running"}}


def gpu(uuid: str, index: int = 0, mib: int = 15 * 1024 + 600) -> GPUDevice:
    return GPUDevice(uuid, index, "Tesla P100-PCIE-16GB", mib, 100, 10, True, 0)


def readme_cluster() -> Cluster:
    a, b = "cn-shanghai.i-uf61h64dz1tmlob9hmtb", "cn-shanghai.i-uf61h64dz1tmlob9hmtc"
    nodes = [node(a, "192.168.0.71", [gpu("GPU-a")]), node(b, "192.168.0.70", [gpu("GPU-b")])]
    # gpushare pods after the webhook's translation: 3 GiB -> 3072 MiB each
    pods = [pod("default", "binpack-1-0", a, [("GPU-a", 3072)]), pod("default", "binpack-1-1", a, [("GPU-a", 3072)]),
            pod("default", "binpack-1-2", b, [("GPU-b", 3072)])]
    return Cluster(nodes, pods, now=T, source="test")


def test_the_user_guide_table_is_reproduced() -> None:
    out = inspect.render_gpushare(inspect.build(readme_cluster()))
    assert [line.rstrip() for line in out.splitlines()] == README.splitlines()
    assert out.splitlines()[-1] == "9/30 (30%)  "  # a tab-terminated cell: padded, as tabwriter prints it


def test_details_layout() -> None:
    out = inspect.render_gpushare(inspect.build(readme_cluster()), details=True)
    lines = out.splitlines()
    assert lines[:5] == ["", "NAME:       cn-shanghai.i-uf61h64dz1tmlob9hmtb", "IPADDRESS:  192.168.0.71", "",
                         "NAME         NAMESPACE  GPU0(Allocated)  "]
    assert lines[5:9] == ["binpack-1-0  default    3                ", "binpack-1-1  default    3                ",
                          "Allocated :  6 (40%)    ", "Total :      15         "]
    rows = "binpack-1-0\tdefault\t3\t\nbinpack-1-1\tdefault\t3\t\n"
    assert lines[9] == "-" * (len(rows) + 10)
    assert lines[-1] == "Allocated/Total GPU Memory In Cluster:  9/30 (30%)  " and lines[-3:-1] == ["", ""]


def test_columns_by_gpu_index_rounding_and_units() -> None:
    nodes = [node("big", "10.0.0.1", [gpu("G0", 0, 81920), gpu("G2", 2, 81920)]),
             node("small", "10.0.0.2", [gpu("S0", 0, 16000)])]
    pods = [pod("a", "p", "big", [("G0", 3000), ("G2", 1)]), pod("b", "q", "small", [("S0", 1025)])]
    report = inspect.build(Cluster(nodes, pods, now=T, source="t"))
    out = inspect.render_gpushare(report).splitlines()
    # GPU1 of "big" is not in its inventory (excluded): "0/0", as gpushare prints a missing device;
    # allocations are rounded up (3000 MiB shows as 3 GiB, 1 MiB as 1), totals down (16000 MiB = 15 GiB)
    assert out[0].split() == ["NAME", "IPADDRESS", "GPU0(Allocated/Total)", "GPU1(Allocated/Total)",
                              "GPU2(Allocated/Total)", "GPU", "Memory(GiB)"]
    assert out[1].split() == ["big", "10.0.0.1", "3/80", "0/0", "1/80", "4/160"]
    assert out[2].split() == ["small", "10.0.0.2", "2/15", "0/0", "0/0", "2/15"]
    assert out[-1].rstrip() == "6/175 (3%)"
    mib = inspect.render_gpushare(report, unit="MiB").splitlines()
    assert mib[0].endswith("GPU Memory(MiB)") and mib[1].split()[2:] == ["3000/81920", "0/0", "1/81920", "3001/163840"]


def test_tabwriter_port_matches_go_rules() -> None:
    # cells are tab-terminated; text after the last tab is outside every column; a line without a
    # cell in a column ends that column's block
    assert inspect.tabwriter("a\tbb\tc\naaa\tb\tc\n") == "a    bb  c\naaa  b   c\n"
    assert inspect.tabwriter("aaaa\tb\nno tabs here\nx\ty\n") == "aaaa  b\nno tabs here\nx  y\n"
    assert inspect.tabwriter("a\tb\t\nlong cell\t\n") == "a          b  \nlong cell  \n"


def test_hostile_names_cannot_break_the_columns() -> None:
    evil = "n\tEVIL\x1b[2J"
    c = Cluster([node(evil, "10.0.0.9\n10.6.6.6", [gpu("G")])], [], now=T, source="t")
    out = inspect.render_gpushare(inspect.build(c))
    assert "\x1b" not in out and "EVIL" in out
    row = out.splitlines()[1]
    assert row.split()[-1] == "0/15" and len(out.splitlines()) == 5


def test_cli_format_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["inspect", "--snapshot", SNAP, "--format", "gpushare"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("NAME        IPADDRESS  GPU0(Allocated/Total)") and out[0].endswith("GPU Memory(GiB)")
    assert out[1].split() == ["gpu-node-a", "unknown", "42/140", "27/140", "0/0", "0/0", "69/280"]
    assert out[-2:] == ["Allocated/Total GPU Memory In Cluster:", "240/622 (38%)  "]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("compat: {gpushareMemoryUnit: MiB}\n")
    assert main(["inspect", "--snapshot", SNAP, "--format", "gpushare", "-d", "--config", str(cfg)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["llm-finetune-0", "train", "40000", "0"] in rows and ["Total", ":", "287542"] in rows
    with pytest.raises(SystemExit):
        main(["inspect", "--snapshot", SNAP, "--format", "hami"])
