"""Submitting a request's samples and merging their delta streams, for both servers.

Concurrency: everything here runs on the server's asyncio loop. `merge` starts one task
per RequestHandle that copies its async delta stream into one asyncio.Queue; the caller
reads batches of deltas that are ready together (one per sample at most), so a server
sends one message per generate step rather than one per sample. Leaving the loop early (a
client that cancels or disconnects, an error) cancels every unfinished request, which
frees its slot within one generate step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jetserve.request import Delta, Overloaded, Request


def submit_all(orch: Any, requests: Sequence[Request]) -> list[Any]:
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


async def _pump(index: int, handle: Any, queue: asyncio.Queue) -> None:
    try:
        async for delta in handle.stream():
            await queue.put((index, delta))
    except Exception as e:  # delivered to the reader, which decides what to tell the client
        await queue.put((index, e))
    else:
        await queue.put((index, None))


async def merge(handles: Sequence[Any]) -> AsyncIterator[list[tuple[int, Delta]]]:
    """Yields lists of (sample index, Delta) that arrived together, each index once.

    Raises the first exception a stream raised. Cancels unfinished requests on exit.
    """
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, h, queue)) for i, h in enumerate(handles)]
    live = set(range(len(handles)))
    # Arrived, not yet delivered, in arrival order. A second item of an index already in
    # this batch (a delta, its end marker, an error) waits for the next batch.
    pending: collections.deque = collections.deque()
    try:
        while live:
            if not pending:
                pending.append(await queue.get())
            while not queue.empty():
                pending.append(queue.get_nowait())
            batch: list[tuple[int, Delta]] = []
            later: collections.deque = collections.deque()
            taken: set[int] = set()  # indices with an item in this batch or deferred
            for i, d in pending:
                if i in taken:
                    later.append((i, d))
                elif isinstance(d, Exception):
                    raise d
                elif d is None:
                    live.discard(i)
                else:
                    batch.append((i, d))
                    taken.add(i)
            pending = later
            if batch:
                yield batch
    finally:
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
