"""Step results back to the host, and requests ended: the one path every executor shares.

An executor (the threaded generate worker, the lock-step loop) dispatches a generate step,
starts its host copy and hands it here (`dispatched`); the step before it, which had a
whole step to land on the host, is read then. Reading takes each row's tokens into its
request (stop ids, length budget: `LiveRequest.take_step`), sends them to the detokenize
thread (`StepOutput`) and reports the step to the listeners (`StepDone`). A request that
ends without a token (cancel, deadline, error) is `end`ed here too, and a failed engine
call `fail`s every request it took with it.

What differs between executors is passed in: what to do with the slot of a request that
finished (the threaded worker frees it at once; lock-step frees it in the next plan, on
every process), and how a failed read is handled.

Concurrency: used by the executor's loop thread only.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterable

from engines.engine_api import ResultTokens
from jetserve.orchestrator.live import EndRequest, LiveRequest, StepOutput
from jetserve.orchestrator.timing import Listeners, PrefillDone, StepDone

log = logging.getLogger(__name__)

Rows = list[tuple[int, LiveRequest]]  # (slot, its request) for every slot a step ran


class ReadBack:
    """Reads one engine's steps one step late.

    Args:
      index: the engine's number, in events and logs.
      outbox / listeners: the detokenize thread's queue; step and prefill listeners.
      finished: called with (slot, request) when a read token ends the request.
      read_failed: called with (error, requests of the step) when a read fails.
    """

    def __init__(self, index: int, outbox: queue.Queue, listeners: Listeners, *,
                 finished: Callable[[int, LiveRequest], None] = lambda slot, live: None,
                 read_failed: Callable[[BaseException, list[LiveRequest]], None] | None = None):
        self.index = index
        self.outbox, self.listeners = outbox, listeners
        self.finished = finished
        self.read_failed = read_failed or self.fail
        self.pending: tuple[ResultTokens, Rows, float] | None = None
        self.tokens = self.drafted = self.accepted = 0  # drafts: speculative decoding
        # Structured output (step_masks.py): steps dispatched only after the one before
        # was read (the device idled), and slots that sat a step out.
        self.syncs = self.sat_out = 0
        self._last_read = 0.0

    def counts(self) -> dict:
        return {"tokens": self.tokens, "drafted": self.drafted, "accepted": self.accepted,
                "syncs": self.syncs, "sat_out": self.sat_out}

    def sync(self) -> None:
        """Reads the pending step before the next is dispatched (the loop needs its
        tokens first): counted in `syncs` when a step was pending."""
        self.syncs += self.pending is not None
        self.read()

    def dispatched(self, res: ResultTokens, rows: Rows, t_dispatch: float) -> None:
        """A step was dispatched (its host copy started): reads the one before it."""
        self.read()
        self.pending = (res, rows, t_dispatch)

    def read(self) -> None:
        """The pending step's tokens -> stop ids, length -> the detokenize thread."""
        if self.pending is None:
            return
        res, rows, t_dispatch = self.pending
        self.pending = None
        try:
            host = res.to_host()
        except Exception as e:
            log.exception("reading step results failed on engine %d", self.index)
            self.read_failed(e, [live for _, live in rows])
            return
        now = time.monotonic()
        out = []
        for slot, live in rows:
            if live.done:
                continue  # ended meanwhile (cancel, stop string): drop the tokens
            n, finish = live.take_step(host, slot)
            if finish is not None:
                live.done = True
                self.finished(slot, live)
            if n or finish is not None:
                out.append((live, slot, n, finish))
            else:  # the slot sat the step out (step_masks.py)
                self.sat_out += 1
        self.tokens += sum(n for _, _, n, _ in out)
        for slot, _ in rows:
            drafted, accepted = host.drafts(slot)
            self.drafted += drafted
            self.accepted += accepted
        if out:
            self.outbox.put(StepOutput(host.data, out, now))
        step_time = now - max(self._last_read, t_dispatch)
        self._last_read = now
        if self.listeners:
            self.listeners.emit(StepDone(self.index, len(rows), step_time))

    def first_token(self, live: LiveRequest, first: ResultTokens, t0: float,
                    prompt_tokens: int, row: int = 0) -> bool:
        """A prefill's sampled token (row `row` of `first`, when the call took several
        prompts) streams now; True when it ends the request."""
        host = first.to_host()
        t1 = time.monotonic()
        if live.preemptions == 0:
            live.timing.prefill_end = t1
        _, finish = live.take(host.tokens(row))
        if finish is not None:
            live.done = True
        self.outbox.put(StepOutput(host.data, [(live, row, 1, finish)], t1))
        if self.listeners:
            self.listeners.emit(PrefillDone(self.index, prompt_tokens, t1 - t0))
        return finish is not None

    def end(self, live: LiveRequest, reason: str, exc: BaseException | None = None) -> None:
        """Ends a request without a token (cancelled, deadline, error, score-only). An
        error is logged here with its traceback under the request's id: the one place
        every failed request passes, so a server can tell its client only that id."""
        if exc is not None:
            log.error("request %s failed", live.request_id, exc_info=exc)
        self._end(live, reason, exc)

    def _end(self, live: LiveRequest, reason: str, exc: BaseException | None) -> None:
        live.done = True
        err = None if exc is None else f"{type(exc).__name__}: {exc}"
        self.outbox.put(EndRequest(live, reason, err))

    def fail(self, exc: BaseException, lives: Iterable[LiveRequest | None] = ()) -> None:
        """A failed engine call (its caller logged the traceback): every request of `lives`
        and of the pending step that has not ended yet ends with the error, and one log
        line names them; the pending step is dropped."""
        victims = {id(live): live for live in lives if live is not None}
        if self.pending is not None:
            victims.update((id(live), live) for _, live in self.pending[1])
            self.pending = None
        ended = [live for live in victims.values() if not live.done]
        if ended:
            log.error("requests %s failed on engine %d with the error logged above: %s",
                      ", ".join(x.request_id for x in ended), self.index,
                      f"{type(exc).__name__}: {exc}")
        for live in ended:
            self._end(live, "error", exc)
