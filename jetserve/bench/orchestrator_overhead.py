"""The orchestrator's generate loop against the bare `engine.generate` step, back to back.

    python -m jetserve.bench.orchestrator_overhead [--model random:small] [--batch 8]

Both run on one engine and one decode state shape with every slot busy:
  bare:         `state, res = engine.generate(params, state)` in a tight loop, results
                never read, blocked on once at the end: the device's own step time.
  orchestrator: `batch` requests streaming through all its threads (prefill, generate,
                detokenize, handles); its step time is measured from the generate
                thread's StepDone events while all `batch` slots are occupied.
The two alternate `--repeats` times, so drift in machine load hits both alike. Prints one
line per run, then the overhead as a percentage of the bare step, best against best and
median against median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, Request, StepDone

PROMPT_LEN = 16


def bare_step_time(engine, params, steps: int) -> float:
    """Seconds per step of engine.generate with every slot filled."""
    state = engine.init_decode_state()
    prompt = np.arange(1, PROMPT_LEN + 1, dtype=np.int32)
    for slot in range(engine.max_concurrent_decodes):
        prefix, _ = engine.prefill(params, prompt, PROMPT_LEN)
        state = engine.insert(prefix, state, slot)
    for _ in range(3):  # compiled already; settle caches
        state, res = engine.generate(params, state)
    jax.block_until_ready(res.data)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, res = engine.generate(params, state)
    jax.block_until_ready((state, res.data))
    return (time.perf_counter() - t0) / steps


def orchestrator_step_time(orch: Orchestrator, batch: int, steps: int) -> float:
    """Seconds per generate-loop step while all `batch` slots are busy."""
    times: list[float] = []

    def on_event(e):
        if isinstance(e, StepDone) and e.batch_size == batch:
            times.append(time.perf_counter())

    orch.add_listener(on_event)
    try:
        prompt = tuple(range(1, PROMPT_LEN + 1))
        hs = [orch.submit(Request(prompt_ids=prompt, max_tokens=steps + 8, ignore_eos=True))
              for _ in range(batch)]
        for h in hs:
            if h.result().finish_reason != "length":
                raise RuntimeError("benchmark request ended early")
    finally:
        orch.remove_listener(on_event)
    steady = times[3:]  # the first reads after all inserts include pipeline fill
    if len(steady) < 10:
        raise RuntimeError(f"only {len(steady)} full-batch steps were seen")
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jetserve.bench.orchestrator_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--devices", type=int, default=1, help="devices of the engine's slice")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.steps + PROMPT_LEN + 8 > args.max_seq_len:
        raise SystemExit(f"--steps {args.steps} does not fit --max-seq-len {args.max_seq_len}")
    engine = build_engine(args.model, devices=jax.devices()[: args.devices],
                          engine_config=EngineConfig(max_concurrent_decodes=args.batch,
                                                     max_prefill_length=64,
                                                     max_seq_len=args.max_seq_len))
    params = engine.load_params()
    orch = Orchestrator.from_engines(engine, params=params)
    t0 = time.perf_counter()
    bare_step_time(engine, params, 5)
    orch.start()
    orch.warmup(prompt_lengths=(PROMPT_LEN,))
    compile_s = time.perf_counter() - t0
    print(f"model {args.model}  batch {args.batch}  devices {args.devices}  "
          f"steps {args.steps}  max_seq_len {args.max_seq_len}  "
          f"(compile + warm-up {compile_s:.1f} s)")
    bare, loop = [], []
    try:
        for i in range(args.repeats):
            bare.append(bare_step_time(engine, params, args.steps))
            loop.append(orchestrator_step_time(orch, args.batch, args.steps))
            print(f"run {i + 1}: bare {bare[-1] * 1e3:.3f} ms/step   "
                  f"orchestrator {loop[-1] * 1e3:.3f} ms/step", flush=True)
    finally:
        orch.stop()
    # Noise from other processes only ever adds time, so the best run of each is the
    # closest to its true cost; the medians are printed beside them.
    b, o = min(bare), min(loop)
    bm, om = statistics.median(bare), statistics.median(loop)
    print(f"bare engine.generate step       best {b * 1e3:.3f} ms  median {bm * 1e3:.3f} ms")
    print(f"orchestrator generate-loop step best {o * 1e3:.3f} ms  median {om * 1e3:.3f} ms")
    print(f"overhead (best/best) {100 * (o / b - 1):+.1f}%   "
          f"(median/median) {100 * (om / bm - 1):+.1f}%   over {args.repeats} runs each")
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "devices": args.devices,
                          "steps": args.steps, "repeats": args.repeats,
                          "bare_ms": [round(x * 1e3, 4) for x in bare],
                          "orchestrator_ms": [round(x * 1e3, 4) for x in loop],
                          "overhead_best": round(o / b - 1, 4),
                          "overhead_median": round(om / bm - 1, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
