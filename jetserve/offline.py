"""A synchronous continuous-batching loop on one engine, the bare Engine API without
threads: the reference the tests and benchmarks hold the orchestrators to
(`jetserve generate` runs the orchestrator, and the lock-step one over several processes).

Prompts wait in order; whenever a slot is free the next prompt is prefilled (in chunks of
max_prefill_length when longer) and inserted, so prompts join the batch at different steps;
prompts admitted together share prefill calls where the engine takes several a call
(--prefill-batch). On a paged engine a prompt also waits until
the pages its whole sequence may take (prompt + token budget) are not promised to the
running ones (`KVCacheManager.reserve`), so a step never runs out of pages. Tokens are
taken and requests finished by the read-back path the orchestrators use (readback.py);
here every step is read before the next one is dispatched (simplicity over overlap).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence

from engines import Engine, HostResults, SamplingParams
from jetserve.orchestrator.live import LiveRequest, Message, StepOutput
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import (
    check_constrainable,
    first_mask,
    mask_kwargs,
    mask_positions,
    step_mask,
)
from jetserve.orchestrator.stopping import stop_ids, token_budget
from jetserve.orchestrator.timing import Listeners, RequestTiming
from jetserve.request import Request, adapters_kwargs, check_prompt_fits
from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.page_planner import with_pages
from jetserve.scheduling.plan import chunks
from jetserve.scheduling.scheduler import Scheduler
from jetserve.scheduling.slots import rows_kwargs, step_batch
from jetserve.structured import Constraint

GREEDY = SamplingParams()  # frozen: one shared default


@dataclasses.dataclass
class OfflineResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[float]


class _Collect:
    """Stands where the detokenize thread's queue stands: keeps each request's token
    log-probs and finish reason."""

    def __init__(self):
        self.logprobs: dict[int, list[float]] = {}
        self.finish: dict[int, str] = {}

    def put(self, message: Message) -> None:
        if not isinstance(message, StepOutput):
            raise RuntimeError(f"offline generation ended a request early: {message}")
        host = HostResults(message.data)
        for live, row, n, finish in message.rows:
            self.logprobs.setdefault(id(live), []).extend(host.logprob(row, j)
                                                          for j in range(n))
            if finish is not None:
                self.finish[id(live)] = finish[0]


def generate_many(
    engine: Engine,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    ignore_eos: bool = False,
    constraints: Sequence[Constraint | None] | None = None,
    adapters: Sequence[str | None] | None = None,
) -> list[OfflineResult]:
    """Runs every prompt to completion; results in prompt order. constraints: per
    prompt, what its output must match (structured output), or None; `adapters`: each
    prompt's LoRA adapter (None: the base model)."""
    samplings = ([sampling] * len(prompts) if isinstance(sampling, SamplingParams)
                 else list(sampling))
    # The longest prompt: max_seq_len - 1 when the engine prefills in chunks.
    longest = engine.max_seq_len - 1 if engine.chunked_prefill else engine.max_prefill_length
    constraints = list(constraints) if constraints is not None else [None] * len(prompts)
    if any(c is not None for c in constraints):
        # Imported here: llguidance loads only where a prompt is constrained (and `c and`
        # below calls it only then).
        from jetserve.structured.grammar import compile_constraint

        check_constrainable("constraints", [engine], engine.tokenizer)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        check_prompt_fits(len(p), longest, engine.max_seq_len, f"prompt {i}")
    stops = stop_ids(engine.eos_ids, (), ignore_eos)
    lives = [LiveRequest(Request(prompt_ids=[int(t) for t in p], sampling=s,
                                 max_tokens=max_tokens, ignore_eos=ignore_eos,
                                 lora_adapter=a),
                         handle=None, timing=RequestTiming(arrival=time.monotonic()),
                         budget=token_budget(len(p), max_tokens, engine.max_seq_len),
                         stop_ids=stops, grammar=c and compile_constraint(
                             c, engine.tokenizer, engine.vocab_size))
             for p, s, c, a in zip(prompts, samplings, constraints,
                                   adapters or [None] * len(prompts), strict=True)]
    sink = _Collect()
    _run(engine, params, lives, ReadBack(0, sink, Listeners()))
    return [OfflineResult(list(p), live.tokens, sink.finish[id(live)], sink.logprobs[id(live)])
            for p, live in zip(prompts, lives, strict=True)]


