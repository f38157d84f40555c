"""One bounded memo for the placement engine's caches.

A dict that holds at most ``capacity`` entries. When full, adding a key drops the least recently
used entry (``lru=True``: a hit makes an entry the most recent) or the oldest one (``lru=False``:
hits cost one dict lookup, for memos read far more often than written). Not thread-safe: the
engine is used from one thread at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """At most ``capacity`` (>= 1) key -> value entries; see the module docstring.

    Raises ValueError for a capacity below 1."""

    __slots__ = ("capacity", "lru", "_d")

    def __init__(self, capacity: int, lru: bool = True):
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} is not allowed; it must be at least 1")
        self.capacity = capacity
        self.lru = lru
        self._d: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        """The value for ``key``, or None (with ``lru``, a hit becomes the most recent entry)."""
        d = self._d
        if not self.lru:
            return d.get(key)
        v = d.pop(key, None)
        if v is not None:
            d[key] = v
        return v

    def put(self, key: K, value: V) -> V:
        """Store ``value`` (not None) under ``key`` as the most recent entry, dropping the least
        recent (or oldest) one when over capacity; returns ``value``."""
        d = self._d
        d.pop(key, None)
        d[key] = value
        if len(d) > self.capacity:
            del d[next(iter(d))]
        return value

    def clear(self) -> None:
        """Drop every entry."""
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[K]:
        """Keys, least recent (or oldest) first."""
        return iter(self._d)
