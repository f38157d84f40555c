"""The engine's one bounded memo: capacity kept, least recently used (or oldest) dropped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kube_vgpu.placement.memo import BoundedMemo


def test_lru_drops_the_least_recently_used() -> None:
    m: BoundedMemo[str, int] = BoundedMemo(2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1  # a is now the most recent
    m.put("c", 3)
    assert "b" not in m and list(m) == ["a", "c"] and len(m) == 2


def test_fifo_drops_the_oldest_whatever_was_read() -> None:
    m: BoundedMemo[str, int] = BoundedMemo(2, lru=False)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1
    m.put("c", 3)
    assert "a" not in m and list(m) == ["b", "c"]
    m.clear()
    assert len(m) == 0 and m.get("b") is None


def test_capacity_below_one_is_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match="capacity: 0 .*at least 1"):
        BoundedMemo(0)


@given(st.integers(1, 5), st.booleans(), st.lists(st.tuples(st.booleans(), st.integers(0, 8)), max_size=60))
@settings(max_examples=200, deadline=None)
def test_behaves_like_a_reference_model(capacity: int, lru: bool, ops: list[tuple[bool, int]]) -> None:
    m: BoundedMemo[int, int] = BoundedMemo(capacity, lru)
    ref: list[tuple[int, int]] = []  # (key, value), least recent first
    for put, k in ops:
        pos = next((i for i, (kk, _) in enumerate(ref) if kk == k), None)
        if put:
            if pos is not None:
                ref.pop(pos)
            ref.append((k, k * 10))
            ref = ref[-capacity:]
            assert m.put(k, k * 10) == k * 10
        else:
            want = None if pos is None else ref[pos][1]
            if pos is not None and lru:
                ref.append(ref.pop(pos))
            assert m.get(k) == want
        assert list(m) == [kk for kk, _ in ref]
