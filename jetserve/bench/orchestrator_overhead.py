"""The orchestrator's generate loop against the bare `engine.generate` step, back to back.

    python -m jetserve.bench.orchestrator_overhead [--model random:small] [--batch 8]

Both run on one engine and one decode state shape with every slot busy:
  bare:         `state, res = engine.generate(params, state)` in a tight loop, results
                never read, blocked on once at the end: the device's own step time.
  orchestrator: `batch` requests streaming through all its threads (prefill, generate,
                detokenize, handles); its step time is measured from the generate
                thread's StepDone events while all `batch` slots are occupied.
The two alternate `--repeats` times, so drift in machine load hits both alike. Prints one
line per run, then the overhead as a percentage of the bare step: wall time best against
best, and process CPU time per step median against median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from engines import EngineConfig
from jetserve import compile_cache
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, Request, StepDone

PROMPT_LEN = 16


def bare_step_time(engine, params, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step of engine.generate with every slot filled."""
    state = engine.init_decode_state()
    prompt = np.arange(1, PROMPT_LEN + 1, dtype=np.int32)
    for slot in range(engine.max_concurrent_decodes):
        prefix, _ = engine.prefill(params, prompt, PROMPT_LEN)
        state = engine.insert(prefix, state, slot)
    for _ in range(3):  # compiled already; settle caches
        state, res = engine.generate(params, state)
    jax.block_until_ready(res.data)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, res = engine.generate(params, state)
    jax.block_until_ready((state, res.data))
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def orchestrator_step_time(orch: Orchestrator, batch: int, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per generate-loop step while all `batch` slots are busy."""
    times: list[tuple[float, float]] = []

    def on_event(e):
        if isinstance(e, StepDone) and e.batch_size == batch:
            times.append((time.perf_counter(), time.process_time()))

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
    n = len(steady) - 1
    return (steady[-1][0] - steady[0][0]) / n, (steady[-1][1] - steady[0][1]) / n


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
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.enable(args.compile_cache)  # before the first compile
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
    bare, loop = [], []  # (wall, cpu) per run
    try:
        for i in range(args.repeats):
            bare.append(bare_step_time(engine, params, args.steps))
            loop.append(orchestrator_step_time(orch, args.batch, args.steps))
            print(f"run {i + 1}: bare {bare[-1][0] * 1e3:.3f} ms/step "
                  f"(cpu {bare[-1][1] * 1e3:.3f})   orchestrator {loop[-1][0] * 1e3:.3f} "
                  f"ms/step (cpu {loop[-1][1] * 1e3:.3f})", flush=True)
    finally:
        orch.stop()
    # Other processes only ever add wall time, so the best run of each is the closest to
    # its true cost; process CPU time per step (all threads, XLA's included) is far less
    # sensitive to them, and its median is printed as a second view.
    wb, wo = min(x[0] for x in bare), min(x[0] for x in loop)
    cb = statistics.median(x[1] for x in bare)
    co = statistics.median(x[1] for x in loop)
    print(f"bare engine.generate step       wall best {wb * 1e3:.3f} ms   "
          f"cpu median {cb * 1e3:.3f} ms")
    print(f"orchestrator generate-loop step wall best {wo * 1e3:.3f} ms   "
          f"cpu median {co * 1e3:.3f} ms")
    print(f"overhead: wall {100 * (wo / wb - 1):+.1f}%   cpu {100 * (co / cb - 1):+.1f}%   "
          f"({args.repeats} runs each, alternating)")
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "devices": args.devices,
                          "steps": args.steps, "repeats": args.repeats,
                          "bare_ms": [[round(v * 1e3, 4) for v in x] for x in bare],
                          "orchestrator_ms": [[round(v * 1e3, 4) for v in x] for x in loop],
                          "overhead_wall": round(wo / wb - 1, 4),
                          "overhead_cpu": round(co / cb - 1, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
