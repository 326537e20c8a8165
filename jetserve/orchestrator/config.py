"""The orchestrator's own knobs (engine shapes live in engines.EngineConfig)."""

from __future__ import annotations

import dataclasses
import math

from jetserve.scheduling.policy import PREFILL_FIRST, check_knobs

TURNS, MIXED = "turns", "mixed"
SCHEDULING = (TURNS, MIXED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """Queue bounds and polling.

    Args:
      max_queued_requests: admission bound; submit() raises Overloaded beyond it.
      max_queued_per_client: the most requests one client (Request.client) may have
        queued; beyond it only that client is refused (Overloaded) while others still get
        in. Clients are served in turn either way (fair_queue.py). None: up to
        max_queued_requests (what callers with one client, batch jobs, want).
      transfer_queue_size: prefixes waiting for the transfer thread, per generate engine.
      backlog_size: transferred prefixes waiting for a slot, per generate engine
        (None: as many as the engine has slots).
      detokenize_queue_size: step results waiting for the detokenize thread.
      poll_interval_s: longest an idle thread sleeps before it rechecks for stop,
        cancellation and deadlines (busy threads check every step).
      prefill_chunk: prefill prompts longer than this in chunks of it, letting running
        requests step between chunks; prompts may then be up to max_seq_len - 1 tokens.
        None: chunks of max_prefill_length, where the engine continues prefixes
        (Engine.chunked_prefill), else one prefill per prompt.
      prefix_cache_hbm_bytes / prefix_cache_host_bytes: budgets of the prefix cache's
        device and host tiers, per prefill engine (both 0: no prefix cache).
      prefix_cache_block: tokens per cached block; a hit reuses whole blocks. A paged
        engine that prefills and generates caches its KV pages: its block is the page size.
      prefix_cache_key: what the cached KV depends on (prefix_cache.model_cache_key).
      max_num_seqs / max_num_batched_tokens / step_policy: the scheduling knobs
        (jetserve/scheduling/policy.py): the most sequences decoding at once (None: every
        slot), the token budget of one decode step (None: none) and prefill-first or
        decode-first; checked against the engines when the orchestrator is built.
      prefill_lookahead: under decode-first, decode steps ahead of a running sequence's
        known end that a waiting prompt may be prefilled for its slot (0: none).
      scheduling: "turns" (prefill, insert and generate calls from their own threads) or
        "mixed" (one paged engine whose decode steps run the prompts' chunks too:
        mixed.py; `build` makes a MixedOrchestrator).
    """

    max_queued_requests: int = 256
    max_queued_per_client: int | None = None
    transfer_queue_size: int = 4
    backlog_size: int | None = None
    detokenize_queue_size: int = 256
    poll_interval_s: float = 0.02
    prefill_chunk: int | None = None
    prefix_cache_hbm_bytes: int = 0
    prefix_cache_host_bytes: int = 0
    prefix_cache_block: int = 16
    prefix_cache_key: str = ""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    step_policy: str = PREFILL_FIRST
    prefill_lookahead: int = 0
    scheduling: str = TURNS

    def __post_init__(self):
        for name in ("max_queued_requests", "transfer_queue_size", "detokenize_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        q = self.max_queued_per_client
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 1):
            raise ValueError(f"max_queued_per_client must be None or an integer >= 1, got {q!r}")
        if q is not None and q > self.max_queued_requests:
            raise ValueError(f"max_queued_per_client={q} is more than "
                             f"max_queued_requests={self.max_queued_requests}; a client's "
                             "share is part of the whole")
        b = self.backlog_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"backlog_size must be None or an integer >= 1, got {b!r}")
        c = self.prefill_chunk
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1, got {c!r}")
        for name in ("prefix_cache_hbm_bytes", "prefix_cache_host_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        b = self.prefix_cache_block
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"prefix_cache_block must be an integer >= 1, got {b!r}")
        check_knobs(max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    step_policy=self.step_policy, prefill_lookahead=self.prefill_lookahead)
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling (--scheduling) must be one of "
                             f"{', '.join(SCHEDULING)}; got {self.scheduling!r}")
        p = self.poll_interval_s
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"poll_interval_s must be in (0, 1] seconds, got {p!r}")

    def refuse_step_policy(self, where: str) -> None:
        """For a driver that does not schedule by max_num_seqs, max_num_batched_tokens and
        step_policy (`where` names it): a knob set there is refused, not ignored."""
        given = [name for name, on in (
            ("max_num_seqs (--max-num-seqs)", self.max_num_seqs is not None),
            ("max_num_batched_tokens (--max-num-batched-tokens)",
             self.max_num_batched_tokens is not None),
            (f"step_policy={self.step_policy} (--step-policy)",
             self.step_policy != PREFILL_FIRST),
            ("prefill_lookahead (--prefill-lookahead)", self.prefill_lookahead != 0)) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: {where} does not schedule by these "
                             "knobs; leave them out")