def _run(engine: Engine, params, lives: list[LiveRequest], readback: ReadBack) -> None:
    """Prefills, inserts and steps until every request has finished."""
    engine = with_pages(engine)  # a paged engine is called through its page planner
    sched: Scheduler[LiveRequest] = Scheduler(engine.max_concurrent_decodes,
                                              KVCacheManager(engine.kv_pages))
    waiting = deque(lives)
    state = engine.init_decode_state()
    sizes = tuple(engine.decode_batch_sizes)  # a step runs the fewest slots it can
    while waiting or sched.slots.in_use:
        admitted: list[LiveRequest] = []  # one per free slot, while their pages fit
        while (waiting and len(admitted) < sched.slots.free_count
               and sched.kv.reserve(waiting[0], len(waiting[0].request.prompt_ids)
                                    + waiting[0].budget)):
            admitted.append(waiting.popleft())
        for live, prefix, first, row, t0 in _prefill_all(engine, params, admitted):
            if readback.first_token(live, first, t0, len(live.request.prompt_ids), row=row):
                sched.kv.unreserve(live)
                continue
            state = engine.insert(prefix, state, sched.assign(live))
        if not sched.slots.in_use:
            continue
        rows = sched.slots.rows()
        t = time.monotonic()
        batch = step_batch(rows, sizes)
        mask, _ = step_mask(rows, batch, engine.vocab_size, positions=mask_positions(engine))
        state, res = engine.generate(params, state, **mask_kwargs(mask),
                                     **rows_kwargs(batch, sizes))
        readback.dispatched(res, rows, t)
        readback.read()
        for slot, live in rows:
            if live.done:
                sched.release(slot)
                engine.free_slot(slot)
                sched.kv.unreserve(live)


def _prefill_all(engine: Engine, params, lives: list[LiveRequest]):
    """(request, prefix, first-token results, its row there, start time) of each request,
    in order: whole prompts of no grammar or adapter share prefill calls as the engine
    takes them (`prefill_rows_for`, --prefill-batch), the rest are prefilled alone."""
    i = 0
    while i < len(lives):
        run = 0  # how many requests from i on could share a call
        while (i + run < len(lives)
               and lives[i + run].may_share_prefill(engine.max_prefill_length)):
            run += 1
        n = engine.prefill_rows_for(run, max(len(x.request.prompt_ids)
                                             for x in lives[i:i + run])) if run > 1 else 1
        t0 = time.monotonic()
        if n > 1:
            group = lives[i:i + n]
            prefixes, first = engine.prefill_rows(
                params, [list(x.request.prompt_ids) for x in group],
                samplings=[x.request.sampling for x in group],
                **adapters_kwargs([x.request.lora_adapter for x in group]))
            for row, (live, prefix) in enumerate(zip(group, prefixes, strict=True)):
                yield live, prefix, first, row, t0
        else:
            live = lives[i]
            prefix, first = prefill_chunked(engine, params, list(live.request.prompt_ids),
                                            live.request.sampling, **first_mask(live),
                                            **live.request.prefill_kwargs())
            yield live, prefix, first, 0, t0
        i += n


def prefill_chunked(engine: Engine, params, prompt: Sequence[int], sampling: SamplingParams,
                    **kwargs):
    """(prefix, first token) of a prompt, in chunks of max_prefill_length, each continuing
    the last; `kwargs`: the request's own (a token_mask, Request.prefill_kwargs)."""
    pieces = chunks(len(prompt), engine.max_prefill_length)
    # Several chunks: the KV at its final size, filled in place.
    prefix = engine.empty_prefix(len(prompt)) if len(pieces) > 1 else None
    for start, end in pieces:
        piece = list(prompt[start:end])
        prefix, first = engine.prefill(params, piece, len(piece), sampling=sampling,
                                       existing_prefix=prefix, donate=True, **kwargs)
    return prefix, first
