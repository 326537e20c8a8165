"""The page questions of one generate engine, answered in one place.

A paged engine's pages (page_pool.py: the block pool with its reference counts,
each slot's pages and the page table) are shared by the decode slots and, when the
prefix cache lives in the same pool, by cached prefix blocks. Every executor asks here
whether work fits:

  - `can_start`: a prefix joining the running slots, with its first step and theirs;
    pages only the prefix cache holds are taken back to make that room (continuous
    admission with preemption: the threaded orchestrator);
  - `step_fits`: the next generate step of the running slots (else someone is preempted);
  - `reserve` / `unreserve`: the most pages a whole sequence may take, promised so that no
    step ever runs short (admission without preemption: lock-step and offline);
  - `share` / `unshare` / `sole_holder`: a prefix cache's blocks as extra holders of the
    pages a slot wrote (prefix_cache.PageStore), so a later request links them.

With a contiguous KV cache (`pages` None) everything fits: slots are the only limit.

The page bookkeeping (page_pool.SlotPages, a PagePlanner's `kv_pages`) is passed in; it
needs `free_count`, `page_size`, `pool` (num_pages, incref, decref, refcount),
`pages_to_start`, `pages_for_step` and `pages_for_sequence`. The prefix cache needs
`make_room(n)`. Concurrency: owned by the thread that owns the engine's slots (the generate thread), as the pages are.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any


class KVCacheManager:
    """Page admission for one engine. `pages`: the engine's `kv_pages` (its PagePlanner's; None: contiguous);
    `cache`: a prefix cache whose blocks live in those pages (may be set later)."""

    def __init__(self, pages: Any | None, cache: Any | None = None):
        self.pages = pages
        self.cache = cache
        self._reserved: dict[Hashable, int] = {}

    @property
    def paged(self) -> bool:
        return self.pages is not None

    def can_start(self, tokens: int, shared: int = 0, *, planned: int = 0) -> bool:
        """Whether a `tokens`-token prefix, `shared` of whose pages are linked from the
        prefix cache, fits with its first step beside the next step of the running slots
        (and `planned` pages promised to prefixes admitted before it this turn)."""
        if self.pages is None:
            return True
        return self._room(self.pages_to_start(tokens, shared) + self.pages.pages_for_step()
                          + planned)

    def pages_to_start(self, tokens: int, shared: int = 0) -> int:
        """New pages a prefix takes once inserted and through its first step (0 when
        contiguous)."""
        if self.pages is None:
            return 0
        return self.pages.pages_to_start(tokens) - shared

    def free(self, slot: int) -> None:
        """A slot's pages go back to the pool (the page planner's free_slot, which the
        executor calls too, finds nothing left to free)."""
        if self.pages is not None:
            self.pages.free(slot)

    def step_fits(self, *, reclaim: bool = True) -> bool:
        """Whether the next generate step's pages are free (taking back cache-only pages
        first when `reclaim`)."""
        if self.pages is None:
            return True
        need = self.pages.pages_for_step()
        return self._room(need) if reclaim else need <= self.pages.free_count

    def reserve(self, key: Hashable, tokens: int) -> bool:
        """Promises `key` the most pages a `tokens`-token sequence may take, if that many
        are not promised already; False (promising nothing) when they are."""
        if self.pages is None:
            return True
        need = self.pages.pages_for_sequence(tokens)
        if need + sum(self._reserved.values()) > self.pages.pool.num_pages:
            return False
        self._reserved[key] = need
        return True

    def unreserve(self, key: Hashable) -> None:
        self._reserved.pop(key, None)

    def clear_reservations(self) -> None:
        self._reserved.clear()

    @property
    def reserved(self) -> int:
        """Pages promised to running sequences."""
        return sum(self._reserved.values())

    # ---- prefix sharing: pages a prefix cache holds beside the slots ---------------------

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def share(self, pages: Iterable[int]) -> None:
        """One more holder (a prefix-cache block) of each of `pages`, which are held."""
        self.pages.pool.incref(pages)

    def unshare(self, pages: Iterable[int]) -> None:
        """One holder fewer; pages nobody holds any more are free again."""
        self.pages.pool.decref(pages)

    def sole_holder(self, page: int) -> bool:
        """Whether one owner alone holds `page` (a cache block no slot links)."""
        return self.pages.pool.refcount(page) == 1

    def stats(self) -> dict:
        """kv_pages / kv_pages_free / kv_page_size, and kv_bytes / kv_bytes_used (device
        bytes of the pool and the sliding layers' rings, SlotPages.kv_bytes; 0 where the
        engine gave none) for the stats and the metrics ({} when contiguous)."""
        if self.pages is None:
            return {}
        total, used = self.pages.kv_bytes()
        return {"kv_pages": self.pages.pool.num_pages, "kv_pages_free": self.pages.free_count,
                "kv_page_size": self.page_size, "kv_bytes": total, "kv_bytes_used": used}

    def _room(self, need: int) -> bool:
        free = self.pages.free_count
        if need > free and self.cache is not None:
            self.cache.make_room(need - free)
        return need <= self.pages.free_count
