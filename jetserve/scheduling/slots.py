"""Slot bookkeeping for one generate engine (plain Python, no jax).

Owned by that engine's generate thread alone: no locks. Readers on other threads (stats)
only look at `in_use`, which is a plain int read.
"""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

T = TypeVar("T")


class SlotTable(Generic[T]):
    """Which request occupies which of the engine's `size` decode slots."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a generate engine needs at least one slot, got {size}")
        self.size = size
        self._free = list(range(size))  # a heap: the lowest free slot is taken first
        self._owner: dict[int, T] = {}
        self.in_use = 0

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquire(self, owner: T) -> int:
        if not self._free:
            raise RuntimeError("no free slot")
        slot = heapq.heappop(self._free)
        self._owner[slot] = owner
        self.in_use = len(self._owner)
        return slot

    def release(self, slot: int) -> T:
        owner = self._owner.pop(slot)
        heapq.heappush(self._free, slot)
        self.in_use = len(self._owner)
        return owner

    def owner(self, slot: int) -> T | None:
        return self._owner.get(slot)

    def rows(self) -> list[tuple[int, T]]:
        """(slot, owner) for every occupied slot, in slot order: a snapshot for one step."""
        return sorted(self._owner.items())
