"""Cost of reading a pod through :mod:`kube_vgpu.views` against the raw dict walks it replaces.

Prints nanoseconds per operation (best of 5 runs) on a realistic extender pod: building a
``PodView``, and reading uid / node name / the life rule through it or through ``.get(...) or {}``.
A short run (about a second); nothing is asserted.

    python benchmarks/views_bench.py
"""

from __future__ import annotations

import timeit
from typing import Any

from kube_vgpu.views import PodView

POD: dict[str, Any] = {
    "metadata": {"name": "train-7", "namespace": "team-a", "uid": "0b6c-11", "resourceVersion": "8812",
                 "annotations": {"kube-vgpu.io/allocation": "{}", "x": "y"}, "labels": {"app": "train"}},
    "spec": {"schedulerName": "kube-vgpu", "nodeName": "", "priority": 0,
             "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1",
                                                                      "nvidia.com/gpumem": "3000"}}}]},
    "status": {"phase": "Pending"},
}


def _raw() -> tuple[str, str, bool]:
    meta = POD.get("metadata") or {}
    spec = POD.get("spec") or {}
    status = POD.get("status") or {}
    return (str(meta.get("uid") or ""), str(spec.get("nodeName") or ""),
            status.get("phase") not in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"))


def _view() -> tuple[str, str, bool]:
    v = PodView(POD)
    return v.uid, v.node_name, v.active


def main() -> None:
    n = 200_000
    for label, stmt in (("PodView(pod) build", lambda: PodView(POD)),
                        ("raw walk: uid, nodeName, active", _raw),
                        ("view: build + uid, node_name, active", _view)):
        best = min(timeit.repeat(stmt, number=n, repeat=5)) / n * 1e9
        print(f"{label:40s} {best:7.0f} ns")


if __name__ == "__main__":
    main()
