"""A decode process's prefill threads: admitted requests -> a prefill worker -> the pull
stage.

Each thread takes a request that must be recomputed (its pull failed, or its KV pages
were preempted) before the next admitted one, asks the least loaded prefill worker to
prefill its sequence (prompt and tokens generated so far), streams the sampled token at
once and hands the held prefix (a `Ticket`) to the pull stage. A worker that fails or
times out is marked down and the request goes to another; only when every worker failed
does the request end with an error. Nothing streams before a prefill succeeded, and a
recomputed request streams its next token only: every token reaches the client once.
Echo / scoring: the worker scores the prompt on its first prefill and sends the log-probs
back with the token (a scoring-only request ends there). Structured output: the request's
grammar lives here; the worker is sent the mask of the
one token it samples, and the generate thread masks the rest as in one process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from typing import Any

import grpc
import numpy as np

from engines.engine_api import ResultTokens
from jetserve.disagg.prefill_client import PrefillWorkers, Worker
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_loop import PrefillLoop
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.step_masks import first_mask
from protos import prefill_worker_pb2 as pb

log = logging.getLogger("jetserve.disagg")


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A prefix a worker holds for this request's pull."""

    worker: Worker
    address: str  # its transfer server
    uuid: int
    meta: dict


class RemotePrefillWorker(PrefillLoop):
    """A prefill thread whose prefill runs on a worker: the prefill loop (recompute
    before new admissions, one request at a time, an exception ends only its request)
    around a remote `_serve`."""

    def __init__(self, index: int, workers: PrefillWorkers, admission: FairQueue,
                 resume: queue.Queue, readback: ReadBack, stopping: threading.Event,
                 poll_s: float, *, receiver_devices: int):
        super().__init__(index, admission, resume, readback, stopping, poll_s)
        self.workers = workers
        self.receiver_devices = receiver_devices
        self.route: Any = None  # offer(live, ticket) -> bool, set by the orchestrator
        self.retries = 0

    def _serve(self, live: LiveRequest) -> None:
        if self._ended_before_prefill(live):
            return
        t0 = time.monotonic()
        if live.preemptions == 0:
            live.timing.prefill_start = t0
        tokens = live.sequence()
        req = live.request
        scoring = live.preemptions == 0 and req.prompt_logprobs  # once, on the prompt
        got = self._ask(live, tokens, scoring)
        if got is None:
            return
        worker, out = got
        if scoring:
            live.prompt_logprobs = _scored(out.prompt_logprobs_json)
            if req.max_tokens == 0:  # scoring only: the worker held nothing
                live.timing.prefill_end = time.monotonic()
                self.readback.end(live, "length")
                return
        row = np.frombuffer(out.first_row, np.int32).reshape(1, out.first_columns)
        ended = self.readback.first_token(live, ResultTokens(data=row), t0, len(tokens))
        self.prefills += 1
        ticket = Ticket(worker, out.transfer_address, out.uuid, json.loads(out.prefix_json))
        if ended:
            self.workers.ack(worker, out.uuid)
            return
        if not self.route(live, ticket):
            self.workers.ack(worker, out.uuid)
            self.readback.end(live, "cancelled")

    def _ask(self, live: LiveRequest, tokens: list[int], scoring: bool
             ) -> tuple[Worker, pb.PrefillRequest] | None:
        """(worker, its answer) from the first worker that prefills `tokens` (and scores
        them, with `scoring`); None when the request ended meanwhile (it is ended here)."""
        req = live.request
        request = pb.PrefillRequest(
            request_id=live.request_id, token_ids=tokens,
            sampling_json=json.dumps(dataclasses.asdict(req.sampling)),
            receiver_devices=self.receiver_devices, token_mask=_first_mask(live),
            prompt_logprobs=scoring, top_logprobs=req.logprobs or 0,
            score_only=scoring and req.max_tokens == 0, lora_adapter=req.lora_adapter or "")
        tried: set[str] = set()
        errors = []
        while True:
            worker = self.workers.pick(tried)
            if worker is None:
                self.readback.end(live, "error", RuntimeError(
                    "every prefill worker failed: " + "; ".join(errors)))
                return None
            try:
                return worker, self.workers.prefill(worker, request)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    self.readback.end(live, "error", ValueError(e.details()))
                    return None
                errors.append(f"{worker.address}: {e.code().name}")
                log.warning("prefill of %s on %s failed (%s); trying another worker",
                            live.request_id, worker.address, e.code().name)
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    tried.add(worker.address)
                    self.retries += 1
                else:
                    time.sleep(self.poll_s)  # every worker may be full: back off a little
            why = "cancelled" if live.done else live.abandoned(time.monotonic())
            if why is not None:
                if not live.done:
                    self.readback.end(live, why)
                return None


def _first_mask(live: LiveRequest) -> bytes:
    """The allowed set of the token the worker samples next, from this request's grammar
    (over the tokens taken so far: a recomputed request's next token), as PrefillRequest
    carries it; empty for an unconstrained request."""
    mask = first_mask(live).get("token_mask")
    return b"" if mask is None else np.ascontiguousarray(mask, np.int32).tobytes()


def _scored(text: str) -> tuple[list, list]:
    """A worker's prompt_logprobs_json as prefill_worker.prompt_logprobs gives it:
    (log-probs, alternatives as (id, log-prob) pairs)."""
    values, alts = json.loads(text)
    return values, [[tuple(pair) for pair in row] for row in alts]
