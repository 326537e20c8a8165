"""`jetserve bench speculative`: decode speed with speculative decoding against without.

Two engines on the same weights, one plain and one with `speculative` (n-gram drafts or
a draft model, engines/speculative.py), decode the same prompts greedily, one prompt per slot, and run
alternately (plain, speculative, plain, ...) so a change in machine load hits both.
Timed: the generate steps only (prefill and insert are the same on both sides), until
every slot has `new_tokens` tokens; tokens past that are not counted. The outputs are
compared token for token (greedy: they must be equal).

Workloads:
  python   windows of Python source from the standard library (code completion: the
           text repeats identifiers and lines, the case prompt lookup is made for);
  random   random token ids (nothing to look up: drafts are mostly rejected, and the
           wider verify step is pure cost).

Reported per workload: tokens/s of each side (best of `repeats`), speedup, acceptance
rate (accepted / proposed drafts) and tokens per verify step.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from engines import EngineConfig
from engines.engine_config import parse_speculative
from jetserve.model_loading import build_engine

WORKLOADS = ("python", "random")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeBenchConfig:
    model: str | None = None  # default: the bundled model
    speculative: str = "ngram:4"
    workloads: tuple[str, ...] = WORKLOADS
    batch: int = 4  # prompts decoded together, one per slot
    prompt_len: int = 192
    new_tokens: int = 96
    repeats: int = 3
    source_dir: str = os.path.dirname(os.__file__)  # the standard library's Python files
    seed: int = 0

    def __post_init__(self):
        if not parse_speculative(self.speculative).enabled:
            raise ValueError("speculative must name a drafter, e.g. 'ngram:4'")
        for w in self.workloads:
            if w not in WORKLOADS:
                raise ValueError(f"workload {w!r} is unknown; expected some of {WORKLOADS}")
        for name in ("batch", "prompt_len", "new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def python_prompts(tokenizer, n: int, length: int, source_dir: str, seed: int) -> list[list[int]]:
    """n windows of `length` tokens from Python files under source_dir (fixed choice)."""
    files = sorted(glob.glob(os.path.join(source_dir, "*.py")))
    if not files:
        raise ValueError(f"no Python files in {source_dir}")
    rng = np.random.default_rng(seed)
    out = []
    for path in rng.permutation(files):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer.encode(f.read(), add_bos=False)
        if len(ids) < 2 * length:
            continue
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start:start + length])
        if len(out) == n:
            return out
    raise ValueError(f"fewer than {n} Python files of {2 * length}+ tokens in {source_dir}")


def _decode(engine, params, prompts: list[list[int]], new_tokens: int):
    """Prefills every prompt into its slot, then times generate steps until each slot has
    new_tokens tokens. Returns (seconds, tokens per slot, steps, drafted, accepted)."""
    state = engine.init_decode_state()
    out = [[] for _ in prompts]
    for slot, p in enumerate(prompts):
        prefix, first = engine.prefill(params, p, len(p))
        out[slot].append(first.to_host().token(0))
        state = engine.insert(prefix, state, slot)
    jax.block_until_ready(state)
    steps = drafted = accepted = 0
    t0 = time.perf_counter()
    while min(len(o) for o in out) < new_tokens:
        state, res = engine.generate(params, state)
        h = res.to_host()
        steps += 1
        for slot in range(len(prompts)):
            if len(out[slot]) < new_tokens:
                d, a = h.drafts(slot)
                drafted, accepted = drafted + d, accepted + a
                out[slot] += h.tokens(slot)
    seconds = time.perf_counter() - t0
    return seconds, [o[:new_tokens] for o in out], steps, drafted, accepted


def run(cfg: SpeculativeBenchConfig, log: Callable[..., None] = print) -> dict:
    max_seq = cfg.prompt_len + cfg.new_tokens + 2 * parse_speculative(cfg.speculative).k + 1

    def engine(speculative):
        return build_engine(cfg.model, devices=jax.devices()[:1], engine_config=EngineConfig(
            max_concurrent_decodes=cfg.batch, max_prefill_length=cfg.prompt_len,
            max_seq_len=max_seq, speculative=speculative))

    plain, spec = engine("none"), engine(cfg.speculative)
    params = plain.load_params()
    spec_params = spec.load_params()  # the same weights (and a draft model's, if any)
    rng = np.random.default_rng(cfg.seed)
    rows = []
    for workload in cfg.workloads:
        if workload == "python":
            if plain.tokenizer is None:
                raise ValueError("the python workload needs a model with a tokenizer")
            prompts = python_prompts(plain.tokenizer, cfg.batch, cfg.prompt_len,
                                     cfg.source_dir, cfg.seed)
        else:
            prompts = rng.integers(0, plain.vocab_size, (cfg.batch, cfg.prompt_len)).tolist()
        for eng, p in ((plain, params), (spec, spec_params)):  # compile outside the timing
            _decode(eng, p, prompts, min(4, cfg.new_tokens))
        best = {"plain": float("inf"), "spec": float("inf")}
        for _ in range(cfg.repeats):
            t_plain, ref, plain_steps, _, _ = _decode(plain, params, prompts, cfg.new_tokens)
            t_spec, got, spec_steps, drafted, accepted = _decode(spec, spec_params, prompts,
                                                                 cfg.new_tokens)
            best["plain"] = min(best["plain"], t_plain)
            best["spec"] = min(best["spec"], t_spec)
        tokens = cfg.batch * (cfg.new_tokens - 1)  # the first came from prefill
        row = {
            "workload": workload, "speculative": cfg.speculative, "batch": cfg.batch,
            "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens,
            "plain_tok_s": round(tokens / best["plain"], 1),
            "spec_tok_s": round(tokens / best["spec"], 1),
            "speedup": round(best["plain"] / best["spec"], 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_step": round(plain_steps / spec_steps, 2),
            "plain_steps": plain_steps, "spec_steps": spec_steps,
            "same_tokens": float(np.mean([a == b for a, b in zip(ref, got, strict=True)])),
        }
        rows.append(row)
        log(f"{workload}: {row}")
    return {"model": cfg.model or "bundled", "rows": rows, "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "python": sys.version.split()[0]}
