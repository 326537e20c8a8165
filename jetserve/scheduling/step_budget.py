"""Decode-first's token budget between two decode steps of one interleaved engine.

A step window runs from one generate dispatch to the next. The prefill thread asks
before each prefill call (`prefill`): the tokens prefilled in this window so far, plus
this call's, plus the decode tokens of the step that closes the window must stay within
`max_num_batched_tokens`; otherwise it waits for that step (`step`), which opens a fresh
window. The step's decode tokens are counted before it runs, as an upper bound: the
sequences running or waiting for a slot now, plus one when this call ends its prompt (it
joins them). The count only falls until the prefill thread, the only one adding to it,
runs again, so the bound holds. A chunk always fits a fresh window (policy.py caps it at
the budget less a full batch of decode tokens), so every window with a sequence free
lets at least one prefill call through.

When nothing runs or waits for a slot there is no step to protect: the window starts over
at that call, so a long prompt on an idle engine prefills chunk after chunk.

A prompt is prefilled only while fewer than max_num_seqs sequences run or wait for a slot,
as vLLM schedules a prompt only into a free sequence: prefilled ahead of a free slot, it
would stream its first token and then wait for a slot, a gap between its first and second
token as long as a running sequence's whole decode, and its prefill would have delayed
the running steps for nothing yet. The lookahead (`ending`, --prefill-lookahead STEPS)
bounds that gap instead: a sequence whose token budget ends within STEPS steps counts as
a slot about to be free, so a prompt may be prefilled for it, and its first token streams
while that sequence finishes. The gap is then at most STEPS steps (TPOT grows by at most
STEPS / output tokens of a step), and under a queue every first token comes about STEPS
steps sooner. Ends the host cannot see ahead (a stop token) are not counted.

Concurrency: the prefill thread and the generate thread of one engine. Both hold the
budget's lock while they dispatch, so a prefill checked against one window cannot run
after the step that closes it, and the step counts against the window it closes. Plain
Python, no jax.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class StepBudget:
    """The window accounting of one interleaved engine under decode-first.

    Args:
      max_num_batched_tokens: decode plus prefill tokens per window.
      max_num_seqs: the most decode tokens one step has.
      decodes: sequences that decode in the next step: running now or waiting for a slot.
      stopping: set when the orchestrator stops (a waiting prefill then goes ahead).
      poll_s: longest wait before the stop flag is looked at again.
      ending: running sequences whose token budget ends within the lookahead (0: none);
        that many prompts may wait for their slots, prefilled.
    """

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int,
                 decodes: Callable[[], int], *, stopping: threading.Event, poll_s: float,
                 ending: Callable[[], int] = lambda: 0):
        if max_num_batched_tokens <= max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} leaves no "
                             f"prefill token beside max_num_seqs={max_num_seqs}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self._decodes = decodes
        self._ending = ending
        self._stopping = stopping
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self.spent = 0  # prefill tokens in the open window
        self.windows = 0  # steps that closed a window
        self.waits = 0  # prefill calls that waited for a step

    def fits(self, tokens: int, ends_prompt: bool) -> bool:
        """Whether a `tokens`-token prefill call may run in the open window, with a sequence
        free for its prompt (the caller holds the lock); a window with nothing to protect
        starts over here."""
        live = self._decodes()
        if live == 0:
            self.spent = 0
        decodes = min(live + int(ends_prompt), self.max_num_seqs)  # a step has no more
        return (live < self.max_num_seqs + self._ending()
                and self.spent + tokens + decodes <= self.max_num_batched_tokens)

    @contextlib.contextmanager
    def prefill(self, tokens: int, ends_prompt: bool) -> Iterator[None]:
        """Waits until the call fits (or the orchestrator stops), counts it and holds the
        window open while the caller dispatches it."""
        with self._cond:
            if not self.fits(tokens, ends_prompt):
                self.waits += 1
                while not self._stopping.is_set() and not self.fits(tokens, ends_prompt):
                    self._cond.wait(self._poll_s)
            self.spent += tokens
            yield

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a generate dispatch: it closes the open window and opens a fresh one."""
        with self._cond:
            yield
            self.spent = 0
            self.windows += 1
            self._cond.notify_all()
