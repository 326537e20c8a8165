"""The transfer thread of one generate engine (disaggregated mode).

Moves each prefix from the prefill slice to the generate slice with
`jax.device_put(prefix, engine.prefix_destination_sharding())` and waits for the copy
here, so the generate thread only ever inserts prefixes that are already in place. Its
input queue is bounded; it blocks while the generate backlog is full. A prefix whose kv
heads the prefill engine repeats otherwise than the generate engine (engines/kv_heads.py:
tp over more devices than kv heads, on one slice and not the other) is first regrouped to
the generate engine's heads (`engine.receive_prefix`), where it is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import jax

from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.live import EndRequest, LiveRequest

log = logging.getLogger(__name__)


class TransferWorker:
    def __init__(self, target: GenerateWorker, outbox: queue.Queue, stopping: threading.Event,
                 *, queue_size: int, poll_s: float):
        self.target = target
        self.outbox = outbox
        self.stopping = stopping
        self.poll_s = poll_s
        self.queue: queue.Queue[tuple[LiveRequest, Any]] = queue.Queue(queue_size)
        self.destination = target.engine.prefix_destination_sharding()
        self.receive = getattr(target.engine, "receive_prefix", lambda prefix: prefix)
        self.busy = False
        self.transfers = 0

    def pending(self) -> int:
        return self.queue.qsize() + int(self.busy)

    def offer(self, live: LiveRequest, prefix: Any) -> bool:
        """Called by a prefill thread; blocks while the queue is full."""
        while not self.stopping.is_set():
            try:
                self.queue.put((live, prefix), timeout=self.poll_s)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                live, prefix = self.queue.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            self.busy = True
            try:
                self._move(live, prefix)
            finally:
                self.busy = False

    def _move(self, live: LiveRequest, prefix: Any) -> None:
        if live.done:
            return
        why = live.abandoned(time.monotonic())
        if why is None:
            try:
                moved = jax.device_put(self.receive(prefix), self.destination)
                jax.block_until_ready(moved)
            except Exception as e:  # this request only
                log.exception("transfer of request %s failed", live.request_id)
                live.done = True
                self.outbox.put(EndRequest(live, "error", f"{type(e).__name__}: {e}"))
                return
            self.transfers += 1
            if self.target.backlog.put((live, moved), self.stopping, self.poll_s):
                return
            why = "cancelled"  # stopped while waiting for room
        live.done = True
        self.outbox.put(EndRequest(live, why))
