"""XLA's f32 dot against jetserve's CPU matmul kernel (engines/cpu_kernels.py) on the
156M Llama's decode matmuls, at decode-sized row counts.

    python scripts/cpu_matmul_ab.py                      # rows 1,2,4,8,16,32,40,64
    python scripts/cpu_matmul_ab.py --rows 8,32 --repeats 20

For each row count M: the q, k, v, o, gate, up and down kernels of all 8 layers of
`random:llama-156m` (D 1024, F 2816, 16 heads, 4 kv heads of 64) and its [32000, 1024] LM
head, stored [out, in] as engines.model keeps them, chained so each matmul waits for the
one before (as in a decode step), jitted once with XLA's dot and once with the kernel.
The two take turns `--repeats` times. Prints per side the median wall ms and process CPU
ms of one chain (CPU above wall: both cores worked), the GFLOP/s of the median wall time,
and XLA's time over the kernel's.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from engines import cpu_kernels

D, F, N, K, H, V, L = 1024, 2816, 16, 4, 64, 32000, 8
LAYER = [(N * H, D), (K * H, D), (K * H, D), (D, N * H), (F, D), (F, D), (D, F)]  # [out, in]


def _chain(matmul):
    def run(xs, ws):
        out, prev = [], None
        for x, w in zip(xs, ws, strict=True):
            if prev is not None:  # depend on the previous result, as a step's layers do
                x = x + prev[:, :1] * 1e-30
            prev = matmul(x, w)
            out.append(prev)
        return out
    return jax.jit(run)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,40,64")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available here (see the warning above)")
    rng = np.random.default_rng(0)
    shapes = LAYER * L + [(V, D)]
    ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in shapes]
    flops_per_row = 2 * sum(o * i for o, i in shapes)
    sides = {"xla": _chain(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))),
             "kernel": _chain(cpu_kernels.matmul_nt)}
    for m in (int(r) for r in args.rows.split(",")):
        xs = [jnp.asarray(rng.standard_normal((m, s[1]), dtype=np.float32)) for s in shapes]
        ref, got = (np.asarray(fn(xs, ws)[-1]) for fn in sides.values())  # also compiles
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
        wall = {s: [] for s in sides}
        cpu = {s: [] for s in sides}
        for _ in range(args.repeats):
            for side, fn in sides.items():
                c0, t0 = _cpu_s(), time.perf_counter()
                jax.block_until_ready(fn(xs, ws))
                wall[side].append(time.perf_counter() - t0)
                cpu[side].append(_cpu_s() - c0)
        med = {s: statistics.median(t) for s, t in wall.items()}
        print(f"M={m:<3d} " + " | ".join(
            f"{s} {med[s] * 1e3:6.1f} ms wall {statistics.median(cpu[s]) * 1e3:6.1f} ms cpu "
            f"{flops_per_row * m / med[s] / 1e9:4.0f} GFLOP/s" for s in sides)
            + f" | xla / kernel {med['xla'] / med['kernel']:.2f}", flush=True)


if __name__ == "__main__":
    main()
