"""The orchestrator of `--scheduling mixed`: one paged engine, whose decode steps also run
the prompts' chunks (mixed_worker.py), instead of prefill / insert / generate turns.

Admission, the registry of requests in flight, the detokenize thread, listeners, stats
and stop are the threaded orchestrator's (driver.py); only the threads differ: one
mixed generate thread takes admitted requests straight from the admission queue.

The prefix cache (--prefix-cache-hbm-mb / --prefix-cache-host-mb, --enable-prefix-caching)
lives in the engine's own KV pages (prefix_stores.PageStore) and belongs to the mixed
thread: a hit links its pages into the prompt's slot and the prompt's chunks start after
them (mixed_worker.py); its stats are the interleaved cache's.

Refused, each by name: a contiguous KV cache (mixed steps run on pages), --step-policy
decode-first (every step runs every decoding sequence anyway), and the prefix cache on an
engine whose sliding layers keep rings of pages (a ring keeps no page behind its window to
link); and devices split into prefill and generate slices (`build`: the mixed step is one
slice's). Structured output is served: each step takes its sampling rows' token masks
(mixed_worker.py). LoRA adapters (--lora-modules) are served: each row of a step runs
through its request's adapter. Speculative decoding (--speculative ngram:K or
draft:PATH:K) is served: each decode row is a verify row of K + 1 tokens, and a draft
model also runs over every prompt chunk (engines/mixed_step.py). Over several processes
the mixed thread's engine calls go to every process as plans (mixed_lockstep.py).
"""

from __future__ import annotations

from typing import Any

from engines import Engine
from jetserve.orchestrator.config import MIXED, OrchestratorConfig
from jetserve.orchestrator.driver import Orchestrator
from jetserve.orchestrator.mixed_worker import MixedWorker
from jetserve.orchestrator.wiring import build_prefix_cache, check_engines, step_policy
from jetserve.scheduling.policy import PREFILL_FIRST


def refuse_engine(engine: Engine, config: OrchestratorConfig) -> None:
    """What --scheduling mixed cannot serve on this engine, by name."""
    if getattr(engine, "page_geometry", None) is None:
        raise ValueError("--scheduling mixed runs its steps on the paged KV cache: add "
                         "--kv-layout paged (got the contiguous layout)")
    if config.step_policy != PREFILL_FIRST:
        raise ValueError(f"--step-policy {config.step_policy}: --scheduling mixed runs every "
                         "decoding sequence in each step whatever the policy; leave it out")
    if (config.prefix_cache_hbm_bytes or config.prefix_cache_host_bytes) and \
            engine.page_geometry.ring_pages:
        raise ValueError("--scheduling mixed keeps its prefix cache in the KV pages, and "
                         "this model's sliding-window layers keep rings of pages (no page "
                         "behind the window to link): leave out --prefix-cache-hbm-mb / "
                         "--prefix-cache-host-mb / --enable-prefix-caching")
    if engine.config.prefill_batch > 1:
        raise ValueError(f"--prefill-batch {engine.config.prefill_batch}: --scheduling mixed "
                         f"already runs the waiting prompts' chunks together in each step; "
                         f"leave it out")


class MixedOrchestrator(Orchestrator):
    """Serves Requests on one paged engine with mixed steps (see the module doc)."""

    worker = MixedWorker  # the mixed thread (mixed_lockstep.py's over several processes)

    def __init__(self, engine: Engine, params: Any, config: OrchestratorConfig | None = None):
        config = config or OrchestratorConfig(scheduling=MIXED)
        check_engines([engine], [engine], [params], [params])
        refuse_engine(engine, config)
        config = self._init_intake([engine], [engine], config)
        planned = self.generate_engines[0]
        self.policy = policy = step_policy(config, [planned], [planned])
        row = engine.config.spec.k + 1  # a decode row's tokens (a verify row's k + 1)
        budget = min(policy.max_num_batched_tokens
                     or policy.max_num_seqs * row + policy.prefill_chunk,
                     planned.mixed_token_buckets[-1])
        if budget <= policy.max_num_seqs * row:
            raise ValueError(f"max_num_batched_tokens={budget} (--max-num-batched-tokens) "
                             f"leaves no prefill token beside max_num_seqs="
                             f"{policy.max_num_seqs} verify rows of {row} tokens: give at "
                             f"least {policy.max_num_seqs * row + 1}")
        self._generate = [self.worker(
            0, planned, params, self._outbox, self._listeners, self._stopping,
            backlog_size=1, poll_s=config.poll_interval_s, policy=policy,
            admission=self._admission, budget=budget, chunk=policy.prefill_chunk,
            cache_key=config.prefix_cache_key)]
        build_prefix_cache(planned, config, self._generate[0])  # sets its `cache`

    @classmethod
    def from_engines(cls, engine: Engine, *, params: Any = None,
                     config: OrchestratorConfig | None = None) -> MixedOrchestrator:
        return cls(engine, engine.load_params() if params is None else params, config)

    def prefix_caches(self) -> list[tuple[int, Any]]:
        """The mixed thread's prefix cache (it owns it: no prefill thread here)."""
        return [(w.index, w.cache) for w in self._generate if w.cache is not None]

    # ---- warm-up: throwaway steps per (token bucket, page-table width) ------------------

    def warmup_shapes(self) -> list[tuple[int, int]]:
        return self._generate[0].warm_shapes()

    def warm_shape(self, tokens: int, width: int, timeout: float | None = None) -> None:
        """Compiles the mixed step of `tokens` tokens and `width` pages, with a token mask
        and without (started)."""
        w = self._generate[0]
        w.call(lambda: w.warm(tokens, width), timeout)

    @property
    def chunks_prompts(self) -> bool:
        return True  # every prompt runs in chunks of the step
