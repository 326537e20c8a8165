"""KV bytes of sliding-window layers on the paged layout: a ring of pages per sequence
against every position.

A Gemma 3 shaped model (random weights: `layers` layers, five sliding ones of `window`
keys to one global, as Gemma 3 lays them out; small widths, since the KV bytes per token
scale the same for every layer) serves one long prompt on the paged layout, by default
with `--scheduling mixed` (its chunks are written straight into the pages); with
`--scheduling turns` the prompt is prefilled into a whole-prompt prefix first (every
layer, every position), which lives until it is inserted into the pages. Figures:

  - kv_store_bytes: the decode state's page pools as allocated on the device (the nbytes
    of every pool array): the global layers' shared pool and the sliding layers' rings;
  - all_global_bytes: those pools with every layer in the shared pool, what the same
    engine allocates without the ring (each layer num_pages + 1 pages, as the global
    layers' pool measured here);
  - peak_live_bytes: the most bytes of live jax arrays beside the parameters seen while
    the prompt was served (polled every 10 ms): the pools, and with turns the prefix
    (temporaries inside a compiled step are not jax arrays and are not counted);
  - plan_bytes: `jetserve plan --kv-layout paged`'s KV bytes of one sequence of
    max_seq_len tokens at the same page size and chunk (jetserve/plan.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import numpy as np

from engines.config import FULL, SLIDING, ModelConfig
from jetserve.plan import ModelSpec, held_context, held_ring_tokens

GLOBAL_EVERY = 6  # Gemma 3: five sliding layers to one global


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowKVConfig:
    layers: int = 12
    window: int = 512
    prompt_len: int = 16384
    max_tokens: int = 16
    page_size: int = 16
    chunk: int = 512
    scheduling: str = "mixed"

    def __post_init__(self):
        if self.scheduling not in ("mixed", "turns"):
            raise ValueError(f"scheduling must be 'mixed' or 'turns', got {self.scheduling!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "scheduling" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")
        if self.layers < GLOBAL_EVERY:
            raise ValueError(f"layers must be >= {GLOBAL_EVERY} (one global layer in six), "
                             f"got {self.layers}")

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.max_tokens


def model_config(cfg: WindowKVConfig) -> ModelConfig:
    """The Gemma 3 shaped model: Gemma 3's mechanisms and layer pattern, small widths."""
    return ModelConfig(
        family="gemma3_text", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=cfg.layers, num_heads=4, num_kv_heads=2, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=cfg.window,
        layer_types=tuple(SLIDING if (i + 1) % GLOBAL_EVERY else FULL
                          for i in range(cfg.layers)),
        qk_norm="head", norm_layout="sandwich", tie_word_embeddings=True,
        activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True,
        rope_theta=1e6, local_rope_theta=1e4, max_position_embeddings=cfg.max_seq_len)


