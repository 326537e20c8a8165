"""A submitted request's stream, for synchronous and asyncio callers.

The detokenize thread is the only writer (`_push`); any number of readers iterate from
the start of the stream (each iterator keeps its own cursor over the list of deltas).
Sync readers wait on a condition variable; async readers register a future that the
writer completes with `loop.call_soon_threadsafe`, so no thread is blocked per request
(the detokenize thread wakes each loop once per step for all its handles: `Wakes`).

An async reader that stops early (its `stream()` generator is closed or its task
cancelled before the final delta: the client disconnected) cancels the request, which frees
its slot within one step. A sync iterator may be dropped and taken up again freely; sync
callers cancel with `cancel()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from jetserve.orchestrator.timing import RequestTiming
from jetserve.request import Delta, Request


@dataclasses.dataclass
class Completion:
    """A finished request: every delta joined."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str
    stop_reason: int | str | None
    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None
    timing: RequestTiming
    error: str | None = None

    @staticmethod
    def join(deltas: list[Delta], timing: RequestTiming, asked_logprobs: bool) -> Completion:
        last = deltas[-1]
        first = deltas[0]
        return Completion(
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            logprobs=[x for d in deltas for x in (d.logprobs or ())] if asked_logprobs else None,
            top_logprobs=([x for d in deltas for x in (d.top_logprobs or ())]
                          if asked_logprobs else None),
            finish_reason=last.finish_reason or "error",
            stop_reason=last.stop_reason,
            prompt_logprobs=first.prompt_logprobs,
            prompt_top_logprobs=first.prompt_top_logprobs,
            timing=timing,
            error=last.error,
        )


class RequestHandle:
    """What `Orchestrator.submit` returns."""

    def __init__(self, request: Request, timing: RequestTiming,
                 on_cancel: Callable[[], None]):
        self.request = request
        self.timing = timing
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._done = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Ends the request with finish_reason "cancelled" (no-op once it has ended)."""
        if not self._done:
            self._on_cancel()

    # ---- writer side (detokenize thread) -------------------------------------------------

    def _push(self, delta: Delta, final: bool, wakes: Wakes | None = None) -> None:
        """Appends a delta; its async readers are woken now, or by `wakes.flush()` when
        given (one wake-up per event loop for a whole step's deltas)."""
        with self._cond:
            if self._done:
                return
            self._deltas.append(delta)
            self._done = final
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        if wakes is None:
            wakes = Wakes()
            wakes.add(waiters)
            wakes.flush()
        else:
            wakes.add(waiters)

    # ---- readers -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Delta]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._deltas) and not self._done:
                    self._cond.wait()
                batch = self._deltas[i:]
                done = self._done
            i += len(batch)
            yield from batch
            if done and i >= len(self._deltas):
                return

    async def stream(self) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        i = 0
        try:
            while True:
                fut = None
                with self._cond:
                    batch = self._deltas[i:]
                    done = self._done
                    if not batch and not done:
                        fut = loop.create_future()
                        self._waiters.append((loop, fut))
                if fut is not None:
                    await fut
                    continue
                i += len(batch)
                for d in batch:
                    yield d
                if done and i >= len(self._deltas):
                    return
        finally:
            if not self._done:
                self.cancel()

    def result(self, timeout: float | None = None) -> Completion:
        """Waits for the request to end; raises TimeoutError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(
                    f"request {self.request_id} still running after {timeout} s")
            deltas = list(self._deltas)
        return Completion.join(deltas, self.timing, self.request.logprobs is not None)


class Wakes:
    """Async readers to wake, gathered by event loop: the writer pushes a step's deltas
    to every handle, then `flush` crosses into each reader loop once (one
    call_soon_threadsafe, one self-pipe write, one loop iteration) rather than once per
    handle, which on a busy host is most of what streaming a token costs."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}

    def add(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
        for loop, fut in waiters:
            self._by_loop.setdefault(loop, []).append(fut)

    def flush(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, futs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, futs)
            except RuntimeError:  # the reader's loop is closed: nobody is waiting any more
                pass


def _resolve(futs: list[asyncio.Future]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)
