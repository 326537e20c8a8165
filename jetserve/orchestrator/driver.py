"""The orchestrator: requests in, streams of deltas out, over prefill and generate engines.

Threads and who owns what
-------------------------
::

  submit() ──> admission queue (bounded: full -> Overloaded at once); one lane per
                 client, served in turn, each bounded by its share (fair_queue.py)
                 │
     prefill thread, one per prefill engine (prefill_worker.py)
       prompt log-probs, engine.prefill -> first token ──────────────┐
                 │ interleaved: own engine          disaggregated: least loaded engine
                 │                                  transfer queue (bounded)
                 │                                  transfer thread, one per generate
                 │                                  engine: device_put + wait
                 ▼                                  (transfer_worker.py)
       backlog of prefixes, per generate engine (bounded)
                 │
     generate thread, one per generate engine (generate_worker.py)
       owns the decode state and its slots: reap, insert, step; reads each step's
       results one step later; checks stop ids and length ───────────┤
                                                                     ▼
     detokenize thread (detokenize_worker.py), one: text, stop strings, deltas,
       finish reasons; the only writer of request streams (handle.py)

Every queue is bounded, so memory stays flat under overload: a full queue blocks the stage
before it, back to admission, which refuses. A request is held by one stage at a time
(live.py says which fields cross threads); cancellation and deadlines are flags the holding
stage checks: a request in a slot is released before the next step. The driver only wires
the stages, admits requests and keeps the registry of requests in flight (under a lock).

Interleaved mode: the same engine object (and params) in both lists; its prefill thread
feeds its own generate thread directly, and that generate thread waits rather than steps
while it has free slots and prefill work pending (prefill has priority), or, under
decode-first (jetserve/scheduling/policy.py), steps at once and lets at most
max_num_batched_tokens of prefill run before each step (step_budget.py). Disaggregated
mode: prefill and generate engines are different objects, normally on disjoint slices.

KV pages (a paged generate engine): its generate thread admits from the backlog what fits
in the free pages and preempts when a step would run out; preempted requests return to the
prefill threads through the resume queue (unbounded, at most one per slot) to be
recomputed. Prompts longer than max_prefill_length (or `prefill_chunk`) are prefilled in
chunks and, interleaved, the generate thread steps between chunks.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engines import Engine
from jetserve.orchestrator.config import OrchestratorConfig
from jetserve.orchestrator.detokenize_worker import STOP, DetokenizeWorker
from jetserve.orchestrator.fair_queue import ClientFull, FairQueue, Full
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.handle import RequestHandle
from jetserve.orchestrator.live import LiveRequest
from jetserve.orchestrator.prefill_worker import PrefillWorker
from jetserve.orchestrator.step_masks import check_constrainable
from jetserve.orchestrator.stopping import stop_ids, token_budget
from jetserve.orchestrator.timing import Event, Listeners, RequestFinished, RequestTiming
from jetserve.orchestrator.transfer_worker import TransferWorker
from jetserve.orchestrator.wiring import (
    budget_between,
    build_prefix_cache,
    check_engines,
    direct_route,
    generate_stats,
    least_loaded_route,
    pending_for,
    step_between,
    step_policy,
)
from jetserve.request import Delta, ModelLimits, Overloaded, Request, check_request
from jetserve.scheduling.page_planner import with_pages


class Orchestrator:
    """Serves Requests on P prefill engines and G generate engines.

    Args:
      prefill_engines / prefill_params: engines that run prompts, with their weights.
      generate_engines / generate_params: engines that decode, with their weights. The
        same engine object in both lists runs interleaved.
      config: queue bounds (OrchestratorConfig).
    """

    def __init__(self, *, prefill_engines: Sequence[Engine], generate_engines: Sequence[Engine],
                 prefill_params: Sequence[Any], generate_params: Sequence[Any],
                 config: OrchestratorConfig | None = None):
        check_engines(prefill_engines, generate_engines, prefill_params, generate_params)
        config = self._init_intake(prefill_engines, generate_engines, config)
        prefill_engines, generate_engines = self.prefill_engines, self.generate_engines
        poll = config.poll_interval_s
        self.policy = step_policy(config, prefill_engines, generate_engines)
        self._generate = [
            GenerateWorker(i, e, p, self._outbox, self._listeners, self._stopping,
                           backlog_size=config.backlog_size or e.max_concurrent_decodes,
                           poll_s=poll, policy=self.policy)
            for i, (e, p) in enumerate(zip(generate_engines, generate_params, strict=True))
        ]
        for g in self._generate:
            g.resume = self._resume.put
        own = {id(g.engine): g for g in self._generate}
        self._prefill = [
            PrefillWorker(i, e, p, self._admission, self._outbox, self._listeners,
                          self._stopping, poll, resume=self._resume,
                          chunk=self.policy.prefill_chunk if config.max_num_batched_tokens
                          else config.prefill_chunk,
                          cache=build_prefix_cache(e, config, own.get(id(e))),
                          cache_key=config.prefix_cache_key)
            for i, (e, p) in enumerate(zip(prefill_engines, prefill_params, strict=True))
        ]
        self._transfer = self._wire()

    def _init_intake(self, prefill_engines: Sequence[Engine], generate_engines: Sequence[Engine],
                     config: OrchestratorConfig | None) -> OrchestratorConfig:
        """What every driver shares: admission, the registry of requests in flight, the
        detokenize thread and listeners (lockstep.py drives the engines differently)."""
        self.config = config = config or OrchestratorConfig()
        longest = min(e.max_prefill_length for e in prefill_engines)
        if config.prefill_chunk is not None and config.prefill_chunk > longest:
            raise ValueError(f"prefill_chunk={config.prefill_chunk} is longer than a prefill "
                             f"engine's max_prefill_length={longest} (--prefill-chunk at "
                             f"most --max-prefill-length)")
        if len({getattr(e, "has_draft_model", False)
                for e in (*prefill_engines, *generate_engines)}) > 1:
            raise ValueError("speculative 'draft:PATH:K': the prefill and generate engines "
                             "must all have the draft model (prefixes carry its KV) or none")
        # A paged engine is called through its page planner: one per engine, shared by
        # the prefill and generate lists (an interleaved engine is in both).
        planned = {id(e): with_pages(e) for e in (*prefill_engines, *generate_engines)}
        self.prefill_engines = [planned[id(e)] for e in prefill_engines]
        self.generate_engines = [planned[id(e)] for e in generate_engines]
        self._stopping = threading.Event()
        self._listeners = Listeners()
        self._admission: FairQueue[LiveRequest] = FairQueue(config.max_queued_requests,
                                                            config.max_queued_per_client)
        self._outbox: queue.Queue = queue.Queue(config.detokenize_queue_size)
        self._resume: queue.Queue[LiveRequest] = queue.Queue()  # preempted, to recompute
        self._live: dict[str, LiveRequest] = {}
        self._live_cond = threading.Condition()  # guards _live and _counters
        self._counters: collections.Counter[str] = collections.Counter()
        self._accepting = True
        self._threads: list[threading.Thread] = []
        self._generate: list[GenerateWorker] = []
        self._prefill: list[PrefillWorker] = []
        self._transfer: list[TransferWorker] = []
        self._detok = DetokenizeWorker(self._outbox, self.tokenizer, self._finished)
        return config

    def _wire(self) -> list[TransferWorker]:
        """Routes each prefill worker to its own generate worker (interleaved) or through
        transfer threads to the least loaded generate worker (disaggregated)."""
        by_engine = {id(g.engine): g for g in self._generate}
        own = {id(p.engine) for p in self._prefill} & set(by_engine)
        transfers = []
        if any(id(p.engine) not in own for p in self._prefill):
            transfers = [TransferWorker(g, self._outbox, self._stopping,
                                        queue_size=self.config.transfer_queue_size,
                                        poll_s=self.config.poll_interval_s)
                         for g in self._generate]
            for g, t in zip(self._generate, transfers, strict=True):
                g.transfer_pending = t.pending
        for p in self._prefill:
            if id(p.engine) in own:
                g = by_engine[id(p.engine)]
                p.route = direct_route(g, self._stopping, self.config.poll_interval_s)
                g.prefill_pending = pending_for(p, self._admission, self._resume)
                p.between_chunks = step_between(g)  # running requests step between chunks
                budget_between(p, g, self.policy, self._stopping, self.config.poll_interval_s)
            else:
                p.route = least_loaded_route(self._generate, transfers)
        return transfers

    @classmethod
    def from_engines(cls, engine: Engine, *, params: Any = None,
                     config: OrchestratorConfig | None = None) -> Orchestrator:
        """Interleaved on one engine (loads its params unless given)."""
        params = engine.load_params() if params is None else params
        return cls(prefill_engines=[engine], generate_engines=[engine],
                   prefill_params=[params], generate_params=[params], config=config)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("the orchestrator is already started")
        if self._stopping.is_set():
            raise RuntimeError("a stopped orchestrator cannot be restarted; build a new one")
        self._threads = [threading.Thread(target=fn, name=f"jetserve-{name}", daemon=True)
                         for name, fn in self._thread_bodies()]
        for t in self._threads:
            t.start()

    def _thread_bodies(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, body) of every thread; the detokenize thread last."""
        return [*((f"prefill-{w.index}", w.run) for w in self._prefill),
                *((f"transfer-{t.target.index}", t.run) for t in self._transfer),
                *((f"generate-{w.index}", w.run) for w in self._generate),
                ("detokenize", self._detok.run)]

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops admitting, finishes (drain) or cancels what is in flight, ends the threads.

        After `timeout` seconds of draining the rest is cancelled. Requests still open
        when the threads are gone end with "cancelled".
        """
        self._accepting = False
        if self._stopping.is_set():
            return  # stopped already
        if not self._threads:
            self._stopping.set()
            self._end_leftovers()
            self._clear_prefix_caches()
            return
        end = None if timeout is None else time.monotonic() + timeout
        if not drain:
            self._cancel_all()
        if not self._wait_idle(end):
            self._cancel_all()
            self._wait_idle(time.monotonic() + max(1.0, 20 * self.config.poll_interval_s))
        self._stopping.set()
        for g in self._generate:
            g.backlog.poke()
        workers = [t for t in self._threads if t.name != "jetserve-detokenize"]
        for t in workers:
            t.join()
        self._outbox.put(STOP)
        for t in self._threads:
            t.join()
        self._end_leftovers()
        self._clear_prefix_caches()

    def _clear_prefix_caches(self) -> None:
        """Gives the pages a prefix cache holds back to their engine's pool (the engine
        may serve another orchestrator)."""
        for _, cache in self.prefix_caches():
            cache.clear()

    def __enter__(self) -> Orchestrator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    def _wait_idle(self, end: float | None) -> bool:
        with self._live_cond:
            while self._live:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._live_cond.wait(left)
        return True

    def _cancel_all(self) -> None:
        with self._live_cond:
            lives = list(self._live.values())
        for live in lives:
            self._cancel(live)

    def _end_leftovers(self) -> None:
        with self._live_cond:
            lives = list(self._live.values())
        for live in lives:
            if not live.finalized:
                live.done = live.finalized = True
                live.timing.end = time.monotonic()
                self._finished(live, "cancelled")
                live.handle._push(Delta(token_ids=[], text="", finish_reason="cancelled"), True)

    # ---- requests ------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Admits a request; raises Overloaded when admission (or its client's share of
        it) is full, ValueError when the request does not fit the served model."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[Request]) -> list[RequestHandle]:
        """Admits every request or none (the sub-requests of one client request: prompts x
        samples), as submit() does; they must share one `client`. ValueError also when they
        are more than one client may queue at once, which no retry would change."""
        for r in requests:
            if not isinstance(r, Request):
                raise ValueError(f"submit() takes a jetserve.request.Request, got "
                                 f"{type(r).__name__}")
            check_request(self.limits, r)
            if r.constraint is not None:
                check_constrainable(r.constraint.field, (*self.prefill_engines,
                                                         *self.generate_engines), self.tokenizer)
        if not requests:
            return []
        clients = {r.client for r in requests}
        if len(clients) > 1:
            raise ValueError(f"submit_many: requests of {len(clients)} clients; one call "
                             "admits one client's requests")
        client = clients.pop()
        if not self._accepting:
            raise Overloaded("the orchestrator is shutting down; not accepting requests")
        share = self._admission.per_client
        if len(requests) > share:
            raise ValueError(f"this request makes {len(requests)} sub-requests (prompts x "
                             f"samples); this server queues at most {share} per client: "
                             "send fewer prompts or samples per request")
        lives = [self._live_request(r) for r in requests]
        self._register(lives)
        try:
            self._admission.put_all_nowait(lives, client)
        except (Full, ClientFull) as e:
            with self._live_cond:
                for live in lives:
                    del self._live[live.request_id]
                self._counters["overloaded"] += 1
            if isinstance(e, ClientFull):
                raise Overloaded(f"this client's share of the admission queue is full "
                                 f"({self._admission.held_by(client)} of {share} requests "
                                 "waiting); retry later") from None
            raise Overloaded(f"admission queue is full ({self.config.max_queued_requests} "
                             "requests waiting); retry later") from None
        with self._live_cond:
            self._counters["submitted"] += len(lives)
        return [live.handle for live in lives]

    def _live_request(self, request: Request) -> LiveRequest:
        grammar = None
        if request.constraint is not None:
            # Imported here: llguidance loads only in a process that gets a constraint.
            from jetserve.structured.grammar import compile_constraint

            grammar = compile_constraint(request.constraint, self.tokenizer, self.vocab_size)
        budget = token_budget(len(request.prompt_ids), request.max_tokens, self.max_seq_len)
        if grammar is not None:
            grammar.check_fits(budget)
        live = LiveRequest(
            request=request, handle=None,  # type: ignore[arg-type]
            timing=RequestTiming(arrival=time.monotonic()),
            budget=budget,
            stop_ids=stop_ids(self.eos_ids, request.stop_token_ids, request.ignore_eos),
            grammar=grammar,
        )
        live.handle = RequestHandle(request, live.timing, lambda: self._cancel(live))
        return live

    def _register(self, lives: list[LiveRequest]) -> None:
        """Into the registry of requests in flight; ValueError on an id already there."""
        with self._live_cond:
            fresh: dict[str, LiveRequest] = {}
            for live in lives:
                if live.request_id in self._live or live.request_id in fresh:
                    raise ValueError(f"request_id {live.request_id!r} is already in flight")
                fresh[live.request_id] = live
            self._live.update(fresh)

    def _cancel(self, live: LiveRequest) -> None:
        live.cancel_requested = True
        for g in self._generate:
            g.backlog.poke()

    def _finished(self, live: LiveRequest, reason: str) -> None:
        """Called on the detokenize thread just before a request's last delta."""
        with self._live_cond:
            if self._live.get(live.request_id) is live:
                del self._live[live.request_id]
            self._counters[f"finished_{reason}"] += 1
            self._live_cond.notify_all()
        if self._listeners:
            self._listeners.emit(RequestFinished(
                live.request_id, reason, len(live.request.prompt_ids), live.generated,
                live.timing, live.request.lora_adapter))

    # ---- observation ---------------------------------------------------------------------

    def add_listener(self, callback: Callable[[Event], None]) -> None:
        """`callback(event)` for RequestFinished, StepDone and PrefillDone events (timing.py),
        called on orchestrator threads: keep it quick."""
        self._listeners.add(callback)

    def remove_listener(self, callback: Callable[[Event], None]) -> None:
        self._listeners.remove(callback)

    def prefix_caches(self) -> list[tuple[int, Any]]:
        """(prefill engine index, its PrefixCache) of every prefill engine that has one."""
        return [(w.index, w.cache) for w in getattr(self, "_prefill", ()) if w.cache is not None]

    def stats(self) -> dict:
        with self._live_cond:
            in_flight = len(self._live)
            counters = dict(self._counters)
            lora = _adapters_in_flight(self._live.values())
        return {
            "admission_queue": self._admission.qsize(),
            "max_queued_requests": self.config.max_queued_requests,
            "admission_clients": self._admission.clients(),
            "in_flight": in_flight,
            "detokenize_queue": self._outbox.qsize(),
            "prefill": [{"engine": w.index, "busy": w.busy, "prefills": w.prefills,
                         "row_calls": w.row_calls}
                        for w in self._prefill],
            "transfer": [{"engine": t.target.index, "queue": t.pending(),
                          "transfers": t.transfers} for t in self._transfer],
            "generate": [{"engine": g.index, "slots": g.slots.size,
                          "slots_in_use": g.slots.in_use, "backlog": len(g.backlog),
                          **generate_stats(g)} for g in self._generate],
            "resume_queue": self._resume.qsize(),
            "prefix_cache": [{"engine": i, **c.stats()} for i, c in self.prefix_caches()],
            "counters": counters,
            "lora": lora,
        }

    def warmup(self, prompt_lengths: Sequence[int] = (1,), timeout: float | None = None, *,
               prompt_logprobs: bool = False) -> None:
        """Compiles prefill (one bucket per length), insert and generate on every engine by
        running throwaway requests (needs start()); with prompt_logprobs, the scoring
        program of each bucket too."""
        n = max(len(self.generate_engines), len(self.prefill_engines))
        # One client each: they go in all at once, whatever a client's share is.
        handles = [self.submit(Request(prompt_ids=(0,) * L, max_tokens=2, ignore_eos=True,
                                       prompt_logprobs=prompt_logprobs,
                                       client=f"warmup-{k}"))
                   for k, L in enumerate(L for L in prompt_lengths for _ in range(n))]
        for h in handles:
            h.result(timeout)

    def prefill_row_shapes(self) -> list[tuple[int, int]]:
        """The (prompts, bucket) shapes of the several-prompt prefill calls the prefill
        threads make (none where each call takes one prompt)."""
        if all(p.max_rows < 2 for p in self._prefill):
            return []
        return self.prefill_engines[0].prefill_row_shapes()

    def warm_prefill_rows(self, rows: int, bucket: int) -> None:
        """Compiles (and runs once, on throwaway prompts) the prefill of `rows` prompts of
        `bucket` tokens on every prefill engine that makes such calls."""
        for p in self._prefill:
            if p.max_rows >= rows:
                p.warm_rows(rows, bucket)

    def warm_decode_batch(self, rows: int) -> None:
        """Compiles the generate step over the first `rows` slots on every generate engine
        with that decode batch size (GenerateWorker.warm_batch)."""
        for g in self._generate:
            g.warm_batch(rows)

    # ---- what the served model is --------------------------------------------------------

    @functools.cached_property
    def limits(self) -> ModelLimits:
        """What the served model accepts (fixed once the engines are built)."""
        return ModelLimits.from_orchestrator(self)

    @property
    def tokenizer(self):
        return self.generate_engines[0].tokenizer

    @property
    def vocab_size(self) -> int:
        return self.generate_engines[0].vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.generate_engines[0].eos_ids)

    @property
    def bos_id(self) -> int | None:
        return self.generate_engines[0].bos_id

    @property
    def max_seq_len(self) -> int:
        return min(e.max_seq_len for e in self.prefill_engines + self.generate_engines)

    @property
    def max_prefill_length(self) -> int:
        return min(e.max_prefill_length for e in self.prefill_engines)

    @property
    def chunks_prompts(self) -> bool:
        """Whether prompts longer than max_prefill_length are prefilled in chunks: by
        default where every prefill engine continues prefixes, always with prefill_chunk."""
        return bool(self.config.prefill_chunk) or all(
            getattr(e, "chunked_prefill", False) for e in self.prefill_engines)

    @property
    def max_prompt_length(self) -> int:
        """The longest prompt admitted: max_seq_len - 1 when chunked (room for one token),
        else one prefill."""
        if self.chunks_prompts:
            return self.max_seq_len - 1
        return self.max_prefill_length

    @property
    def top_logprobs(self) -> int:
        return min(e.top_logprobs for e in self.prefill_engines + self.generate_engines)

    @property
    def max_concurrent_decodes(self) -> int:
        return sum(e.max_concurrent_decodes for e in self.generate_engines)


def _adapters_in_flight(lives) -> dict[str, list[str]]:
    """The LoRA adapters of requests in flight: "running" (prefill started), "waiting"."""
    out: dict[str, set[str]] = {"running": set(), "waiting": set()}
    for live in lives:
        if live.request.lora_adapter is not None:
            state = "waiting" if live.timing.prefill_start is None else "running"
            out[state].add(live.request.lora_adapter)
    return {k: sorted(v) for k, v in out.items()}
