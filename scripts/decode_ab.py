"""The jitted decode step of two checkouts of this repository, side by side on a busy
machine: one worker process per checkout, taking turns every few steps.

    git worktree add /tmp/base <commit>       # or: git archive <commit> | tar -x -C /tmp/base
    python scripts/decode_ab.py /tmp/base . --batch 1,8,32 --rounds 8 [--kv-layout paged]
    python scripts/decode_ab.py . . --layers-a loop --layers-b scan   # one checkout, two modes

Each worker imports jetserve from its own checkout, builds an engine for
`random:llama-156m` with B slots, fills every slot with a 192-token prompt (as `jetserve
bench decode` does), warms up, and then runs `--steps` blocked generate steps each time
the driver tells it to; the two take turns (the order flips every round), so the other
load on the machine hits both alike. Prints per batch the median, first-quartile and best
step of each side and their ratios (A / B: above 1 means B is faster). `--layers-a` /
`--layers-b` set a side's EngineConfig.layers (engines/layer_scan.py; checkouts that
have the field only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(batch: int, steps: int, model: str, context: int, kv_layout: str,
           layers: str | None) -> None:
    import jax

    from engines import EngineConfig
    from jetserve.bench.decode import fill_slots
    from jetserve.model_loading import build_engine

    engine = build_engine(model, engine_config=EngineConfig(
        max_concurrent_decodes=batch, max_seq_len=1024, max_prefill_length=context,
        kv_layout=kv_layout, **({"layers": layers} if layers else {})))
    params = engine.load_params()
    state = fill_slots(engine, params, context)
    for _ in range(3):
        state, res = engine.generate(params, state)
    jax.block_until_ready(res.data)
    print("ready", flush=True)
    for _ in sys.stdin:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, res = engine.generate(params, state)
            jax.block_until_ready(res.data)
            times.append((time.perf_counter() - t0) * 1e3)
        print(" ".join(f"{t:.3f}" for t in times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="checkout A (the baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="steps per turn")
    ap.add_argument("--model", default="random:llama-156m")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--kv-layout", default="contiguous", choices=("contiguous", "paged"))
    ap.add_argument("--layers-a", help="checkout A's EngineConfig.layers (auto, loop, scan)")
    ap.add_argument("--layers-b", help="checkout B's EngineConfig.layers")
    ap.add_argument("--layers", help=argparse.SUPPRESS)  # internal: this worker's
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: batch
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.model, args.context, args.kv_layout,
                      args.layers)
    sides = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    modes = {"A": args.layers_a, "B": args.layers_b}
    for b in (int(x) for x in args.batch.split(",")):
        procs = {}
        for side, root in sides.items():
            procs[side] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), args.a, args.b, "--worker", str(b),
                 "--steps", str(args.steps), "--model", args.model, "--context",
                 str(args.context), "--kv-layout", args.kv_layout,
                 *(["--layers", mode] if (mode := modes[side]) else [])],
                cwd=root, env=dict(os.environ, PYTHONPATH=root), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
            if procs[side].stdout.readline().strip() != "ready":
                raise SystemExit(f"worker for {root} failed to start (batch {b})")
        times = {side: [] for side in procs}
        load0 = os.getloadavg()[0]
        for r in range(args.rounds):
            for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
                procs[side].stdin.write("go\n")
                procs[side].stdin.flush()
                times[side] += [float(x) for x in procs[side].stdout.readline().split()]
        for p in procs.values():
            p.stdin.close()
            p.wait()
        stats = {s: (statistics.median(t), statistics.quantiles(t, n=4)[0], min(t))
                 for s, t in times.items()}
        a, bb = stats["A"], stats["B"]
        print(f"batch {b}: {len(times['A'])} steps each, load {load0:.2f} -> "
              f"{os.getloadavg()[0]:.2f} | A median {a[0]:.2f} p25 {a[1]:.2f} best {a[2]:.2f} "
              f"ms | B median {bb[0]:.2f} p25 {bb[1]:.2f} best {bb[2]:.2f} ms | A / B median "
              f"{a[0] / bb[0]:.3f} p25 {a[1] / bb[1]:.3f} best {a[2] / bb[2]:.3f}", flush=True)


if __name__ == "__main__":
    main()
