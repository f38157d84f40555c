"""`make bench`: run every benchmark script in this folder in turn and print their numbers.

Each benchmark prints its own numbers and targets; nothing here asserts. A benchmark that needs
something this machine lacks (the shared trace, a C compiler) says so and is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"run_all.py"}
#: run only with a real control plane (KUBE_BIN_DIR, see tests/e2e/README.md)
NEEDS_CONTROL_PLANE = {"e2e_throughput.py"}


def main() -> int:
    scripts = sorted(p for p in HERE.glob("*.py") if p.name not in SKIP and not p.name.startswith("_"))
    failed = []
    for s in scripts:
        print(f"\n######## {s.name} ########", flush=True)
        if s.name in NEEDS_CONTROL_PLANE and not os.environ.get("KUBE_BIN_DIR"):
            print(f"######## {s.name}: skipped (needs KUBE_BIN_DIR: kube-apiserver, kube-scheduler, etcd)", flush=True)
            continue
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(s)], cwd=HERE.parent)
        print(f"######## {s.name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(s.name)
    if failed:
        print(f"\nbenchmarks that failed to run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
