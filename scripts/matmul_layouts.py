"""One decoder layer's matmuls at decode-sized row counts, kernels stored [in, out] against
[out, in], under XLA on this machine's default backend.

    python scripts/matmul_layouts.py                          # the 156M Llama's shapes
    python scripts/matmul_layouts.py --rows 1,8,32 --repeats 30

For each row count M: the q, k, v, o, gate, up and down matmuls of one layer of
`random:llama-156m` (D 1024, F 2816, 16 heads, 4 kv heads of 64) and its [D, 32000] LM
head, jitted once per layout; the two layouts take turns, `--repeats` times, so machine
noise hits both. Prints median ms per layer and per head, and the GFLOP/s and weight
GB/s they come to, beside a 2048^3 matmul in the same run (the FLOP/s probe of `jetserve
bench decode`). engines.model stores kernels [out, in]; this shows why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, N, K, H, V = 1024, 2816, 16, 4, 64, 32000
# (in, out) of one layer's kernels: q, k, v, o, gate, up, down.
LAYER = [(D, N * H), (D, K * H), (D, K * H), (N * H, D), (D, F), (D, F), (F, D)]


def _in_out(xs, ws):
    return [x @ w for x, w in zip(xs, ws, strict=True)]


def _out_in(xs, ws):
    dims = (((1,), (1,)), ((), ()))
    return [jax.lax.dot_general(x, w, dims) for x, w in zip(xs, ws, strict=True)]


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,128", help="row counts M, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    kernels = {"layer": [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in LAYER],
               "lm_head": [rng.standard_normal((D, V), dtype=np.float32) * 0.02]}
    stored = {"in_out": {k: [jnp.asarray(w) for w in ws] for k, ws in kernels.items()},
              "out_in": {k: [jnp.asarray(w.T.copy()) for w in ws] for k, ws in kernels.items()}}
    fns = {"in_out": jax.jit(_in_out), "out_in": jax.jit(_out_in)}

    a = jnp.ones((2048, 2048), jnp.float32)
    probe = jax.jit(jnp.dot)
    probe(a, a).block_until_ready()
    best = min(_time(probe, a, a) for _ in range(5))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} load {os.getloadavg()[0]:.2f}; "
          f"2048^3 matmul probe {2 * 2048**3 / best / 1e9:.0f} GFLOP/s")
    for m in (int(r) for r in args.rows.split(",")):
        for part, ws in kernels.items():
            # Each kernel's own input row block: [M, in].
            xs = [jnp.asarray(rng.standard_normal((m, w.shape[0]), dtype=np.float32)) for w in ws]
            ref, got = (np.asarray(o) for o in (fns["in_out"](xs, stored["in_out"][part])[-1],
                                                 fns["out_in"](xs, stored["out_in"][part])[-1]))
            np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)  # also compiles both
            times = {lay: [] for lay in fns}
            for _ in range(args.repeats):
                for lay, fn in fns.items():
                    times[lay].append(_time(fn, xs, stored[lay][part]))
            flops = sum(2 * m * w.shape[0] * w.shape[1] for w in ws)
            nbytes = sum(w.nbytes for w in ws)
            line = [f"M={m:<4d} {part:7s}"]
            for lay, ts in times.items():
                med = statistics.median(ts)
                line.append(f"{lay} {med * 1e3:7.2f} ms {flops / med / 1e9:4.0f} GFLOP/s "
                            f"{nbytes / med / 1e9:5.1f} GB/s")
            ratio = statistics.median(times["in_out"]) / statistics.median(times["out_in"])
            print(" | ".join(line) + f" | in_out / out_in {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
