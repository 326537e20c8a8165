"""A synchronous continuous-batching loop on one engine: tests, and `jetserve generate`
across several processes (which must dispatch identical steps, so no threads).

Prompts wait in order; whenever a slot is free the next prompt is prefilled (in chunks of
max_prefill_length when longer) and inserted, so prompts join the batch at different
steps. On a paged engine a prompt also waits until the pages its whole sequence may take
(prompt + token budget) are not promised to the running ones, so a step never runs out of
pages. Every step's results are read back before
the next step (the threaded orchestrator overlaps this; here simplicity wins).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

from engines import Engine, HostResults, SamplingParams
from jetserve.orchestrator.stopping import stop_ids, token_budget, token_finish

GREEDY = SamplingParams()  # frozen: one shared default


@dataclasses.dataclass
class OfflineResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logprobs: list[float]


def generate_many(
    engine: Engine,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    ignore_eos: bool = False,
) -> list[OfflineResult]:
    """Runs every prompt to completion; results in prompt order."""
    samplings = ([sampling] * len(prompts) if isinstance(sampling, SamplingParams)
                 else list(sampling))
    stops = stop_ids(engine.eos_ids, (), ignore_eos)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        check_prompt_fits(engine, len(p), f"prompt {i}")
    results: list[OfflineResult | None] = [None] * len(prompts)
    waiting = deque(range(len(prompts)))
    active: dict[int, int] = {}  # slot -> prompt index
    out: dict[int, OfflineResult] = {}
    state = engine.init_decode_state()
    free = list(range(engine.max_concurrent_decodes))

    budgets = [token_budget(len(p), max_tokens, engine.max_seq_len) for p in prompts]
    pages = engine.kv_pages
    promised: dict[int, int] = {}  # slot -> pages its sequence may take at most

    def fits(i: int) -> bool:
        if pages is None:
            return True
        need = pages.pages_for_sequence(len(prompts[i]) + budgets[i])
        return need + sum(promised.values()) <= pages.pool.num_pages

    def accept(i: int, h: HostResults, row: int) -> bool:
        """Records the row's tokens up to the first that ends request i; returns True
        when it is finished."""
        r = out[i]
        for j, token in enumerate(h.tokens(row)):
            r.token_ids.append(token)
            r.logprobs.append(h.logprob(row, j))
            finish = token_finish(token, len(r.token_ids), budgets[i], stops)
            if finish is not None:
                r.finish_reason = finish[0]
                return True
        return False

    while waiting or active:
        while waiting and free and fits(waiting[0]):
            i = waiting.popleft()
            prefix, first = prefill_chunked(engine, params, prompts[i], samplings[i])
            out[i] = OfflineResult(list(prompts[i]), [], "length", [])
            if accept(i, first.to_host(), 0):
                results[i] = out.pop(i)
                continue
            slot = free.pop(0)
            state = engine.insert(prefix, state, slot)
            active[slot] = i
            if pages is not None:
                promised[slot] = pages.pages_for_sequence(len(prompts[i]) + budgets[i])
        if not active:
            continue
        state, res = engine.generate(params, state)
        h = res.to_host()
        for slot, i in list(active.items()):
            if accept(i, h, slot):
                results[i] = out.pop(i)
                del active[slot]
                engine.free_slot(slot)
                promised.pop(slot, None)
                free.append(slot)
    return [r for r in results if r is not None]


def check_prompt_fits(engine: Engine, n: int, what: str) -> None:
    """ValueError unless a prompt of n tokens fits: max_seq_len - 1 when the engine
    prefills in chunks (room for one token), else max_prefill_length."""
    if engine.chunked_prefill:
        if n > engine.max_seq_len - 1:
            raise ValueError(f"{what} has {n} tokens; the longest prompt is max_seq_len - 1 "
                             f"= {engine.max_seq_len - 1} (--max-seq-len raises it)")
    elif n > engine.max_prefill_length:
        raise ValueError(f"{what} has {n} tokens; the longest prompt is max_prefill_length="
                         f"{engine.max_prefill_length} (--max-prefill-length raises it)")


def prefill_chunked(engine: Engine, params, prompt: Sequence[int], sampling: SamplingParams):
    """(prefix, first token) of a prompt, in chunks of max_prefill_length, each continuing
    the last."""
    prefix = None
    P = engine.max_prefill_length
    for start in range(0, len(prompt), P):
        piece = list(prompt[start:start + P])
        prefix, first = engine.prefill(params, piece, len(piece), sampling=sampling,
                                       existing_prefix=prefix)
    return prefix, first
