"""A host loop over mixed steps, for tests: prompts arrive over time and are prefilled in
chunks while the sequences already admitted decode, in one ragged step each time.

It plays the scheduler's part in the simplest way (decode rows first, then chunks up to
a token budget) and keeps pages in a jetserve.scheduling PagePool, each slot's in
position order, as the KV-cache manager would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from engines.mixed_batch import MixedRow
from engines.sampling import SamplingParams
from engines.token_mask import allow_all
from jetserve.scheduling.page_pool import PagePool, pages_for, width_bucket


@dataclasses.dataclass
class _Seq:
    index: int
    prompt: list[int]
    sent: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MixedRun:
    outputs: list[list[int]]  # each prompt's generated tokens, in prompt order
    shapes: set[tuple[int, int]]  # (token bucket, page-table width) of every step
    steps: int
    mixed_steps: int  # steps with both decode rows and a chunk
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)  # as outputs


def chunk_row(slot: int, q: _Seq, n: int, sampling: SamplingParams | None,
              adapter: str | None = None) -> MixedRow:
    """The row of q's next n prompt tokens (its first chunk starts its sampling, seeded
    by its index)."""
    return MixedRow(slot=slot, chunk=q.prompt[q.sent:q.sent + n], start=q.sent,
                    last=q.sent + n == len(q.prompt),
                    sampling=(sampling or SamplingParams()) if q.sent == 0 else None,
                    seed=q.index, adapter=adapter)


def _bucket(engine, rows) -> int:
    """The step's token bucket; 0 for decode rows alone (the generate step's program)."""
    if all(r.decode for r in rows):
        return 0
    tokens = sum(len(r.chunk) or 1 for r in rows)
    return min(b for b in engine.mixed_token_buckets if b >= tokens)


def run_mixed(engine, params, prompts, *, max_tokens: int, chunk: int, budget: int,
              arrive_every: int = 2, sampling: SamplingParams | None = None,
              widest: bool = False, masks: Callable[[int, int], np.ndarray] | None = None,
              pause_every: int = 0, adapters=None) -> MixedRun:
    """Prompt i arrives at step i * arrive_every; every sequence gets max_tokens tokens.
    `widest`: every step takes the whole page table (one width: fewer programs to
    compile), else the width the pages held need (as generate's planner). `masks`: each
    step takes a token mask, masks(i, j) the packed row of prompt i's token j (rows that
    sample nothing allow all); `pause_every` k > 0: a decode row sits out (an all-zero
    row) the steps where step + slot is a multiple of k. `adapters`: prompt i's LoRA
    adapter (None: the base model), on each of its chunks; a slot's is let go
    (engine.free_slot) when its sequence ends."""
    adapters = adapters or [None] * len(prompts)
    g = engine.page_geometry
    pool = PagePool(g.num_pages)
    max_pages = pages_for(g.max_seq_len, g.page_size)
    table = np.full((g.slots, max_pages), g.num_pages, np.int32)  # num_pages: trash
    slots: dict[int, _Seq] = {}
    outputs: list[list[int] | None] = [None] * len(prompts)
    logprobs: list[list[float] | None] = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    state = engine.init_decode_state()
    run = MixedRun(outputs=[], shapes=set(), steps=0, mixed_steps=0)
    while waiting or slots:
        for s in range(g.slots):  # admit what has arrived into free slots
            if s not in slots and waiting and waiting[0] * arrive_every <= run.steps:
                i = waiting.pop(0)
                slots[s] = _Seq(i, list(prompts[i]))
        rows, reach, left = [], {}, budget
        for s, q in sorted(slots.items()):  # decode first
            if q.sent == len(q.prompt):
                rows.append(MixedRow(slot=s))
                reach[s] = len(q.prompt) + len(q.out) - 1
                left -= 1
        for s, q in sorted(slots.items()):
            n = min(chunk, len(q.prompt) - q.sent, left)
            if q.sent < len(q.prompt) and n > 0:
                rows.append(chunk_row(s, q, n, sampling, adapters[q.index]))
                reach[s] = q.sent + n - 1
                left -= n
        if not rows:
            run.steps += 1
            continue
        for s, pos in reach.items():  # pages through every position this step writes
            q = slots[s]
            while len(q.pages) * g.page_size <= pos:
                (page,) = pool.alloc(1)
                table[s, len(q.pages)] = page
                q.pages.append(page)
        width = max_pages if widest else width_bucket(
            max(len(q.pages) for q in slots.values()), max_pages)
        run.shapes.add((_bucket(engine, rows), width))
        run.mixed_steps += any(r.decode for r in rows) and any(r.chunk for r in rows)
        mask, paused = _step_mask(engine, rows, slots, masks, pause_every, run.steps)
        kw = {} if mask is None else {"token_mask": mask}
        state, res = engine.mixed_step(params, state, table[:, :width].copy(), rows, **kw)
        host = res.to_host()
        for r in rows:
            q = slots[r.slot]
            q.sent += len(r.chunk)
            assert host.valid(r.slot) == ((r.decode or r.last) and r.slot not in paused)
            if host.valid(r.slot):
                q.out.append(host.token(r.slot))
                q.logprobs.append(host.logprob(r.slot))
            if len(q.out) == max_tokens:
                outputs[q.index], logprobs[q.index] = q.out, q.logprobs
                if adapters[q.index] is not None:
                    engine.free_slot(r.slot)
                pool.decref(q.pages)
                table[r.slot] = g.num_pages
                del slots[r.slot]
        run.steps += 1
    run.outputs, run.logprobs = outputs, logprobs
    return run


def _step_mask(engine, rows, slots, masks, pause_every: int, step: int):
    """(the step's token mask or None, the slots it sits out)."""
    if masks is None:
        return None, set()
    mask = allow_all(engine.page_geometry.slots, engine.vocab_size)
    paused = set()
    for r in rows:
        q = slots[r.slot]
        if r.decode and pause_every and (step + r.slot) % pause_every == 0:
            mask[r.slot] = 0
            paused.add(r.slot)
        elif r.decode or r.last:
            mask[r.slot] = masks(q.index, len(q.out))
    return mask, paused
