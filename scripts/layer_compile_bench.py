"""Cold compile cost against the layer count: does a deeper model compile for longer?

    python scripts/layer_compile_bench.py --layers 4,32 [--model small] [--json]
        [--layer-modes loop,scan] [--kv-layout paged]

For each layer count L, a fresh process (no persistent compile cache, so every program
compiles from scratch) builds the engine of `random:MODEL` with num_layers = L and the
same width, then times the first prefill, insert and generate call: tracing, lowering,
the XLA compile and one run. The compile seconds come from jax's own compile events
(jetserve/compile_cache.CompileCounter); the HLO size is the instruction count of the
optimized generate program, which grows with L while layers are a Python loop and stays
flat once one layer body is compiled under a loop. Prints each phase's seconds and its
ratio against the smallest L measured in the same run (issue 21 asks for 32 layers
within ~1.3x of 4), and their total (the three programs' cold start, within 1.6x).
`--layer-modes` runs each L under each EngineConfig.layers mode ("loop": the unrolled
layers, "scan": one layer body, engines/layer_scan.py; "auto": the engine's choice), and
reports XLA's memory analysis of the generate step: its temporaries beside the donated,
aliased cache (a second copy of the cache per step would show there). `--kv-layout paged`
measures the paged engine (its page pools stacked under the scan), generate's memory
analysis at the widest page table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PHASES = ("prefill", "insert", "generate")


def worker(model: str, layers: int, prompt_len: int, mode: str, kv_layout: str) -> dict:
    import dataclasses

    import jax
    import numpy as np

    jax.config.update("jax_enable_compilation_cache", False)
    from engines import EngineConfig
    from engines.factory import create_engine
    from jetserve.compile_cache import CompileCounter
    from jetserve.model_loading import RANDOM_MODELS
    from jetserve.scheduling.page_planner import with_pages

    cfg = dataclasses.replace(RANDOM_MODELS[model], num_layers=layers)
    engine = with_pages(create_engine(cfg, devices=jax.devices()[:1],
                                      config=EngineConfig(layers=mode, kv_layout=kv_layout)))
    params = engine.load_params()
    state = engine.init_decode_state()
    prompt = np.arange(1, prompt_len + 1) % cfg.vocab_size
    out = {"layers": layers, "mode": mode, "kv_layout": kv_layout}
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
    out.update(generate_program(engine, params, engine.init_decode_state()))
    return out


def generate_program(engine, params, state) -> dict:
    """Instructions in the optimized HLO of the generate step (one more compile), and
    its memory analysis in MiB: temporaries and the aliased (donated) decode state. A
    paged engine (a PagePlanner) is lowered with its whole page table."""
    from jetserve.scheduling.page_planner import PagePlanner

    table = ()
    if isinstance(engine, PagePlanner):
        engine, table = engine.engine, (engine.kv_pages.table.copy(),)
    compiled = engine._generate_jit.lower(params, state, *table, None).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return {"generate_hlo_ops": sum(1 for line in text.splitlines()
                                    if " = " in line and not line.startswith("HloModule")),
            "generate_temp_mib": round(mem.temp_size_in_bytes / 2**20, 2),
            "generate_aliased_mib": round(mem.alias_size_in_bytes / 2**20, 2)}


def measure(model: str, layers: int, prompt_len: int, mode: str, kv_layout: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--layers", str(layers),
           "--prompt-len", str(prompt_len), "--layer-modes", mode, "--kv-layout", kv_layout]
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
    """One line per (mode, L); ratios against the first L of the same mode."""
    lines = [f"{'mode':>5} {'L':>4} " + " ".join(f"{p + ' s':>12} {'x':>5}" for p in PHASES)
             + f" {'total s':>8} {'x':>5} {'gen HLO ops':>11} {'x':>5} {'temp MiB':>8}"
             + f" {'cache MiB':>9}"]
    floors: dict[str, dict] = {}
    for r in rows:
        floor = floors.setdefault(r["mode"], r)
        cells = []
        for p in PHASES:
            s = r[p]["first_call_s"]
            cells.append(f"{s:>12.2f} {s / floor[p]['first_call_s']:>5.2f}")
        total, floor_total = (sum(x[p]["first_call_s"] for p in PHASES) for x in (r, floor))
        ops = r["generate_hlo_ops"]
        lines.append(f"{r['mode']:>5} {r['layers']:>4} " + " ".join(cells)
                     + f" {total:>8.2f} {total / floor_total:>5.2f}"
                     + f" {ops:>11} {ops / floor['generate_hlo_ops']:>5.2f}"
                     + f" {r['generate_temp_mib']:>8.2f} {r['generate_aliased_mib']:>9.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,32", help="layer counts, comma-separated")
    ap.add_argument("--model", default="small", help="a random:NAME model (default small)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--layer-modes", default="auto",
                    help="EngineConfig.layers modes, comma-separated: auto, loop, scan")
    ap.add_argument("--kv-layout", default="contiguous", choices=("contiguous", "paged"))
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, int(args.layers), args.prompt_len,
                                args.layer_modes, args.kv_layout)), flush=True)
        return
    layers = sorted(int(x) for x in args.layers.split(","))
    if not layers or layers[0] < 1:
        raise SystemExit(f"--layers must be positive integers, got {args.layers!r}")
    modes = args.layer_modes.split(",")
    bad = [m for m in modes if m not in ("auto", "loop", "scan")]
    if bad:
        raise SystemExit(f"--layer-modes takes auto, loop and scan, got {bad}")
    rows = [measure(args.model, n, args.prompt_len, m, args.kv_layout)
            for m in modes for n in layers]
    if args.json:
        print(json.dumps({"model": f"random:{args.model}", "kv_layout": args.kv_layout,
                          "rows": rows,
                          "load_average_1m": round(os.getloadavg()[0], 2)}))
    else:
        print("\n".join(report(rows)))
        print(f"(first call: trace + lower + compile + one run; ratios against "
              f"{layers[0]} layers; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
