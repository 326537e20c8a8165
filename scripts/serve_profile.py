"""Where a served token's host CPU goes: `jetserve serve` with each of its threads under
cProfile, driven by `jetserve bench serve`'s own client at rate inf.

    python scripts/serve_profile.py --model random:llama-156m --batch 32 --protocol http

The child server is `jetserve serve` as `jetserve bench serve-path` starts it (same
slots, max_seq_len and prefill length); here every thread whose name starts with
"jetserve" (generate, prefill, detokenize, the gRPC and HTTP loops) runs under its own
cProfile. One round of `--batch` requests warms the server and clients, `--rounds` more
are counted; then the server is stopped (its threads end and write their profiles) and
this prints, per thread, its CPU milliseconds per generated token (thread_time over the
whole run, warm-up included: read it for the split, not as the bench's figure) and the
functions with the most time of their own.

cProfile slows Python code (roughly 1.5-2x here), so the milliseconds are inflated: use
them to see which thread and which calls dominate, and `jetserve bench serve-path` for
the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import sys
import tempfile
import threading
import time

import numpy as np


def serve_profiled(out: str, argv: list[str]) -> int:
    """The child: `jetserve serve argv` with each jetserve-* thread profiled into `out`."""
    import cProfile

    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        if not self.name.startswith("jetserve"):
            return run(self)
        prof, t0 = cProfile.Profile(), time.thread_time()
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(out, f"{self.name}.pstats"))
            with open(os.path.join(out, f"{self.name}.cpu"), "w") as f:
                f.write(repr(time.thread_time() - t0))

    threading.Thread.run = profiled
    from jetserve.cli import main

    return main(["serve", *argv])


async def drive(url: str, args: argparse.Namespace) -> int:
    """Warm-up round, then `rounds` rounds of `batch` requests at once; tokens counted."""
    from jetserve.bench import serve

    client = serve.make_client(url, None, None)
    tokens = 0
    try:
        while not await client.ready():
            await asyncio.sleep(0.2)
        for seed in range(args.rounds + 1):
            w = serve.Workload(num_requests=args.batch, prompt_len=args.prompt_len,
                               output_len=args.output_len, max_total=args.max_seq_len,
                               seed=seed)
            recs, duration = await serve.run_rate(client, serve.make_requests(
                w, np.random.default_rng(seed)), np.zeros(args.batch))
            n = sum(r["output_tokens"] for r in recs)
            tokens += n
            print(f"round {seed}{' (warm-up)' if seed == 0 else ''}: {n / duration:.1f} tok/s")
    finally:
        await client.close()
    return tokens


def report(out: str, tokens: int, top: int) -> None:
    for name in sorted(f[:-7] for f in os.listdir(out) if f.endswith(".pstats")):
        with open(os.path.join(out, f"{name}.cpu")) as f:
            cpu = float(f.read())
        print(f"\n===== {name}: {cpu:.2f} s CPU, {1e3 * cpu / tokens:.3f} ms per token")
        pstats.Stats(os.path.join(out, f"{name}.pstats")).sort_stats("tottime").print_stats(top)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":
        return serve_profiled(sys.argv[2], sys.argv[3:])
    from jetserve.bench import serve_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-156m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--top", type=int, default=12, help="functions shown per thread")
    p.add_argument("--out", default=None, help="profiles go here (default: a temp dir)")
    args = p.parse_args()
    args.serve_arg = []
    args.max_seq_len = -(-(args.prompt_len + args.output_len) // 128) * 128
    out = args.out or tempfile.mkdtemp(prefix="serve_profile-")
    os.makedirs(out, exist_ok=True)
    cmd = serve_path.server_command(args)
    cmd = [sys.executable, os.path.abspath(__file__), "_serve", out, *cmd[4:]]  # after "serve"
    proc, ports = serve_path.start_server(args, command=cmd)
    try:
        url = (f"grpc://127.0.0.1:{ports['gRPC']}" if args.protocol == "grpc"
               else f"http://127.0.0.1:{ports['HTTP']}")
        tokens = asyncio.run(drive(url, args))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    print(f"profiles in {out}; {tokens} tokens generated in all")
    report(out, tokens, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
