"""Mixture-of-experts cost on a Mixtral-shaped random model: E experts top-k against
2 experts top-k at prefill, and the dense against the routed form of one MoE layer at
decode sizes (the threshold in engines.model.MoeMlp).

    python scripts/moe_prefill_ab.py                        # all three parts
    python scripts/moe_prefill_ab.py --parts prefill --runs 7
    PYTHONPATH=/tmp/base python scripts/moe_prefill_ab.py --parts prefill   # another checkout

prefill: two engines on one device, the same shapes (D 512, F 2048, 2 layers, 8 heads of
64 over 2 kv heads, vocab 32000) but for the number of experts, prefill a `--tokens`
prompt in turns `--runs` times; prints each side's best ms and their ratio. With k of
2 experts every token runs every expert, so the 2-expert model is the floor an 8-expert
model with routed experts should approach (same active FLOPs).

decode: one MoE layer of the 8-expert model, jitted dense (every expert on every token)
and routed, on B tokens for each `--batches`; best of `--repeats`; prints both and
dense / routed (above 1: routed is faster).

blocks: the routed layer's grouped FFN (engines.moe.blocked_ffn) on the prefill's rows
with each block size of `--block-rows`, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, L, N, K, H, V = 512, 2048, 2, 8, 2, 64, 32000


def _config(experts: int, k: int):
    from engines import ModelConfig

    return ModelConfig(family="mixtral", vocab_size=V, hidden_size=D, intermediate_size=F,
                       num_layers=L, num_heads=N, num_kv_heads=K, head_dim=H,
                       num_experts=experts, num_experts_per_tok=k)


def _best_ms(fns: dict, repeats: int) -> dict:
    """Each of fns (already compiled) called in turns `repeats` times, so load on the
    machine hits all alike -> the best wall ms of each."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def prefill(args) -> None:
    from engines import EngineConfig, create_engine

    T = args.tokens
    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=T, max_seq_len=2 * T)
    prompt = np.random.default_rng(0).integers(3, V, size=T).astype(np.int32)
    sides = {}
    for e in (args.experts, 2):
        eng = create_engine(_config(e, args.top_k), devices=jax.devices()[:1], config=cfg)
        params = eng.load_params()
        run = functools.partial(lambda eng, params: eng.prefill(params, prompt, T)[0].token,
                                eng, params)
        jax.block_until_ready(run())  # compile
        sides[e] = run
    best = _best_ms(sides, args.runs)
    for e in sides:
        print(f"prefill {T} tokens, {e} experts top-{args.top_k}: best {best[e]:.1f} ms "
              f"of {args.runs}")
    print(f"ratio {args.experts} experts / 2 experts: {best[args.experts] / best[2]:.2f}")


def _layer(experts: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return jnp.asarray(0.05 * rng.standard_normal(shape), jnp.float32)

    x = draw(1, tokens, D) * 20
    return x, draw(D, experts), draw(experts, D, F), draw(experts, D, F), draw(experts, F, D)


def decode(args) -> None:
    from engines import moe

    def glu(gate, up):
        return jax.nn.silu(gate) * up

    for b in args.batches:
        x, *w = _layer(args.experts, b)
        fns = {}
        for routed in (False, True):
            fn = jax.jit(functools.partial(moe.moe, k=args.top_k, glu=glu, routed=routed))
            jax.block_until_ready(fn(x, *w))
            fns[routed] = functools.partial(fn, x, *w)
        ms = _best_ms(fns, args.repeats)
        print(f"decode {b:3d} tokens, {args.experts} experts top-{args.top_k}: dense "
              f"{ms[False]:.3f} ms, routed {ms[True]:.3f} ms, dense / routed "
              f"{ms[False] / ms[True]:.2f}")


def blocks(args) -> None:
    from engines import moe

    x, router, w1, w3, w2 = _layer(args.experts, args.tokens)
    x = x[0]
    _, experts = moe.route(x, router, args.top_k)
    key = experts.reshape(-1)
    xs = x[jnp.argsort(key, stable=True) // args.top_k]
    sizes = jnp.bincount(key, length=args.experts).astype(jnp.int32)
    fns = {}
    for b in args.block_rows:
        fn = jax.jit(functools.partial(moe.blocked_ffn, glu=lambda g, u: jax.nn.silu(g) * u,
                                       block=b))
        jax.block_until_ready(fn(xs, sizes, w1, w3, w2))
        fns[b] = functools.partial(fn, xs, sizes, w1, w3, w2)
    for b, ms in _best_ms(fns, args.repeats).items():
        print(f"grouped ffn, {xs.shape[0]} rows over {args.experts} experts, blocks of "
              f"{b:3d} rows: best {ms:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument("--parts", default="prefill,decode,blocks")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5, help="prefill runs per side")
    ap.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--block-rows", type=ints, default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=20, help="decode / blocks: timed calls")
    args = ap.parse_args()
    parts = {"prefill": prefill, "decode": decode, "blocks": blocks}
    for p in args.parts.split(","):
        if p not in parts:
            raise SystemExit(f"--parts: unknown part {p!r}; expected some of {list(parts)}")
        parts[p](args)


if __name__ == "__main__":
    main()
