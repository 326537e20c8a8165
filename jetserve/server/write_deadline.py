"""A write timeout for a whole stream with one timer, not one per write.

Concurrency: one stream's writes run one at a time in one task on an asyncio loop.
`asyncio.timeout` around each write arms and cancels a loop timer per chunk, which at
rate inf was a visible share of the HTTP loop's CPU (a heap push and a cancelled handle
per token). Here a write only notes when it began; the one timer, armed by the first
write, fires at that write's deadline, and if the write still pending then began later
(earlier writes finished) it re-arms itself at that one's deadline. A write that took
longer than `seconds` is cancelled and raises TimeoutError, as under `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class WriteDeadline:
    """Bounds each `write` of one stream by `seconds`; `close()` when the stream ends."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._began: float | None = None  # loop time the pending write began
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def write(self, aw: Awaitable[T]) -> T:
        """Awaits `aw`; TimeoutError if it is still pending after `seconds`."""
        self._task = asyncio.current_task()
        self._began = began = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(began + self.seconds, self._check)
        try:
            return await aw
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self._began = None

    def _check(self) -> None:
        self._timer = None
        if self._began is None:
            return  # no write pending: the next one arms the timer
        due = self._began + self.seconds
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._expired = True
        self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
