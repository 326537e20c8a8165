"""`jetserve bench prefill-rows`: several prompts in one prefill call (--prefill-batch)
against the same prompts prefilled one a call, back to back, with the floors beside them.

    jetserve bench prefill-rows [--model random:llama-156m] [--prompt-len 16,128]
                                [--rows 2,4,8] [--rounds 3]

For each prompt length T and row count R, in one process on one device: R random prompts
of T tokens go through `engine.prefill_rows` (one call), then through `engine.prefill`
(R calls, dispatched back to back), each blocked on at the end; every program is run once
before timing, and the best of `--rounds` passes is kept (noise only slows a pass). Beside
them, measured in the same run: the weight-read floor of one call (the parameters' bytes
over the streaming-read bandwidth, jetserve.bench.bandwidth) and the compute floor of R
prompts of T tokens (their matmul and causal attention FLOPs, jetserve.bench.prefill's
count, over the jitted matmul's FLOP/s, `--matmul-size`). A call bound by the
weight read costs about one floor whatever R is, so R prompts a call cost about one
prompt's call; a call bound by compute costs R times one, and sharing gains little.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from engines import EngineConfig
from jetserve.bench import bandwidth
from jetserve.bench.prefill import prefill_flops
from jetserve.model_loading import build_engine


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def measure(engine, params, length: int, rows: int, rounds: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, engine.vocab_size, size=length).astype(np.int32)
               for _ in range(rows)]
    shared = lambda: engine.prefill_rows(params, prompts, samplings=[None] * rows)[1].data  # noqa: E731

    def alone():
        return [engine.prefill(params, p, length)[1].data for p in prompts]

    shared(), alone()  # compile (and run once) both
    one_call = _best(shared, rounds)
    calls = _best(alone, rounds)
    return {"prompt_len": length, "rows": rows, "shared_ms": 1e3 * one_call,
            "alone_ms": 1e3 * calls, "speedup": calls / one_call}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jetserve bench prefill-rows",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-156m", help="HF or Orbax dir, or random:NAME")
    p.add_argument("--prompt-len", default="16,128", help="comma-separated prompt lengths")
    p.add_argument("--rows", default="2,4,8", help="comma-separated prompts per call (powers of 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--matmul-size", type=int, default=2048,
                   help="side of the square matmul whose FLOP/s sets the compute floor")
    p.add_argument("--read-bytes", type=int, default=None,
                   help="bandwidth probe size (default 2 GiB: past any cache)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.prompt_len.split(",")]
        args.row_counts = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--prompt-len and --rows take comma-separated integers, got "
                f"{args.prompt_len!r} and {args.rows!r}")
    if any(n < 1 for n in args.lengths) or any(r < 2 or r & (r - 1) for r in args.row_counts):
        p.error(f"--prompt-len must be >= 1 and --rows powers of two >= 2, got "
                f"{args.prompt_len!r} and {args.rows!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    longest = max(r * (1 << max(4, (n - 1).bit_length()))
                  for r in args.row_counts for n in args.lengths)  # the widest call's bucket
    engine = build_engine(args.model, devices=jax.devices()[:1], engine_config=EngineConfig(
        max_concurrent_decodes=max(args.row_counts), max_seq_len=longest,
        max_prefill_length=longest, prefill_batch=max(args.row_counts)))
    params = engine.load_params()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bw = bandwidth.stream_read_bandwidth(read_bytes=args.read_bytes).best_bps
    flops = bandwidth.matmul_flops(size=args.matmul_size)
    rows = []
    for n in args.lengths:
        for r in args.row_counts:
            row = measure(engine, params, n, r, args.rounds)
            row["weight_read_floor_ms"] = 1e3 * weight_bytes / bw
            row["compute_floor_ms"] = 1e3 * r * prefill_flops(engine.model_config, n, n) / flops
            rows.append(row)
            if not args.json:
                print(f"{r} prompts x {n} tokens: one call {row['shared_ms']:.1f} ms, {r} calls "
                      f"{row['alone_ms']:.1f} ms ({row['speedup']:.2f}x); floors: weight read "
                      f"{row['weight_read_floor_ms']:.1f} ms, compute "
                      f"{row['compute_floor_ms']:.1f} ms", flush=True)
    if args.json:
        print(json.dumps({"model": args.model, "bandwidth_bps": bw, "matmul_flops": flops,
                          "weight_bytes": weight_bytes, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
