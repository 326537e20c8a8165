"""One turn's decisions, as the scheduler hands them to an executor.

A `StepPlan` says which slots to free and which prompts to prefill into which slots before
the turn's generate step. The lock-step executor sends it to every process
(orchestrator/step_plan.py is its wire form); offline generation runs it where it is made.
The threaded executor's prompts arrive prefilled (a prefill thread made their KV), so its
`Turn` says which slots to free, which waiting prefixes to insert into which slots, and
whether to step.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Admission:
    """A prompt to run this turn. slot None: score only (prompt log-probs, no decoding)."""

    slot: int | None
    prompt_ids: tuple[int, ...]
    sampling: object  # engines.SamplingParams (not imported: this package never loads jax)
    seed: int  # drawn by the scheduler when the request gave none
    prompt_logprobs: bool = False
    # Structured output: its first token is sampled under its grammar's mask, which the
    # executor gets from where the grammar lives (process 0, in lock step).
    constrained: bool = False
    adapter: str | None = None  # the LoRA adapter it runs through (None: the base model)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    stop: bool = False
    releases: tuple[int, ...] = ()  # slots to free before admitting
    admissions: tuple[Admission, ...] = ()
    # The turn's generate step takes a token mask (a slot it runs is constrained).
    step_mask: bool = False


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A prefilled request waiting for a slot (the threaded executor's backlog).

    tokens: its prefix's length; shared: pages of it linked from the prefix cache;
    item: the executor's own (its prefix), handed back in the plan."""

    request: object
    tokens: int
    shared: int = 0
    item: object = None


@dataclasses.dataclass(frozen=True)
class Release:
    """A slot to free: its request finished (why None) or was abandoned (why: "cancelled"
    or "deadline", to end it with)."""

    slot: int
    request: object
    why: str | None = None


@dataclasses.dataclass(frozen=True)
class Turn:
    """The threaded executor's turn: free, insert, then step (or wait for prefill work)."""

    releases: tuple[Release, ...] = ()
    inserts: tuple[tuple[int, Waiting], ...] = ()  # (slot, what goes into it)
    step: bool = False


def chunks(length: int, chunk: int | None) -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk of a `length`-token prompt (chunk 0 or None: one
    piece)."""
    if length < 1:
        raise ValueError(f"a prompt to prefill needs at least one token, got {length}")
    if chunk is not None and chunk < 0:
        raise ValueError(f"prefill chunk must be >= 0, got {chunk}")
    step = chunk or length
    return [(s, min(s + step, length)) for s in range(0, length, step)]
