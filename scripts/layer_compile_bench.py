"""Cold compile cost against the layer count: does a deeper model compile for longer?

    python scripts/layer_compile_bench.py --layers 4,32 [--model small] [--json]

For each layer count L, a fresh process (no persistent compile cache, so every program
compiles from scratch) builds the engine of `random:MODEL` with num_layers = L and the
same width, then times the first prefill, insert and generate call: tracing, lowering,
the XLA compile and one run. The compile seconds come from jax's own compile events
(jetserve/compile_cache.CompileCounter); the HLO size is the instruction count of the
optimized generate program, which grows with L while layers are a Python loop and stays
flat once one layer body is compiled under a loop. Prints each phase's seconds and its
ratio against the smallest L measured in the same run (issue 21 asks for 32 layers
within ~1.3x of 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PHASES = ("prefill", "insert", "generate")


def worker(model: str, layers: int, prompt_len: int) -> dict:
    import dataclasses

    import jax
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    from engines.factory import create_engine
    from jetserve.compile_cache import CompileCounter
    from jetserve.model_loading import RANDOM_MODELS

    cfg = dataclasses.replace(RANDOM_MODELS[model], num_layers=layers)
    engine = create_engine(cfg, devices=jax.devices()[:1])
    params = engine.load_params()
    state = engine.init_decode_state()
    prompt = np.arange(1, prompt_len + 1) % cfg.vocab_size
    out = {"layers": layers}
    calls = {
        "prefill": lambda: engine.prefill(params, prompt, prompt_len),
        "insert": lambda: engine.insert(prefix, state, 0),
        "generate": lambda: engine.generate(params, state),
    }
    for phase in PHASES:
        with CompileCounter() as counter:
            t0 = time.perf_counter()
            result = jax.block_until_ready(calls[phase]())
            wall = time.perf_counter() - t0
        if phase == "prefill":
            prefix = result[0]
        elif phase == "insert":
            state = result
        out[phase] = {"first_call_s": round(wall, 3), **counter.as_dict()}
    out["generate_hlo_ops"] = hlo_ops(engine, params, engine.init_decode_state())
    return out


def hlo_ops(engine, params, state) -> int:
    """Instructions in the optimized HLO of the generate step (one more compile)."""
    text = engine._generate_jit.lower(params, state, None).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line and not line.startswith("HloModule"))


def measure(model: str, layers: int, prompt_len: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--layers", str(layers),
           "--prompt-len", str(prompt_len)]
    # The worker imports this checkout's packages, whatever else is installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root,
               JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {layers} layers exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> list[str]:
    floor = rows[0]
    lines = [f"{'L':>4} " + " ".join(f"{p + ' s':>14} {'x':>5}" for p in PHASES)
             + f" {'gen HLO ops':>12} {'x':>5}"]
    for r in rows:
        cells = []
        for p in PHASES:
            s = r[p]["first_call_s"]
            cells.append(f"{s:>14.2f} {s / floor[p]['first_call_s']:>5.2f}")
        ops = r["generate_hlo_ops"]
        lines.append(f"{r['layers']:>4} " + " ".join(cells)
                     + f" {ops:>12} {ops / floor['generate_hlo_ops']:>5.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,32", help="layer counts, comma-separated")
    ap.add_argument("--model", default="small", help="a random:NAME model (default small)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, int(args.layers), args.prompt_len)), flush=True)
        return
    layers = sorted(int(x) for x in args.layers.split(","))
    if not layers or layers[0] < 1:
        raise SystemExit(f"--layers must be positive integers, got {args.layers!r}")
    rows = [measure(args.model, n, args.prompt_len) for n in layers]
    if args.json:
        print(json.dumps({"model": f"random:{args.model}", "rows": rows,
                          "load_average_1m": round(os.getloadavg()[0], 2)}))
    else:
        print("\n".join(report(rows)))
        print(f"(first call: trace + lower + compile + one run; ratios against "
              f"{layers[0]} layers; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
