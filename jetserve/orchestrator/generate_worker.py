"""The generate thread of one generate engine: insert, step, read back one step later.

It alone owns the engine's decode state, its scheduler (slots, page admission,
preemption: jetserve/scheduling) and the `LiveRequest`s in its slots. Each turn the
scheduler plans (`Scheduler.plan` -> a `Turn`) and the loop runs the plan:

  1. free the slots whose request is done (stop string, error), cancelled or past its
     deadline, so a cancelled request leaves its slot before the next step;
  2. insert waiting prefixes from the backlog into the slots the plan gave them (fair
     per client, while their pages fit);
  3. step: dispatch `engine.generate` (asynchronous; over the first slots only when the
     engine has a smaller decode batch size holding every slot in use), start its host
     copy, then read the
     *previous* step's results, which had a whole step to land on the host, so the device
     always has the next step queued while the host looks at tokens. A request whose
     token budget ends with the step just dispatched leaves its slot at once; one that
     hit a stop id leaves it when that step is read, one step later.

Which waiting prefix gets a free slot, whether it fits and whom to preempt is the
scheduler's call (jetserve/scheduling): on a paged engine (`engine.kv_pages`, kept by its
page planner; the engine itself takes the page table per call) a prefix is inserted only
when the pool has its pages plus what the next step needs; otherwise it waits in the
backlog. When a step needs more pages than are free, the scheduler's victim
(the most recently inserted request) is preempted: its slot and pages are freed and it
goes back to a prefill thread (`resume`) to be recomputed. A prefix cache over this
engine's pages (`cache`) counts as using its pages: admission and steps first take back
pages only the cache holds (moving those blocks to the host tier), and an insert links
the pages of the request's cache hit, then lets the cache adopt the prompt's whole pages
(prefix_cache.py). Results are read one step late by the shared read-back path
(readback.py).

Token ids are checked here (stop ids, length); text is left to the detokenize thread.
In interleaved mode (the engine also prefills) the loop waits rather than steps while it
has free slots and prefill work is pending for it: prefill has priority. Under
decode-first (`policy`, jetserve/scheduling/policy.py) it steps whenever a slot is in use,
and each step closes the prefill budget's window (`step_window`, step_budget.py); after
each step it publishes how many running sequences end within the policy's lookahead
(`ending`), the slots a prompt may be prefilled ahead for.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from engines.engine_api import Engine
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefix_cache import Hit, PrefixCache
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import mask_kwargs, mask_positions, must_sync, step_mask
from jetserve.orchestrator.timing import Listeners
from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Turn, Waiting
from jetserve.scheduling.policy import StepPolicy
from jetserve.scheduling.scheduler import Scheduler
from jetserve.scheduling.slots import SlotTable, compaction, rows_kwargs, step_batch

log = logging.getLogger(__name__)


class Backlog:
    """Prefixes waiting for a slot: bounded; producers block while it is full."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._items: collections.deque[tuple[LiveRequest, Any]] = collections.deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: tuple[LiveRequest, Any], stopping: threading.Event,
            poll_s: float) -> bool:
        """Blocks while full; False when the orchestrator stopped meanwhile."""
        with self._cond:
            while len(self._items) >= self.maxsize:
                if stopping.is_set():
                    return False
                self._cond.wait(poll_s)
            self._items.append(item)
            self._cond.notify_all()
            return True

    def items(self) -> list[tuple[LiveRequest, Any]]:
        """What waits, in arrival order (a snapshot)."""
        with self._cond:
            return list(self._items)

    def pop(self, item: tuple[LiveRequest, Any] | None = None
            ) -> tuple[LiveRequest, Any] | None:
        """Removes `item` (by default the oldest) and returns it."""
        with self._cond:
            if not self._items:
                return None
            if item is None or item is self._items[0]:
                item = self._items.popleft()
            else:
                self._items.remove(item)
            self._cond.notify_all()
            return item

    def take_if(self, pred: Callable[[LiveRequest], bool]) -> list[LiveRequest]:
        """Removes and returns the waiting requests for which pred is true."""
        with self._cond:
            if not any(pred(live) for live, _ in self._items):
                return []
            keep = [(live, p) for live, p in self._items if not pred(live)]
            gone = [live for live, _ in self._items if pred(live)]
            self._items = collections.deque(keep)
            self._cond.notify_all()
            return gone

    def wait(self, timeout: float) -> None:
        """Until something arrives, `poke` is called, or timeout."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)

    def poke(self) -> None:
        with self._cond:
            self._cond.notify_all()


class GenerateWorker:
    def __init__(self, index: int, engine: Engine, params: Any, outbox: queue.Queue,
                 listeners: Listeners, stopping: threading.Event, *, backlog_size: int,
                 poll_s: float, policy: StepPolicy | None = None):
        self.index = index
        self.engine = engine
        self.params = params
        self.stopping = stopping
        self.poll_s = poll_s
        self.pages = engine.kv_pages  # None: a contiguous cache, slots are the only limit
        # Decides admission, preemption and prefill priority; the prefix cache, when the
        # driver sets one over this engine's pages (`cache`), counts in its page answers.
        self.sched: Scheduler[LiveRequest] = Scheduler(
            policy.max_num_seqs if policy else engine.max_concurrent_decodes,
            KVCacheManager(self.pages), client=lambda live: live.request.client,
            decode_first=bool(policy and policy.decode_first))
        self.readback = ReadBack(index, outbox, listeners, finished=self._finished,
                                 read_failed=lambda e, lives: self._fail_all(e, extra=lives))
        self.backlog = Backlog(backlog_size)
        self.state = engine.init_decode_state()
        # The slot counts a step is compiled for (the last: every slot); a step runs the
        # smallest that holds the slots in use (engines.engine_api decode_batch_sizes).
        self.batch_sizes = tuple(engine.decode_batch_sizes)
        self.batch_steps = dict.fromkeys(self.batch_sizes, 0)  # steps run at each size
        self.moves = 0  # requests moved to a lower slot (_compact)
        # Held while the decode state is replaced (insert, step) or read from another
        # thread (read_pages): a donated state must not be read after it is gone.
        self.state_lock = threading.Lock()
        # Set by the driver: hands a preempted request back to a prefill thread.
        self.resume: Callable[[LiveRequest], None] = lambda live: None
        self._step_cond = threading.Condition()
        # Set by the driver in interleaved mode: is prefill work on its way to this engine,
        # and is it paused between chunks (waiting for this engine to step)?
        self.prefill_pending: Callable[[], tuple[bool, bool]] = lambda: (False, False)
        self.transfer_pending: Callable[[], int] = lambda: 0
        # Set by the driver under decode-first: held around each generate dispatch.
        self.step_window: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.steps = 0
        # Decode-first's lookahead: how many running sequences end within this many steps
        # (their token budgets say so), published after each step for the prefill budget.
        self.lookahead = policy.prefill_lookahead if policy else 0
        self.ending = 0
        self._lengths: dict[int, tuple[Any, int]] = {}  # id(prefix) -> (prefix, its length)

    @property
    def slots(self) -> SlotTable[LiveRequest]:
        return self.sched.slots

    @property
    def cache(self) -> PrefixCache | None:
        return self.sched.kv.cache

    @cache.setter
    def cache(self, cache: PrefixCache | None) -> None:
        self.sched.kv.cache = cache

    @property
    def preemptions(self) -> int:
        return self.sched.preemptions

    def load(self) -> int:
        """Requests here or on their way: the router sends new ones to the least loaded."""
        return self.slots.in_use + len(self.backlog) + self.transfer_pending()

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    self._turn()
                except Exception as e:  # a bug here must not end the thread silently
                    log.exception("generate loop of engine %d failed", self.index)
                    self._fail_all(e)
        finally:
            self.readback.read()

    def _turn(self) -> None:
        now = time.monotonic()
        self._drop_ended(now)
        busy, between = self.prefill_pending()
        self._run(self.sched.plan(now, self._waiting(), prefill_work=busy,
                                  between_chunks=between))

    def _run(self, turn: Turn) -> None:
        """The scheduler's turn: free, insert, then one step (or wait for work)."""
        for r in turn.releases:
            self.engine.free_slot(r.slot)
            if r.why is not None:
                self.readback.end(r.request, r.why)
        for slot, w in turn.inserts:
            self.backlog.pop(w.item)
            self._admit(slot, *w.item)
        if turn.step:
            self._step()
        else:
            self.readback.read()
            self.backlog.wait(self.poll_s)

    def _drop_ended(self, now: float) -> None:
        """Waiting requests that ended leave the backlog (one that ended at its first
        token waits only to have its pages cached)."""
        if not len(self.backlog):
            return
        ended = lambda r: (r.done and r.cache_hit is None) or (  # noqa: E731
            not r.done and r.abandoned(now) is not None)
        for live in self.backlog.take_if(ended):
            live.release_cache_hit()
            if not live.done:
                self.readback.end(live, live.abandoned(now) or "cancelled")

    def _waiting(self) -> list[Waiting]:
        """The backlog as the scheduler weighs it: each prefix's length and the pages of
        it a prefix-cache hit links (lengths read once; a contiguous cache needs none)."""
        out, known, self._lengths = [], self._lengths, {}
        for item in self.backlog.items():
            live, prefix = item
            if self.pages is None:
                out.append(Waiting(live, 0, 0, item))
                continue
            _, n = known.get(id(prefix)) or (prefix, int(prefix.length))
            self._lengths[id(prefix)] = (prefix, n)  # holding prefix keeps its id unique
            shared = len(live.cache_hit.pages) if live.cache_hit is not None else 0
            out.append(Waiting(live, n, shared, item))
        return out

    def _admit(self, slot: int, live: LiveRequest, prefix: Any) -> None:
        """Runs one insert of the plan (a request that ended meanwhile gives its slot
        back, after its pages are cached when it has a cache hit)."""
        hit, live.cache_hit = live.cache_hit, None
        try:
            why = None if live.done else live.abandoned(time.monotonic())
            if (live.done and hit is None) or why is not None:
                self._release(slot)
                if why is not None:
                    self.readback.end(live, why)
                return
            if self._insert(slot, live, prefix, hit) and live.done:
                self._release(slot)  # ended: only its pages were wanted, by the cache
        finally:
            if hit is not None:
                hit.release()

    def _insert(self, slot: int, live: LiveRequest, prefix: Any, hit: Hit | None) -> bool:
        """Into its planned slot (False when the insert failed), linking the pages of a
        prefix-cache hit; then the cache adopts the prompt's whole pages."""
        try:
            shared = {"shared_pages": hit.pages} if hit is not None and hit.pages else {}
            with self.state_lock:
                self.state = self.engine.insert(prefix, self.state, slot, **shared)
            if hit is not None:
                self.cache.adopt(hit, self.pages.pages_of(slot))
            return True
        except Exception as e:
            log.exception("insert of request %s failed", live.request_id)
            self._release(slot)
            if not live.done:
                self.readback.end(live, "error", e)
            self._recover_state(e)
            return False

    def read_pages(self, pages: list[int]) -> Any:
        """The KV of `pages` as prefix-cache blocks (engine.page_blocks), from any thread."""
        with self.state_lock:
            return self.engine.page_blocks(self.state, pages)

    def _make_room(self) -> None:
        """Until the next step's pages are free: pages only the prefix cache holds come
        back first, then the scheduler's victims are preempted for recompute."""
        if self.sched.step_fits():
            return
        self.readback.read()  # every token of a victim must be known before it leaves
        while (slot := self.sched.next_victim()) is not None:
            live = self.sched.preempt(slot)
            self.engine.free_slot(slot)
            if not live.done:
                live.preempted()
                self.resume(live)

    def wait_for_step(self) -> None:
        """Until this engine dispatched one more step, has no request to step, or stops
        (a chunked prefill lets the running requests move between its chunks)."""
        with self._step_cond:
            seen = self.steps
            while self.steps == seen and self.slots.in_use and not self.stopping.is_set():
                self._step_cond.wait(self.poll_s)

    def _step(self) -> None:
        self._make_room()
        if must_sync(self.slots.rows()):
            self.readback.sync()  # constrained slots' next masks need their last tokens
        if not self.slots.in_use:
            return
        if len(self.batch_sizes) > 1:
            self._compact()
        rows = self.slots.rows()
        t = time.monotonic()
        try:
            batch = step_batch(rows, self.batch_sizes)
            mask, paused = step_mask(rows, batch, self.engine.vocab_size, pause=True,
                                     positions=mask_positions(self.engine))
            with self.step_window(), self.state_lock:
                self.state, res = self.engine.generate(self.params, self.state,
                                                       **mask_kwargs(mask),
                                                       **rows_kwargs(batch, self.batch_sizes))
            res.copy_to_host_async()
        except Exception as e:
            log.exception("generate step failed on engine %d", self.index)
            self._fail_all(e)
            return
        self.batch_steps[batch] += 1
        with self._step_cond:
            self.steps += 1
            self._step_cond.notify_all()
        ending = 0
        for slot, live in rows:
            if slot in paused:
                continue  # sat this step out (step_masks.py)
            live.steps += 1
            if live.last_step_dispatched():
                self._release(slot)  # its last token is in flight; the slot is free now
            elif self.lookahead and live.budget - 1 - live.steps <= self.lookahead:
                ending += 1
        self.ending = ending
        self.readback.dispatched(res, rows, t)

    def _compact(self) -> None:
        """Moves running requests down into free lower slots where that lets the step run
        a smaller decode batch size (one copy of a slot's cache each, against a cheaper
        step for as long as they run). The read-back of a step already dispatched keeps
        its own (slot, request) rows, so its tokens are read where that step put them."""
        for src, dst in compaction(self.slots.rows(), self.batch_sizes):
            try:
                with self.state_lock:
                    self.state = self.engine.move_slot(self.state, src, dst)
            except Exception as e:
                log.exception("moving slot %d to %d failed on engine %d", src, dst, self.index)
                self._recover_state(e)
                return
            self.slots.move(src, dst)
            self.engine.free_slot(src)
            self.moves += 1

    def warm_batch(self, rows: int) -> None:
        """Compiles the step over the first `rows` slots by running it while those slots
        are empty (a step leaves an empty slot as it was), and with the smallest size the
        slot move; skipped where the engine has no such size or a request holds one of
        those slots (it then compiles when first needed)."""
        if rows not in self.batch_sizes[:-1]:
            return
        with self.state_lock:
            held = {slot for slot, _ in self.slots.rows()}
            if any(slot < rows for slot in held):
                return
            self.state, res = self.engine.generate(self.params, self.state, rows=rows)
            last = self.slots.size - 1
            if rows == self.batch_sizes[0] and not held & {0, last}:
                # and a move between two empty slots (_compact's program)
                self.state = self.engine.move_slot(self.state, last, 0)
        jax.block_until_ready(res.data)

    # ---- helpers -------------------------------------------------------------------------

    def _finished(self, slot: int, live: LiveRequest) -> None:
        del slot  # the step's slot; the request may have moved since (_compact)
        if (now := self.slots.slot_of(live)) is not None:
            self._release(now)

    def _release(self, slot: int) -> None:
        self.sched.release(slot)
        self.engine.free_slot(slot)

    def _fail_all(self, exc: BaseException, extra: list[LiveRequest] = ()) -> None:
        """A failed step takes every request in this engine with it; the engine goes on
        with a fresh decode state."""
        lives = [*extra, *(live for _, live in self.slots.rows())]
        for slot, _ in self.slots.rows():
            self._release(slot)
        self.readback.fail(exc, lives)
        if self.cache is not None:  # its pages are about to be zeroed
            self.cache.clear()
        with self.state_lock:
            self.state = self.engine.init_decode_state()

    def _recover_state(self, exc: BaseException) -> None:
        """A failed insert may have consumed the donated decode state: if so, every
        request in this engine ends with the error and the state is rebuilt."""
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state)):
            self._fail_all(exc)
