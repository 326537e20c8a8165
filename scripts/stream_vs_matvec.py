"""The bandwidth probe of `jetserve bench decode` beside the reads a batch-1 decode step
makes, in turns, on this host.

    python scripts/stream_vs_matvec.py --rounds 12

Each round times, best of 3 passes each, over the same 492 MB as the 156M Llama's matmul
weights:
- `probe`: the probe itself, jetserve.bench.bandwidth.stream_read_bandwidth (a numpy
  threaded sum and torch's sum over a fresh numpy array, which numpy places on 2 MiB huge
  pages where transparent huge pages are on `madvise`; the best pass);
- `xla-sum`: XLA's jitted sum over a jax array (XLA's own buffer);
- `xla-matvec`: XLA's one-row dot against that buffer as a [N, 1024] weight stored
  [out, in], as a batch-1 step reads each layer.
Prints GB/s of each, and each over the probe of the same round: on a host whose
bandwidth swings from second to second, only ratios taken side by side mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jetserve.bench import bandwidth

BYTES = 491_520_000  # 120,000 rows of 1,024 float32


def _best(f, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    rows, K = BYTES // 4096, 1024
    w = jnp.full((rows, K), 0.5, jnp.float32)
    x = jnp.ones((1, K), jnp.float32)
    xla_sum = jax.jit(jnp.sum)
    matvec = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    xla_sum(w).block_until_ready()
    matvec(x, w).block_until_ready()
    sides = {"xla-sum": lambda: xla_sum(w).block_until_ready(),
             "xla-matvec": lambda: matvec(x, w).block_until_ready()}
    ratios = {k: [] for k in sides}
    for r in range(args.rounds):
        gbps = {"probe": bandwidth.stream_read_bandwidth(read_bytes=BYTES, repeats=3).gbps}
        gbps.update({k: BYTES / _best(f) / 1e9 for k, f in sides.items()})
        for k in ratios:
            ratios[k].append(gbps[k] / gbps["probe"])
        print(f"round {r + 1:2d}: " + "  ".join(f"{k} {v:5.1f} GB/s" for k, v in gbps.items())
              + "  | " + "  ".join(f"{k} / probe {ratios[k][-1]:.2f}" for k in ratios))
    for k, v in ratios.items():
        print(f"{k} / probe: median {statistics.median(v):.2f}, range {min(v):.2f}-{max(v):.2f}")


if __name__ == "__main__":
    main()
