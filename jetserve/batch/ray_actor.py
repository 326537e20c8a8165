"""One engine of a Ray batch job: a Ray Data actor that runs blocks of rows.

`EngineActor` is the class `ray_job` gives `Dataset.map_batches`: Ray Data starts one per
engine (one per slice; on one host, the devices it is given), and calls it with a block
of input rows at a time (an Arrow table of `line`, `key`, `text`: the input line's number,
its row's key, its JSON). Each block runs through the engine loop of `jetserve batch` on
one host: the same validation (`runner.build`), the same order (`runner.jobs_of`), the
same orchestrator at full occupancy (`orchestrated.execute`), the same output rows. The
block's output rows go back as a table of `key`, `row` (the output line) and
`prompt_tokens`; the driver writes them.

Deaths: each attempt at a block is announced to the job's ledger (ray_ledger.py), which
says whether an earlier attempt died and what it left. After a death the block's rows
run one at a time, each announced before it runs, so a second death names its row; a
row that the ledger counts as poisoned gets its error row without running. Rows are
reported finished as they finish, so an attempt after a death runs only what was not.

Fault injection, for tests only: when the environment variable `FAULT_ENV`
(JETSERVE_TEST_KILL_ACTOR_ON_ID) is set in an actor's process, the actor kills its own
process (SIGKILL) as the row with that id goes into its engine, as a row that crashes
the engine would. It is a seam for the poison-row tests, never for production use;
nothing else reads it.

Threads: Ray calls the actor on one thread at a time; the orchestrator has its own
threads, and a daemon thread sends the ledger a heartbeat every HEARTBEAT_S.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from jetserve.batch import ray_ledger
from jetserve.batch.inputs import Entry
from jetserve.batch.journal import encode_row
from jetserve.batch.rows import Job, output_key, parse_line
from jetserve.batch.runner import BatchConfig, build, jobs_of

FAULT_ENV = "JETSERVE_TEST_KILL_ACTOR_ON_ID"


class EngineActor:
    """A Ray Data UDF class (`map_batches(EngineActor, fn_constructor_kwargs=...)`).

    cfg: the job's BatchConfig (row defaults: max_tokens, adapters, tool parser);
    make_orchestrator: a picklable zero-argument callable that builds this actor's
    orchestrator (not started) on the devices Ray gave its process; ledger: the name of
    the job's ledger actor.
    """

    def __init__(self, cfg: BatchConfig, make_orchestrator: Callable, ledger: str):
        import ray

        from jetserve.server.validation import ModelLimits

        self._cfg = cfg
        self._ledger = ray.get_actor(ledger)
        ctx = ray.get_runtime_context()
        self._id = ctx.get_actor_id() or f"pid-{os.getpid()}"
        beat = (self._id, os.getpid(), ctx.get_node_id())
        ray.get(self._ledger.heartbeat.remote(*beat))
        threading.Thread(target=self._beat, args=beat, daemon=True,
                         name="jetserve-ray-heartbeat").start()
        self._orch = make_orchestrator()
        self._orch.start()
        self._limits = ModelLimits.from_orchestrator(self._orch,
                                                     generation=cfg.generation_defaults)
        self._fault = os.environ.get(FAULT_ENV)

    def _beat(self, *beat) -> None:
        while True:
            time.sleep(ray_ledger.HEARTBEAT_S)
            self._ledger.heartbeat.remote(*beat)

    def __call__(self, batch):
        import pyarrow as pa
        import ray

        lines = batch["line"].to_pylist()
        keys = batch["key"].to_pylist()
        texts = batch["text"].to_pylist()
        block = _block_id(lines)
        attempt = ray.get(self._ledger.begin.remote(block, keys, self._id))
        out: dict[str, tuple[str, int]] = dict(attempt.done)  # key -> (line, prompt tokens)

        def emit(items: list[tuple[Job | None, dict]]) -> None:
            done = [(output_key(row), encode_row(row).decode(),
                     job.prompt_len if job else 0) for job, row in items]
            for key, line, n in done:
                out[key] = (line, n)
            self._ledger.finished.remote(block, done)

        todo = [(Entry(n, json.loads(k), k, None), t)
                for n, k, t in zip(lines, keys, texts, strict=True) if k not in out]
        for entry, text in todo:
            if entry.key in attempt.poisoned:
                emit([(None, _poison_row(entry, text, attempt.poisoned[entry.key]))])
        todo = [(e, t) for e, t in todo if e.key not in out]
        if attempt.alone:
            for entry, text in todo:
                ray.get(self._ledger.started.remote(block, entry.key))
                job = build(self._cfg, self._limits, entry, text)
                if isinstance(job, dict):
                    emit([(None, job)])
                else:
                    self._execute(iter([job]), emit)
        elif todo:
            self._execute(jobs_of(self._cfg, self._limits, todo, emit), emit)
        ray.get(self._ledger.end.remote(block, self._id))
        return pa.table({"key": list(out), "row": [line for line, _ in out.values()],
                         "prompt_tokens": [n for _, n in out.values()]})

    def _execute(self, jobs: Iterator[Job], emit) -> None:
        from jetserve.batch import orchestrated

        if self._fault:
            jobs = _kill_on(self._fault, jobs)
        orchestrated.execute(self._orch, jobs, emit)


def _block_id(lines: list[int]) -> str:
    """A block's name: its first and last input line and its size (blocks hold
    disjoint, ordered runs of lines)."""
    return f"{lines[0]}-{lines[-1]}x{len(lines)}"


def _poison_row(entry: Entry, text: str, deaths: int) -> dict:
    row = entry.error_row(
        f"line {entry.line}: id {entry.id!r} was running when its engine actor's process "
        f"died, {deaths} times (the last time alone in its engine); it is not run again "
        "(--resume --retry-failed runs it again)")
    meta = parse_line(text).get("metadata")
    if meta is not None:
        row["metadata"] = meta
    return row


def _kill_on(target: str, jobs: Iterator[Job]) -> Iterator[Job]:
    """The fault-injection seam (see FAULT_ENV): dies as the target row is taken."""
    for job in jobs:
        if str(job.id) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        yield job
