"""The prefill thread of one prefill engine: admission queue -> first token -> a slot.

It takes the next admitted request (the oldest of the client whose turn it is), runs the
prompt (and its prompt log-probs when asked), sends the first token to the detokenize
thread at once, then hands the prefix on: straight into its own engine's backlog in
interleaved mode, or to the transfer thread of the least loaded generate engine. Handing
on blocks while that queue is full, which is what bounds memory end to end. An exception
ends only the request being prefilled.

Requests preempted by a generate thread (paged KV, out of pages) come back through the
resume queue, which goes before new admissions: their prompt and generated tokens are
prefilled again and the next token streams as if decoded.

Chunked prefill: a sequence longer than `chunk` tokens is prefilled in chunks, each
continuing the last (`existing_prefix`); between chunks `between_chunks()` lets the
generate thread of the same engine run a step, so running requests keep streaming while
a long prompt arrives. Under decode-first, `budget` (step_budget.py) instead holds each
prefill call until it fits the token budget of the engine's next decode step.

Prefix cache (`cache`, prefix_cache.py): before prefilling, the longest cached whole-block
prefix of the sequence is looked up and only the rest is prefilled on top of it. Its new
blocks are cached after the prefill (array store), or, when the cache keeps its blocks in
this engine's KV pages, the hit travels with the request and the generate thread links
its pages into the slot and adopts the prompt's pages (page store).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engines.engine_api import Engine
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_loop import PrefillLoop
from jetserve.orchestrator.prefix_cache import Hit, PrefixCache
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import first_mask
from jetserve.orchestrator.timing import Listeners

# route(live, prefix) hands a prefilled request on; False when the orchestrator stopped.
# A lookup waits at most this many poll intervals for an earlier request's pages to be
# cached, when they would lengthen its hit (prefix_cache.PrefixCache.lookup).
ADOPT_WAIT_POLLS = 5
Route = Callable[[LiveRequest, Any], bool]


class PrefillWorker(PrefillLoop):
    """A prefill thread over a local engine (see the module docstring)."""

    def __init__(self, index: int, engine: Engine, params: Any, admission: FairQueue,
                 outbox: queue.Queue, listeners: Listeners, stopping: threading.Event,
                 poll_s: float, *, resume: queue.Queue | None = None,
                 chunk: int | None = None, cache: PrefixCache | None = None,
                 cache_key: str = ""):
        super().__init__(index, admission, resume, ReadBack(index, outbox, listeners),
                         stopping, poll_s)
        self.chunk = chunk or engine.max_prefill_length
        self.between_chunks: Callable[[], None] = lambda: None  # set by the driver
        self.waiting_between_chunks = False
        # budget(tokens, ends_prompt): held around each prefill call (set by the driver).
        self.budget: Callable[[int, bool], contextlib.AbstractContextManager] = (
            lambda tokens, ends_prompt: contextlib.nullcontext())
        self.cache, self.cache_key = cache, cache_key
        self.engine = engine
        self.params = params
        self.route: Route | None = None  # set by the driver

    def _serve(self, live: LiveRequest) -> None:
        if self._ended_before_prefill(live):
            return
        req = live.request
        t0 = time.monotonic()
        resumed = live.preemptions > 0
        tokens = np.asarray(live.sequence(), np.int32)
        if not resumed:
            live.timing.prefill_start = t0
            if req.prompt_logprobs:
                live.prompt_logprobs = prompt_logprobs(self.engine, self.params, tokens,
                                                     req.logprobs or 0)
            if req.max_tokens == 0:  # scoring only
                live.timing.prefill_end = time.monotonic()
                self.readback.end(live, "length")
                return
        cache = self.cache
        hit = None
        if cache is not None:
            hit = cache.lookup(req.cache_key(self.cache_key), tokens, wait_s=ADOPT_WAIT_POLLS * self.poll_s)
        try:
            out = self._prefill(live, tokens, hit)
            if out is None:
                return  # ended between chunks
            prefix, first = out
            if hit is not None and not cache.pages:
                cache.insert(hit, prefix)
            ended = self.readback.first_token(live, first, t0, len(tokens))  # streams now
            self.prefills += 1
            if hit is not None and cache.pages:  # the generate thread adopts and releases it
                if ended and len(tokens) // cache.block <= len(hit.pages):
                    return  # ended, and nothing new to cache
                cache.hand_on(hit)
                live.cache_hit, hit = hit, None
            elif ended:
                return
            # An ended request goes on only for its pages to be cached (done and cache_hit).
            if not self.route(live, prefix):
                live.release_cache_hit()
                if not ended:
                    self.readback.end(live, "cancelled")
        finally:
            if hit is not None:
                hit.release()

    def _prefill(self, live: LiveRequest, tokens: np.ndarray, hit: Hit | None):
        """(prefix, first token) for `tokens`, after the cached part of a hit, in chunks of
        at most `chunk`; None when the request was cancelled or timed out between chunks
        (it is ended here)."""
        done = 0 if hit is None else hit.tokens
        prefix = self.cache.existing_prefix(hit, tokens) if done else None
        if not done and len(tokens) > self.chunk:  # the KV at its final size, filled in place
            prefix = self.engine.empty_prefix(len(tokens))
        for start in range(done, len(tokens), self.chunk):
            if start > done:
                self.waiting_between_chunks = True
                try:
                    self.between_chunks()
                finally:
                    self.waiting_between_chunks = False
                why = "cancelled" if live.done else live.abandoned(time.monotonic())
                if why is not None:
                    if not live.done:
                        self.readback.end(live, why)
                    return None
            piece = tokens[start:start + self.chunk]
            # The cache's prefix is shared (copied); any other is this loop's alone.
            with self.budget(len(piece), start + len(piece) == len(tokens)):
                prefix, first = self.engine.prefill(self.params, piece, len(piece),
                                                    sampling=live.request.sampling,
                                                    existing_prefix=prefix,
                                                    donate=not done or start > done,
                                                    **first_mask(live),
                                                    **live.request.prefill_kwargs())
        return prefix, first


def prompt_logprobs(engine: Engine, params: Any, tokens: np.ndarray, n: int):
    """(log-prob per prompt token, top-n alternatives per prompt token); the first token
    has no context: None and []."""
    out = engine.prompt_logprobs(params, tokens)
    lps = np.asarray(out.token_logprobs, np.float32).tolist()
    ids = np.asarray(out.top_ids)[:, :n].tolist()
    tops = np.asarray(out.top_logprobs, np.float32)[:, :n].tolist()
    values: list[float | None] = [None] + [float(x) for x in lps[1:]]
    pairs = zip(ids[1:], tops[1:], strict=True)
    alts = [[]] + [list(zip(i, t, strict=True)) for i, t in pairs]
    return values, alts