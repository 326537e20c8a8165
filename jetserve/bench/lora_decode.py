"""`jetserve bench decode --loras N --lora-rank R`: the generate step with LoRA adapters
against the base model's, same weights, same run.

For each batch size B three decode states run the same `context`-token prompt in every
slot: the base engine (no LoRA pool); the LoRA engine with slot b on adapter b mod N (every
slot on another adapter when B <= N, else N adapters spread evenly); and the LoRA engine
with no adapter in the batch. The adapters are random (rank R on all seven projections,
held on the host and written into the pool as a request would). The three are timed in
turns, a few steps each, so load from other processes falls on all of them alike; the
figures are medians and the ratios are against the base step:

    adapters_ratio = step(every slot on an adapter) / step(base)
    no_adapter_ratio = step(LoRA engine, base requests only) / step(base)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import jax
import numpy as np

from engines import EngineConfig
from engines.lora import LoraConfig
from engines.lora_loading import AdapterWeights, module_dims, target_modules
from jetserve.bench.decode import DecodeBenchConfig, fill_slots, time_steps
from jetserve.model_loading import build_engine

ROUNDS = 6  # turns per variant; each turn times cfg.steps // ROUNDS steps (at least 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraBenchConfig:
    decode: DecodeBenchConfig
    lora: LoraConfig  # max_loras adapters (all resident), each of rank max_rank


def random_adapter(cfg, rank: int, seed: int) -> AdapterWeights:
    """An adapter of every projection at `rank`, random A and B (scale 1)."""
    rng = np.random.default_rng(seed)
    L = cfg.num_layers
    a, b = {}, {}
    for m in target_modules(cfg):
        n_in, n_out = module_dims(cfg, m)
        a[m] = rng.normal(0, 0.02, (L, rank, n_in)).astype(np.float32)
        b[m] = rng.normal(0, 0.02, (L, n_out, rank)).astype(np.float32)
    return AdapterWeights(path=f"random-{seed}", rank=rank, scale=1.0, a=a, b=b)


def _fill_adapters(engine, params, context: int, names: list[str]):
    """A decode state with slot b holding the prompt through adapter names[b % N]."""
    prompt = np.random.RandomState(0).randint(3, engine.vocab_size, context).astype(np.int32)
    state = engine.init_decode_state()
    for slot in range(engine.max_concurrent_decodes):
        prefix, _ = engine.prefill(params, prompt, context, adapter=names[slot % len(names)])
        state = engine.insert(prefix, state, slot)
    return state


def run(cfg: LoraBenchConfig, devices: Sequence[jax.Device] | None = None, log=print) -> dict:
    d, loras, rank = cfg.decode, cfg.lora.max_loras, cfg.lora.max_rank
    devices = list(devices or jax.devices()[:1])
    if d.context > 512:
        raise ValueError(f"context {d.context}: the LoRA bench prefills whole prompts (<= 512)")
    rows, params = [], None
    for B in d.batches:
        ec = EngineConfig(max_concurrent_decodes=B, max_seq_len=d.seq_len,
                          max_prefill_length=d.context, dtype=d.dtype)
        base = build_engine(d.model, devices=devices, sharding=d.sharding, engine_config=ec)
        lora = build_engine(d.model, devices=devices, sharding=d.sharding,
                            engine_config=dataclasses.replace(ec, max_loras=loras,
                                                              max_lora_rank=rank))
        if params is None:
            params = base.load_params()
        names = [f"adapter{i}" for i in range(loras)]
        for i, name in enumerate(names):
            lora.adapters.add(name, random_adapter(lora.source_config, rank, i))
        states = {"base": (base, fill_slots(base, params, d.context)),
                  "adapters": (lora, _fill_adapters(lora, params, d.context, names)),
                  "no_adapter": (lora, fill_slots(lora, params, d.context))}
        times = {k: [] for k in states}
        per_turn = max(1, d.steps // ROUNDS)
        for turn in range(ROUNDS + 1):  # turn 0 warms up (compiles) and is dropped
            for k, (eng, st) in states.items():
                # One untimed step a turn: the engine's weights back in cache after the others.
                t, st = time_steps(eng, params, st, warmup=1 if turn else d.warmup,
                                   steps=per_turn)
                states[k] = (eng, st)
                if turn:
                    times[k].extend(t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"batch": B, "context": d.context, "loras": loras, "rank": rank,
               "distinct_adapters": min(B, loras),
               **{f"{k}_ms": round(v, 3) for k, v in med.items()},
               "adapters_ratio": round(med["adapters"] / med["base"], 3),
               "no_adapter_ratio": round(med["no_adapter"] / med["base"], 3)}
        rows.append(row)
        log(f"batch {B}: base {med['base']:.2f} ms, every slot on an adapter "
            f"{med['adapters']:.2f} ms ({row['adapters_ratio']}x), no adapter in the batch "
            f"{med['no_adapter']:.2f} ms ({row['no_adapter_ratio']}x)")
        del states, base, lora
    return {"model": d.model, "dtype": d.dtype, "loras": loras, "rank": rank,
            "rows": rows}
