"""KV capacity: how many sequences run at once in one KV budget, paged against contiguous.

Both layouts get the same budget of `kv_tokens` cached positions per layer:
  contiguous: every slot reserves max_seq_len positions, so kv_tokens // max_seq_len slots;
  paged:      kv_tokens // page_size pages shared by up to `paged_slots` slots, each
              sequence holding only the pages its tokens fill.
The same requests (a chat-like mix: lognormal prompt and output lengths, each sequence
within max_seq_len) go through the orchestrator on each engine, all submitted at once.
Concurrency is the batch of each generate step (StepDone), averaged over the steps taken
while requests were still waiting for room (the budget is the limit there), with the
largest batch seen and the wall time of the whole run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request, StepDone


@dataclasses.dataclass(frozen=True, kw_only=True)
class CapacityConfig:
    model: str = "random:tiny"
    kv_tokens: int = 8192
    max_seq_len: int = 1024
    page_size: int = 16
    paged_slots: int = 40
    requests: int = 120
    prompt_median: int = 160
    output_median: int = 96
    seed: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and f.name != "seed" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")
        if self.kv_tokens < self.max_seq_len:
            raise ValueError(f"kv_tokens ({self.kv_tokens}) must hold one sequence of "
                             f"max_seq_len ({self.max_seq_len})")


def length_mix(cfg: CapacityConfig) -> list[tuple[int, int]]:
    """(prompt length, output tokens) per request: lognormal around the medians."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for _ in range(cfg.requests):
        p = int(np.clip(rng.lognormal(np.log(cfg.prompt_median), 0.8), 4, cfg.max_seq_len // 2))
        n = int(np.clip(rng.lognormal(np.log(cfg.output_median), 0.8), 1, cfg.max_seq_len - p))
        out.append((p, n))
    return out


def _run_layout(cfg: CapacityConfig, engine_config: EngineConfig,
                mix: list[tuple[int, int]]) -> dict:
    engine = build_engine(cfg.model, engine_config=engine_config, seed=cfg.seed)
    orch = Orchestrator.from_engines(engine, config=OrchestratorConfig(
        max_queued_requests=len(mix) + 8))
    batches: list[tuple[int, bool]] = []

    def on_event(e) -> None:
        if isinstance(e, StepDone):
            s = orch.stats()
            waiting = (s["admission_queue"] + s["resume_queue"]
                       + sum(g["backlog"] for g in s["generate"])) > 0
            batches.append((e.batch_size, waiting))

    rng = np.random.default_rng(cfg.seed + 1)
    with orch:
        orch.warmup([16])
        orch.add_listener(on_event)
        t0 = time.perf_counter()
        handles = [orch.submit(Request(prompt_ids=tuple(rng.integers(1, 256, p).tolist()),
                                       max_tokens=n, ignore_eos=True)) for p, n in mix]
        done = [h.result() for h in handles]
        wall = time.perf_counter() - t0
        stats = orch.stats()["generate"][0]
    bad = [c.error for c in done if c.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not finish: {bad[:3]}")
    saturated = [b for b, waiting in batches if waiting] or [b for b, _ in batches]
    return {"slots": engine.max_concurrent_decodes, "steps": len(batches),
            "mean_concurrency": round(statistics.fmean(saturated), 2),
            "max_concurrency": max(b for b, _ in batches), "wall_s": round(wall, 2),
            "tokens": sum(len(c.token_ids) for c in done),
            "preemptions": stats.get("preemptions", 0)}


def run(cfg: CapacityConfig, log: Callable[..., None] = print) -> dict:
    mix = length_mix(cfg)
    shapes = dict(max_prefill_length=cfg.max_seq_len // 2, max_seq_len=cfg.max_seq_len,
                  top_logprobs=0)
    contiguous_slots = cfg.kv_tokens // cfg.max_seq_len
    log(f"{len(mix)} requests, prompt median {int(np.median([p for p, _ in mix]))}, output "
        f"median {int(np.median([n for _, n in mix]))}, sequence mean "
        f"{statistics.fmean(p + n for p, n in mix):.0f} tokens; KV budget {cfg.kv_tokens} "
        f"tokens")
    rows = {}
    for name, ec in (
        ("contiguous", EngineConfig(max_concurrent_decodes=contiguous_slots, **shapes)),
        ("paged", EngineConfig(max_concurrent_decodes=cfg.paged_slots, kv_layout="paged",
                               page_size=cfg.page_size,
                               num_pages=cfg.kv_tokens // cfg.page_size, **shapes)),
    ):
        log(f"running {name} ...")
        rows[name] = _run_layout(cfg, ec, mix)
    ratio = rows["paged"]["mean_concurrency"] / rows["contiguous"]["mean_concurrency"]
    return {"config": dataclasses.asdict(cfg), "rows": rows, "concurrency_ratio": round(ratio, 2)}
