"""Property test of the DRA plugin's plan (grants -> per-GPU bookings): whatever results a claim
holds, the limits written are the sums of what was consumed per GPU, never above the GPU, and any
result the node cannot serve refuses the whole claim."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.dra.plugin import DRAPlugin, Options, PrepareError
from kube_vgpu.config import Config
from kube_vgpu.dra.claims import Grant
from kube_vgpu.model import GPUDevice

NODE = "n1"
DEVICES = (GPUDevice(uuid="GPU-a", index=0, model="m", memory_mib=24576, cores=100),
           GPUDevice(uuid="GPU-b", index=1, model="m", memory_mib=81920, cores=200))


def plugin() -> DRAPlugin:
    p = DRAPlugin(Config(), Options(node_name=NODE, dev_root="/nonexistent"), claims=None,  # type: ignore[arg-type]
                  nvml=object(), minor_of=lambda u: None)  # type: ignore[arg-type]
    p._devices = DEVICES
    return p


grant = st.builds(
    Grant, request=st.sampled_from(["a", "b", "c/d"]), pool=st.sampled_from([NODE, NODE, NODE, "n2"]),
    device=st.sampled_from(["gpu-0", "gpu-1", "gpu-1", "gpu-7"]),
    memory_mib=st.one_of(st.none(), st.integers(1, 90000)), cores=st.integers(1, 100),
    share_id=st.none())


@settings(max_examples=400, deadline=None)
@given(st.lists(grant, min_size=0, max_size=6))
def test_bookings_are_the_per_gpu_sums_within_the_gpu_or_the_claim_is_refused(grants: list[Grant]) -> None:
    p = plugin()
    by_name = {f"gpu-{d.index}": d for d in DEVICES}
    try:
        prepared = p._plan("ns", "c", "uid-1", grants)
    except PrepareError as e:
        # refused for a reason that really holds
        bad = [g for g in grants if g.pool != NODE or g.device not in by_name]
        over = False
        for name, d in by_name.items():
            mine = [g for g in grants if g.device == name and g.pool == NODE]
            mem = sum(d.memory_mib if g.whole else (g.memory_mib or 0) for g in mine)
            cores = sum(min(100, d.cores) if g.whole else g.cores for g in mine)
            over = over or mem > d.memory_mib or cores > d.cores
        assert bad or over, (str(e), grants)
        return
    assert all(g.pool == NODE and g.device in by_name for g in grants)
    assert [d.device for d in prepared.devices] == [g.device for g in grants]
    assert [d.requests for d in prepared.devices] == [(g.request.split("/")[0],) for g in grants]
    seen = list(dict.fromkeys(g.device for g in grants))
    assert [b.uuid for b in prepared.bookings] == [by_name[n].uuid for n in seen]
    for b, name in zip(prepared.bookings, seen, strict=True):
        d = by_name[name]
        mine = [g for g in grants if g.device == name]
        assert b.memory_mib == sum(d.memory_mib if g.whole else (g.memory_mib or 0) for g in mine) <= d.memory_mib
        assert b.cores == min(100, sum(min(100, d.cores) if g.whole else g.cores for g in mine))
        assert 1 <= b.cores <= 100
