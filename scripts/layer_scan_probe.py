"""What one layer body under `nn.scan` would compile to, before the engine does it (#21).

    python scripts/layer_scan_probe.py --layers 4,32 [--model small]

Compiles the decoder forward of `random:MODEL` with L layers three ways, using the
engine's own Block (engines/model.py) and KV stores (engines/kv_cache.py):

  loop        engines.model.Decoder as it is: a Python loop, one copy of the layer per layer
  scan-xs     the layers under nn.scan, each layer's cache a scanned input and its updated
              cache a scanned output (stacked [L, ...])
  scan-carry  the layers under nn.scan, the stacked cache [L, ...] carried through the loop
              and written in place at (layer, slot, position)

for the prefill of one 16-token prompt (loop and scan only: a prefill has no cache to
carry) and for one generate step of 4 slots over a 256-entry cache. Prints the seconds
to lower and to compile, the instruction count of the optimized HLO, and XLA's memory
analysis of the step (temporaries beyond the donated, aliased cache: a scanned output
that holds a second copy of the cache shows here). Parameters are random; no engine, no
mesh, no persistent compile cache. A probe of the design, not the engine's numbers:
scripts/layer_compile_bench.py measures the engine.

    python scripts/layer_scan_probe.py --step-time --model llama-156m --layers 8

times the compiled generate step instead, loop against scan-carry, taking turns (10
rounds of 10 steps), with the memory analysis of each at that model's width.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from engines import model as M
from engines.kv_cache import DecodeKV, DecodeState, PrefillKV
from jetserve.model_loading import RANDOM_MODELS
from sharding import axes

B, S, T = 4, 256, 16  # decode slots, cache length, prompt length


class _StackedDecodeKV(DecodeKV):
    """DecodeKV over one layer `i` (traced) of stacked caches kc [L, B, K, H, S] and
    vc [L, B, K, S, H]: writes the new entries into the stack, attends over layer i."""

    def __init__(self, state: DecodeState, kc, vc, i):
        super().__init__(dataclasses.replace(state, k=(kc[0],), v=(vc[0],)), state.lengths)
        self.kc, self.vc, self.i = kc, vc, i

    def update(self, layer, k, v):
        rows = jnp.arange(k.shape[0])
        self.kc = self.kc.at[self.i, rows, :, :, self.pos].set(k[:, 0])
        self.vc = self.vc.at[self.i, rows, :, self.pos].set(v[:, 0])
        self.k, self.v = [self.kc[self.i]], [self.vc[self.i]]
        return None, None, self.k_pos  # the step attends through `attend`


class _Body(nn.Module):
    """One layer under the scan. carry: x (and the stacked caches in scan-carry); xs: this
    layer's caches (scan-xs), its index (scan-carry) or nothing (prefill)."""

    cfg: object
    how: str  # "prefill", "scan-xs" or "scan-carry"

    @nn.compact
    def __call__(self, carry, xs, positions, inv_freq, state):
        x = carry[0] if self.how == "scan-carry" else carry
        if self.how == "prefill":
            kv = PrefillKV(positions, None)
        elif self.how == "scan-xs":
            kv = DecodeKV(dataclasses.replace(state, k=(xs[0],), v=(xs[1],)), state.lengths)
        else:
            kv = _StackedDecodeKV(state, carry[1], carry[2], xs)
        x = M.Block(self.cfg, jnp.float32, 0, name="block")(x, positions, inv_freq, kv)
        if self.how == "scan-carry":
            return (x, kv.kc, kv.vc), None
        return x, (kv.k[0], kv.v[0])


