"""Serving from several processes (jax.distributed): one engine, steps taken in lock step.

Why not the threaded orchestrator: each engine call is one SPMD program over the devices
of every process, so every process must make the same calls in the same order with the
same inputs. Threads that prefill and step whenever they like cannot promise that, and
only process 0 has the requests.

The loop, one turn at a time, on every process::

  process 0: plan  ── free the slots of requests that ended (stop id, length, stop
                      string, cancel, deadline), admit waiting requests into free slots
                      (seed drawn here when the request gave none): the scheduler's
                      TurnPlanner (jetserve/scheduling/turn_planner.py) decides
  all:       exchange ── broadcast_from_primary of the encoded plan (step_plan.py)
  all:       apply ── free_slot; prefill (+ prompt log-probs; in chunks of
                      `prefill_chunk` or max_prefill_length) and insert per admission,
                      consecutive whole prompts sharing a call where the engine takes
                      several (--prefill-batch, `_groups`); one generate step when any
                      slot is occupied
  process 0: read ── the previous step's tokens (one step late, as generate_worker.py,
                      so the host reads while the device runs) -> the detokenize thread

Structured output: the grammars live on process 0, which alone reads tokens. A
constrained admission's first-token mask, and the mask of a step that runs a constrained
slot, are made there (step_masks.py, as the threaded generate loop makes them: a slot
whose last token is not read yet sits the step out, and a batch of constrained slots
alone reads the step before back first) and broadcast as one more array before the call
that takes them; the plan says which calls take one (`Admission.constrained`,
`StepPlan.step_mask`), so the others know to wait for it.

Prefix cache (--prefix-cache-hbm-mb / --prefix-cache-host-mb): every process keeps one
(an array store: prefix_cache.py, "Several processes") and, applying a plan, looks up
every admission with a slot in plan order, prefills only what follows its hit, caches
the prompt's new blocks and releases the hits, in the same order everywhere; so the
caches stay alike and every process takes the same hit decision without a word in the
plan. A prompt that continues a cached prefix is prefilled in a call of its own.

Process 0 keeps everything else of `Orchestrator` (it is a subclass): submit, validation,
the bounded admission queue (clients served in turn), the detokenize thread, request
handles, listeners, stats, drain on stop. So the servers run on it unchanged. Its loop runs on a thread of its own
(`start`); the other processes run the same loop in their main thread (`run`) and never
look at tokens: the plan alone tells them which slots are in use.

On a paged engine (`engine.kv_pages`, kept by its page planner) a request is admitted only when the pages its whole
sequence may take (prompt + token budget) are not promised to the running ones
(`KVCacheManager.reserve`, as in jetserve.offline), so no step runs out of pages and
nothing is preempted. Every process inserts and frees in the same order, so their page
tables agree. Tokens are read back, and requests ended, by the path the threaded
orchestrator uses (readback.py).

Idle: process 0 waits up to `idle_wait_s` for a request before it broadcasts an empty
plan (a request arriving wakes it at once); the others block in the broadcast.
Shutdown: `stop()` on process 0 drains as `Orchestrator.stop` does, then the loop
broadcasts a stop plan and every process leaves its loop. An engine call that fails
fails on every process alike (same program, same inputs), and every process recovers the
same way: the request (or, for a failed step, every request) ends with "error" and the
loop goes on.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import jax
import numpy as np

from engines.engine_api import Engine, ResultTokens
from engines.token_mask import mask_words
from jetserve import distributed
from jetserve.orchestrator.config import OrchestratorConfig
from jetserve.orchestrator.driver import Orchestrator
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from jetserve.orchestrator.prefix_cache import Hit
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import (
    first_mask,
    mask_kwargs,
    mask_positions,
    must_sync,
    step_mask,
)
from jetserve.orchestrator.step_plan import Broadcast, PlanCodec, exchange
from jetserve.orchestrator.wiring import build_prefix_cache
from jetserve.request import adapter_cache_key, adapters_kwargs
from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Admission, StepPlan, chunks
from jetserve.scheduling.turn_planner import TurnPlanner

log = logging.getLogger(__name__)


class LockStepOrchestrator(Orchestrator):
    """One interleaved engine driven in lock step by every process.

    Args:
      engine / params: the engine (its mesh spans the devices of all processes) and its
        weights.
      config: queue bounds, read on process 0, and prefill_chunk, which every process
        must be given alike (OrchestratorConfig).
      primary: whether this is process 0 (default: jax.process_index() == 0).
      broadcast: process 0's array on every process (default:
        distributed.broadcast_from_primary).
      idle_wait_s: how long process 0 waits for a request before an empty turn.
    """

    def __init__(self, engine: Engine, params: Any, *, config: OrchestratorConfig | None = None,
                 primary: bool | None = None, broadcast: Broadcast | None = None,
                 idle_wait_s: float = 0.25):
        self._init_intake([engine], [engine], config)
        self.config.refuse_step_policy("lock step over several processes")
        engine = self.engine = self.generate_engines[0]  # a paged one with its page planner
        self.params = params
        self.primary = distributed.is_primary() if primary is None else primary
        self._broadcast = broadcast or distributed.broadcast_from_primary
        self.idle_wait_s = idle_wait_s
        adapters = getattr(engine, "adapters", None)  # a LoRA engine's, loaded alike everywhere
        self._codec = PlanCodec(engine.max_concurrent_decodes,
                                adapters.name_of if adapters is not None else None)
        self._state = engine.init_decode_state()
        # slot -> its request (process 0) or None (the others only know it is in use).
        self._rows: dict[int, LiveRequest | None] = {}
        # Pages each running sequence may take, promised by process 0 at admission.
        self._kv = KVCacheManager(engine.kv_pages)
        self._planner = TurnPlanner(engine.max_concurrent_decodes, self._kv)
        self._held: LiveRequest | None = None  # next in line, waiting for pages (process 0)
        self._readback = ReadBack(0, self._outbox, self._listeners)
        self.cache = build_prefix_cache(engine, self.config, None)  # every process its own
        self.steps = self.prefills = 0

    def _thread_bodies(self):
        return [("lockstep", self.run), ("detokenize", self._detok.run)]

    def submit_many(self, requests):
        if not self.primary:
            raise RuntimeError("requests go to process 0; this process follows its plans")
        return super().submit_many(requests)

    def stats(self) -> dict:
        s = super().stats()
        s["prefill"] = [{"engine": 0, "busy": False, "prefills": self.prefills}]
        s["generate"] = [{"engine": 0, "slots": self._codec.slots,
                          "slots_in_use": len(self._rows), "backlog": 0,
                          "steps": self.steps, **self._readback.counts()}]
        if self._kv.paged:
            s["generate"][0].update(**self._kv.stats(), preemptions=0)
        if self.cache is not None:
            s["prefix_cache"] = [{"engine": 0, **self.cache.stats()}]
        return s

    def prefix_caches(self) -> list[tuple[int, Any]]:
        return [] if self.cache is None else [(0, self.cache)]

    def _clear_prefix_caches(self) -> None:
        """Kept at stop: process 0's cache stays as every follower's (they never clear)."""

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Turns until process 0 stops: the loop thread on process 0, the main thread of
        the others."""
        try:
            while True:
                plan, lives = self._plan() if self.primary else (None, [])
                plan = exchange(plan, self._codec, self._broadcast)
                if plan.stop:
                    break
                self._apply(plan, lives or [None] * len(plan.admissions))
        except Exception as e:  # a broadcast or a plan failed: no way to stay in step
            log.exception("lock-step loop failed; this process stops serving")
            self._accepting = False
            self._readback.pending = None
            with self._live_cond:
                lives = [lv for lv in self._live.values() if not lv.done]
            self._readback.fail(e, lives)
            raise
        self._readback.read()

    # ---- process 0: what to do this turn ---------------------------------------------------

    def _plan(self) -> tuple[StepPlan, list[LiveRequest]]:
        if self._stopping.is_set():
            return StepPlan(stop=True), []
        return self._planner.plan(self._rows, time.monotonic(), next_request=self._next_request,
                                  admitted=self._admitted, ended=self._readback.end)

    def _admitted(self, live: LiveRequest) -> None:
        self._held = None  # in the plan: the next request comes from the queue

    def _next_request(self, idle: bool) -> LiveRequest | None:
        """The next request still wanted (held, or from the admission queue: it stays held
        until admitted); when idle, waits a little for one."""
        if idle:
            self._readback.read()  # nothing will be dispatched: deliver the last tokens now
        wait = self.idle_wait_s if idle else 0.0
        while True:
            if self._held is None:
                try:
                    self._held = (self._admission.get(timeout=wait) if wait
                                  else self._admission.get_nowait())
                except queue.Empty:
                    return None
                self._admission.task_done()
            live = self._held
            why = None if live.done else live.abandoned(time.monotonic())
            if why is None and not live.done:
                return live
            self._held = None
            if why is not None:
                self._readback.end(live, why)
            wait = 0.0

    # ---- every process: doing it ---------------------------------------------------------

    def _apply(self, plan: StepPlan, lives: list[LiveRequest | None]) -> None:
        for slot in plan.releases:
            del self._rows[slot]
            self.engine.free_slot(slot)
        hits = [self._lookup(a) for a in plan.admissions]
        try:
            for group in self._groups(plan.admissions, lives, hits):
                if len(group) > 1:
                    self._admit_rows(group)
                else:
                    self._admit(*group[0])
        finally:
            for hit in hits:  # in plan order on every process (each evicts alike)
                if hit is not None:
                    hit.release()
        if self._rows:
            self._step(plan.step_mask)

    def _lookup(self, a: Admission) -> Hit | None:
        """The prefix-cache hit of an admission with a slot (pinned until released)."""
        if self.cache is None or a.slot is None:
            return None
        return self.cache.lookup(adapter_cache_key(self.config.prefix_cache_key, a.adapter),
                                 a.prompt_ids)

    def _groups(self, admissions, lives, hits) -> list[list[tuple[Admission, LiveRequest | None,
                                                                  Hit | None]]]:
        """The admissions in order, in runs that share one prefill call (engine.prefill_rows:
        whole prompts of a slot, no prompt scoring, grammar or cached prefix) as the
        engine's shapes take them, the others one each. The plan (and the caches, alike
        everywhere) alone decides it, so every process groups alike."""
        chunk = self.config.prefill_chunk or self.engine.max_prefill_length
        pairs = list(zip(admissions, lives, hits, strict=True))
        shares = [a.slot is not None and not a.prompt_logprobs and not a.constrained
                  and len(a.prompt_ids) <= chunk and (hit is None or not hit.tokens)
                  for a, _, hit in pairs]
        groups, i = [], 0
        while i < len(pairs):
            run = 0
            while i + run < len(pairs) and shares[i + run]:
                run += 1
            n = self.engine.prefill_rows_for(run, max(len(a.prompt_ids) for a, _, _ in
                                                      pairs[i:i + run])) if run > 1 else 1
            groups.append(pairs[i:i + n])
            i += n
        return groups

    def _admit_rows(self, group: list[tuple[Admission, LiveRequest | None, Hit | None]]
                    ) -> None:
        """Several whole prompts in one prefill call, then each inserted into its slot
        (after its blocks are cached, when there is a prefix cache)."""
        t0 = time.monotonic()
        for _, live, _ in group:
            if live is not None:
                live.timing.prefill_start = t0
        inserted = []
        try:
            prefixes, first = self.engine.prefill_rows(
                self.params, [np.asarray(a.prompt_ids, np.int32) for a, _, _ in group],
                samplings=[a.sampling for a, _, _ in group],
                seeds=[a.seed for a, _, _ in group],
                **adapters_kwargs([a.adapter for a, _, _ in group]))
            for (a, _, hit), prefix in zip(group, prefixes, strict=True):
                if hit is not None:
                    self.cache.insert(hit, prefix)
                self._state = self.engine.insert(prefix, self._state, a.slot)
                inserted.append(a.slot)
        except Exception as e:  # the same failure on every process
            log.exception("prefill of several prompts or insert failed")
            self._admissions_failed(group, e, inserted)
            return
        for row, (a, live, _) in enumerate(group):
            self._rows[a.slot] = live
            self.prefills += 1
            if live is not None:
                self._first_token(live, first, t0, row)

    def _admissions_failed(self, pairs, exc: BaseException, inserted=()) -> None:
        """Admissions whose prefill or insert failed (alike on every process): their
        slots given back (those inserted already, freed), their requests ended; a decode
        state the failed call consumed is made anew (every request ends)."""
        for slot in inserted:
            self.engine.free_slot(slot)
        for a, live, _ in pairs:
            self._kv.unreserve(a.slot)
            if live is not None:
                self._readback.end(live, "error", exc)
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self._state)):
            self._fail_all(exc)

    def _admit(self, a: Admission, live: LiveRequest | None, hit: Hit | None) -> None:
        tokens = np.asarray(a.prompt_ids, np.int32)
        t0 = time.monotonic()
        if live is not None:
            live.timing.prefill_start = t0
        try:
            kw = {} if not a.constrained else {"token_mask": self._mask_from_primary(
                first_mask(live)["token_mask"] if live is not None else None, 1)}
            if a.adapter is not None:
                kw["adapter"] = a.adapter  # the LoRA adapter, by the name all loaded
            if a.prompt_logprobs:
                if live is None:
                    self.engine.prompt_logprobs(self.params, tokens, adapter=a.adapter)
                else:
                    live.prompt_logprobs = prompt_logprobs(self.engine, self.params, tokens,
                                                           live.request.logprobs or 0,
                                                           a.adapter)
            if a.slot is None:  # scoring only
                if live is not None:
                    live.timing.prefill_end = time.monotonic()
                    self._readback.end(live, "length")
                return
            done = 0 if hit is None else hit.tokens  # the cached part
            pieces = [(done + s, done + e) for s, e in chunks(
                len(tokens) - done, self.config.prefill_chunk or self.engine.max_prefill_length)]
            if done:  # the cache's blocks as a prefix of their own (its first chunk copies it)
                prefix = self.cache.existing_prefix(hit, tokens)
            else:  # several chunks: the KV at its final size, filled in place
                prefix = self.engine.empty_prefix(len(tokens)) if len(pieces) > 1 else None
            for start, end in pieces:
                piece = tokens[start:end]
                prefix, first = self.engine.prefill(self.params, piece, len(piece),
                                                    sampling=a.sampling, seed=a.seed,
                                                    existing_prefix=prefix,
                                                    donate=not done or start > done, **kw)
            if hit is not None:
                self.cache.insert(hit, prefix)
            self._state = self.engine.insert(prefix, self._state, a.slot)
        except Exception as e:  # the same failure on every process
            log.exception("prefill or insert failed")
            self._admissions_failed([(a, live, hit)], e)
            return
        self._rows[a.slot] = live
        self.prefills += 1
        if live is not None:
            self._first_token(live, first, t0)

    def _first_token(self, live: LiveRequest, first: ResultTokens, t0: float,
                     row: int = 0) -> None:
        """Process 0: the prefill's token (row `row` of `first`) streams now. A request it
        ends keeps its slot until the next plan frees it (every process inserted it)."""
        try:
            self._readback.first_token(live, first, t0, len(live.request.prompt_ids), row)
        except Exception as e:
            log.exception("reading the first token failed")
            self._readback.end(live, "error", e)

    def _mask_from_primary(self, mask: np.ndarray | None, *shape: int) -> np.ndarray:
        """Process 0's mask i32[*shape, W] on every process (the others pass None)."""
        if mask is None:
            mask = np.zeros((*shape, mask_words(self.engine.vocab_size)), np.int32)
        return np.asarray(self._broadcast(mask), np.int32)

    def _step_mask_shape(self) -> tuple[int, ...]:
        """A step mask's leading axes: slots, and each position a verify step samples."""
        positions = mask_positions(self.engine)
        B = self.engine.max_concurrent_decodes
        return (B,) if positions == 1 else (B, positions)

    def _step_mask(self, rows) -> tuple[np.ndarray | None, set[int]]:
        """Process 0: this step's mask (every row allowed when no slot is constrained any
        more) and the slots that sit it out."""
        if must_sync(rows):
            self._readback.sync()  # the constrained slots' next masks need their tokens
        B = self.engine.max_concurrent_decodes
        positions = mask_positions(self.engine)
        mask, paused = step_mask(rows, B, self.engine.vocab_size, pause=True,
                                 positions=positions)
        if mask is None:  # every row allowed everything
            mask = np.full((*self._step_mask_shape(), mask_words(self.engine.vocab_size)),
                           -1, np.int32)
        return mask, paused

    def _step(self, masked: bool = False) -> None:
        rows = sorted(self._rows.items())
        mask, paused = self._step_mask(rows) if masked and self.primary else (None, set())
        t = time.monotonic()
        try:
            if masked:
                mask = self._mask_from_primary(mask, *self._step_mask_shape())
            self._state, res = self.engine.generate(self.params, self._state,
                                                    **mask_kwargs(mask))
        except Exception as e:  # the same failure on every process
            log.exception("generate step failed")
            self._fail_all(e)
            return
        self.steps += 1
        if not self.primary:
            return
        res.copy_to_host_async()
        for slot, live in rows:
            if slot not in paused:  # a paused slot sat the step out (step_masks.py)
                live.steps += 1
        self._readback.dispatched(res, rows, t)

    def _fail_all(self, exc: BaseException) -> None:
        """A failed step ends every request in a slot; a fresh decode state follows."""
        victims = list(self._rows.values())
        for slot in list(self._rows):
            del self._rows[slot]
            self.engine.free_slot(slot)
        self._kv.clear_reservations()
        self._readback.fail(exc, victims)
        self._state = self.engine.init_decode_state()
