"""The loop every prefill thread runs, whatever does the prefill.

`PrefillLoop.run` takes a preempted request if one waits on the resume queue (before new
admissions, so recomputed requests are not starved), else the next admitted one, and
hands it to `_serve`, one request at a time; an exception there ends only that request.
A subclass whose engine prefills several prompts per call takes more admitted requests at
once (`_more`, without waiting) and serves them together (`_serve_many`).
Subclasses say how a request is prefilled: on a local engine (prefill_worker.py) or on a
remote prefill worker (jetserve/disagg/remote_prefill.py).
"""

from __future__ import annotations

import queue
import threading
import time

from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.readback import ReadBack


class PrefillLoop:
    """One prefill thread's loop (`run`); `_serve(live)` is the subclass's.

    Args:
      index: which prefill thread this is (stats, thread names).
      admission: the admission queue it takes new requests from.
      resume: requests to prefill again (preempted, or their pull failed); a queue of its
        own when None.
      readback: sends first tokens and ends requests.
      stopping: set when the orchestrator stops.
      poll_s: how long one wait for a request lasts.
    """

    def __init__(self, index: int, admission: FairQueue, resume: queue.Queue | None,
                 readback: ReadBack, stopping: threading.Event, poll_s: float):
        self.index = index
        self.admission = admission
        self.resume: queue.Queue[LiveRequest] = resume if resume is not None else queue.Queue()
        self.readback = readback
        self.stopping = stopping
        self.poll_s = poll_s
        self.busy = False
        self.prefills = 0
        # The most prompts one prefill call takes (1: one a call; more where the engine
        # takes several, Engine.prefill_rows), and the calls that took several.
        self.max_rows = 1
        self.row_calls = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            live, admitted = self._next()
            if live is None:
                continue
            self.busy = True
            more: list[LiveRequest] = []
            try:
                more = self._more(live) if admitted else []
                if more:
                    self._serve_many([live, *more])
                else:
                    self._serve_one(live)
            finally:
                self.busy = False
                for _ in range(int(admitted) + len(more)):
                    self.admission.task_done()

    def _serve_one(self, live: LiveRequest) -> None:
        try:
            self._serve(live)
        except Exception as e:  # this request only
            self._failed(live, e)

    def _failed(self, live: LiveRequest, e: BaseException) -> None:
        """Ends one request with the error its prefill raised (logged by readback.end)."""
        self.readback.end(live, "error", e)

    def _more(self, first: LiveRequest) -> list[LiveRequest]:
        """Admitted requests to prefill together with `first` (a subclass whose engine
        takes several prompts per call); none here."""
        del first
        return []

    def _serve_many(self, lives: list[LiveRequest]) -> None:
        for live in lives:
            self._serve_one(live)

    def _serve(self, live: LiveRequest) -> None:
        raise NotImplementedError

    def _next(self) -> tuple[LiveRequest | None, bool]:
        """A preempted request if one waits, else the next admitted; (None, _) if idle."""
        try:
            return self.resume.get_nowait(), False
        except queue.Empty:
            pass
        try:
            return self.admission.get(timeout=self.poll_s), True
        except queue.Empty:
            return None, False

    def _ended_before_prefill(self, live: LiveRequest) -> bool:
        """Whether `live` needs no prefill: already done, or abandoned while it waited
        (cancelled, past its deadline), in which case it is ended here."""
        if live.done:
            return True
        why = live.abandoned(time.monotonic())
        if why is not None:
            self.readback.end(live, why)
            return True
        return False
