"""Runs batch jobs through the orchestrator, keeping every slot busy.

The caller's thread submits jobs ahead until the orchestrator's admission queue is full
(`Overloaded`), so prefill always has the next prompt while generate steps run, and the
engine's slots refill the step after a request ends; then it waits for completions and
writes them, and submits again. Memory stays bounded by the admission bound plus the
slots. A listener (called on the orchestrator's detokenize thread just before a request's
last delta) queues the finished request's id; this thread collects the Completion,
which is then complete or about to be.

Threads: the caller's (submit, collect, emit) and the orchestrator's own; the only thing
shared with them is the `finished` queue.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

from jetserve.batch.results import error_row, from_completion
from jetserve.batch.rows import Job
from jetserve.batch.runner import BatchConfig, Emit, Prepared, Summary, run_job
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Overloaded, RequestFinished
from jetserve.server.validation import ModelLimits

WAIT_S = 0.5  # longest wait for a completion before trying to submit again


def config(engine, *, max_queued: int | None = None, **fields) -> OrchestratorConfig:
    """Admission bounded by max_queued (default: 4 x the engine's slots, at least 32);
    fields: other OrchestratorConfig fields (prefill_chunk, prefix cache budgets)."""
    if max_queued is not None and max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {max_queued}")
    return OrchestratorConfig(
        max_queued_requests=max_queued or max(32, 4 * engine.max_concurrent_decodes),
        **fields)


def run(cfg: BatchConfig, orch: Orchestrator, warmup_lengths: tuple[int, ...] = (),
        prepared: Prepared | None = None) -> Summary:
    """The whole job on an orchestrator (not yet started; stopped at the end).
    warmup_lengths: prompt lengths compiled before the job starts (benchmarks; a job
    compiles as it goes). prepared: runner.prepare(cfg), done before the model loaded."""
    with orch:
        if warmup_lengths:
            orch.warmup(prompt_lengths=warmup_lengths)
        return run_job(cfg, ModelLimits.from_orchestrator(
                           orch, generation=cfg.generation_defaults),
                       lambda jobs, emit: execute(orch, jobs, emit), prepared)


def execute(orch: Orchestrator, jobs: Iterator[Job], emit: Emit) -> None:
    """Runs every job on a started orchestrator; emits each row as it finishes."""
    finished: queue.Queue[str] = queue.Queue()

    def listener(event) -> None:
        if isinstance(event, RequestFinished):
            finished.put(event.request_id)

    orch.add_listener(listener)
    in_flight: dict[str, tuple[Job, object]] = {}
    pending = _Peek(jobs)
    try:
        while True:
            _submit_ahead(orch, pending, in_flight, emit)
            if not in_flight:
                if pending.empty():
                    return
                time.sleep(WAIT_S / 50)  # admission is full of others' requests
                continue
            out = []
            try:
                rid = finished.get(timeout=WAIT_S)
            except queue.Empty:
                continue
            while True:
                item = in_flight.pop(rid, None)
                if item is not None:  # not a warm-up request
                    job, handle = item
                    out.append((job, from_completion(job, handle.result())))
                try:
                    rid = finished.get_nowait()
                except queue.Empty:
                    break
            if out:
                emit(out)
    finally:
        orch.remove_listener(listener)
        for _, handle in in_flight.values():  # stopped early: free the slots
            handle.cancel()


def _submit_ahead(orch: Orchestrator, pending: _Peek, in_flight: dict, emit: Emit) -> None:
    errors = []
    while not pending.empty():
        job = pending.peek()
        try:
            handle = orch.submit(job.request)
        except Overloaded:
            break  # admission is full: every slot has work queued behind it
        except ValueError as e:  # the row does not fit the model
            errors.append((job, error_row(job, str(e))))
        else:
            in_flight[job.request.request_id] = (job, handle)
        pending.pop()
    if errors:
        emit(errors)


class _Peek:
    """An iterator whose next item can be looked at before it is taken."""

    def __init__(self, it: Iterator[Job]):
        self._it = it
        self._next: list[Job] = []

    def empty(self) -> bool:
        if not self._next:
            try:
                self._next.append(next(self._it))
            except StopIteration:
                return True
        return False

    def peek(self) -> Job:
        return self._next[0]

    def pop(self) -> Job:
        return self._next.pop()
