"""Structured output on the host side of a generate step: each constrained slot's mask.

A constrained slot's mask for step N depends on the token step N - 1 gave it, which the
generate loop reads only after dispatching step N (one step late, so the device always
has a step queued). Two ways out, chosen per step:

- with an unconstrained request in the batch, nobody waits: a constrained slot whose
  last token is not read yet gets an all-zero mask row and sits the step out
  (engines/token_mask.hold_paused: no token, no key or length change; on a paged cache
  the page planner sees the same row and keeps the slot's length). Its token is read
  while that step runs, its grammar takes it and its mask is ready for the next.
  Constrained requests then get a token every other step, free ones every step.
- when every request in the batch is constrained, the loop syncs (`must_sync`): it reads
  step N - 1 back first, then writes the masks and dispatches step N. The device idles
  for the read-back wait plus the mask work (tens of microseconds per slot for a JSON
  schema); `jetserve bench structured` measures it. The read-back counts these waits
  (`syncs`) and the slots that sat a step out (`sat_out`).

A batch without a constrained request keeps the program compiled without a mask.
A mixed step (mixed_worker.py) takes the same masks, for its decode rows and for the
chunks that end a prompt (`starting`: their first token, which no step has in flight).

Plain numpy and llguidance; the engine takes the mask as `token_mask=`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from engines import TransformerEngine
from engines.token_mask import allow_all

Rows = Sequence[tuple[int, Any]]  # (slot, LiveRequest)


def any_constrained(rows: Rows) -> bool:
    return any(live.grammar is not None and not live.done for _, live in rows)


def must_sync(rows: Rows) -> bool:
    """Whether the loop reads the previous step back before this one (see module doc)."""
    return any_constrained(rows) and all(live.grammar is not None for _, live in rows)


def step_mask(rows: Rows, batch: int, vocab_size: int, *, pause: bool = False,
              positions: int = 1, starting: Collection[int] = ()
              ) -> tuple[np.ndarray | None, set[int]]:
    """(i32[B, W] with each constrained slot's allowed next tokens and every other row all
    ones, or None when no slot is constrained; the slots that sit this step out). pause:
    a constrained slot with a step not read yet sits out (all-zero row) instead of
    getting a mask from a grammar that has not seen its last token. `starting`: slots
    whose row samples its prompt's first token (a mixed step's last chunk): every token
    before it was read, so it never sits out. `positions` > 1: a
    speculative verify step's i32[B, positions, W], one mask per position it samples:
    a constrained slot's grammar mask first and nothing after (its drafts are not
    checked against the grammar, so it keeps one token a step), free rows all ones."""
    if not any_constrained(rows):
        return None, set()
    mask = allow_all(batch, vocab_size)
    later = np.full((batch, positions - 1, mask.shape[1]), -1, np.int32)
    paused = set()
    for slot, live in rows:
        g = live.grammar
        if g is None or live.done or g.stopped:
            continue
        later[slot] = 0
        if pause and slot not in starting and live.generated != live.steps + 1:
            # a token of its is in flight
            mask[slot] = 0
            paused.add(slot)
        else:
            g.fill(mask, slot, remaining=live.budget - live.generated)
    if positions == 1:
        return mask, paused
    return np.concatenate([mask[:, None], later], axis=1), paused


def mask_positions(engine: Any) -> int:
    """How many positions a generate step of `engine` (or the engine a wrapper holds)
    samples, each with its mask: K + 1 with speculative decoding, else 1."""
    inner = _innermost(engine)
    if not isinstance(inner, TransformerEngine) or not inner.config.spec.enabled:
        return 1
    return inner.config.spec.k + 1


def mask_kwargs(mask: np.ndarray | None) -> dict:
    """generate's keyword arguments for a step's mask (none without one: engines that
    apply no masks are never given one)."""
    return {} if mask is None else {"token_mask": mask}


def mask_refusal(engine: Any) -> str | None:
    """Why `engine` (or the engine a page planner, or any wrapper, holds) cannot serve a
    constrained request; None when it can."""
    inner = _innermost(engine)
    if not isinstance(inner, TransformerEngine):
        return f"{type(inner).__name__} applies no token masks"
    return None


def _innermost(engine: Any) -> Any:
    """The transformer engine `engine` is or wraps (page planners, ...), else the
    innermost engine it wraps."""
    inner = engine
    while not isinstance(inner, TransformerEngine) and hasattr(inner, "engine"):
        inner = inner.engine
    return inner


def check_constrainable(field: str, engines: Sequence[Any], tokenizer: Any) -> None:
    """ValueError (naming the request field) unless every engine applies token masks and
    the model has a tokenizer (grammars are over text)."""
    for e in engines:
        why = mask_refusal(e)
        if why is not None:
            raise ValueError(f"{field}: structured output is not available here: {why}")
    if tokenizer is None:
        raise ValueError(f"{field}: structured output needs a tokenizer; this model has none")


def first_mask(live: Any) -> dict:
    """prefill's keyword arguments for a request's first token: its grammar's mask."""
    g = live.grammar
    return {} if g is None else {"token_mask": g.mask_row(remaining=live.budget - live.generated)}
