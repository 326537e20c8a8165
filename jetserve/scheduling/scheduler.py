"""Scheduling policy for one generate engine's decode slots (plain Python, no jax).

The executors ask; the scheduler decides:

  - admission: a free slot goes to the waiting request whose client holds the fewest
    slots, the oldest among those (`FairShare`), so a client whose many requests filled
    the backlog does not keep another client's request out of the slots they free; it
    goes in only when its pages fit (`KVCacheManager.can_start`);
  - preemption: when the next step's pages are not free, the most recently inserted
    request gives its slot back and is recomputed later (`next_victim`);
  - prefill before decode: with a free slot and nothing waiting, a generate engine that
    also prefills waits for the prefill rather than stepping, unless that prefill is
    between two of its chunks, waiting for this very step (`yield_to_prefill`): chunks of
    a long prompt interleave with decode steps. Under decode-first (policy.py) it never
    waits: every step runs as soon as it can, and step_budget.py bounds the prefill
    before it.

`plan` makes these calls into one `Turn` for the threaded executor, which only runs it.
Whole-sequence page promises (lock-step, offline) are `KVCacheManager.reserve`.
Concurrency: owned by the executor's loop thread; other threads read only plain ints.

Requests are duck-typed (a LiveRequest): `done` and `abandoned(now)` (turn_planner.py
asks the same, and `ended_rows` answers both).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Release, Turn, Waiting
from jetserve.scheduling.slots import SlotTable

R = TypeVar("R")


def ended_rows(rows: Iterable[tuple[int, Any]], now: float) -> list[Release]:
    """The rows with nothing more to compute: finished, or abandoned (cancel, deadline)."""
    out = []
    for slot, request in rows:
        why = None if request.done else request.abandoned(now)
        if request.done or why is not None:
            out.append(Release(slot, request, why))
    return out


class FairShare(Generic[R]):
    """Ranks waiting requests by the slots their client holds, counting the ones given out
    since it was made (`took`); the lowest rank goes first."""

    def __init__(self, client: Callable[[R], Hashable], holders: Iterable[R]):
        self._client = client
        self._held = collections.Counter(client(r) for r in holders)

    def rank(self, request: R) -> int:
        return self._held[self._client(request)]

    def took(self, request: R) -> None:
        self._held[self._client(request)] += 1

    def pick(self, waiting: Iterable[R]) -> R | None:
        """The first of the lowest rank (arrival order among equals)."""
        return min(waiting, key=self.rank, default=None)


class Scheduler(Generic[R]):
    """Slots, admission, preemption order and priority for one engine.

    Args:
      slots: the engine's decode slots.
      kv: its page questions (KVCacheManager).
      client: who sent a request (fair share counts slots per client).
      decode_first: never wait for prefill rather than step (policy.DECODE_FIRST).
    """

    def __init__(self, slots: int, kv: KVCacheManager, *,
                 client: Callable[[R], Hashable] = lambda request: None,
                 decode_first: bool = False):
        self.slots: SlotTable[R] = SlotTable(slots)
        self.decode_first = decode_first
        self.kv = kv
        self._client = client
        self._order: dict[int, int] = {}  # slot -> insert order (the newest is preempted)
        self._inserts = 0
        self.preemptions = 0

    # ---- the threaded executor's turn ----------------------------------------------------

    def plan(self, now: float, waiting: Sequence[Waiting], *, prefill_work: bool = False,
             between_chunks: bool = False) -> Turn:
        """One turn: free the slots of requests with nothing more to compute (their pages
        go back now), give free slots to waiting prefixes in fair order while their pages
        fit, then step unless prefill work should go first (`yield_to_prefill`). The
        executor runs it: free_slot and end for each release, insert each into its slot."""
        releases = ended_rows(self.slots.rows(), now)
        for r in releases:
            self.release(r.slot)
            self.kv.free(r.slot)
        share, left = self.fair_share(), list(waiting)
        inserts, planned = [], 0
        while self.slots.has_free and left:
            w = min(left, key=lambda w: share.rank(w.request))  # first of the lowest rank
            need = self.kv.pages_to_start(w.tokens, w.shared)
            if not self.kv.can_start(w.tokens, w.shared, planned=planned):
                break
            left.remove(w)
            share.took(w.request)
            planned += need
            inserts.append((self.assign(w.request), w))
        step = self.slots.in_use > 0 and not self.yield_to_prefill(
            len(left), prefill_work, between_chunks)
        return Turn(releases=tuple(releases), inserts=tuple(inserts), step=step)

    # ---- admission -------------------------------------------------------------------------

    def fair_share(self) -> FairShare[R]:
        return FairShare(self._client, (r for _, r in self.slots.rows()))

    def can_admit(self, tokens: int, shared: int = 0) -> bool:
        """A free slot, and pages for a `tokens`-token prefix (`shared` of its pages
        linked from the prefix cache) and its first step beside the running slots'."""
        return self.slots.has_free and self.kv.can_start(tokens, shared)

    def assign(self, request: R) -> int:
        """The lowest free slot, now `request`'s."""
        slot = self.slots.acquire(request)
        self._inserts += 1
        self._order[slot] = self._inserts
        return slot

    def release(self, slot: int) -> R:
        self._order.pop(slot, None)
        return self.slots.release(slot)

    # ---- preemption --------------------------------------------------------------------------

    def step_fits(self) -> bool:
        """Whether the next step's pages are free, taking back cache-only pages first."""
        return self.kv.step_fits()

    def next_victim(self) -> int | None:
        """The slot to preempt before the next step (the most recently inserted), or None
        when the step fits (or no slot is in use). The caller frees its pages, then asks
        again."""
        if not self.slots.in_use or self.kv.step_fits(reclaim=False):
            return None
        return max(self._order, key=self._order.__getitem__)

    def preempt(self, slot: int) -> R:
        self.preemptions += 1
        return self.release(slot)

    # ---- prefill or decode -------------------------------------------------------------------

    def yield_to_prefill(self, waiting: int, prefill_work: bool, between_chunks: bool) -> bool:
        """Whether an engine that also prefills should wait rather than step: it has a
        free slot, nothing `waiting` to fill it, and prefill work on its way that is not
        paused between chunks (that prefill waits for this engine's next step). Never
        under decode-first."""
        return (not self.decode_first and self.slots.has_free and waiting == 0 and prefill_work
                and not between_chunks)
