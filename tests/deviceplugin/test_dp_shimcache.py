"""Per-container usage from the shim's shared cache file (layout defined by libvgpu, read by kube_vgpu.shimregion)."""

from __future__ import annotations

from pathlib import Path

from dp_helpers import write_region

from deviceplugin.shimcache import cache_path, read_container

MIB = 1024 * 1024


def test_reads_used_bytes_per_visible_device(tmp_path: Path) -> None:
    p = Path(cache_path(str(tmp_path), "uid-1", "main"))
    write_region(p, {0: 512 * MIB, 1: 3 * MIB})
    got = read_container(str(tmp_path), "uid-1", "main")
    assert got is not None and got.used[0] == 512 * MIB and got.used[1] == 3 * MIB
    assert got.oom_refusals == 0


def test_reads_the_shims_refusal_counter(tmp_path: Path) -> None:
    p = Path(cache_path(str(tmp_path), "uid-1", "main"))
    write_region(p, {0: MIB}, oom_refusals=7)
    got = read_container(str(tmp_path), "uid-1", "main")
    assert got is not None and got.oom_refusals == 7


def test_absent_short_or_foreign_file_is_no_data(tmp_path: Path) -> None:
    assert read_container(str(tmp_path), "uid-1", "main") is None
    p = Path(cache_path(str(tmp_path), "uid-1", "main"))
    p.parent.mkdir(parents=True)
    p.write_bytes(b"not a region")
    assert read_container(str(tmp_path), "uid-1", "main") is None
    assert read_container(str(tmp_path), "", "main") is None
