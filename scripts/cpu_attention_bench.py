"""The CPU decode-attention kernel (engines/csrc/decode_attention.cc) alone, at the 156M
Llama's batch-32 decode shapes: 16 query heads over 4 kv heads of 64, 8 layers chained.

    python scripts/cpu_attention_bench.py
    python scripts/cpu_attention_bench.py --batch 32 --live 257 --cache 512 --rounds 3

Prints per round the best and median wall ms of the 8-layer chain with every slot at
`--live` entries of a `--cache`-entry cache (the keys and values of each layer its own
arrays, so they come from memory), and the live bytes over the best time; then the same
chain at 4 slots on one layer's arrays, which stay in the last-level cache, per slot, kv
head and layer.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from engines import cpu_kernels

N, K, H, L = 16, 4, 64, 8


def _chain(q, ks, vs, pos):
    out = q
    for k, v in zip(ks, vs, strict=True):  # each layer waits for the one before
        out = cpu_kernels.decode_attention(out, k, v, pos, None)
    return out


def _times(fn, args, reps: int) -> list[float]:
    fn(*args).block_until_ready()  # compile
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--live", type=int, default=257, help="live entries per slot")
    ap.add_argument("--cache", type=int, default=512, help="cache entries per slot (S)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not 1 <= a.live <= a.cache:
        raise SystemExit(f"--live must be in [1, --cache], got {a.live} and {a.cache}")
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available here (x86-64 AVX2 + FMA, a C++ "
                         "compiler, JETSERVE_CPU_KERNELS not 0)")
    B, S = a.batch, a.cache
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H), np.float32))
    ks = [jnp.asarray(rng.standard_normal((B, K, H, S), np.float32)) for _ in range(L)]
    vs = [jnp.asarray(rng.standard_normal((B, K, S, H), np.float32)) for _ in range(L)]
    pos = jnp.full((B,), a.live - 1, jnp.int32)  # entries 0 .. live - 1
    chain = jax.jit(_chain)
    live_bytes = L * 2 * B * K * H * a.live * 4
    for r in range(a.rounds):
        t = _times(chain, (q, ks, vs, pos), a.reps)
        print(f"round {r}: {L} layers, batch {B}: best {min(t) * 1e3:.2f} ms, median "
              f"{np.median(t) * 1e3:.2f} ms; {live_bytes / 1e6:.0f} MB live, "
              f"{live_bytes / min(t) / 1e9:.1f} GB/s")
    small = 4
    hot = jax.jit(lambda q, k, v, p: _chain(q, [k] * L, [v] * L, p))
    t = _times(hot, (q[:small], ks[0][:small], vs[0][:small], pos[:small]), 3 * a.reps)
    print(f"from cache, {small} slots: best {min(t) * 1e3:.3f} ms, "
          f"{min(t) / (small * K * L) * 1e6:.2f} us per slot, kv head and layer")


if __name__ == "__main__":
    main()