class _LivePeak:
    """The most bytes of live device arrays (those in `skip` aside) seen by a poller."""

    def __init__(self, skip_bytes: int):
        self.skip, self.peak = skip_bytes, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        import jax

        while not self._stop.is_set():
            live = sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
            self.peak = max(self.peak, live - self.skip)
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(cfg: WindowKVConfig, log=print) -> dict:
    import jax

    from engines import EngineConfig, create_engine
    from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
    from jetserve.orchestrator.mixed import MixedOrchestrator
    from jetserve.scheduling.page_planner import with_pages

    mc = model_config(cfg)
    engine = with_pages(create_engine(mc, devices=jax.devices()[:1], config=EngineConfig(
        max_concurrent_decodes=1, max_prefill_length=cfg.chunk, max_seq_len=cfg.max_seq_len,
        kv_layout="paged", page_size=cfg.page_size, dtype="float32")))
    if engine.ring is None:
        raise ValueError(f"no ring: window {cfg.window} + chunk {cfg.chunk} hold as many "
                         f"pages as a whole sequence of {cfg.max_seq_len}")
    params = engine.load_params()
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    prompt = np.random.default_rng(0).integers(3, mc.vocab_size, cfg.prompt_len).tolist()
    config = OrchestratorConfig(scheduling=cfg.scheduling, prefill_chunk=cfg.chunk)
    orch = (MixedOrchestrator(engine, params, config) if cfg.scheduling == "mixed" else
            Orchestrator.from_engines(engine, params=params, config=config))
    log(f"serving one {cfg.prompt_len}-token prompt, {cfg.max_tokens} tokens out, in "
        f"chunks of {cfg.chunk}, scheduling {cfg.scheduling} ...")
    t0 = time.perf_counter()
    with orch, _LivePeak(param_bytes) as peak:
        out = orch.submit(Request(prompt_ids=prompt, max_tokens=cfg.max_tokens,
                                  ignore_eos=True)).result()
        state = orch._generate[0].state
        pools = [*state.k, *state.v]
        kv_store = sum(a.nbytes for a in pools)
        shared = [a for i, a in enumerate(state.k) if not engine.ring.holds(i)][0]
        all_global = 2 * mc.num_layers * shared.nbytes
    seconds = time.perf_counter() - t0
    spec = ModelSpec.from_config(mc)
    ring_tokens = held_ring_tokens(spec, cfg.page_size, cfg.chunk)
    plan_bytes = held_context(spec, cfg.max_seq_len, ring_tokens) * spec.kv_values_per_token * 4
    g = engine.page_geometry
    return {
        "config": dataclasses.asdict(cfg),
        "model": {"layers": mc.num_layers, "sliding_layers": g.ring_layers,
                  "window": cfg.window, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim},
        "tokens_out": len(out.token_ids),
        "seconds": seconds,
        "ring_pages_per_slot": g.ring_pages,
        "shared_pool_pages": g.num_pages,
        "kv_store_bytes": kv_store,
        "all_global_bytes": all_global,
        "kv_ratio": kv_store / all_global,
        "peak_live_bytes": peak.peak,
        "peak_ratio": peak.peak / all_global,
        "plan_bytes": plan_bytes,
        "plan_error": plan_bytes / kv_store - 1,
    }


def report(r: dict, log=print) -> None:
    mb = 1e6
    log(f"{r['model']['layers']} layers ({r['model']['sliding_layers']} sliding, window "
        f"{r['model']['window']}), one {r['config']['prompt_len']}-token prompt served in "
        f"{r['seconds']:.1f} s ({r['tokens_out']} tokens out, scheduling "
        f"{r['config']['scheduling']})")
    log(f"  ring: {r['ring_pages_per_slot']} pages of {r['config']['page_size']} per slot; "
        f"shared pool: {r['shared_pool_pages']} pages")
    log(f"  KV store on the device: {r['kv_store_bytes'] / mb:.2f} MB; all-global cache: "
        f"{r['all_global_bytes'] / mb:.2f} MB; ratio {r['kv_ratio']:.3f}")
    log(f"  peak live jax arrays beside the parameters: {r['peak_live_bytes'] / mb:.2f} MB "
        f"({r['peak_ratio']:.3f} of the all-global cache)")
    log(f"  jetserve plan --kv-layout paged: {r['plan_bytes'] / mb:.2f} MB "
        f"({100 * r['plan_error']:+.2f}% against the store)")


def main(argv: list[str] | None = None) -> int:
    """`jetserve bench window-kv`: its own flags."""
    p = argparse.ArgumentParser(prog="jetserve bench window-kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = WindowKVConfig()
    for name in ("layers", "window", "prompt_len", "max_tokens", "page_size", "chunk"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--scheduling", default=d.scheduling, choices=("mixed", "turns"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cfg = WindowKVConfig(layers=args.layers, window=args.window, prompt_len=args.prompt_len,
                         max_tokens=args.max_tokens, page_size=args.page_size, chunk=args.chunk,
                         scheduling=args.scheduling)
    out = run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
    else:
        report(out)
    return 0
