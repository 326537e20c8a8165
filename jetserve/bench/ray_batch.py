"""`jetserve bench ray-batch`: the rows per second of `jetserve batch --ray` with 1, 2, ...
engine actors against the same job on one process, on this machine.

One job of --rows rows (generation, and one row in four scoring) runs first in this
process (the engine loop of `jetserve batch`; the clock starts once the engine is
loaded), then on a local Ray cluster (--num-cpus CPUs, a --object-store-mb object store)
once per pool size in --actors. For each it prints the job's wall time and rows/s (on
Ray: the actors' start, with their engines' load, included), and for Ray also the time
from the first block's start to the last block's end and rows/s over it, which leaves
the actors' start out. Programs compile during the job everywhere, read from the
persistent compile cache after a first run. On a machine with fewer cores than actors the engines share the
cores, so more actors cannot be faster: the comparison shows what dispatching blocks
through Ray Data costs.

Needs the `ray` extra (pip install 'jetserve[ray]').
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetserve bench ray-batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--actors", default="1,2", help="pool sizes to run, comma-separated")
    p.add_argument("--block-rows", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=2, help="the local cluster's CPUs")
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--max-concurrent-decodes", type=int, default=8)
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    return p


def _lines(n: int, max_tokens: int) -> list[str]:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        ids = rng.integers(1, 256, int(rng.integers(8, 48))).tolist()
        if i % 4 == 3:
            rows.append({"id": i, "context_ids": ids[:-4], "continuation_ids": ids[-4:]})
        else:
            rows.append({"id": i, "prompt_ids": ids, "max_tokens": max_tokens,
                         "ignore_eos": True})
    return [json.dumps(r) for r in rows]


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags, checked before any cluster or engine starts (ValueError names one)."""
    args = _parser().parse_args(argv)
    try:
        args.pools = [int(x) for x in args.actors.split(",") if x.strip()]
    except ValueError:
        args.pools = []
    if not args.pools or min(args.pools) < 1:
        raise ValueError(f"--actors: pool sizes >= 1, comma-separated, got {args.actors!r}")
    for flag in ("rows", "block_rows", "max_tokens", "num_cpus", "object_store_mb"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, flag)}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    pools = args.pools
    flags = ["--model", args.model, "--max-seq-len", str(args.max_seq_len),
             "--max-concurrent-decodes", str(args.max_concurrent_decodes), "--devices", "1",
             "--max-tokens", str(args.max_tokens)]
    from jetserve.batch import ray_job

    ray = ray_job.import_ray()
    # The cluster first: its processes start before JAX's threads exist here. One host:
    # Ray's single-machine mode keeps every process on the loopback address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False,
             object_store_memory=args.object_store_mb << 20, logging_level=logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="jetserve-ray-bench-") as d:
            inp = os.path.join(d, "in.jsonl")
            with open(inp, "w") as f:
                f.write("\n".join(_lines(args.rows, args.max_tokens)) + "\n")
            results = [_one_process(inp, os.path.join(d, "one.jsonl"), flags)]
            results += [_on_ray(n, args.block_rows, inp, os.path.join(d, f"ray{n}.jsonl"),
                                flags) for n in pools]
    finally:
        ray.shutdown()
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        line = (f"{r['run']:>13}: {r['rows']} rows, wall {r['wall_s']:6.1f} s, "
                f"{r['rows_per_s']:6.1f} rows/s")
        if r["engines_s"] is not None:
            line += (f"; first block's start to last block's end {r['engines_s']:5.1f} s, "
                     f"{r['engine_rows_per_s']:6.1f} rows/s")
        print(line)
    return 0


def _one_process(inp: str, out: str, flags: list[str]) -> dict:
    """The job as `jetserve batch` runs it on one process, less the process's start and
    the engine's load (compiles are in, as in the actors)."""
    from jetserve.batch import orchestrated
    from jetserve.batch.runner import BatchConfig
    from jetserve.commands.batch import orchestrator_factory

    orch = orchestrator_factory(flags)()
    s = orchestrated.run(BatchConfig(input=inp, output=out, progress=False), orch)
    rows = s.ok + s.failed
    return {"run": "one process", "rows": rows, "wall_s": round(s.wall_s, 2),
            "rows_per_s": round(rows / s.wall_s, 2), "engines_s": None,
            "engine_rows_per_s": None}


def _on_ray(n: int, block_rows: int, inp: str, out: str, flags: list[str]) -> dict:
    from jetserve.batch import ray_job
    from jetserve.batch.runner import BatchConfig
    from jetserve.commands.batch import orchestrator_factory

    s = ray_job.run(BatchConfig(input=inp, output=out, progress=False),
                    orchestrator_factory(flags),
                    ray_job.RayPool(actors=n, block_rows=block_rows))
    print(f"{n} actors: {s.line()}", file=sys.stderr)
    d = s.as_dict()
    return {"run": f"{n} actor{'s' if n > 1 else ''}", "rows": s.ok + s.failed,
            **{k: d[k] for k in ("wall_s", "rows_per_s", "engines_s", "engine_rows_per_s")}}
