"""The scheduler, its page questions and its plan on plain Python: no jax anywhere.

The page bookkeeping is the package's own (jetserve/scheduling/page_pool.py, plain Python
and numpy).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jetserve.scheduling import page_pool
from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Waiting, chunks
from jetserve.scheduling.scheduler import FairShare, Scheduler

ROOT = Path(__file__).resolve().parents[3]

PS = 4  # tokens per page


def slot_pages(num_pages=8, slots=4, max_seq_len=16):
    return page_pool.SlotPages(slots=slots, page_size=PS, num_pages=num_pages,
                               max_seq_len=max_seq_len)


def scheduler(pages, slots=4):
    return Scheduler(slots, KVCacheManager(pages), client=lambda r: r[0])


def admit(sched, pages, request, tokens, shared=()):
    """What an executor does with an admission: a slot, then the engine's insert."""
    slot = sched.assign(request)
    pages.insert(slot, tokens, shared=shared)
    return slot


def drop(sched, pages, slot):
    """A request leaves: its slot, then its pages."""
    sched.release(slot)
    pages.free(slot)


class CacheOfPages:
    """A prefix cache's part in the pool, through the KV-cache manager as
    prefix_cache.PageStore goes: it holds pages and gives back, on make_room, those only
    it holds."""

    def __init__(self, sched):
        self.kv, self.held, self.asked = sched.kv, [], []
        sched.kv.cache = self

    def adopt(self, pages):
        self.kv.share(pages)
        self.held += pages

    def make_room(self, n):
        self.asked.append(n)
        sole = [p for p in self.held if self.kv.sole_holder(p)][:n]
        self.kv.unshare(sole)
        self.held = [p for p in self.held if p not in sole]


