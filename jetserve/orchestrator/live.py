"""A request in flight, and the messages the engine threads send the detokenize thread.

Ownership: a `LiveRequest` is held by one stage at a time (admission queue -> prefill
thread -> transfer thread -> generate backlog -> a generate slot); the holder alone
updates `generated` and `steps`, and hands the request on through a queue (which orders
memory). Three flags cross threads, each a plain bool written once:
  - `cancel_requested`: set by the caller (`RequestHandle.cancel`); the holder ends it.
  - `done`: "stop working on it", set by whichever thread decides it ends (generate
    thread on a stop id / length / cancel / deadline, detokenize thread on a stop string
    or an error). Holders drop done requests and free their slots.
  - `finalized`: set only by the detokenize thread when it pushed the last delta.
A request preempted for KV pages goes back from its slot to a prefill thread (the
resume queue), which recomputes its KV from `sequence()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engines.engine_api import HostResults
from jetserve.orchestrator.detokenize import TextStream
from jetserve.orchestrator.handle import RequestHandle
from jetserve.orchestrator.stopping import Finish, token_finish
from jetserve.orchestrator.timing import RequestTiming
from jetserve.request import Request


@dataclasses.dataclass(eq=False)
class LiveRequest:
    request: Request
    handle: RequestHandle
    timing: RequestTiming
    budget: int  # tokens it may generate (stopping.token_budget)
    stop_ids: frozenset[int]
    generated: int = 0  # tokens decided so far (holder thread)
    tokens: list[int] = dataclasses.field(default_factory=list)  # their ids (holder thread)
    preemptions: int = 0  # times its KV pages were taken back for recompute
    steps: int = 0  # generate steps dispatched for it (generate thread)
    cancel_requested: bool = False
    done: bool = False
    finalized: bool = False
    prompt_logprobs: tuple[list, list] | None = None  # set by the prefill thread
    text: TextStream | None = None  # detokenize thread
    first_sent: bool = False  # detokenize thread
    # A prefix-cache hit over the engine's own KV pages (prefix_cache.PageStore), pinned
    # from its prefill until the generate thread inserted it (or dropped the request).
    cache_hit: Any = None
    # Structured output: the request's jetserve.structured.TokenGrammar, advanced by the
    # holder thread over each token taken; None when unconstrained.
    grammar: Any = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def abandoned(self, now: float) -> str | None:
        """"cancelled" / "deadline" when the holder should end it now, else None."""
        if self.cancel_requested:
            return "cancelled"
        d = self.request.deadline
        if d is not None and now >= d:
            return "deadline"
        return None

    def take(self, tokens: list[int]) -> tuple[int, Finish | None]:
        """Counts one step's generated tokens in order, up to the first that ends the
        request; returns (tokens taken, how the last one ends it, if it does). Tokens
        after a stop id or the budget are dropped, so a step of several tokens ends the
        request where one token per step would."""
        for n, token in enumerate(tokens, 1):
            self.generated += 1
            self.tokens.append(token)
            finish = token_finish(token, self.generated, self.budget, self.stop_ids)
            if (finish is None or finish[0] == "length") and self.grammar is not None and (
                    not self.grammar.advance(token) or self.grammar.stopped):
                finish = ("stop", None)  # the structure is complete: nothing may follow
            if finish is not None:
                return n, finish
        return len(tokens), None

    def take_step(self, host: HostResults, slot: int) -> tuple[int, Finish | None]:
        """`take` of the slot's tokens of one generate step, counting its drafts."""
        drafted, accepted = host.drafts(slot)
        self.timing.drafted += drafted
        self.timing.accepted += accepted
        return self.take(host.tokens(slot))

    def sequence(self) -> list[int]:
        """Prompt and generated tokens: what a preempted request prefills again."""
        return list(self.request.prompt_ids) + self.tokens

    def may_share_prefill(self, chunk: int) -> bool:
        """Whether this request can be one prompt of a prefill call that takes several
        (Engine.prefill_rows): a fresh, whole prompt (at most `chunk` tokens) with no prompt
        scoring or grammar (an adapter goes with it: request.adapters_kwargs)."""
        req = self.request
        return (self.preemptions == 0 and not req.prompt_logprobs and req.max_tokens != 0
                and self.grammar is None and len(req.prompt_ids) <= chunk)

    def release_cache_hit(self) -> None:
        if self.cache_hit is not None:
            self.cache_hit.release()
            self.cache_hit = None

    def preempted(self) -> None:
        """Its slot is gone; the next prefill recomputes `sequence()` and samples the next
        token, after which steps count as if that prefill had been its first."""
        self.preemptions += 1
        self.steps = self.generated

    def last_step_dispatched(self) -> bool:
        """After a dispatched step: True when that step yields the last budgeted token
        at the latest (the first token came from prefill; every step gives at least one),
        so the slot can be freed at once."""
        return 1 + self.steps >= self.budget


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One step's host results and which request each used row belongs to."""

    data: np.ndarray  # i32[B, C] (engines.engine_api ResultTokens layout)
    # (request, row, tokens of the row it takes, how the last of them ends it)
    rows: list[tuple[LiveRequest, int, int, Finish | None]]
    time: float


@dataclasses.dataclass(frozen=True)
class EndRequest:
    """End a request without a token (cancelled, deadline, error, score-only)."""

    live: LiveRequest
    reason: str
    error: str | None = None


Message = StepOutput | EndRequest
