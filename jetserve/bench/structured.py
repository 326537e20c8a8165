"""`jetserve bench structured`: decode step time with every slot constrained by a JSON
schema, against none constrained, on the same engine and weights in one run.

Each batch size B gets an engine with B slots, all filled with the same prompt, and two
loops of `steps` steps, timed whole (wall time / steps), as the generate thread runs them
(jetserve/orchestrator/generate_worker.py, step_masks.py):

  free         dispatch step N (the program without a mask), then read step N - 1 back:
               the device always has the next step queued
  constrained  read step N - 1 back (waiting for it), advance every slot's llguidance
               matcher by its token, write the B masks, dispatch step N with them: the
               device idles while the host works (the sync cost)
  mixed        every other slot constrained, the rest free, as the generate thread runs
               such a batch: nobody waits; a constrained slot steps every other step and
               sits the ones between out (an all-zero mask row) while its token is read

    ratio = constrained step / free step     (target <= 1.15)

`--kv-layout paged` runs the same loops on the paged engine, through its page planner
(which keeps a slot that sat a step out at its length).

Also reported: the masked program alone (all tokens allowed, read one step late), which
separates the device's cost of applying a mask from the host's sync, and the host's mask
time per step. A matcher whose structure is complete starts over, so every step computes
real masks. The grammar needs a tokenizer: the model's own, or else the bundled model's
(4,096 tokens; ids past it are never allowed), which then understates the mask work of a
larger vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from engines import EngineConfig
from engines.token_mask import allow_all
from jetserve.bench.decode import fill_slots
from jetserve.model_loading import BUNDLED_DIR, build_engine
from jetserve.scheduling.page_planner import with_pages
from jetserve.structured import Constraint
from jetserve.structured.grammar import compile_constraint
from jetserve.tokenizer import load_tokenizer

# Nested, with strings, numbers, enums and arrays: the mask work of a realistic schema.
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "tags", "address", "active"],
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                   "kind": {"enum": ["home", "work"]}}},
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredBenchConfig:
    model: str | None = "random:llama-156m"
    batches: tuple[int, ...] = (8, 32)
    context: int = 64
    steps: int = 32
    warmup: int = 4
    repeats: int = 3  # loops per mode, alternating; the best counts (a shared machine)
    kv_layout: str = "contiguous"

    def __post_init__(self):
        if self.kv_layout not in ("contiguous", "paged"):
            raise ValueError(f"kv_layout must be 'contiguous' or 'paged', got {self.kv_layout!r}")
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive integers, got {self.batches!r}")
        for name in ("context", "steps", "warmup", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class _Loop:
    """One engine's decode loop in the three modes (see module doc)."""

    def __init__(self, engine, params, state, grammars):
        self.engine, self.params, self.state, self.grammars = engine, params, state, grammars
        self.B, self.V = engine.max_concurrent_decodes, engine.vocab_size
        self.mask_s = 0.0  # host mask time of the constrained loops
        self.mode = "free"

    def _masks(self, tokens: np.ndarray | None, slots=None, sit_out=False) -> np.ndarray:
        """The step's mask: each of `slots` (default all) advanced by its token (when
        given) and masked, or given an all-zero row (`sit_out`); other rows all ones."""
        t0 = time.perf_counter()
        mask = allow_all(self.B, self.V)
        for b in range(self.B) if slots is None else slots:
            g = self.grammars[b]
            if tokens is not None and (not g.advance(int(tokens[b])) or g.stopped):
                g.matcher.reset()  # complete: start the structure again
            if sit_out:
                mask[b] = 0
            else:
                g.fill(mask, b)
        if self.mode == "constrained":
            self.mask_s += time.perf_counter() - t0
        return mask

    def run(self, mode: str, steps: int) -> float:
        """Seconds per step over `steps` steps of `mode`."""
        pending, taken, self.mode = None, None, mode
        mask = allow_all(self.B, self.V) if mode == "masked" else None
        if mode == "constrained":
            mask = self._masks(None)
        half = range(0, self.B, 2)  # mixed: the constrained slots
        t0 = time.perf_counter()
        for i in range(steps):
            if mode == "constrained" and pending is not None:
                tokens = np.asarray(pending.data)[:, 3]  # engine_api COL_TOKENS
                mask = self._masks(tokens)
            elif mode == "mixed":  # step i - 2's tokens were read after step i - 1 went
                mask = self._masks(taken, half, sit_out=i % 2 == 1)
                taken = None
            kw = {} if mask is None else {"token_mask": mask}
            self.state, res = self.engine.generate(self.params, self.state, **kw)
            res.copy_to_host_async()
            if mode != "constrained" and pending is not None:
                data = np.asarray(pending.data)  # read one step late: the next is queued
                if mode == "mixed" and i % 2 == 1:  # step i - 1 gave the half tokens
                    taken = data[:, 3]
            pending = res
        np.asarray(pending.data)
        return (time.perf_counter() - t0) / steps


