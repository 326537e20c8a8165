"""The mixed step's XLA ragged attention alone (engines/ragged_attention.py), one layer.

    python scripts/ragged_attention_bench.py [--decode-rows 8] [--context 192]
        [--chunk 128] [--chunk-start 128] [--reps 20]

llama-156m's attention shapes (16 query heads, 4 kv heads of 64, float32, pages of 16):
`--decode-rows` rows of one token at position `--context` and one row of a `--chunk`-token
chunk at positions `--chunk-start`.., padded to a multiple of 8 tokens (as the mixed
step's token buckets), over random pools; every row holds its own pages. Prints the
median and best of `--reps` calls of the jitted attention (compiled first).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from engines.ragged_attention import ragged_paged_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--chunk-start", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    D, K, N, H, ps = args.decode_rows, 4, 16, 64, 16
    R = D + 1
    W = 1
    while W * ps < max(args.context, args.chunk_start + args.chunk) + 8:
        W *= 2
    rng = np.random.default_rng(0)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((K, R * W + 1, ps, H)), jnp.float32)
                      for _ in range(2))
    table = jnp.asarray(np.arange(R * W).reshape(R, W), jnp.int32)
    T = -(-(D + args.chunk) // 8) * 8
    rows, pos = np.full(T, R - 1, np.int32), np.full(T, -1, np.int32)
    rows[:D], pos[:D] = np.arange(D), args.context
    rows[D:D + args.chunk] = D
    pos[D:D + args.chunk] = np.arange(args.chunk_start, args.chunk_start + args.chunk)
    q = jnp.asarray(rng.standard_normal((T, N, H)), jnp.float32)
    fn = jax.jit(lambda q, r, p: ragged_paged_attention(q, k_pool, v_pool, table, r, p, None))
    rows, pos = jnp.asarray(rows), jnp.asarray(pos)
    fn(q, rows, pos).block_until_ready()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        fn(q, rows, pos).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"{D} decode rows at {args.context}, chunk {args.chunk} at {args.chunk_start} "
          f"({T} tokens, width {W}): median {statistics.median(times):.2f} ms, "
          f"best {min(times):.2f} ms of {args.reps}")


if __name__ == "__main__":
    main()
