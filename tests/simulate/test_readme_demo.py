"""README.md's claims about `make demo` (`kube-vgpu replay` on the built-in synthetic cluster) are
what the replay prints: the cluster's size and the allocation at 100% arrived for the three
policies the README compares (the table's two-decimal means over the default seeds)."""

from __future__ import annotations

import re
from pathlib import Path

from replay import main as sim
from replay.synthetic import synthetic_nodes, synthetic_pods

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_states_the_demos_cluster_and_numbers() -> None:
    nodes = synthetic_nodes()
    pods = synthetic_pods(nodes)
    size = re.search(r"synthetic cluster \((\d+) nodes, (\d+) GPUs", README)
    assert size, "README no longer states the synthetic cluster's size"
    assert (int(size.group(1)), int(size.group(2))) == (len(nodes), sum(len(n.devices) for n in nodes))

    claim = re.search(r"falls behind BestFit\s+\((\d+\.\d+)% against (\d+\.\d+)% at 100% arrived\);"
                      r".*?comes out on top\s+\((\d+\.\d+)%\)", README, re.S)
    assert claim, "README no longer compares fgd, bestfit and fgd-bestfit on the demo"
    fgd, bestfit, fgd_bestfit = (float(g) for g in claim.groups())

    # the demo's defaults: seeds 42 and 43, inflate 1.3 (replay/main.py main())
    results = sim.run_all(nodes, pods, ["fgd", "bestfit", "fgd-bestfit"], [42, 43], 1.3, jobs=1, progress=False)
    at100 = {pol: round(pts[100][0], 2) for pol, pts in sim.summarise(results).items()}
    assert at100 == {"fgd": fgd, "bestfit": bestfit, "fgd-bestfit": fgd_bestfit}, (
        f"README says fgd {fgd}, bestfit {bestfit}, fgd-bestfit {fgd_bestfit} at 100% arrived; "
        f"`make demo` prints {at100}")
    assert fgd_bestfit > bestfit > fgd  # "falls behind BestFit", "comes out on top"
