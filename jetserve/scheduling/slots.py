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

    def move(self, src: int, dst: int) -> None:
        """src's owner now holds the free slot dst; src is free."""
        if dst in self._owner or src not in self._owner:
            raise RuntimeError(f"cannot move slot {src} to {dst}: {src} must be in use and "
                               f"{dst} free")
        self._free.remove(dst)
        self._free.append(src)
        heapq.heapify(self._free)  # remove() broke the heap order
        self._owner[dst] = self._owner.pop(src)

    def slot_of(self, owner: T) -> int | None:
        """The slot `owner` holds now (it may have moved since a step's snapshot)."""
        return next((s for s, o in self._owner.items() if o is owner), None)

    def owner(self, slot: int) -> T | None:
        return self._owner.get(slot)

    def rows(self) -> list[tuple[int, T]]:
        """(slot, owner) for every occupied slot, in slot order: a snapshot for one step."""
        return sorted(self._owner.items())


def step_batch(rows: list[tuple[int, T]], sizes: tuple[int, ...]) -> int:
    """The smallest of an engine's decode batch sizes (ascending, the last every slot:
    Engine.decode_batch_sizes) that holds every occupied slot of `rows`. Slots are taken
    lowest first, so a few requests step as a small batch."""
    top = max((slot for slot, _ in rows), default=0) + 1
    return next(b for b in sizes if b >= top)


def compaction(rows: list[tuple[int, T]], sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(src, dst) moves of occupied slots down into free ones that let a step run a
    smaller decode batch size: the slots at or past the smallest size that holds them all
    (by count) go to the lowest free slots below it. None when the size would not drop."""
    held = [slot for slot, _ in rows]
    if not held:
        return []
    want = next(b for b in sizes if b >= len(held))
    if step_batch(rows, sizes) == want:
        return []
    empty = sorted(set(range(want)) - set(held))
    movers = sorted(s for s in held if s >= want)
    return list(zip(movers, empty[:len(movers)], strict=True))  # enough: len(held) <= want


def rows_kwargs(batch: int, sizes: tuple[int, ...]) -> dict:
    """generate's `rows=` for a step of `batch` slots below the full batch; engines with
    one decode batch size are never given one."""
    return {} if batch == sizes[-1] else {"rows": batch}
