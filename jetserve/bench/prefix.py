"""TTFT of requests that share a long system prompt: prefix cache off, on, host tier only;
and the bytes the cache holds for them.

One engine, interleaved (paged by default: the cache's device tier is then the engine's
own KV pages). Each request is the same `system_len`-token system prompt plus its own
short question, one request at a time, two generated tokens each (the second makes a
request leave only after its insert, where a paged engine's cache adopts its pages, so
the next request finds them); TTFT is `RequestTiming.ttft` (submit to the first token on
the stream). Modes:
  off:  no prefix cache: every request prefills system prompt and question;
  hbm:  cache in device memory: after the first request, only the question is prefilled;
  host: device budget 0, host budget only: a hit copies the cached KV back to the device.
Each mode first runs the same workload once on another system prompt of the same length,
so every program is compiled before the measured run. The first measured request of a
cached mode is a miss and is reported apart from the hits.

Dedup: a fresh device-tier cache after `requests` prompts through one new system prompt
holds that prompt's whole blocks once plus each prompt's own blocks; beside it, what a
cache of one entry per prompt (the whole prompt's prefill KV, padded to its bucket)
would hold for them.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import numpy as np

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator.prefix_stores import block_bytes

MB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixBenchConfig:
    model: str = "random:small"
    system_len: int = 1000
    question_len: int = 16
    requests: int = 8
    cache_mb: int = 512
    kv_layout: str = "paged"
    page_size: int = 16  # also the cache block of a contiguous engine

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")


def _ttfts(orch: Orchestrator, cfg: PrefixBenchConfig, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 256, cfg.system_len).tolist()
    out = []
    for _ in range(cfg.requests):
        question = rng.integers(1, 256, cfg.question_len).tolist()
        c = orch.submit(Request(prompt_ids=system + question, max_tokens=2,
                                ignore_eos=True)).result()
        out.append(c.timing.ttft)
    return out


def run(cfg: PrefixBenchConfig, log: Callable[..., None] = print) -> dict:
    total = cfg.system_len + cfg.question_len
    engine = build_engine(cfg.model, engine_config=EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=total, max_seq_len=total + 16,
        top_logprobs=0, kv_layout=cfg.kv_layout, page_size=cfg.page_size))
    params = engine.load_params()
    budget = cfg.cache_mb * MB
    rows = {}
    for name, hbm, host in (("off", 0, 0), ("hbm", budget, 0), ("host", 0, budget)):
        with Orchestrator.from_engines(engine, params=params,
                                       config=_config(cfg, hbm, host)) as orch:
            log(f"{name}: compiling ...")
            _ttfts(orch, cfg, seed=1)
            log(f"{name}: measuring ...")
            ms = [t * 1e3 for t in _ttfts(orch, cfg, seed=2)]
            cache = (orch.stats()["prefix_cache"] or [{}])[0]
        first, rest = ms[0], ms[1:] or ms
        rows[name] = {"first_ms": round(first, 2), "p50_ms": round(statistics.median(rest), 2),
                      "mean_ms": round(statistics.fmean(rest), 2),
                      "hit_rate": round(cache.get("hit_rate", 0.0), 3),
                      "hbm_bytes": cache.get("hbm_bytes", 0),
                      "host_bytes": cache.get("host_bytes", 0)}
    off = rows["off"]["p50_ms"]
    return {"config": dataclasses.asdict(cfg), "rows": rows,
            "speedup_hbm": round(off / rows["hbm"]["p50_ms"], 2),
            "speedup_host": round(off / rows["host"]["p50_ms"], 2),
            "dedup": _dedup(cfg, engine, params, budget, log)}


def _config(cfg: PrefixBenchConfig, hbm: int, host: int) -> OrchestratorConfig:
    return OrchestratorConfig(prefix_cache_hbm_bytes=hbm, prefix_cache_host_bytes=host,
                              prefix_cache_block=cfg.page_size,
                              prefix_cache_key=f"bench {cfg.model}")


def _dedup(cfg: PrefixBenchConfig, engine, params, budget: int,
           log: Callable[..., None]) -> dict:
    """Bytes a device-tier cache holds after `requests` prompts through one system prompt,
    against one copy of the system prompt's blocks and one entry per prompt."""
    log("dedup: measuring ...")
    with Orchestrator.from_engines(engine, params=params,
                                   config=_config(cfg, budget, 0)) as orch:
        _ttfts(orch, cfg, seed=3)
        cache = orch.stats()["prefix_cache"][0]
    block = block_bytes(engine, cfg.page_size)
    total = cfg.system_len + cfg.question_len
    per_prompt_entry = engine.bucket_for(total) * block // cfg.page_size  # its KV, padded
    return {"prompts": cfg.requests, "held_bytes": cache["hbm_bytes"],
            "held_blocks": cache["hbm_blocks"],
            "system_copy_bytes": cfg.system_len // cfg.page_size * block,
            "per_entry_bytes": cfg.requests * per_prompt_entry}