def _bench_batch(cfg: StructuredBenchConfig, b: int, params, tokenizer, log):
    seq = cfg.context + (cfg.warmup + cfg.steps) * (1 + 4 * cfg.repeats) + 8
    engine = with_pages(build_engine(
        cfg.model, devices=jax.devices()[:1], engine_config=EngineConfig(
            max_concurrent_decodes=b, max_seq_len=-(-seq // 128) * 128,
            max_prefill_length=min(512, cfg.context), kv_layout=cfg.kv_layout)))
    params = params if params is not None else engine.load_params()
    state = fill_slots(engine, params, cfg.context)
    grammars = [compile_constraint(Constraint(kind="json_schema", value=SCHEMA), tokenizer,
                                   engine.vocab_size) for _ in range(b)]
    loop = _Loop(engine, params, state, grammars)
    best = {m: float("inf") for m in ("free", "masked", "constrained", "mixed")}
    for m in best:  # compile both programs, warm the loops
        loop.run(m, cfg.warmup)
    loop.mask_s = 0.0
    modes = list(best)
    for r in range(cfg.repeats):  # the order turns each repeat: drifting load hits all
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            best[m] = min(best[m], loop.run(m, cfg.steps))
    mask_ms = loop.mask_s / (cfg.repeats * cfg.steps) * 1e3
    row = {"batch": b, "free_step_ms": _r(best["free"] * 1e3),
           "masked_step_ms": _r(best["masked"] * 1e3),
           "constrained_step_ms": _r(best["constrained"] * 1e3),
           "mixed_step_ms": _r(best["mixed"] * 1e3),
           "host_mask_ms_per_step": _r(mask_ms),
           "ratio_constrained_to_free": _r(best["constrained"] / best["free"]),
           "ratio_masked_to_free": _r(best["masked"] / best["free"]),
           "ratio_mixed_to_free": _r(best["mixed"] / best["free"]),
           "traces": engine.trace_counts()}
    log(f"batch {b}: free {row['free_step_ms']} ms, masked program {row['masked_step_ms']} "
        f"ms, constrained {row['constrained_step_ms']} ms (host masks {row['host_mask_ms_per_step']}"
        f" ms) -> {row['ratio_constrained_to_free']}x; half constrained "
        f"{row['mixed_step_ms']} ms -> {row['ratio_mixed_to_free']}x")
    return row, params


def run(cfg: StructuredBenchConfig, log=print) -> dict:
    load0 = os.getloadavg()[0]
    probe = build_engine(cfg.model, devices=jax.devices()[:1],
                         engine_config=EngineConfig(max_concurrent_decodes=1, max_seq_len=128,
                                                    max_prefill_length=64))
    tokenizer = probe.tokenizer or load_tokenizer(BUNDLED_DIR)
    source = "the model's" if probe.tokenizer is not None else "the bundled model's (4,096)"
    log(f"grammar over {source} tokenizer; vocabulary {probe.vocab_size}")
    rows, params = [], None
    for b in cfg.batches:
        row, params = _bench_batch(cfg, b, params, tokenizer, log)
        rows.append(row)
    return {"model": cfg.model, "kv_layout": cfg.kv_layout, "tokenizer": source, "schema": SCHEMA, "steps": cfg.steps,
            "repeats": cfg.repeats, "cpus": os.cpu_count(),
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "rows": rows}


def _r(x: float) -> float:
    return float(f"{x:.4g}")
