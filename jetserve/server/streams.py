"""Submitting a request's samples and merging their delta streams, for both servers.

Concurrency: everything here runs on one server's asyncio loop. `merge` starts one task
per RequestHandle that copies its async delta stream into that sample's bounded deque;
the caller reads batches of deltas that are ready together (one per sample at most), so a
server sends one message per generate step rather than one per sample. A batch costs
O(samples ready) and merge suspends after each one, so a backlog drains in linear time
without holding the loop. Leaving the loop early (a client that cancels or disconnects,
an error, a drain cut) cancels every unfinished request, which frees its slot within one
generate step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from jetserve.request import Delta, Overloaded, Request

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator

# What an overloaded server (HTTP 429, gRPC RESOURCE_EXHAUSTED) tells a client to wait,
# in seconds: about how long a slot takes to turn over.
RETRY_AFTER_S = "1"


def internal_error(request_id: str) -> str:
    """What a client is told of an error inside the server (a 500, an SSE error event, a
    gRPC INTERNAL): the id the server logged it under with its traceback, never the
    exception's text, which can hold internals (paths, shapes, other requests' data)."""
    return (f"internal error while handling request {request_id}; the server log has the "
            "details")


def submit_all(orch: Orchestrator, requests: Sequence[Request]) -> list[Any]:
    """Submits every request or none: at once where the orchestrator can (submit_many, so
    none takes a place in the queue), else on Overloaded the ones already in are cancelled."""
    if hasattr(orch, "submit_many"):
        return orch.submit_many(requests)
    handles = []
    try:
        for r in requests:
            handles.append(orch.submit(r))
    except (Overloaded, ValueError):
        for h in handles:
            h.cancel()
        raise
    return handles


class ShuttingDown(Exception):
    """The server's drain timeout ran out while the stream was still going."""


class StreamCut:
    """Fired once when a draining server stops waiting for its streams (one per loop).

    Every merge that was given it raises ShuttingDown at its next batch, so each server
    can end its streams the way its protocol says (a final SSE chunk and [DONE]; a gRPC
    status) instead of having the connection cut under it.
    """

    def __init__(self) -> None:
        self.fired = False
        self._wakers: set[Any] = set()

    def fire(self) -> None:
        self.fired = True
        for wake in list(self._wakers):
            wake()


# How long after a drain cut a server's own hard stop comes: time for the cut streams to
# send their last message.
CUT_GRACE_S = 5.0

# Deltas buffered per sample before its pump stops pulling from the request's stream: the
# backlog stays in the request's handle (which keeps them anyway) rather than here.
BUFFER = 64


class _Merger:
    """Per-sample deques plus the set of samples with something ready.

    Each batch costs O(samples ready), never a rescan of what is buffered, so draining a
    backlog of N deltas is O(N).
    """

    def __init__(self, n: int, cut: StreamCut | None):
        self.buffers: list[collections.deque] = [collections.deque() for _ in range(n)]
        self.room = [asyncio.Event() for _ in range(n)]
        for e in self.room:
            e.set()
        self.ready: dict[int, None] = {}  # insertion-ordered set: arrival order of samples
        self.wake = asyncio.Event()
        self.cut = cut

    def put(self, i: int, item: Any) -> None:
        buf = self.buffers[i]
        buf.append(item)
        self.ready[i] = None
        self.wake.set()
        if len(buf) >= BUFFER:
            self.room[i].clear()

    async def pump(self, i: int, handle: Any) -> None:
        try:
            async for delta in handle.stream():
                self.put(i, delta)
                if not self.room[i].is_set():
                    await self.room[i].wait()
        except Exception as e:  # delivered to the reader, which decides what to tell the client
            self.put(i, e)
        else:
            self.put(i, None)

    def take(self) -> list[tuple[int, Any]]:
        """One item of every sample that has one, in the order they became ready."""
        out = []
        for i in list(self.ready):
            buf = self.buffers[i]
            out.append((i, buf.popleft()))
            if not buf:
                del self.ready[i]
            if len(buf) < BUFFER:
                self.room[i].set()
        return out

    async def wait(self) -> None:
        while not self.ready:
            if self.cut is not None and self.cut.fired:
                return
            self.wake.clear()
            await self.wake.wait()


async def merge(handles: Sequence[Any], *,
                cut: StreamCut | None = None) -> AsyncIterator[list[tuple[int, Delta]]]:
    """Yields lists of (sample index, Delta) that arrived together, each index once.

    Raises the first exception a stream raised, and ShuttingDown once `cut` fires. Cancels
    unfinished requests on exit. Suspends after every batch, even when more is ready, so
    a backlog (or a reader whose sends never block, e.g. its socket is gone) cannot hold
    the event loop.
    """
    m = _Merger(len(handles), cut)
    if cut is not None:
        cut._wakers.add(m.wake.set)
    tasks = [asyncio.ensure_future(m.pump(i, h)) for i, h in enumerate(handles)]
    live = set(range(len(handles)))
    try:
        while live:
            await m.wait()
            if cut is not None and cut.fired:
                raise ShuttingDown("server shutting down")
            batch: list[tuple[int, Delta]] = []
            for i, d in m.take():
                if isinstance(d, Exception):
                    raise d
                if d is None:
                    live.discard(i)
                else:
                    batch.append((i, d))
            if batch:
                yield batch
            if m.ready:  # more is ready: suspend anyway (with nothing ready, wait() does)
                await asyncio.sleep(0)
    finally:
        if cut is not None:
            cut._wakers.discard(m.wake.set)
        for i in live:
            handles[i].cancel()
        for t in tasks:
            t.cancel()


@dataclasses.dataclass
class Joined:
    """One sample's deltas joined (what a non-streaming response returns)."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    def add(self, d: Delta) -> None:
        self.token_ids.extend(d.token_ids)
        self.text += d.text
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(d.logprobs)
        if d.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + list(d.top_logprobs)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = list(d.prompt_logprobs)
            self.prompt_top_logprobs = (list(d.prompt_top_logprobs)
                                        if d.prompt_top_logprobs is not None else None)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason
            self.error = d.error


async def join(handles: Sequence[Any]) -> list[Joined]:
    out = [Joined() for _ in handles]
    async with contextlib.aclosing(merge(handles)) as batches:
        async for batch in batches:
            for i, d in batch:
                out[i].add(d)
    return out