class _ScanDecoder(nn.Module):
    cfg: object
    how: str

    @nn.compact
    def __call__(self, tokens, positions, caches, state):
        c = self.cfg
        embed = M._param(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                         (axes.VOCAB, axes.EMBED), jnp.float32)
        x = jnp.take(embed, tokens, axis=0)  # (B, T, D)
        inv_freq = M.rope_inputs(c)
        # Parameters gain a leading layer axis named by the logical axis `layers`.
        scan = nn.scan(_Body, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                       length=c.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        if self.how == "scan-carry":
            xs, carry = jnp.arange(c.num_layers), (x, *caches)
        else:
            xs, carry = caches, x
        carry, ys = scan(c, self.how, name="layers")(carry, xs, positions, inv_freq, state)
        x, caches = (carry[0], carry[1:]) if self.how == "scan-carry" else (carry, ys)
        return M.Backend().linear(x[:, -1:], embed), caches


def _compile_args(fn, *args, donate=()) -> dict:
    t0 = time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ops = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    mem = compiled.memory_analysis()
    return {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "hlo_ops": ops,
            "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
            "aliased_mib": round(mem.alias_size_in_bytes / 2**20, 1)}


def probe_prefill(cfg, how: str) -> dict:
    tokens, pos = jnp.ones((1, T), jnp.int32), jnp.arange(T)[None]
    if how == "loop":
        m = M.Decoder(cfg)
        params = m.init(jax.random.key(0), tokens, pos, PrefillKV(pos, None))
        return _compile_args(lambda p, t: m.apply(p, t, pos, PrefillKV(pos, None)), params,
                             tokens)
    m = _ScanDecoder(cfg, "prefill")
    params = m.init(jax.random.key(0), tokens, pos, None, None)
    return _compile_args(lambda p, t: m.apply(p, t, pos, None, None), params, tokens)


def probe_decode(cfg, how: str) -> dict:
    """Compiles one generate step; its figures (see _compile)."""
    return _compile(*_decode_step(cfg, how))


def _decode_step(cfg, how: str):
    """(step, params, caches, state?) of one generate step; positions are 100."""
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    state = DecodeState(k=(), v=(), k_scale=(), v_scale=(), lengths=jnp.full((B,), 100, jnp.int32),
                        tokens=jnp.zeros((B,), jnp.int32), sampling=None, prompt_mask=None,
                        counts=None, history=None)
    kc, vc = jnp.zeros((L, B, K, H, S)), jnp.zeros((L, B, K, S, H))
    tokens, pos = jnp.ones((B, 1), jnp.int32), jnp.full((B, 1), 100, jnp.int32)
    if how == "loop":
        m = M.Decoder(cfg)
        full = dataclasses.replace(state, k=tuple(kc), v=tuple(vc))
        params = m.init(jax.random.key(0), tokens, pos, DecodeKV(full, state.lengths))

        def step(p, st):
            kv = DecodeKV(st, st.lengths)
            return m.apply(p, tokens, pos, kv), dataclasses.replace(st, k=tuple(kv.k),
                                                                    v=tuple(kv.v))

        return step, params, full
    m = _ScanDecoder(cfg, how)
    params = m.init(jax.random.key(0), tokens, pos, (kc, vc), state)
    return (lambda p, caches: m.apply(p, tokens, pos, caches, state)), params, (kc, vc)


def _compile(fn, params, cache) -> dict:
    return _compile_args(fn, params, cache, donate=(1,))


def step_times(cfg, rounds: int = 10, steps: int = 10) -> None:
    """Median and best ms per generate step, loop and scan-carry taking turns."""
    runs = {}
    for how in ("loop", "scan-carry"):
        fn, params, cache = _decode_step(cfg, how)
        step = jax.jit(fn, donate_argnums=(1,))
        runs[how] = [step, params, step(params, cache)[1], []]
        fig = _compile(fn, params, cache)  # seconds not shown: jit has it compiled already
        print(f"{how:>10} L={cfg.num_layers}",
              {k: fig[k] for k in ("hlo_ops", "temp_mib", "aliased_mib")}, flush=True)
    for _ in range(rounds):
        for run in runs.values():
            step, params, cache, times = run
            t0 = time.perf_counter()
            for _ in range(steps):
                out, cache = step(params, cache)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / steps * 1e3)
            run[2] = cache
    for how, (*_, times) in runs.items():
        print(f"{how:>10} step median {statistics.median(times):.2f} ms, best {min(times):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,32", help="layer counts, comma-separated")
    ap.add_argument("--model", default="small", choices=sorted(RANDOM_MODELS))
    ap.add_argument("--step-time", action="store_true",
                    help="time the generate step (loop vs scan-carry) at the first --layers")
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    if args.step_time:
        n = int(args.layers.split(",")[0])
        step_times(dataclasses.replace(RANDOM_MODELS[args.model], num_layers=n))
        return
    for step, hows, probe in (("prefill", ("loop", "scan"), probe_prefill),
                              ("generate", ("loop", "scan-xs", "scan-carry"), probe_decode)):
        for how in hows:
            for n in (int(x) for x in args.layers.split(",")):
                cfg = dataclasses.replace(RANDOM_MODELS[args.model], num_layers=n)
                print(f"{step:>8} {how:>10} L={n:<3}", probe(cfg, how), flush=True)


if __name__ == "__main__":
    main()
