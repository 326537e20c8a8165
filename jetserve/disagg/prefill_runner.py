"""The prefill thread of a `--role prefill` worker: prompts in, registered prefixes out.

RPC handlers `submit` jobs to a bounded queue (full: Overloaded, which the service answers
RESOURCE_EXHAUSTED so the decode side asks another worker); one thread per engine takes
them in order, prefills (in chunks of max_prefill_length, each continuing the last, for a
longer prompt; after the longest cached prefix with a prefix cache), registers the prefix
with the KVSender for one pull and completes the job's future with the first token's row
and the prefix's description. A constrained request's job carries the mask of the one
token sampled here (the decode side's grammar gives it and constrains the rest); an echo or
scoring request's job also scores the prompt (or only that: no prefix held). Between
jobs it
frees prefixes held past their time. An exception fails only its own job.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from engines import SamplingParams
from jetserve.disagg.kv_transfer import KVSender
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from jetserve.orchestrator.prefix_cache import PrefixCache
from jetserve.request import Overloaded, adapter_cache_key

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrefillJob:
    request_id: str
    token_ids: np.ndarray  # i32[T]
    sampling: SamplingParams
    receiver_devices: int
    token_mask: np.ndarray | None = None  # i32[1, W]: the first token's allowed set
    prompt_logprobs: int | None = None  # score the prompt, with this many alternatives
    score_only: bool = False  # only that: no prefill, no prefix held
    adapter: str | None = None  # the LoRA adapter to prefill through (None: the base model)
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A finished job: the first token's ResultTokens row and the held prefix."""

    first_row: np.ndarray  # i32[C] (empty when the job only scored)
    uuid: int
    meta: dict
    address: str
    prompt_logprobs: tuple[list, list] | None = None  # when asked (prefill_worker.py)


class PrefillRunner:
    """Runs prefill jobs on one engine, holding each prefix in `sender` for a pull."""

    def __init__(self, engine: Any, params: Any, sender: KVSender, *, max_queued: int,
                 poll_s: float = 0.05, cache: PrefixCache | None = None, cache_key: str = ""):
        self.engine, self.params, self.sender = engine, params, sender
        self.cache, self.cache_key = cache, cache_key
        self.poll_s = poll_s
        self.queue: queue.Queue[PrefillJob] = queue.Queue(max_queued)
        self.stopping = threading.Event()
        self.busy = False
        self.prefills = 0
        self._thread: threading.Thread | None = None

    def depth(self) -> int:
        """Jobs waiting or running: what the decode side balances on."""
        return self.queue.qsize() + int(self.busy)

    def submit(self, job: PrefillJob) -> concurrent.futures.Future:
        longest = self.engine.max_seq_len - 1
        if not 1 <= len(job.token_ids) <= longest:
            raise ValueError(f"token_ids has {len(job.token_ids)} tokens; this worker takes "
                             f"1 to {longest} (max_seq_len - 1)")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"prefill queue is full ({self.queue.maxsize} jobs)") from None
        return job.future

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="jetserve-prefill-runner",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.sender.expire()
            try:
                job = self.queue.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            if not job.future.set_running_or_notify_cancel():
                continue
            self.busy = True
            try:
                job.future.set_result(self._run(job))
            except Exception as e:  # this job only
                log.exception("prefill of request %s failed", job.request_id)
                job.future.set_exception(e)
            finally:
                self.busy = False

    def _run(self, job: PrefillJob) -> Prefilled:
        scored = None
        if job.prompt_logprobs is not None:
            scored = prompt_logprobs(self.engine, self.params, job.token_ids,
                                     job.prompt_logprobs, job.adapter)
        if job.score_only:
            return scored_only(scored)
        prefix, first = self.prefill(job.token_ids, job.sampling, token_mask=job.token_mask,
                                     adapter=job.adapter)
        uuid, meta = self.sender.register(prefix, job.receiver_devices)
        self.prefills += 1
        return Prefilled(first_row=np.asarray(first.to_host().data)[0], uuid=uuid, meta=meta,
                         address=self.sender.address, prompt_logprobs=scored)

    def ack(self, uuid: int) -> bool:
        """The decode side acknowledged (or no longer wants) the prefix under `uuid`."""
        return self.sender.ack(uuid)

    def prefill(self, tokens: np.ndarray, sampling: SamplingParams, seed: int | None = None,
                token_mask: np.ndarray | None = None,
                adapter: str | None = None) -> tuple[Any, Any]:
        """(prefix, first token) of `tokens`, in chunks of max_prefill_length, after the
        longest cached prefix when there is a prefix cache (whose new blocks it caches);
        `seed`, `token_mask` (structured output) and `adapter` (LoRA) as engine.prefill's.
        A prompt's KV differs by adapter, and so does its cache key."""
        # Only a constrained prefill names the mask, only an adapted one the adapter: an
        # engine without masks or adapters takes neither.
        masked = {} if token_mask is None else {"token_mask": token_mask}
        if adapter is not None:
            masked["adapter"] = adapter
        key = adapter_cache_key(self.cache_key, adapter)
        hit = None if self.cache is None else self.cache.lookup(key, tokens)
        try:
            done = 0 if hit is None else hit.tokens
            prefix = self.cache.existing_prefix(hit, tokens) if done else None
            chunk, first = self.engine.max_prefill_length, None
            for start in range(done, len(tokens), chunk):
                piece = tokens[start:start + chunk]
                prefix, first = self.engine.prefill(self.params, piece, len(piece),
                                                    sampling=sampling, existing_prefix=prefix,
                                                    seed=seed, **masked)
            if hit is not None:
                self.cache.insert(hit, prefix)
            return prefix, first
        finally:
            if hit is not None:
                hit.release()

    def warm_up(self) -> int:
        """Compiles one prefill per bucket (and the gather to one device) before serving;
        the number of buckets."""
        buckets = self.engine.prefill_buckets()
        for b in buckets:
            n = min(b, self.engine.max_seq_len - 1)
            prefix, _ = self.prefill(np.zeros(n, np.int32), SamplingParams())
            uuid, _ = self.sender.register(prefix, 1)
            self.sender.ack(uuid)
        return len(buckets)

    def idle(self) -> bool:
        return self.depth() == 0 and self.sender.registered() == 0


def scored_only(scored: tuple[list, list] | None) -> Prefilled:
    """A job that only scored its prompt: no token, no prefix held."""
    return Prefilled(first_row=np.zeros(0, np.int32), uuid=0, meta={}, address="",
                     prompt_logprobs=scored)


def wait_idle(runner: PrefillRunner, timeout_s: float) -> bool:
    """Until no job is queued or running and every prefix was pulled and acknowledged (or
    expired); False after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not runner.idle():
        if time.monotonic() >= end:
            return False
        runner.sender.expire()
        time.sleep(runner.poll_s)
    return True
