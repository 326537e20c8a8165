"""`jetserve bench batch`: a `jetserve batch` job against transformers batched generate.

Same HF-format weights, same prompts (random ids, lengths drawn between `min_len` and
`max_len`), greedy, EOS ignored, `new_tokens` each. Three sides, one after another in
this process, each timed from its first prompt to its last token:

- batch: the job as `jetserve batch` runs it (jetserve.batch.orchestrated.run: input
  JSONL read, ordered by length, the orchestrator at full occupancy, every result
  appended and fsync'd to an output file).
- engine loop: the same engine's bare prefill / insert / generate loop
  (jetserve.offline.generate_many) on the same prompts: no threads, no file.
- transformers: `model.generate` on PyTorch CPU float32, `hf_batch` prompts at a time,
  left-padded with an attention mask; prompts sorted by length first, so padding costs it
  as little as the batch job's ordering costs jetserve.

tokens/s counts generated tokens (prompts x new_tokens) over each side's wall time,
prompt processing included; each side's best of `repeats` runs counts, the sides taking
turns. Compilation is done before timing (warm-up requests over every prompt bucket);
transformers gets one warm-up batch.

Threads: the orchestrator's own during the batch side; torch's intra-op pool during the
transformers side; the sides never overlap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

from engines import EngineConfig
from jetserve.bench.compare_hf import model_dir
from jetserve.model_loading import build_engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchBenchConfig:
    model: str | None = None  # HF directory; None: a random llama of `preset` in a temp dir
    preset: str = "small"
    prompts: int = 1000
    min_len: int = 8
    max_len: int = 64
    new_tokens: int = 32
    slots: int = 32  # jetserve's max_concurrent_decodes
    hf_batch: int = 32
    torch_threads: int | None = None  # None: every CPU core
    repeats: int = 2  # each side's best wall time counts
    seed: int = 0

    def __post_init__(self):
        for name in ("prompts", "min_len", "new_tokens", "slots", "hf_batch", "torch_threads",
                     "repeats"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.max_len < self.min_len:
            raise ValueError(f"max_len {self.max_len} is below min_len {self.min_len}")

    @property
    def max_seq_len(self) -> int:
        return -(-(self.max_len + self.new_tokens) // 128) * 128


def make_prompts(cfg: BatchBenchConfig, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(cfg.seed)
    lengths = rng.integers(cfg.min_len, cfg.max_len + 1, size=cfg.prompts)
    # Ids from 3 up: clear of the usual pad / BOS / EOS ids.
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in lengths]


def _buckets(engine, prompts: Sequence[Sequence[int]]) -> list[int]:
    return sorted({engine.bucket_for(len(p)) for p in prompts})


def run_batch_side(engine, params, prompts, cfg: BatchBenchConfig, workdir: str):
    """(seconds, token ids per prompt) of a `jetserve batch` job over the prompts."""
    from jetserve.batch import orchestrated
    from jetserve.batch.journal import read_rows
    from jetserve.batch.runner import BatchConfig
    from jetserve.orchestrator import Orchestrator

    os.makedirs(workdir, exist_ok=True)
    inp = os.path.join(workdir, "in.jsonl")
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt_ids": p, "max_tokens": cfg.new_tokens,
                                "ignore_eos": True}) + "\n")
    out = os.path.join(workdir, "out.jsonl")
    job = BatchConfig(input=inp, output=out, progress=False)
    orch = Orchestrator.from_engines(engine, params=params,
                                     config=orchestrated.config(engine))
    summary = orchestrated.run(job, orch, warmup_lengths=tuple(_buckets(engine, prompts)))
    rows = {r["id"]: r for r in read_rows(out)}
    if summary.failed or len(rows) != len(prompts):
        raise RuntimeError(f"the batch job failed: {summary.line()}")
    return summary.wall_s, [rows[i]["token_ids"] for i in range(len(prompts))]


def run_engine_loop(engine, params, prompts, cfg: BatchBenchConfig):
    from jetserve.offline import generate_many

    t0 = time.perf_counter()
    res = generate_many(engine, params, prompts, max_tokens=cfg.new_tokens, ignore_eos=True)
    return time.perf_counter() - t0, [r.token_ids for r in res]


class HfBatched:
    """transformers generate on left-padded batches, greedy, never stopping at EOS."""

    def __init__(self, path: str):
        import torch
        import transformers as tf

        self.torch = torch
        self.model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                      do_sample=False, num_beams=1)
        return out[:, width:].tolist()

    def run(self, prompts, cfg: BatchBenchConfig):
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        self.generate([prompts[i] for i in order[: cfg.hf_batch]], 2)  # warm-up
        out: list[list[int] | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        for s in range(0, len(order), cfg.hf_batch):
            chunk = order[s:s + cfg.hf_batch]
            for i, toks in zip(chunk, self.generate([prompts[i] for i in chunk],
                                                    cfg.new_tokens), strict=True):
                out[i] = toks
        return time.perf_counter() - t0, out


def run(cfg: BatchBenchConfig, devices: Sequence[jax.Device] | None = None, log=print) -> dict:
    import torch

    devices = list(devices or jax.devices()[:1])
    torch.set_num_threads(cfg.torch_threads or os.cpu_count() or 1)
    with model_dir(cfg.model, cfg.seed, preset=cfg.preset) as path, \
            tempfile.TemporaryDirectory(prefix="jetserve-bench-batch-") as work:
        engine = build_engine(path, devices=devices, engine_config=EngineConfig(
            max_concurrent_decodes=cfg.slots, max_prefill_length=cfg.max_len,
            max_seq_len=cfg.max_seq_len, dtype="float32"))
        params = engine.load_params()
        prompts = make_prompts(cfg, engine.vocab_size)
        n_out = len(prompts) * cfg.new_tokens
        log(f"{len(prompts)} prompts of {cfg.min_len}..{cfg.max_len} tokens, "
            f"{cfg.new_tokens} new tokens each, {cfg.slots} slots")
        hf = HfBatched(path)
        run_engine_loop(engine, params, [[3] * b for b in _buckets(engine, prompts)], cfg)
        sides = {
            "batch job": lambda r: run_batch_side(engine, params, prompts, cfg,
                                                  os.path.join(work, str(r))),
            "engine loop": lambda r: run_engine_loop(engine, params, prompts, cfg),
            "transformers": lambda r: hf.run(prompts, cfg),
        }
        best = {k: float("inf") for k in sides}
        tokens = {}
        for r in range(cfg.repeats):  # the sides alternate, so machine noise reaches all
            for k, f in sides.items():
                t, tokens[k] = f(r)
                best[k] = min(best[k], t)
                log(f"run {r + 1} {k}: {t:.2f} s, {n_out / t:.1f} tokens/s")
    t_batch, t_loop, t_hf = best.values()
    same = {k: round(float(np.mean([a == b for a, b in zip(
        tokens["batch job"], tokens[k], strict=True)])), 3)
        for k in ("transformers", "engine loop")}
    return {
        "prompts": len(prompts), "min_len": cfg.min_len, "max_len": cfg.max_len,
        "new_tokens": cfg.new_tokens, "slots": cfg.slots, "hf_batch": cfg.hf_batch,
        "torch_threads": torch.get_num_threads(), "repeats": cfg.repeats,
        "batch_tok_s": round(n_out / t_batch, 1),
        "engine_loop_tok_s": round(n_out / t_loop, 1),
        "hf_tok_s": round(n_out / t_hf, 1),
        "batch_over_hf": round(t_hf / t_batch, 3),
        "batch_over_engine_loop": round(t_loop / t_batch, 3),
        # Greedy tokens equal to transformers', prompt by prompt (float noise can flip a
        # near-tie on random weights).
        "same_as_hf": same["transformers"], "same_as_engine_loop": same["engine loop"],
    }
