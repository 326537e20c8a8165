"""The transfer stage of a decode process: pull each prefix from its prefill worker into
the generate engine's layout, off the generate thread.

A dispatcher thread takes tickets in order (a bounded queue: prefill threads block while
it is full) and starts one pull thread per prefix while the bytes in flight stay under
`max_bytes_in_flight` (one prefix larger than that still goes, alone). A pulled prefix is
acknowledged (the worker frees it) and put in the generate backlog. A pull that fails
because the worker went away sends the request back to be prefilled again on another
worker (as a preempted request is: its tokens so far are kept, the next one streams as
if decoded), at most `max_retries` times; so does a pull that takes longer than the
receiver's timeout (a worker that hangs: the receiver gives up on it and the pull
thread ends, see kv_transfer.py); a prefix that does not fit this engine
(PrefixMismatch) ends its request with that error. Figures for metrics: `TransferStats`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from jetserve.disagg import prefix_wire
from jetserve.disagg.kv_transfer import KVReceiver
from jetserve.disagg.prefill_client import PrefillWorkers
from jetserve.disagg.remote_prefill import Ticket
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.live import EndRequest, LiveRequest
from jetserve.orchestrator.transfer_worker import TransferWorker

log = logging.getLogger("jetserve.disagg")


class TransferStats:
    """Pulled bytes, pull latencies and failures (thread-safe counters)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = self.pulls = self.failures = self.retries = 0
        self.seconds = 0.0
        self.latencies: list[float] = []  # since the last `drain_latencies`

    def pulled(self, n: int, seconds: float) -> None:
        with self._lock:
            self.bytes += n
            self.pulls += 1
            self.seconds += seconds
            self.latencies.append(seconds)

    def failed(self, retried: bool) -> None:
        with self._lock:
            self.failures += 1
            self.retries += int(retried)

    def drain_latencies(self) -> list[float]:
        with self._lock:
            out, self.latencies = self.latencies, []
            return out

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes": self.bytes, "pulls": self.pulls, "failures": self.failures,
                    "retries": self.retries, "seconds": self.seconds}


class BytesInFlight:
    """A budget of bytes; `take` blocks while it would overflow (unless nothing is out)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_bytes_in_flight must be >= 1, got {limit}")
        self.limit, self.used, self.count = limit, 0, 0
        self._cond = threading.Condition()

    def take(self, n: int, stopping: threading.Event, poll_s: float) -> bool:
        with self._cond:
            while self.count and self.used + n > self.limit:
                if stopping.is_set():
                    return False
                self._cond.wait(poll_s)
            self.used += n
            self.count += 1
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self.count -= 1
            self._cond.notify_all()


class PullWorker(TransferWorker):
    """The transfer thread of a decode process: TransferWorker's bounded queue (`offer`),
    with pulls from prefill workers in place of device_put."""

    def __init__(self, target: GenerateWorker, receiver: KVReceiver, workers: PrefillWorkers,
                 outbox: queue.Queue, resume: Callable[[LiveRequest], None],
                 stopping: threading.Event, *, queue_size: int, poll_s: float,
                 max_bytes_in_flight: int, max_retries: int):
        super().__init__(target, outbox, stopping, queue_size=queue_size, poll_s=poll_s)
        self.receiver, self.workers, self.resume = receiver, workers, resume
        self.max_retries = max_retries
        self.budget = BytesInFlight(max_bytes_in_flight)
        self.stats = TransferStats()

    def pending(self) -> int:
        return self.queue.qsize() + self.budget.count

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                live, ticket = self.queue.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            n = prefix_wire.nbytes(ticket.meta)
            if not self.budget.take(n, self.stopping, self.poll_s):
                self._end(live, ticket, "cancelled")
                return
            threading.Thread(target=self._pull, args=(live, ticket, n), daemon=True,
                             name="jetserve-pull").start()

    def _pull(self, live: LiveRequest, ticket: Ticket, n: int) -> None:
        try:
            self._move(live, ticket, n)
        except Exception as e:  # a bug: this request only
            log.exception("pull of request %s failed", live.request_id)
            self._end(live, ticket, "error", e)
        finally:
            self.budget.give(n)

    def _move(self, live: LiveRequest, ticket: Ticket, n: int) -> None:
        why = "cancelled" if live.done else live.abandoned(time.monotonic())
        if why is not None:
            self._end(live, ticket, why)
            return
        t0 = time.monotonic()
        try:
            prefix = self.receiver.pull(ticket.address, ticket.uuid, ticket.meta,
                                        f"prefill worker {ticket.worker.address}")
        except prefix_wire.PrefixMismatch as e:
            self.stats.failed(retried=False)
            self._end(live, ticket, "error", e)
            return
        except Exception as e:  # the worker went away (or the transfer broke): recompute
            self._retry(live, ticket, e)
            return
        self.stats.pulled(n, time.monotonic() - t0)
        self.transfers += 1
        self.workers.ack(ticket.worker, ticket.uuid)
        if not self.target.backlog.put((live, prefix), self.stopping, self.poll_s):
            self._end(live, None, "cancelled")

    def _retry(self, live: LiveRequest, ticket: Ticket, e: Exception) -> None:
        self.workers.mark_down(ticket.worker)
        if live.preemptions >= self.max_retries:
            self.stats.failed(retried=False)
            self._end(live, ticket, "error", RuntimeError(
                f"pulling its prefix failed {live.preemptions + 1} times, last from "
                f"{ticket.worker.address}: {type(e).__name__}: {e}"))
            return
        log.warning("pull of request %s from %s failed (%s); prefilling it again",
                    live.request_id, ticket.worker.address, type(e).__name__)
        self.stats.failed(retried=True)
        live.preempted()
        self.resume(live)
        self.workers.ack(ticket.worker, ticket.uuid)  # a worker still there frees it now

    def _end(self, live: LiveRequest, ticket: Ticket | None, reason: str,
             exc: BaseException | None = None) -> None:
        if ticket is not None:
            self.workers.ack(ticket.worker, ticket.uuid)
        if live.done:
            return
        live.done = True
        err = None if exc is None else f"{type(exc).__name__}: {exc}"
        self.outbox.put(EndRequest(live, reason, err))
