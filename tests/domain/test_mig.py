"""kube_vgpu.mig: the profile tables, the smallest-profile choice with the admin's allowlist,
fragmentation-aware placement over a GPU's geometry (property: no two instances ever share a memory
slice), whole-GPU plans, and the repartition-only-when-idle rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.mig import (
    MEMORY_SLICES,
    TABLES,
    Instance,
    MigError,
    choose_profile,
    free_starts,
    headroom,
    layout_error,
    place,
    plan,
    repartition_refusal,
    single_profile_error,
    table_for,
)
from kube_vgpu.resources import is_mig_resource, mig_resource

H200 = TABLES["H200-141GB"]
A100 = TABLES["A100-40GB"]


def test_tables_are_self_consistent() -> None:
    for t in TABLES.values():
        names = [p.name for p in t.profiles]
        assert len(names) == 7 and len(set(names)) == 7, t.key
        for p in t.profiles:
            assert all(0 <= s and s + p.memory_slices <= MEMORY_SLICES for s in p.starts), p
            assert 0 < p.memory_mib <= t.memory_mib, p
            # the instance count is what the placements allow side by side (the +me one: one)
            alone = 0
            got: list[Instance] = []
            while free_starts(t, p, got):
                got.append(Instance(p.name, free_starts(t, p, got)[0]))
                alone += 1
            assert alone == p.instances, (t.key, p.name)
        assert [p.name for p in t.profiles if p.media] == [names[1]]
        assert t.profiles[-1].compute_slices == 7 and t.profiles[-1].memory_slices == MEMORY_SLICES


def test_h200_names_and_counts_from_the_user_guide() -> None:
    got = {p.name: (p.compute_slices, p.instances) for p in H200.profiles}
    assert got == {"1g.18gb": (1, 7), "1g.18gb+me": (1, 1), "1g.35gb": (1, 4), "2g.35gb": (2, 3),
                   "3g.71gb": (3, 2), "4g.71gb": (4, 1), "7g.141gb": (7, 1)}


def test_table_by_model_name() -> None:
    assert table_for("NVIDIA H200", 143771) is H200
    assert table_for("NVIDIA A100-SXM4-40GB", 40960) is A100
    assert table_for("NVIDIA A100-SXM4-80GB", 81920) is TABLES["A100-80GB"]
    assert table_for("NVIDIA H100 80GB HBM3", 81559) is TABLES["H100-80GB"]
    assert table_for("Tesla T4", 15360) is None


def test_smallest_profile_that_holds_the_request() -> None:
    assert choose_profile(1, H200).name == "1g.18gb"
    assert choose_profile(18432, H200).name == "1g.18gb"
    assert choose_profile(18433, H200).name == "1g.35gb"  # 1 compute slice before 2g.35gb: same memory
    assert choose_profile(40000, H200).name == "3g.71gb"
    assert choose_profile(100000, H200).name == "7g.141gb"
    assert choose_profile(4000, A100).name == "1g.5gb"


def test_allowlist_is_respected() -> None:
    assert choose_profile(1000, H200, ["3g.71gb", "7g.141gb"]).name == "3g.71gb"
    assert choose_profile(1000, H200, ["2g.35gb", "1g.10gb"]).name == "2g.35gb"  # other models' names ignored
    # the media variant only when the admin names it
    assert choose_profile(1000, H200).media is False
    assert choose_profile(1000, H200, ["1g.18gb+me"]).name == "1g.18gb+me"


def test_no_profile_fits_names_request_model_and_profiles() -> None:
    with pytest.raises(MigError) as e:
        choose_profile(80000, H200, ["1g.18gb", "3g.71gb"])
    msg = str(e.value)
    assert "80000 MiB" in msg and "H200-141GB" in msg
    assert "1g.18gb (18432 MiB)" in msg and "3g.71gb (72704 MiB)" in msg
    with pytest.raises(MigError, match="must be a whole number of MiB > 0"):
        choose_profile(0, H200)


def test_placement_keeps_the_large_profiles_possible() -> None:
    # beside a 3g at 0 a 1g goes to slice 6, not 4: 4-5 stay free for a 2g
    pl = place(1000, H200, [Instance("3g.71gb", 0)])
    assert (pl.profile.name, pl.start) == ("1g.18gb", 6)
    assert free_starts(H200, H200.profile("2g.35gb"), [Instance("3g.71gb", 0), Instance("1g.18gb", 6)]) == [4]
    # on an empty GPU a 1g goes to the end, keeping the 4g / 3g halves whole where it can
    first = place(1000, H200, [])
    assert first.start == 6 and first.headroom[1] == 1  # a 4g.71gb still fits


def test_a_larger_profile_only_when_the_smaller_is_full() -> None:
    full = [Instance("1g.18gb", s) for s in range(7)]
    with pytest.raises(MigError, match=r"no free placement for 1000 MiB on H200-141GB .*profiles tried"):
        place(1000, H200, full)
    some = [Instance("3g.71gb", 0), Instance("2g.35gb", 4)]
    pl = place(1000, H200, some, ["1g.18gb", "1g.35gb"])
    assert (pl.profile.name, pl.start) == ("1g.18gb", 6)
    two = [Instance("3g.71gb", 0), Instance("1g.18gb", 4), Instance("1g.18gb", 5), Instance("1g.18gb", 6)]
    with pytest.raises(MigError):
        place(1000, H200, two, ["1g.18gb"])
    with pytest.raises(MigError, match="profiles tried: 1g.18gb, 2g.35gb"):
        place(1000, H200, [Instance("4g.71gb", 0), Instance("1g.35gb", 4), Instance("1g.35gb", 6)],
              ["1g.18gb", "2g.35gb"])


def test_invalid_layouts_named() -> None:
    assert "overlaps" in (layout_error(H200, [Instance("3g.71gb", 0), Instance("2g.35gb", 2)]) or "")
    assert "cannot start at memory slice 2" in (layout_error(H200, [Instance("3g.71gb", 2)]) or "")
    assert "does not exist" in (layout_error(H200, [Instance("1g.10gb", 0)]) or "")
    assert layout_error(H200, [Instance("4g.71gb", 0), Instance("3g.71gb", 4)]) is None
    with pytest.raises(MigError, match="not valid"):
        place(1000, H200, [Instance("7g.141gb", 0), Instance("1g.18gb", 0)])


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(sorted(TABLES)), reqs=st.lists(st.integers(1, 150_000), max_size=12),
       allow=st.lists(st.sampled_from(["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
                                       "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "1g.5gb", "2g.10gb"]),
                      max_size=4))
def test_placements_never_overlap(model: str, reqs: list[int], allow: list[str]) -> None:
    t = TABLES[model]
    got: list[Instance] = []
    for r in reqs:
        before = headroom(t, got)
        try:
            pl = place(r, t, got, allow)
        except MigError:
            continue
        assert pl.profile.memory_mib >= r
        got.append(Instance(pl.profile.name, pl.start))
        assert layout_error(t, got) is None, got
        assert headroom(t, got) <= before
        used = [s for i in got for s in t.profile(i.profile).slices_at(i.start)]
        assert len(used) == len(set(used)) and all(0 <= s < MEMORY_SLICES for s in used)


def test_plan_for_an_idle_gpu() -> None:
    layout = plan([60000, 18000, 18000, 30000], H200)
    assert layout_error(H200, layout) is None
    assert sorted(i.profile for i in layout) == ["1g.18gb", "1g.18gb", "1g.35gb", "3g.71gb"]
    with pytest.raises(MigError, match="no free placement for 100000 MiB"):
        plan([100000, 100000], H200)


def test_repartition_only_when_idle() -> None:
    assert repartition_refusal("GPU-a", {"MIG-1": 0, "MIG-2": 0}) is None
    why = repartition_refusal("GPU-a", {"MIG-1": 0, "MIG-2": 1})
    assert why is not None and "MIG-2" in why and "MIG-1" not in why and "GPU-a" in why


def test_single_needs_one_profile() -> None:
    assert single_profile_error({"MIG-1": "1g.10gb", "MIG-2": "1g.10gb"}) is None
    why = single_profile_error({"MIG-1": "1g.10gb", "MIG-2": "3g.40gb"})
    assert why is not None and "1g.10gb, 3g.40gb" in why


def test_mig_resource_names() -> None:
    assert mig_resource("nvidia.com/gpu", "1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert is_mig_resource("nvidia.com/mig-1g.10gb", "nvidia.com/gpu")
    assert not is_mig_resource("nvidia.com/mig-", "nvidia.com/gpu")
    assert not is_mig_resource("nvidia.com/gpumem", "nvidia.com/gpu")
    assert not is_mig_resource("example.com/mig-1g.10gb", "nvidia.com/gpu")
