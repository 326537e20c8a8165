"""The admission queue: one FIFO lane per client, served round robin, bounded in total and
per client.

Why: with one FIFO, a single request that fans out into many sub-requests (prompts x n)
fills the queue, and every other client waits behind all of it, or is refused. Here each
client (Request.client: an API key or a peer address, set by the servers) has its own
lane; `get` takes the head of the next non-empty lane in turn, so a request that arrives
behind a long lane waits for at most one item of each other client. A client may hold at
most `per_client` queued items, so the rest of the bound stays open to others.

What the prefill threads and the lock-step loop use is queue.Queue's interface: `get`
with a timeout (raising queue.Empty), `get_nowait`, `task_done`, `unfinished_tasks`
(admitted but not yet handed on, so a generate thread knows prefill work is coming) and
`qsize`. Putting differs: `put_all_nowait(items, client)` admits a whole group (the
samples of one client request) or none of it, raising `Full` or `ClientFull`.

Thread-safe: one lock guards the lanes and counters; `get` waits on a condition of it.
Plain Python, no jax.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Full(queue.Full):
    """The queue holds its total bound."""


class ClientFull(queue.Full):
    """This client's lane holds its share; other clients may still get in."""


class FairQueue(Generic[T]):
    """Per-client FIFO lanes served round robin.

    Args:
      maxsize: the most items queued in all lanes together (>= 1).
      per_client: the most items one client may have queued (None: up to maxsize).
    """

    def __init__(self, maxsize: int, per_client: int | None = None):
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an integer >= 1, got {maxsize!r}")
        if per_client is not None and (not isinstance(per_client, int) or per_client < 1):
            raise ValueError(f"per_client must be None or an integer >= 1, got {per_client!r}")
        self.maxsize = maxsize
        self.per_client = min(per_client or maxsize, maxsize)
        self._lanes: dict[str, collections.deque[T]] = {}  # client -> its queued items
        # Clients with items, next to be served first. The one just served goes to the
        # back; a client whose lane was empty joins just ahead of it, so it waits for at
        # most one item of each other client, not one more of the client just served.
        self._turns: collections.deque[str] = collections.deque()
        self._back_just_served = False
        self._size = 0
        self._unfinished = 0
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)

    # ---- producers -----------------------------------------------------------------------

    def put_nowait(self, item: T, client: str = "") -> None:
        self.put_all_nowait([item], client)

    def put_all_nowait(self, items: Sequence[T], client: str = "") -> None:
        """Queues every item at the tail of `client`'s lane, or none of them.

        Raises:
          ClientFull: the client's lane would hold more than per_client.
          Full: the queue would hold more than maxsize.
        """
        if not items:
            return
        with self._lock:
            lane = self._lanes.get(client)
            held = len(lane) if lane is not None else 0
            if held + len(items) > self.per_client:
                raise ClientFull(held)
            if self._size + len(items) > self.maxsize:
                raise Full(self._size)
            if lane is None:
                lane = self._lanes[client] = collections.deque()
                if self._back_just_served:
                    self._turns.insert(len(self._turns) - 1, client)
                else:
                    self._turns.append(client)
            lane.extend(items)
            self._size += len(items)
            self._unfinished += len(items)
            self._not_empty.notify(len(items))

    # ---- consumers -----------------------------------------------------------------------

    def get(self, block: bool = True, timeout: float | None = None) -> T:
        """The head of the lane whose turn it is; raises queue.Empty when none comes
        (at once unless `block`, else within `timeout` seconds, or never with None)."""
        with self._not_empty:
            if block:
                end = None if timeout is None else time.monotonic() + timeout
                while not self._size:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        raise queue.Empty
                    self._not_empty.wait(left)
            elif not self._size:
                raise queue.Empty
            client = self._turns.popleft()
            lane = self._lanes[client]
            item = lane.popleft()
            if lane:
                self._turns.append(client)
            else:
                del self._lanes[client]
            self._back_just_served = bool(lane)
            self._size -= 1
            return item

    def get_nowait(self) -> T:
        return self.get(block=False)

    def task_done(self) -> None:
        """One item taken by get() has been handed on."""
        with self._lock:
            if self._unfinished <= 0:
                raise ValueError("task_done() called more times than there were items")
            self._unfinished -= 1

    # ---- observation ---------------------------------------------------------------------

    @property
    def unfinished_tasks(self) -> int:
        """Items put and not yet task_done() (queued, or taken and being handed on)."""
        return self._unfinished

    def qsize(self) -> int:
        return self._size

    def held_by(self, client: str) -> int:
        """How many items `client` has queued."""
        with self._lock:
            lane = self._lanes.get(client)
            return len(lane) if lane is not None else 0

    def clients(self) -> int:
        """How many clients have items queued."""
        return len(self._lanes)