def test_the_package_never_imports_jax():
    code = ("import sys\n"
            "import jetserve.scheduling, jetserve.scheduling.scheduler, "
            "jetserve.scheduling.kv_cache_manager, jetserve.scheduling.plan, "
            "jetserve.scheduling.slots, jetserve.scheduling.page_pool, "
            "jetserve.scheduling.page_planner, jetserve.scheduling.policy, "
            "jetserve.scheduling.step_budget\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'engines')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_admission_waits_for_pages_not_only_for_slots():
    pages = slot_pages(num_pages=8)
    sched = scheduler(pages)
    assert sched.can_admit(12)  # 4 pages through its first step, of 8
    admit(sched, pages, ("a", 0), 12)  # 3 pages; its next step takes a 4th
    assert sched.can_admit(12)  # 4 + 1 for the running slot's step = 5 free
    admit(sched, pages, ("a", 1), 12)
    assert pages.free_count == 2 and sched.slots.has_free
    assert not sched.can_admit(4)  # 2 pages to start + 2 for the running steps > 2 free
    assert not sched.can_admit(1)
    drop(sched, pages, 1)
    assert sched.can_admit(4)


def test_admission_needs_a_free_slot_even_with_pages():
    pages = slot_pages(num_pages=16, slots=2)
    sched = scheduler(pages, slots=2)
    admit(sched, pages, ("a", 0), 1)
    admit(sched, pages, ("a", 1), 1)
    assert pages.free_count > 10 and not sched.can_admit(1)


def test_contiguous_cache_admits_by_slots_alone():
    sched = scheduler(None, slots=1)
    assert sched.can_admit(10**6) and sched.step_fits() and sched.next_victim() is None
    sched.assign(("a", 0))
    assert not sched.can_admit(1)


def test_a_free_slot_goes_to_the_client_holding_fewest():
    sched = scheduler(None)
    sched.assign(("a", 0))
    sched.assign(("a", 1))
    waiting = [("a", 2), ("a", 3), ("b", 0), ("b", 1), ("c", 0)]
    share = sched.fair_share()
    assert share.pick(waiting) == ("b", 0)  # b and c hold none; b came first
    share.took(("b", 0))
    assert share.pick(w for w in waiting if w != ("b", 0)) == ("c", 0)
    share.took(("c", 0))
    assert share.pick([("a", 2), ("b", 1)]) == ("b", 1)  # b holds 1, a holds 2
    assert FairShare(lambda r: r[0], []).pick([]) is None


def test_preemption_takes_the_newest_insert_first_until_the_step_fits():
    pages = slot_pages(num_pages=5, max_seq_len=16)
    sched = scheduler(pages)
    for i in range(4):
        admit(sched, pages, ("a", i), 4)  # slot i, one full page
    drop(sched, pages, 0)
    admit(sched, pages, ("b", 0), 4)  # slot 0 again: the newest insert
    assert pages.free_count == 1 and pages.pages_for_step() == 4  # every slot starts a page
    victims = []
    while (slot := sched.next_victim()) is not None:
        victims.append((slot, sched.preempt(slot)))
        pages.free(slot)
    assert victims == [(0, ("b", 0)), (3, ("a", 3))]  # newest first, then the next newest
    assert sched.step_fits() and sched.preemptions == 2
    pages.check()


def test_cache_only_pages_come_back_before_anyone_is_preempted():
    pages = slot_pages(num_pages=4, max_seq_len=16)
    sched = scheduler(pages)
    cache = CacheOfPages(sched)
    admit(sched, pages, ("a", 0), 4)
    cache.adopt(pages.pages_of(0))
    drop(sched, pages, 0)  # its page is the cache's alone now
    for i in range(1, 4):
        admit(sched, pages, ("a", i), 4)  # slots 0-2; each step starts a page
    assert pages.free_count == 0 and pages.pages_for_step() == 3
    assert sched.next_victim() == 2 and not cache.asked  # victims never ask the cache
    assert not sched.step_fits() and cache.asked == [3]  # the step does, first
    assert pages.free_count == 1 and not cache.held


def test_shared_prefix_pages_are_counted_once_and_the_cache_gives_back_its_own():
    pages = slot_pages(num_pages=8)
    sched = scheduler(pages)
    cache = CacheOfPages(sched)
    admit(sched, pages, ("a", 0), 9)  # 3 pages
    cache.adopt(pages.pages_of(0)[:2])  # the prompt's 2 whole pages
    shared = pages.pages_of(0)[:2]
    assert [pages.pool.refcount(p) for p in shared] == [2, 2]
    # A second request with the same 8-token prefix links those pages: 4 to start, 2 of
    # them shared, + 1 for slot 0's step = 3 of the 5 free.
    assert sched.can_admit(12, shared=2) and not cache.asked
    admit(sched, pages, ("b", 0), 12, shared=shared)
    assert [pages.pool.refcount(p) for p in shared] == [3, 3]  # 2 slots + the cache
    pages.check({"cache": cache.held})
    drop(sched, pages, 0)
    drop(sched, pages, 1)
    assert [pages.pool.refcount(p) for p in shared] == [1, 1]  # the cache's alone
    assert pages.free_count == 6
    # A 25-token prefix needs 7 pages: the cache is asked for the one missing and gives
    # back one of the pages only it holds, no more.
    big = slot_pages(num_pages=8, max_seq_len=32)
    sched = scheduler(big)
    big_cache = CacheOfPages(sched)
    admit(sched, big, ("x", 0), 8)
    big_cache.adopt(big.pages_of(0))
    drop(sched, big, 0)
    assert big.free_count == 6 and sched.can_admit(25)
    assert big_cache.asked == [1] and big.free_count == 7 and len(big_cache.held) == 1
    big.check({"cache": big_cache.held})


def test_whole_sequence_reservations_admit_only_what_can_finish():
    kv = KVCacheManager(slot_pages(num_pages=8, max_seq_len=16))
    assert kv.reserve(0, 16)  # 4 pages
    assert kv.reserve(1, 9)  # 3 pages
    assert not kv.reserve(2, 8) and kv.reserved == 7  # 2 more would be 9 > 8
    assert kv.reserve(2, 4)
    kv.unreserve(0)
    assert kv.reserve(3, 16) and kv.reserved == 8
    kv.clear_reservations()
    assert kv.reserved == 0
    assert KVCacheManager(None).reserve(0, 10**6)


def test_chunks_of_a_long_prompt():
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(8, 4) == [(0, 4), (4, 8)]
    assert chunks(3, 0) == chunks(3, None) == [(0, 3)]  # no chunking: one piece
    with pytest.raises(ValueError, match="prefill chunk"):
        chunks(3, -1)


def test_prefill_goes_first_but_chunks_interleave_with_decode_steps():
    sched = scheduler(None, slots=2)
    sched.assign(("a", 0))
    # A free slot, nothing waiting, a prefill on its way: wait for it (prefill first).
    assert sched.yield_to_prefill(waiting=0, prefill_work=True, between_chunks=False)
    # The same prefill paused between two chunks waits for this step: step.
    assert not sched.yield_to_prefill(waiting=0, prefill_work=True, between_chunks=True)
    # Something waiting fills the slot first; no prefill work: step.
    assert not sched.yield_to_prefill(waiting=1, prefill_work=True, between_chunks=False)
    assert not sched.yield_to_prefill(waiting=0, prefill_work=False, between_chunks=False)
    sched.assign(("a", 1))  # no free slot: a prefill could not join anyway
    assert not sched.yield_to_prefill(waiting=0, prefill_work=True, between_chunks=False)


class Req:
    """A request as the scheduler sees one: its client, whether it is done, and why it
    was abandoned at a time (None: it was not)."""

    def __init__(self, client, *, done=False, why=None):
        self.client, self.done, self.why = client, done, why

    def abandoned(self, now):
        return self.why


def planner(pages, slots=4):
    return Scheduler(slots, KVCacheManager(pages), client=lambda r: r.client)


def test_a_turn_frees_ended_rows_then_admits_fairly_while_pages_fit():
    pages = slot_pages(num_pages=8)
    sched = planner(pages)
    done, gone, running = Req("a", done=True), Req("a", why="cancelled"), Req("a")
    for r in (done, gone, running):
        admit(sched, pages, r, 4)  # slots 0-2, one page each
    waiting = [Waiting(Req("a"), 4), Waiting(Req("b"), 8), Waiting(Req("c"), 12)]
    turn = sched.plan(0.0, waiting)
    assert [(r.slot, r.why) for r in turn.releases] == [(0, None), (1, "cancelled")]
    assert pages.free_count == 7  # the freed slots' pages are back before admission
    # b and c hold no slot: they go first, b (3 pages) then c (4 pages): with slot 2's
    # step (1 page) that is 8 > 7 free, so c waits, and a (ranked after c) waits too.
    assert [(slot, w.request.client) for slot, w in turn.inserts] == [(0, "b")]
    assert turn.step and sched.slots.owner(0) is waiting[1].request


def test_a_turn_admits_by_slots_alone_on_a_contiguous_cache():
    sched = planner(None, slots=2)
    waiting = [Waiting(Req("a"), 10**6), Waiting(Req("a"), 1), Waiting(Req("b"), 1)]
    turn = sched.plan(0.0, waiting)
    assert [(slot, w.request.client) for slot, w in turn.inserts] == [(0, "a"), (1, "b")]
    assert turn.step and not sched.slots.has_free


def test_a_turn_waits_for_prefill_with_a_free_slot_and_nothing_waiting():
    sched = planner(None, slots=2)
    sched.assign(Req("a"))
    assert not sched.plan(0.0, [], prefill_work=True).step  # prefill first
    assert sched.plan(0.0, [], prefill_work=True, between_chunks=True).step
    assert sched.plan(0.0, []).step
    idle = planner(None, slots=2)
    assert not idle.plan(0.0, []).step  # nothing to step
