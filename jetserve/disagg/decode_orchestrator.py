"""The orchestrator of a `--role decode` process: prefill on remote workers, generate here.

Threads (compare jetserve/orchestrator/driver.py, whose admission, registry, detokenize
thread and lifecycle it keeps):

  submit() -> admission queue (bounded, fair per client)
     remote prefill threads (remote_prefill.py): a prefill worker prefills, the first
       token streams at once, the held prefix's ticket goes on ──┐
     pull dispatcher + pull threads (pull_worker.py): bytes in flight bounded; pull,
       check, regroup, move into this engine's layout, ack ─────┤
     generate thread (generate_worker.py): backlog -> slots -> steps
     detokenize thread: text, stop strings, the request's stream
     prefill-load thread: every second each worker's Load (queue depth, up or down)

Over several processes (`--coordinator`, this is process 0): pulls land on one device
here and the generate thread spreads each prefix over the other processes before its
insert, every engine call in lock step with them (decode_lockstep.py).

A request whose pull fails goes back to the remote prefill threads (the resume queue,
shared with requests preempted for KV pages) and is prefilled again on another worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engines import Engine
from jetserve.disagg.decode_lockstep import (
    LockStepGenerate,
    SpreadingGenerateWorker,
    refuse_constraints,
)
from jetserve.disagg.kv_transfer import KVReceiver
from jetserve.disagg.prefill_client import PrefillWorkers
from jetserve.disagg.prefix_spread import PrefixSpreader
from jetserve.disagg.pull_worker import PullWorker
from jetserve.disagg.remote_prefill import RemotePrefillWorker
from jetserve.orchestrator.config import OrchestratorConfig
from jetserve.orchestrator.driver import Orchestrator
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.wiring import check_engines


class DecodeOrchestrator(Orchestrator):
    """Serves Requests on one generate engine, prefilled by remote workers.

    Args:
      engine / params: the generate engine and its weights (its limits stand for the
        workers', which `PrefillWorkers.check` compared at start-up).
      workers: the prefill workers.
      config: queue bounds.
      prefill_threads: remote prefills in flight at once (default: 2 per worker).
      max_bytes_in_flight: bound on the bytes being pulled at once.
      transfer_host: the address of this side's transfer server.
      spreader: set when the engine spans several processes (this is process 0): pulls
        land on one device of this process and are spread over the others before each
        insert, every engine call in lock step with them (decode_lockstep.py).
    """

    def __init__(self, *, engine: Engine, params: Any, workers: PrefillWorkers,
                 config: OrchestratorConfig | None = None, prefill_threads: int | None = None,
                 max_bytes_in_flight: int = 256 << 20, transfer_host: str = "127.0.0.1",
                 spreader: PrefixSpreader | None = None):
        check_engines([engine], [engine], [params], [params])
        config = self._init_intake([engine], [engine], config)
        config.refuse_step_policy("--role decode")
        engine = self.generate_engines[0]
        self.prefill_engines = [_RemotePrefill(engine)]
        poll = config.poll_interval_s
        self.lock_step = None if spreader is None else LockStepGenerate(engine, spreader)
        worker = GenerateWorker if spreader is None else SpreadingGenerateWorker
        g = worker(0, self.lock_step or engine, params, self._outbox, self._listeners,
                   self._stopping, poll_s=poll,
                   backlog_size=config.backlog_size or engine.max_concurrent_decodes)
        g.resume = self._resume.put
        self._generate = [g]
        self.workers = workers
        receiver = KVReceiver(engine, host=transfer_host,
                              destination=spreader and spreader.local_sharding())
        pull = PullWorker(g, receiver, workers, self._outbox,
                          self._resume.put, self._stopping,
                          queue_size=config.transfer_queue_size, poll_s=poll,
                          max_bytes_in_flight=max_bytes_in_flight,
                          max_retries=len(workers.workers))
        g.transfer_pending = pull.pending
        self._transfer = [pull]
        n = prefill_threads or 2 * len(workers.workers)
        devices = len(receiver.devices)
        self._remote = [RemotePrefillWorker(i, workers, self._admission, self._resume,
                                            ReadBack(i, self._outbox, self._listeners),
                                            self._stopping, poll, receiver_devices=devices)
                        for i in range(n)]
        for r in self._remote:
            r.route = pull.offer

    def _thread_bodies(self) -> list[tuple[str, Callable[[], None]]]:
        return [*((f"remote-prefill-{r.index}", r.run) for r in self._remote),
                ("prefill-load", lambda: self.workers.refresh_until(self._stopping)),
                ("pull", self._transfer[0].run), ("generate-0", self._generate[0].run),
                ("detokenize", self._detok.run),
                *([("lockstep-idle", lambda: self.lock_step.heartbeat(self._stopping))]
                  if self.lock_step else [])]

    def submit_many(self, requests):
        if self.lock_step is not None:
            refuse_constraints(requests)
        return super().submit_many(requests)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        try:
            super().stop(drain=drain, timeout=timeout)
        finally:
            self.workers.close()
            if self.lock_step is not None:
                self.lock_step.close()  # the other processes leave

    def stats(self) -> dict:
        out = super().stats()
        pull = self._transfer[0]
        out["transfer"] = [{"engine": 0, "queue": pull.pending(), "transfers": pull.transfers,
                            **pull.stats.snapshot()}]
        out["prefill"] = [{"engine": r.index, "busy": r.busy, "prefills": r.prefills,
                           "retries": r.retries} for r in self._remote]
        out["prefill_workers"] = self.workers.loads()
        return out

    @property
    def transfer_stats(self):
        return self._transfer[0].stats


class _RemotePrefill:
    """Stands for the prefill workers where the driver and the warm-up ask about prefill
    (limits, buckets, whether prompts are scored, whether token masks apply): the
    generate engine's answers (the workers were checked to serve the same model at
    start-up). Nothing calls its engine methods: the workers run them."""

    def __init__(self, engine: Engine):
        self._engine = engine

    @property
    def engine(self) -> Engine:
        """The engine a page planner wraps, or the engine itself: what step_masks asks
        whether token masks apply (the workers were checked to serve the same model)."""
        return getattr(self._engine, "engine", self._engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
