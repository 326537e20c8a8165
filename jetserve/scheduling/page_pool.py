"""Host-side accounting of KV pages (plain Python and numpy; never imports jax).

A paged KV cache keeps each layer's keys and values in a pool of fixed-size pages
(`engines.paged_kv`). Which page belongs to whom is decided here, on the host:

  - `PagePool`: the physical pages, a free list and a reference count per page. A page
    is either free (count 0, on the free list) or held by one or more owners (a slot, a
    prefix-cache entry). Counting references lets a cached prefix's pages be shared.
  - `SlotPages`: the pages of each decode slot of one engine, the page table the device
    reads, and each slot's length as the host knows it. The engine's PagePlanner
    (page_planner.py) asks it for pages on insert and before every generate step, and
    returns them on free_slot; the engine itself only gets the table.

Concurrency: an engine's SlotPages is touched only by the thread that calls its planner's
insert / generate / free_slot (the orchestrator's generate thread). Other threads may read
the plain-int counters (`free_count`) for stats.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """No free page is left; the caller should wait, or preempt a sequence."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PagePool:
    """`num_pages` pages with reference counts. Allocation takes the lowest free page."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # A stack, lowest on top: recently freed pages are reused first (warm in caches).
        self._free = list(range(num_pages - 1, -1, -1))
        self.free_count = num_pages

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with one reference; raises OutOfPages (taking none)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, {len(self._free)} of {self.num_pages} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        self.free_count = len(self._free)
        return out

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is free; only held pages can be shared")
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; pages nobody holds go back to the free list."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is already free (double free)")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        self.free_count = len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def check(self, owners: Mapping[object, Iterable[int]]) -> None:
        """Asserts the accounting invariant: every page is free, or held by exactly as
        many owners as its reference count says (an owner holds a page at most once).

        `owners` maps every live holder (a slot, a cache entry) to its pages.
        """
        held: dict[int, int] = {}
        for owner, pages in owners.items():
            pages = list(pages)
            if len(set(pages)) != len(pages):
                raise AssertionError(f"owner {owner!r} holds a page twice: {pages}")
            for p in pages:
                held[p] = held.get(p, 0) + 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p in range(self.num_pages):
            n = held.get(p, 0)
            if p in free and n:
                raise AssertionError(f"page {p} is free but held by {n} owner(s)")
            if p not in free and n == 0:
                raise AssertionError(f"page {p} is neither free nor held (leaked)")
            if self._refs[p] != n:
                raise AssertionError(f"page {p} has refcount {self._refs[p]}, {n} holder(s)")
        if self.free_count != len(self._free):
            raise AssertionError("free_count is stale")


class SlotPages:
    """Pages of each of B decode slots over one PagePool, and the device's page table.

    The table is i32[B, max_pages]; entries a slot does not hold point at `trash`, a page
    index past the pool that the device keeps as scratch (writes of empty slots land
    there, reads of it are masked).

    With speculative decoding (`lookahead` = K drafts) a step writes up to K + 1 positions
    per slot and keeps only some: before a step each slot gets pages through position
    length + K, after it the host counts the slot as long as it may have become (length
    + K + 1, an upper bound), and `sync` brings lengths back to the device's before the
    next step, returning the pages that only rejected positions used.
    """

    def __init__(self, *, slots: int, page_size: int, num_pages: int, max_seq_len: int,
                 lookahead: int = 0, page_bytes: int = 0, ring_bytes: int = 0):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.slots = slots
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_pages = pages_for(max_seq_len, page_size)  # per slot
        if num_pages < self.max_pages:
            raise ValueError(
                f"num_pages={num_pages} cannot hold one sequence of max_seq_len={max_seq_len} "
                f"({self.max_pages} pages of {page_size}); give at least {self.max_pages}")
        self.lookahead = lookahead
        # Device bytes of one page (every layer in the pool) and of every slot's ring of
        # pages (sliding layers: engines/paged_kv.py WindowRing), for the stats.
        self.page_bytes, self.ring_bytes = page_bytes, ring_bytes
        self.pool = PagePool(num_pages)
        self.trash = num_pages
        self.table = np.full((slots, self.max_pages), self.trash, np.int32)
        self._pages: dict[int, list[int]] = {}  # slot -> its pages, in position order
        self._len: dict[int, int] = {}  # slot -> tokens in its cache (next write position)

    # ---- questions the scheduler asks ----------------------------------------------------

    @property
    def free_count(self) -> int:
        return self.pool.free_count

    def pages_to_insert(self, tokens: int) -> int:
        """Pages an insert of a `tokens`-token prefix takes."""
        return pages_for(tokens, self.page_size)

    def pages_to_start(self, tokens: int) -> int:
        """Pages a `tokens`-token prefix holds once inserted and through its first step."""
        return pages_for(min(tokens + self.lookahead + 1, self.max_seq_len), self.page_size)

    def pages_for_sequence(self, tokens: int) -> int:
        """The most pages a sequence of `tokens` tokens (prompt and budget) may hold, the
        positions a speculative step writes past its end included."""
        if self.lookahead:  # a last step past the budget, and one more before it is read
            tokens += 2 * (self.lookahead + 1)
        return pages_for(min(tokens, self.max_seq_len), self.page_size)

    def pages_for_step(self) -> int:
        """Pages the next generate step must allocate (slots starting a new page)."""
        return sum(self._step_pages(s) for s in self._len)

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes of KV the device holds, bytes of it in use): the pool's pages and the
        rings; in use, the pages held and the rings of the slots holding a sequence."""
        ring_used = self.ring_bytes * len(self._len) // self.slots
        return (self.pool.num_pages * self.page_bytes + self.ring_bytes,
                self.pool.used_count * self.page_bytes + ring_used)

    def live_slots(self) -> list[int]:
        return sorted(self._len)

    def length(self, slot: int) -> int | None:
        return self._len.get(slot)

    def pages_of(self, slot: int) -> list[int]:
        return list(self._pages.get(slot, ()))

    # ---- what the engine does ------------------------------------------------------------

    def insert(self, slot: int, tokens: int, shared: Sequence[int] = ()) -> list[int]:
        """Gives `slot` pages for a `tokens`-token prefix (freeing what it held): the
        `shared` pages first (held pages another owner keeps too, e.g. a prefix cache's;
        one more reference each), then fresh ones."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} out of range [0, {self.slots})")
        if not 1 <= tokens <= self.max_seq_len:
            raise ValueError(f"prefix length {tokens} out of range [1, {self.max_seq_len}]")
        need = self.pages_to_insert(tokens)
        if shared and len(shared) * self.page_size >= tokens:
            raise ValueError(f"{len(shared)} shared pages leave no position of a "
                             f"{tokens}-token prefix to write")
        self.free(slot)
        pages = self.pool.alloc(need - len(shared))
        self.pool.incref(shared)
        pages = [*shared, *pages]
        self._pages[slot] = pages
        self._len[slot] = tokens
        self.table[slot, : len(pages)] = pages
        return pages

    def before_step(self, skip: Collection[int] = ()) -> int:
        """Allocates the pages this step writes into; returns the gather width in pages
        (the batch's most live pages, rounded up to a power of two, at most max_pages).
        `skip`: slots that write no new position this step (a mixed step's prompts,
        whose pages they hold already).

        Raises OutOfPages, allocating nothing, when the pool cannot cover the step.
        """
        need = [s for s in self._len if s not in skip for _ in range(self._step_pages(s))]
        fresh = self.pool.alloc(len(need))
        for s, p in zip(need, fresh, strict=True):
            self.table[s, len(self._pages[s])] = p
            self._pages[s].append(p)
        widest = max((len(p) for p in self._pages.values()), default=1)
        return width_bucket(widest, self.max_pages)

    def after_step(self, held: Collection[int] = ()) -> None:
        """Each live slot gained one token, or with lookahead K at most K + 1 (a full slot
        stays full, as on the device); the `held` slots sat the step out and gained none
        (the position they wrote is written again when they next step)."""
        for s, n in self._len.items():
            if s not in held:
                self._len[s] = min(n + self.lookahead + 1, self.max_seq_len)

    def sync(self, lengths, skip: Collection[int] = ()) -> None:
        """Speculative steps: each live slot's length as the device has it (lengths[slot],
        at most the host's upper bound); pages past it, written only at rejected
        positions, go back to the pool. `skip`: slots whose device length is not theirs
        yet (a mixed step's prompts, whose chunks have not all run)."""
        for s, n in self._len.items():
            if s in skip:
                continue
            true = min(int(lengths[s]), n)
            keep = pages_for(true, self.page_size)
            extra = self._pages[s][keep:]
            if extra:
                del self._pages[s][keep:]
                self.table[s, keep:keep + len(extra)] = self.trash
                self.pool.decref(extra)
            self._len[s] = true

    def free(self, slot: int) -> None:
        pages = self._pages.pop(slot, None)
        self._len.pop(slot, None)
        if pages:
            self.pool.decref(pages)
        self.table[slot, :] = self.trash

    def check(self, extra_owners: Mapping[object, Iterable[int]] | None = None) -> None:
        """The page invariant over slots (and any other holders, e.g. a prefix cache)."""
        owners: dict[object, Iterable[int]] = {("slot", s): p for s, p in self._pages.items()}
        owners.update(extra_owners or {})
        self.pool.check(owners)
        for s in range(self.slots):
            row = self.table[s]
            pages = self._pages.get(s, [])
            if list(row[: len(pages)]) != pages or (row[len(pages):] != self.trash).any():
                raise AssertionError(f"page table row of slot {s} disagrees with its pages")
            if s in self._len and len(pages) != pages_for(self._len[s], self.page_size):
                raise AssertionError(f"slot {s} holds {len(pages)} pages for "
                                     f"{self._len[s]} tokens")

    def _step_pages(self, slot: int) -> int:
        """Pages the next step writes into that the slot does not hold yet: through
        position length + lookahead (none for a full slot)."""
        n = self._len[slot]
        if n >= self.max_seq_len:
            return 0
        reach = min(n + self.lookahead + 1, self.max_seq_len)
        return max(0, pages_for(reach, self.page_size) - len(self._pages[slot]))


def width_bucket(pages: int, max_pages: int) -> int:
    """Gather width for `pages` live pages: the next power of two, capped at max_pages."""
    w = 1
    while w < pages:
        w *= 2
    return min(w, max_pages)


def width_buckets(max_pages: int) -> tuple[int, ...]:
    """Every gather width the decode step compiles for (one program each)."""
    out, w = [], 1
    while w < max_pages:
        out.append(w)
        w *= 2
    out.append(max_pages)
    return tuple(out)
