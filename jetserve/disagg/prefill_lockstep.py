"""A prefill worker over several processes (`jetserve serve --role prefill --coordinator
...`): one prefill engine whose mesh spans the devices of every process, run in lock step.

Each engine call is one SPMD program over all processes, so every process must prefill
the same tokens, with the same seed, in the same order. Process 0 alone serves the
worker's gRPC service; its runner thread takes one job at a time and broadcasts a turn
(`exchange_turn`) that every process then applies:

  turn = {"job": tokens, sampling, seed, uuid, receiver devices, first token's mask,
                 prompt log-probs asked, score only | None,
          "acks": uuids the decode side acknowledged since the last turn,
          "stop": whether process 0 is stopping}

Applying it: free the acknowledged prefixes, free those held past their time, prefill
the job's tokens (in chunks; scoring them first when asked), register this process's
blocks of the prefix with its own transfer server under the turn's uuid (prefix_wire.py:
the decode side pulls every process's blocks). Process 0 completes the job with the first
token and the description, which lists every process's transfer server (gathered once
at start-up).

When no job waits, process 0 sends an empty turn every `idle_wait_s`, so acknowledgements
reach the others and a stop is seen; the others block in the broadcast meanwhile. A
failure of the engine is the same on every process (same program, same inputs): the job
fails, the loop goes on. A failed broadcast (a process went away) ends the loop: process
0 fails the job at hand and every queued one, and refuses new ones (the decode side marks
the worker down and retries elsewhere).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engines import SamplingParams
from jetserve import distributed
from jetserve.disagg.kv_transfer import KVSender
from jetserve.disagg.prefill_runner import Prefilled, PrefillJob, PrefillRunner, scored_only
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from jetserve.orchestrator.prefix_cache import PrefixCache

log = logging.getLogger("jetserve.disagg")

Broadcast = Callable[[np.ndarray], np.ndarray]
_MIN_TURN_BYTES = 256
_ADDRESS_BYTES = 256


def exchange_turn(turn: dict | None, broadcast: Broadcast) -> dict:
    """Process 0 passes its turn, the others None; every process gets process 0's turn
    (JSON bytes, padded to a power of two so few broadcast shapes are compiled)."""
    data = b"" if turn is None else json.dumps(turn).encode()
    n = int(np.asarray(broadcast(np.array([len(data)], np.int32)))[0])
    buf = np.zeros(max(_MIN_TURN_BYTES, 1 << (n - 1).bit_length()), np.int32)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(broadcast(buf))
    return json.loads(got[:n].astype(np.uint8).tobytes())


def gather_addresses(address: str) -> list[str]:
    """Every process's transfer server address, by process index (a collective: every
    process calls it)."""
    from jax.experimental import multihost_utils

    raw = address.encode()
    if len(raw) > _ADDRESS_BYTES:
        raise ValueError(f"--transfer-host: address {address!r} is longer than "
                         f"{_ADDRESS_BYTES} bytes")
    row = np.zeros(_ADDRESS_BYTES, np.int32)
    row[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, _ADDRESS_BYTES)
    return [r[r > 0].astype(np.uint8).tobytes().decode() for r in rows]


class LockStepPrefillRunner(PrefillRunner):
    """PrefillRunner over an engine that spans several processes (see module doc).

    Args (beyond PrefillRunner's; its prefix cache, one on every process, stays alike on
    all: each applies the same turns in the same order, prefix_cache.py "Several
    processes"):
      primary: whether this is process 0 (default: jax.process_index() == 0).
      broadcast: process 0's array on every process (default:
        distributed.broadcast_from_primary).
      idle_wait_s: how long process 0 waits for a job before an empty turn.
    """

    def __init__(self, engine: Any, params: Any, sender: KVSender, *, max_queued: int,
                 poll_s: float = 0.05, primary: bool | None = None,
                 broadcast: Broadcast | None = None, idle_wait_s: float = 0.1,
                 cache: PrefixCache | None = None, cache_key: str = ""):
        super().__init__(engine, params, sender, max_queued=max_queued, poll_s=poll_s,
                         cache=cache, cache_key=cache_key)
        self.primary = distributed.is_primary() if primary is None else primary
        self._broadcast = broadcast or distributed.broadcast_from_primary
        self.idle_wait_s = idle_wait_s
        self._acks: list[int] = []
        self._acks_lock = threading.Lock()
        self._broken: str | None = None  # why the lock step ended, once it did
        sender.sources = gather_addresses(sender.address)

    def submit(self, job: PrefillJob):
        if self._broken is not None:
            raise RuntimeError(f"this prefill worker stopped: {self._broken}")
        return super().submit(job)

    def ack(self, uuid: int) -> bool:
        freed = self.sender.ack(uuid)
        with self._acks_lock:  # the other processes free their blocks at the next turn
            self._acks.append(uuid)
        return freed

    def run(self) -> None:
        """Process 0's turns, until stopped (the runner thread)."""
        job = None
        try:
            while True:
                stop = self.stopping.is_set()
                job = None if stop else self._take()
                with self._acks_lock:
                    acks, self._acks = self._acks, []
                turn = {"stop": stop, "acks": acks, "job": _job_turn(job)}
                self._apply(exchange_turn(turn, self._broadcast), job)
                job = None
                if stop:
                    return
        except Exception as e:  # a broadcast failed: the processes are out of step
            log.exception("prefill lock step failed; this worker takes no more prompts")
            self._broken = f"lock step with the other processes failed: {e}"
            self.stopping.set()
            self._fail_all(job, e)

    def _fail_all(self, job: PrefillJob | None, e: Exception) -> None:
        """Fails the job at hand and every queued one (their callers go elsewhere)."""
        while True:
            if job is not None and not job.future.done():
                job.future.set_exception(e)
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return

    def follow(self) -> None:
        """Another process's turns, until process 0 stops (its main thread)."""
        while True:
            turn = exchange_turn(None, self._broadcast)
            self._apply(turn, None)
            if turn["stop"]:
                return

    def _take(self) -> PrefillJob | None:
        try:
            job = self.queue.get(timeout=self.idle_wait_s)
        except queue.Empty:
            return None
        return job if job.future.set_running_or_notify_cancel() else None

    def _apply(self, turn: dict, job: PrefillJob | None) -> None:
        if not self.primary:
            for uuid in turn["acks"]:
                self.sender.ack(uuid)
        self.sender.expire()
        t = turn["job"]
        if t is None:
            return
        self.busy = True
        try:
            tokens = np.asarray(t["tokens"], np.int32)
            scored = self._score(tokens, t["prompt_logprobs"], t["adapter"])
            if t["score_only"]:
                if job is not None:
                    job.future.set_result(scored_only(scored))
                return
            mask = t["token_mask"]
            prefix, first = self.prefill(
                tokens, SamplingParams(**t["sampling"]), seed=t["seed"],
                token_mask=None if mask is None else np.asarray([mask], np.int32),
                adapter=t["adapter"])
            uuid, meta = self.sender.register(prefix, t["receiver_devices"], uuid=t["uuid"])
            self.prefills += 1
            if job is not None:
                job.future.set_result(Prefilled(
                    first_row=np.asarray(first.to_host().data)[0], uuid=uuid, meta=meta,
                    address=self.sender.address, prompt_logprobs=scored))
        except Exception as e:  # the same on every process: this job only
            log.exception("prefill of request %s failed", t["request_id"])
            if job is not None:
                job.future.set_exception(e)
        finally:
            self.busy = False

    def _score(self, tokens: np.ndarray, n: int | None, adapter: str | None
               ) -> tuple[list, list] | None:
        """The prompt's log-probs when asked, through the job's adapter (every process
        runs the program; process 0 reads it)."""
        if n is None:
            return None
        if not self.primary:
            self.engine.prompt_logprobs(self.params, tokens, adapter=adapter)
            return None
        return prompt_logprobs(self.engine, self.params, tokens, n, adapter)

    def warm_up(self) -> int:
        """Compiles one prefill per bucket on every process (through the turns)."""
        buckets = self.engine.prefill_buckets()
        for b in buckets:
            n = min(b, self.engine.max_seq_len - 1)
            job = PrefillJob(request_id=f"warm-up-{b}", token_ids=np.zeros(n, np.int32),
                             sampling=SamplingParams(), receiver_devices=1)
            self.ack(self.submit(job).result().uuid)
        return len(buckets)


def _job_turn(job: PrefillJob | None) -> dict | None:
    if job is None:
        return None
    s = job.sampling
    return {"request_id": job.request_id, "tokens": job.token_ids.tolist(),
            "sampling": dataclasses.asdict(s),
            "seed": s.seed if s.seed is not None else secrets.randbits(31),
            "uuid": secrets.randbits(63), "receiver_devices": job.receiver_devices,
            "token_mask": None if job.token_mask is None else job.token_mask[0].tolist(),
            "prompt_logprobs": job.prompt_logprobs, "score_only": job.score_only,
            "adapter": job.adapter}

