"""What one mixed step runs: every decoding slot, then chunks of prompts up to the budget.

`--scheduling mixed` (orchestrator/mixed_worker.py) has no prefill thread: a prompt
waits in a slot of its own while its chunks run inside the decode steps
(engines/mixed_step.py). Each step the scheduler fills the token budget
(`max_num_batched_tokens`, by default every slot's decode token plus one chunk):

  1. one token for every slot that decodes: decode rows never wait for a prompt;
  2. the rest, in the order the prompts were admitted (the oldest finishes first, so its
     first token comes soonest), as chunks of at most `chunk` tokens: one chunk per
     prompt per step, cut short where the budget ends.

Plain Python (no jax): `fill` is the policy, the worker turns its answer into rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefilling:
    """A slot whose prompt has not run to its end: `done` of its `length` tokens ran."""

    slot: int
    length: int
    done: int = 0

    def __post_init__(self):
        if not 0 <= self.done < self.length:
            raise ValueError(f"slot {self.slot}: done={self.done} must be in "
                             f"[0, length={self.length})")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, end) of `slot` run this step; `last`: the prompt ends."""

    slot: int
    start: int
    end: int
    last: bool


def fill(decoding: int, prompts: Sequence[Prefilling], *, budget: int,
         chunk: int) -> list[Chunk]:
    """The chunks of one step beside `decoding` decode tokens (see the module doc);
    `prompts` in admission order. ValueError when the budget leaves no prefill token
    beside the decode tokens, so a prompt would wait for ever."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    left = budget - decoding
    if prompts and left < 1:
        raise ValueError(f"a budget of {budget} tokens leaves no prefill token beside "
                         f"{decoding} decode tokens")
    out = []
    for p in prompts:
        if left < 1:
            break
        n = min(chunk, p.length - p.done, left)
        out.append(Chunk(p.slot, p.done, p.done + n, p.done + n == p.length))
        left -= n
    return out
