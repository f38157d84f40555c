"""examples/dra/gpu-slice.yaml asks for what the driver publishes (runs without a cluster;
tests/e2e/test_e2e_dra.py applies it to a real control plane and prepares its claim)."""

from __future__ import annotations

from pathlib import Path

import yaml

from kube_vgpu.dra import CAPACITY_CORES, CAPACITY_MEMORY, DEVICE_CLASS
from kube_vgpu.dra.slices import resource_slice
from kube_vgpu.model import GPUDevice
from kube_vgpu.quantity import parse_quantity

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dra" / "gpu-slice.yaml"


def test_example_claim_fits_the_published_request_policy() -> None:
    template, pod = yaml.safe_load_all(EXAMPLE.read_text())
    assert template["apiVersion"] == "resource.k8s.io/v1" and template["kind"] == "ResourceClaimTemplate"
    [req] = template["spec"]["spec"]["devices"]["requests"]
    ask = req["exactly"]
    assert ask["deviceClassName"] == DEVICE_CLASS
    caps = ask["capacity"]["requests"]
    assert set(caps) == {CAPACITY_MEMORY, CAPACITY_CORES}
    assert parse_quantity(caps[CAPACITY_MEMORY]) == 3000 * 2**20 and parse_quantity(caps[CAPACITY_CORES]) == 30
    dev = resource_slice("n", [GPUDevice(uuid="GPU-1", index=0, model="NVIDIA H200", memory_mib=143771)],
                         pool_generation=1)["spec"]["devices"][0]
    for name, want in caps.items():
        rng = dev["capacity"][name]["requestPolicy"]["validRange"]
        q, lo, hi, step = (parse_quantity(x) for x in (want, rng["min"], rng["max"], rng["step"]))
        assert lo <= q <= hi and (q - lo) % step == 0, f"{name}={want} is not a valid request ({rng})"
    # the pod uses the template, and its container the pod's claim
    [rc] = pod["spec"]["resourceClaims"]
    assert rc["resourceClaimTemplateName"] == template["metadata"]["name"]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": rc["name"]}]
