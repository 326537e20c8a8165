"""Structured output on the host side of a generate step: each constrained slot's mask.

A constrained slot's mask for step N depends on the token step N - 1 gave it, so a batch
with a constrained slot is stepped in sync: the executor reads step N - 1 back (which the
unconstrained loop reads only after dispatching step N), the requests' grammars take
their tokens (LiveRequest.take), and `step_mask` writes the next allowed sets before step
N is dispatched. The device idles meanwhile: the read-back wait plus the mask work (tens
of microseconds per slot for a JSON schema; `jetserve bench structured` measures the
whole). Unconstrained slots of the same batch wait that long too; a batch without a
constrained slot keeps the one-step-late read-back and the step compiled without a mask.

Plain numpy and llguidance; the engine takes the mask as `token_mask=`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engines import TransformerEngine
from engines.token_mask import allow_all

Rows = Sequence[tuple[int, Any]]  # (slot, LiveRequest)


def any_constrained(rows: Rows) -> bool:
    return any(live.grammar is not None and not live.done for _, live in rows)


def step_mask(rows: Rows, batch: int, vocab_size: int) -> np.ndarray | None:
    """i32[B, W] with each constrained slot's allowed next tokens and every other row all
    ones; None when no slot is constrained (the engine's step without a mask)."""
    if not any_constrained(rows):
        return None
    mask = allow_all(batch, vocab_size)
    for slot, live in rows:
        g = live.grammar
        if g is not None and not live.done and not g.stopped:
            g.fill(mask, slot)
    return mask


def mask_kwargs(mask: np.ndarray | None) -> dict:
    """generate's keyword arguments for a step's mask (none without one: engines that
    apply no masks are never given one)."""
    return {} if mask is None else {"token_mask": mask}


def mask_refusal(engine: Any) -> str | None:
    """Why `engine` (or the engine a page planner wraps) cannot serve a constrained
    request; None when it can."""
    inner = getattr(engine, "engine", engine)
    if not isinstance(inner, TransformerEngine):
        return f"{type(inner).__name__} applies no token masks"
    if inner.config.spec.enabled:
        return (f"speculative decoding ({inner.config.speculative!r}) does not apply token "
                "masks; serve structured output without --speculative")
    return None


def first_mask(live: Any) -> dict:
    """prefill's keyword arguments for a request's first token: its grammar's mask."""
    g = live.grammar
    return {} if g is None else {"token_mask": g.mask_row()}
