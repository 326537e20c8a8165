"""The detokenize thread: host results -> text, stop strings, deltas, finish reasons.

It is the only writer of request streams. Engine threads send it `StepOutput` (a step's
host results with the request of each row and how the token ends it, as far as token ids
tell) and `EndRequest` in the order things happened, through one bounded queue. It owns
each request's `TextStream`; a stop string ends a request here (it marks the request done
so the generate thread frees the slot on its next step). An exception while handling one
request ends that request with finish_reason "error" and nothing else.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from engines.engine_api import HostResults
from jetserve.orchestrator.detokenize import TextStream
from jetserve.orchestrator.handle import Wakes
from jetserve.orchestrator.live import EndRequest, LiveRequest, StepOutput
from jetserve.orchestrator.stopping import Finish
from jetserve.request import Delta

log = logging.getLogger(__name__)

STOP = object()  # queue sentinel: exit after everything before it


class DetokenizeWorker:
    def __init__(self, inbox: queue.Queue, tokenizer,
                 on_finished: Callable[[LiveRequest, str], None]):
        self.inbox = inbox
        self.tokenizer = tokenizer
        self.on_finished = on_finished

    def run(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is STOP:
                return
            if isinstance(msg, StepOutput):
                self._step(msg)
            else:
                self._end(msg)

    def _step(self, msg: StepOutput) -> None:
        h = HostResults(msg.data)
        wakes = Wakes()  # the step's readers are woken together, once per event loop
        try:
            for live, row, n, finish in msg.rows:
                if live.finalized:
                    continue
                try:
                    self._tokens(live, h, row, n, finish, msg.time, wakes)
                except Exception as e:  # this request only
                    log.exception("detokenizing request %s failed", live.request_id)
                    self._emit(live, Delta(token_ids=[], text=""), ("error", None),
                               error=f"{type(e).__name__}: {e}", wakes=wakes)
        finally:
            wakes.flush()

    def _tokens(self, live: LiveRequest, h: HostResults, row: int, n: int,
                finish: Finish | None, t: float, wakes: Wakes) -> None:
        """The first n tokens of a row as one delta; `finish` ends the request at the
        n-th, and a stop string ends it at the token that completes it (later ones are
        dropped)."""
        req = live.request
        if live.text is None:
            live.text = TextStream(self.tokenizer, req.prompt_ids, req.stop_strings)
        ids, text, stop_string = [], "", None
        for i in range(n):
            token = h.token(row, i)
            ids.append(token)
            if i == n - 1 and finish is not None and finish[0] == "stop" and (
                    finish[1] is not None):  # None: a complete grammar, not a stop token
                text += live.text.finish()  # a stop token's own text is never emitted
                break
            piece, stop_string = live.text.push(token)
            text += piece
            if stop_string is not None:
                break
            if i == n - 1 and finish is not None:
                text += live.text.finish()
        delta = Delta(token_ids=ids, text=text)
        if req.logprobs is not None:
            delta.logprobs = [h.logprob(row, i) for i in range(len(ids))]
            delta.top_logprobs = [h.top_logprobs(row, i)[: req.logprobs] if req.logprobs else []
                                  for i in range(len(ids))]
        timing = live.timing
        if timing.first_token is None:
            timing.first_token = time.monotonic()
        timing.token_times.extend([t] * len(ids))
        if stop_string is not None:
            live.done = True  # the generate thread frees the slot on its next step
            finish = ("stop", stop_string)
        self._emit(live, delta, finish, wakes=wakes)

    def _end(self, msg: EndRequest) -> None:
        live = msg.live
        if live.finalized:
            return
        text = ""
        if msg.error is None and live.text is not None:
            try:
                text = live.text.finish()
            except Exception:  # keep the original reason; the text is lost
                log.exception("flushing text of request %s failed", live.request_id)
        delta = Delta(token_ids=[], text=text)
        if live.request.logprobs is not None:
            delta.logprobs, delta.top_logprobs = [], []
        self._emit(live, delta, (msg.reason, None), error=msg.error)

    def _emit(self, live: LiveRequest, delta: Delta, finish, *, error: str | None = None,
              wakes: Wakes | None = None):
        if not live.first_sent:
            live.first_sent = True
            if live.prompt_logprobs is not None:
                delta.prompt_logprobs, delta.prompt_top_logprobs = live.prompt_logprobs
        final = finish is not None
        if final:
            delta.finish_reason, delta.stop_reason = finish
            delta.error = error
            live.done = True
            live.finalized = True
            live.timing.end = time.monotonic()
            # Bookkeeping first, so a caller who sees the last delta sees it gone from
            # stats() too.
            self.on_finished(live, delta.finish_reason)
        live.handle._push(delta, final, wakes)
