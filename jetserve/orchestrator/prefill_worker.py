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

Several prompts a call (`--prefill-batch`, engine.prefill_rows): when the engine takes
them, the thread takes every admitted request waiting with the one it got (`_more`, no
wait), and the fresh, whole prompts without prompt scoring, grammar, adapter or cached
prefix share calls, as many a call as the engine's shapes hold (`prefill_rows_for`); each
then streams its first token and goes on to a slot as if prefilled alone. The rest are
prefilled one by one, as above.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engines.engine_api import Engine, ResultTokens
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_loop import PrefillLoop
from jetserve.orchestrator.prefix_cache import Hit, PrefixCache
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import first_mask
from jetserve.orchestrator.timing import Listeners
from jetserve.request import adapters_kwargs

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
        # As many prompts a call as the engine takes (decode-first, whose budget counts one
        # prompt a call, refuses more: wiring.py).
        self.max_rows = max((r for r, _ in engine.prefill_row_shapes()), default=1)
        self.route: Route | None = None  # set by the driver

    def _serve(self, live: LiveRequest) -> None:
        begun = self._begin(live)
        if begun is not None:
            self._serve_begun(live, *begun)

    def _serve_begun(self, live: LiveRequest, tokens: np.ndarray, hit: Hit | None,
                     t0: float) -> None:
        """Prefills one begun request in its own calls and hands it on."""
        try:
            out = self._prefill(live, tokens, hit)
        except BaseException:
            if hit is not None:
                hit.release()
            raise
        if out is None:  # ended between chunks
            if hit is not None:
                hit.release()
            return
        self._hand_on(live, tokens, hit, *out, t0)

    def _begin(self, live: LiveRequest) -> tuple[np.ndarray, Hit | None, float] | None:
        """(the tokens to prefill, the prefix-cache hit, the start time), or None when the
        request needs no prefill (it ended, or only scores its prompt: ended here)."""
        if self._ended_before_prefill(live):
            return None
        req = live.request
        t0 = time.monotonic()
        tokens = np.asarray(live.sequence(), np.int32)
        if live.preemptions == 0:
            live.timing.prefill_start = t0
            if req.prompt_logprobs:
                live.prompt_logprobs = prompt_logprobs(self.engine, self.params, tokens,
                                                     req.logprobs or 0, req.lora_adapter)
            if req.max_tokens == 0:  # scoring only
                live.timing.prefill_end = time.monotonic()
                self.readback.end(live, "length")
                return None
        hit = None
        if self.cache is not None:
            hit = self.cache.lookup(req.cache_key(self.cache_key), tokens,
                                    wait_s=ADOPT_WAIT_POLLS * self.poll_s)
        return tokens, hit, t0

    def _hand_on(self, live: LiveRequest, tokens: np.ndarray, hit: Hit | None, prefix: Any,
                 first: ResultTokens, t0: float, row: int = 0) -> None:
        """Streams the first token (row `row` of `first`), caches the prompt's blocks and
        routes the prefix to a slot; `hit` is released here unless it goes on with the
        request (to the generate thread, which adopts and releases it)."""
        cache = self.cache
        try:
            if hit is not None and not cache.pages:
                cache.insert(hit, prefix)
            ended = self.readback.first_token(live, first, t0, len(tokens), row=row)  # streams
            self.prefills += 1
            if hit is not None and cache.pages:
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

    # ---- several prompts per prefill call (engine.prefill_rows) -------------------------

    def _more(self, first: LiveRequest) -> list[LiveRequest]:
        """Admitted requests to prefill with `first`, taken without waiting while the
        engine takes several prompts per call and `first` can share one."""
        if self.max_rows < 2 or not first.may_share_prefill(self.chunk):
            return []
        more: list[LiveRequest] = []
        while len(more) < self.max_rows - 1:
            try:
                more.append(self.admission.get_nowait())
            except queue.Empty:
                break
        return more

    def warm_rows(self, rows: int, bucket: int) -> None:
        """Compiles and runs once the call of `rows` throwaway prompts of `bucket` tokens."""
        _, res = self.engine.prefill_rows(self.params, [np.zeros(bucket, np.int32)] * rows,
                                          samplings=[None] * rows, seeds=[0] * rows)
        res.to_host()

    def _serve_many(self, lives: list[LiveRequest]) -> None:
        """Prefills the requests that can share calls in as few as the engine's shapes
        allow (`prefill_rows_for`), in order; the others one by one (`_serve`)."""
        shared: list[tuple[LiveRequest, np.ndarray, Hit | None, float]] = []
        for live in lives:
            if not live.may_share_prefill(self.chunk):
                self._serve_one(live)
                continue
            try:
                begun = self._begin(live)
            except Exception as e:
                self._failed(live, e)
                continue
            if begun is None:
                continue
            tokens, hit, t0 = begun
            if hit is not None and hit.tokens:  # continues a cached prefix: a call of its own
                try:
                    self._serve_begun(live, tokens, hit, t0)
                except Exception as e:
                    self._failed(live, e)
                continue
            shared.append((live, tokens, hit, t0))
        while shared:
            n = self.engine.prefill_rows_for(len(shared), max(len(t) for _, t, _, _ in shared))
            group, shared = shared[:n], shared[n:]
            self._prefill_group(group)

    def _prefill_group(self, group: list[tuple[LiveRequest, np.ndarray, Hit | None, float]]
                       ) -> None:
        """One call for the group's prompts (a plain prefill for a group of one), then each
        request handed on; an exception of the call ends every request of the group."""
        try:
            if len(group) == 1:
                live, tokens, hit, _ = group[0]
                outs = [self._prefill(live, tokens, hit)]
            else:
                prefixes, first = self.engine.prefill_rows(
                    self.params, [t for _, t, _, _ in group],
                    samplings=[live.request.sampling for live, _, _, _ in group],
                    **adapters_kwargs([live.request.lora_adapter for live, _, _, _ in group]))
                self.row_calls += 1
                outs = [(p, first) for p in prefixes]
        except Exception as e:
            for live, _, hit, _ in group:
                if hit is not None:
                    hit.release()
                self._failed(live, e)
            return
        for row, ((live, tokens, hit, t0), out) in enumerate(zip(group, outs, strict=True)):
            if out is None:  # a group of one, ended between chunks
                if hit is not None:
                    hit.release()
                continue
            try:
                self._hand_on(live, tokens, hit, *out, t0, row=row)
            except Exception as e:
                self._failed(live, e)

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


def prompt_logprobs(engine: Engine, params: Any, tokens: np.ndarray, n: int,
                    adapter: str | None = None):
    """(log-prob per prompt token, top-n alternatives per prompt token), through LoRA
    adapter `adapter` when one is named; the first token has no context: None and []."""
    out = engine.prompt_logprobs(params, tokens, adapter=adapter)
    lps = np.asarray(out.token_logprobs, np.float32).tolist()
    ids = np.asarray(out.top_ids)[:, :n].tolist()
    tops = np.asarray(out.top_logprobs, np.float32)[:, :n].tolist()
    values: list[float | None] = [None] + [float(x) for x in lps[1:]]
    pairs = zip(ids[1:], tops[1:], strict=True)
    alts = [[]] + [list(zip(i, t, strict=True)) for i, t in pairs]
    return values, alts