"""The generate thread of `--scheduling mixed`: prompts run inside the decode steps.

One thread owns the paged engine, its decode state and its slots, and takes requests
straight from the admission queue (no prefill thread, no backlog of prefixes). Each turn:

  1. free the slots whose request is done, cancelled or past its deadline (as the
     interleaved generate thread does), and drop waiting requests that were abandoned;
  2. admit waiting requests (preempted ones first, then the admission queue's fair order)
     into free slots, fewest slots per client first, while the pages of the whole prompt
     and the next step fit (`KVCacheManager.can_start`); the prompt's pages are taken at
     once (`PagePlanner.start_prompt`). With a prefix cache (`cache`, in this engine's
     pages: prefix_stores.PageStore) the prompt is looked up first: the slot links the
     pages of its cached whole blocks on the device (shared, one reference more each)
     and its chunks start after them, so a hit only starts the prompt later (a whole
     prompt cached still runs its last token, which samples the first). Blocks on the
     cache's host tier are recomputed and move back up into the slot's pages when the
     prompt is adopted. A request with a repetition penalty runs its whole prompt (the
     penalty's prompt mask is built from the chunks);
  3. one `engine.mixed_step` (engines/mixed_step.py): a token for every decoding slot
     (with speculative decoding a verify row of K + 1: its last token and K drafts,
     n-gram or a draft model's, of which the device keeps what it accepts), plus chunks
     of the admitted prompts up to the token budget (jetserve/scheduling/mixed_plan.py);
     with speculative decoding a prompt's first chunk after a prefix-cache hit carries
     the hit's tokens (MixedRow.context), for the drafts. The chunk that ends a prompt samples its first
     token, and then the cache adopts the prompt's whole pages (as the interleaved
     generate thread's insert does) and releases the hit. Results are read one step
     late through the shared read-back path (readback.py): stop ids, max_tokens,
     streaming and metrics as in the interleaved mode. When the next step's pages are
     not free, the most recently admitted request is preempted (releasing its hit and
     its links) and recomputed later from its prompt and tokens (its chunks run again,
     after what the cache holds of them by then).
     Structured output: each sampling row (decode rows, the chunks that end a prompt)
     gets its grammar's mask as the interleaved generate thread makes it (step_masks.py):
     a constrained decode row whose last token is not read yet sits the step out when an
     unconstrained request is in the batch, else the step waits for the read-back; a
     grammar that is complete ends its request "stop" when its last token is read.

LoRA: a request's adapter runs in its chunks and decode rows (engines/lora_engine.py
PagedLoraEngine): its row is held for the slot at admission (`start_prompt`) until the
slot is freed; a request whose adapter finds every row held by running requests waits
for one to end. A prefix cache over an engine whose sliding layers keep rings of pages
is refused at start (orchestrator mixed.py).
Warm-up (`warm`, run on this thread through `call`) compiles every (token bucket,
page-table width) the steps can take, with a token mask and without (the mask only
where the model has a tokenizer, which grammars need).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engines.lora_registry import RowsBusy
from engines.mixed_batch import MixedRow
from engines.sampling import SamplingParams
from engines.token_mask import allow_all
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from jetserve.orchestrator.prefix_cache import Hit
from jetserve.orchestrator.step_masks import (
    mask_kwargs,
    mask_positions,
    mask_refusal,
    must_sync,
    step_mask,
)
from jetserve.orchestrator.timing import PrefillDone
from jetserve.scheduling import mixed_plan
from jetserve.scheduling.scheduler import ended_rows

log = logging.getLogger(__name__)


class MixedWorker(GenerateWorker):
    """See the module doc. `budget`: tokens per step; `chunk`: prompt tokens per row."""

    def __init__(self, *args: Any, admission: FairQueue, budget: int, chunk: int,
                 cache_key: str = "", **kw: Any):
        super().__init__(*args, **kw)
        self.cache_key = cache_key  # the prefix cache's model key (config.prefix_cache_key)
        self.admission = admission
        self.budget, self.chunk = budget, chunk
        self.waiting: collections.deque[LiveRequest] = collections.deque()
        self.resume = self.waiting.appendleft  # preempted: recomputed first
        # slot -> (its request's tokens to run, how many ran): slots still in their prompt
        self._prompts: dict[int, tuple[list[int], int]] = {}
        # slot -> its prefix-cache hit (pinned), from admission to its prompt's last chunk
        self._hits: dict[int, Hit] = {}
        self._calls: queue.Queue = queue.Queue()  # (fn, future) to run on this thread
        # A decode row's tokens: k + 1 with n-gram speculative decoding (a verify row)
        self.row_tokens = mask_positions(self.engine)

    def load(self) -> int:
        return self.slots.in_use + len(self.waiting)

    # ---- the loop ------------------------------------------------------------------------

    def _turn(self) -> None:
        self._run_calls()
        now = time.monotonic()
        for r in ended_rows(self.slots.rows(), now):
            self._release(r.slot)
            if r.why is not None:
                self.readback.end(r.request, r.why)
        self._take_waiting(now)
        self._admit_waiting()
        if self.slots.in_use:
            self._step()
            return
        self.readback.read()
        if not self.waiting:
            self._wait_for_request()

    def _take_waiting(self, now: float) -> None:
        """Drops abandoned waiting requests; tops the waiting list up from admission to
        as many as there are free slots."""
        for live in [w for w in self.waiting if w.done or w.abandoned(now) is not None]:
            self.waiting.remove(live)
            if not live.done:
                self.readback.end(live, live.abandoned(now) or "cancelled")
        while len(self.waiting) < self.slots.free_count:
            try:
                live = self.admission.get_nowait()
            except queue.Empty:
                return
            self._enqueue(live, now)

    def _wait_for_request(self) -> None:
        try:
            live = self.admission.get(timeout=self.poll_s)
        except queue.Empty:
            return
        self._enqueue(live, time.monotonic())

    def _enqueue(self, live: LiveRequest, now: float) -> None:
        self.admission.task_done()
        why = None if live.done else live.abandoned(now)
        if why is not None:
            self.readback.end(live, why)
        elif not live.done and not self._score_only(live, now):
            self.waiting.append(live)

    def _score_only(self, live: LiveRequest, now: float) -> bool:
        """Prompt log-probs first (a program of their own); True when that is all the
        request asked for (max_tokens 0) and it has ended."""
        req = live.request
        if live.preemptions or not req.prompt_logprobs:
            return False
        live.timing.prefill_start = now
        try:
            live.prompt_logprobs = prompt_logprobs(
                self.engine, self.params, np.asarray(req.prompt_ids, np.int32),
                req.logprobs or 0, req.lora_adapter)
        except Exception as e:  # this request only
            self.readback.end(live, "error", e)
            return True
        if req.max_tokens == 0:
            live.timing.prefill_end = time.monotonic()
            self.readback.end(live, "length")
            return True
        return False

    def _admit_waiting(self) -> None:
        """Free slots to waiting requests in fair order while their pages fit."""
        share = self.sched.fair_share()
        while self.slots.has_free and self.waiting:
            live = share.pick(self.waiting)
            tokens = live.sequence()
            hit = self._lookup(live, tokens)
            shared = hit.pages if hit is not None else []
            if not self.sched.kv.can_start(len(tokens), len(shared)):
                if hit is not None:
                    hit.release()
                return
            slot = self.sched.assign(live)
            try:  # a LoRA adapter's row is held for the slot until free_slot
                self.engine.start_prompt(slot, len(tokens), adapter=_adapter(live),
                                         shared_pages=shared)
            except Exception as e:  # this request only (an adapter not loaded)
                if hit is not None:
                    hit.release()
                self._release(slot)
                if isinstance(e, RowsBusy):
                    return  # every adapter row is held by a running request: it waits
                self.waiting.remove(live)
                self.readback.end(live, "error", e)
                continue
            self.waiting.remove(live)
            share.took(live)
            if hit is not None:
                self.cache.counted(hit)
                self._hits[slot] = hit
            self._prompts[slot] = (tokens, self._first(slot))

    def _lookup(self, live: LiveRequest, tokens: list[int]) -> Hit | None:
        """The prompt's cached whole blocks (pinned; counted once admitted), or None
        without a cache or with a repetition penalty (whose prompt mask the chunks
        build)."""
        req = live.request
        if self.cache is None or req.sampling.repetition_penalty != 1.0:
            return None
        return self.cache.lookup(req.cache_key(self.cache_key), tokens, count=False)

    def _first(self, slot: int) -> int:
        """Where the slot's prompt chunks start: after its hit's linked pages."""
        hit = self._hits.get(slot)
        return len(hit.pages) * self.sched.kv.page_size if hit is not None else 0

    # ---- one step ------------------------------------------------------------------------

    def _step(self) -> None:
        self._make_room()
        if must_sync(self.slots.rows()):
            self.readback.sync()  # constrained slots' next masks need their last tokens
        if not self.slots.in_use:
            return
        owners = dict(self.slots.rows())
        decoding = [s for s in owners if s not in self._prompts]
        chunks = mixed_plan.fill(len(decoding) * self.row_tokens, self._prefilling(),
                                 budget=self.budget, chunk=self.chunk)
        rows = [MixedRow(slot=s) for s in decoding] + [self._chunk_row(c, owners[c.slot])
                                                        for c in chunks]
        t = time.monotonic()
        try:
            starting = [c.slot for c in chunks if c.last]
            mask, paused = step_mask([(s, owners[s]) for s in (*decoding, *starting)],
                                     self.engine.page_geometry.slots, self.engine.vocab_size,
                                     pause=True, starting=starting,
                                     positions=self.row_tokens)
            with self.state_lock:  # no prefill thread waits on the steps here
                self.state, res = self.engine.mixed_step(self.params, self.state, rows,
                                                         prefilling=tuple(self._prompts),
                                                         **mask_kwargs(mask))
            res.copy_to_host_async()
        except Exception as e:
            log.exception("mixed step failed on engine %d", self.index)
            self._fail_all(e)
            return
        self.steps += 1
        sampled = [(s, owners[s]) for s in decoding]
        for s in decoding:
            if s not in paused:  # a paused row sat this step out (step_masks.py)
                owners[s].steps += 1
        for c in chunks:
            self._advance(c, owners[c.slot], t, sampled)
        for slot, live in sampled:
            if slot not in paused and live.last_step_dispatched():
                self._release(slot)  # its last token is in flight; the slot is free now
        self.readback.dispatched(res, sorted(sampled, key=lambda r: r[0]), t)

    def _prefilling(self) -> list[mixed_plan.Prefilling]:
        """The slots still in their prompt, the earliest admitted first (the dict keeps
        admission order)."""
        return [mixed_plan.Prefilling(slot=s, length=len(toks), done=done)
                for s, (toks, done) in self._prompts.items()]

    def _chunk_row(self, c: mixed_plan.Chunk, live: LiveRequest) -> MixedRow:
        tokens, _ = self._prompts[c.slot]
        first = c.start == self._first(c.slot)
        # After a prefix-cache hit, speculative decoding's drafts read the linked tokens.
        context = tokens[:c.start] if first and self.row_tokens > 1 else ()
        return MixedRow(slot=c.slot, chunk=tokens[c.start:c.end], start=c.start,
                        last=c.last, sampling=live.request.sampling if first else None,
                        adapter=_adapter(live), context=context)

    def _advance(self, c: mixed_plan.Chunk, live: LiveRequest, t: float,
                 sampled: list[tuple[int, LiveRequest]]) -> None:
        """A chunk was dispatched: the prompt moves on; its last samples the first token
        (timed as the interleaved prefill's end, and reported as a PrefillDone)."""
        tokens, _ = self._prompts[c.slot]
        if c.start == self._first(c.slot) and live.timing.prefill_start is None:
            live.timing.prefill_start = t
        if not c.last:
            self._prompts[c.slot] = (tokens, c.end)
            return
        del self._prompts[c.slot]
        if (hit := self._hits.pop(c.slot, None)) is not None:
            self.cache.adopt(hit, self.pages.pages_of(c.slot))  # releases the hit
        sampled.append((c.slot, live))
        if live.preemptions == 0:
            live.timing.prefill_end = time.monotonic()
        if self.readback.listeners:
            start = live.timing.prefill_start or t
            self.readback.listeners.emit(PrefillDone(self.index, len(tokens), time.monotonic() - start))

    # ---- helpers -------------------------------------------------------------------------

    def _release(self, slot: int) -> None:
        self._drop_prompt(slot)
        super()._release(slot)

    def _drop_prompt(self, slot: int) -> None:
        """Forgets the slot's prompt progress and releases its hit (nothing cached)."""
        self._prompts.pop(slot, None)
        if (hit := self._hits.pop(slot, None)) is not None:
            hit.release()

    def _make_room(self) -> None:
        """As the generate thread's, forgetting a preempted slot's prompt progress."""
        if self.sched.step_fits():
            return
        self.readback.read()
        while (slot := self.sched.next_victim()) is not None:
            live = self.sched.preempt(slot)
            self._drop_prompt(slot)
            self.engine.free_slot(slot)
            if not live.done:
                live.preempted()
                self.resume(live)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs `fn` on this thread between two turns (the decode state is its alone);
        returns its result or raises its error."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, done))
        return done.result(timeout)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                done.set_exception(e)

    # ---- warm-up -------------------------------------------------------------------------

    def warm_shapes(self) -> list[tuple[int, int]]:
        """Every (token bucket, page-table width) a step can take: the buckets up to the
        first that holds the budget, by every width the page planner gives; bucket 0 is
        the step of decode rows alone (the generate step's program, one per width)."""
        buckets = self.engine.mixed_token_buckets
        top = next((b for b in buckets if b >= self.budget), buckets[-1])
        return [(T, W) for T in (0, *buckets) if T <= top
                for W in self.engine.generate_widths()]

    def warm(self, tokens: int, width: int) -> None:
        """Compiles the step of `tokens` tokens and `width` pages, without a token mask
        and (where grammars can be served) with one (run it through `call`):
        chunks of throwaway tokens in free slots whose table is all trash, so no page is
        written and the slots stay free (a chunk that does not end leaves them not live);
        tokens 0: a step of no rows, which compiles the decode-rows program. A LoRA
        engine's steps compile twice: with the adapter pool, and plain."""
        g = self.engine.page_geometry
        rows, left = [], tokens
        for slot in range(g.slots):
            if left and self.slots.owner(slot) is None:
                # With speculative decoding the first row also compiles the program that
                # writes a prefix-cache hit's tokens (MixedRow.context): it starts at 1.
                ctx = (0,) if self.row_tokens > 1 and not rows else ()
                n = min(left, g.max_seq_len - 1 - len(ctx))
                rows.append(MixedRow(slot=slot, chunk=(0,) * n, start=len(ctx), context=ctx,
                                     sampling=SamplingParams()))
                left -= n
        if left:
            raise RuntimeError(f"no free slots for a {tokens}-token warm-up step")
        masks = [None]
        if self.engine.tokenizer is not None and mask_refusal(self.engine) is None:
            mask = allow_all(g.slots, self.engine.vocab_size)  # structured output's
            masks.append(mask if self.row_tokens == 1 else  # a verify row's: one a position
                         np.repeat(mask[:, None], self.row_tokens, axis=1))
        # A LoRA engine's step with the adapter pool too (the plain one runs while no
        # slot holds an adapter).
        programs = [{}, {"adapters": True}] if hasattr(self.engine, "hold_adapter") else [{}]
        for mask in masks:
            for program in programs:
                with self.state_lock:
                    self.state, res = self.engine.warm_step(
                        self.params, self.state, width, rows, **mask_kwargs(mask), **program)
                res.to_host()


def _adapter(live: LiveRequest) -> str | None:
    """The request's LoRA adapter (None: the base model)."""
    return getattr(live.request, "lora_adapter", None)
