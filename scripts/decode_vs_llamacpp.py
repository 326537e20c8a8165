"""Decode alone, jetserve against llama.cpp on the same weights, in turns on a busy machine.

    python scripts/decode_vs_llamacpp.py --gguf /work/peers/model/llama-156m-f32.gguf \
        --llama-bin /work/peers/llama-build/bin --model /work/peers/model/llama-156m-hf \
        --batch 1,8,32 --rounds 2 --threads 2,1 --layers loop,scan

Each round runs, one after the other and in an order that flips every round (so a load
that rises or falls during the run hits both sides alike): `llama-batched-bench -npp 128
-ntg 128 -npl BATCHES -t T` for each thread count T (scripts/peer_bench.sh's command), and
`jetserve bench decode` (context 192, midway through the same 128 + 128; its memory
bandwidth probe before and after; jetserve.bench.decode) for each layer layout, each in a
fresh process. Every turn records the 1-minute load average at its start and end.
Prints one line per turn, then per round and batch jetserve's tokens/s over llama.cpp's
(each jetserve layout against each llama.cpp thread count), and writes every turn's raw
figures as JSON lines to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from peer_report import parse_batched_bench


def llama_turn(args, threads: int) -> dict:
    """One llama-batched-bench run: {batch: decode tokens/s}."""
    batches = [int(b) for b in args.batch.split(",")]
    cmd = [os.path.join(args.llama_bin, "llama-batched-bench"), "-m", args.gguf,
           "-c", str(max(batches) * 256 + 256), "-npp", "128", "-ntg", "128",
           "-npl", args.batch, "-t", str(threads), "--output-format", "jsonl"]
    env = dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr[-2000:]}")
    return {"tok_s": parse_batched_bench(done.stdout)}


def jetserve_turn(args, layers: str) -> dict:
    """One `jetserve bench decode` run in a fresh process: {batch: tokens/s}, bandwidth."""
    cmd = [sys.executable, os.path.abspath(__file__), "--jetserve-worker", layers,
           "--model", args.model, "--batch", args.batch, "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"jetserve worker exited with {done.returncode}: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"tok_s": {int(r["batch"]): r["tokens_per_s"] for r in out["rows"]},
            "bandwidth_gbps": out["bandwidth_probes_gbps"],
            "floor_tok_s": {int(r["batch"]): round(r["batch"] / r["floor_ms"] * 1e3, 1)
                            for r in out["rows"]}}


def worker(args) -> None:
    from jetserve.bench import decode

    cfg = decode.DecodeBenchConfig(model=args.model, batches=tuple(
        int(b) for b in args.batch.split(",")), steps=args.steps, layers=args.jetserve_worker)
    print(json.dumps(decode.run(cfg, log=lambda *a: None)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="/work/peers/model/llama-156m-f32.gguf")
    ap.add_argument("--llama-bin", default="/work/peers/llama-build/bin")
    ap.add_argument("--model", default="random:llama-156m",
                    help="jetserve's model: the GGUF's HF checkpoint, or random:NAME")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", default="2,1", help="llama.cpp thread counts, one turn each")
    ap.add_argument("--layers", default="loop,scan", help="jetserve layouts, one turn each")
    ap.add_argument("--steps", type=int, default=24, help="jetserve's timed steps per batch")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per turn")
    ap.add_argument("--out", help="JSON lines of every turn")
    ap.add_argument("--jetserve-worker", help=argparse.SUPPRESS)  # internal: the layout
    args = ap.parse_args()
    if args.jetserve_worker:
        return worker(args)
    turns = ([("llama.cpp", f"-t {t}", lambda t=int(t): llama_turn(args, t))
              for t in args.threads.split(",")]
             + [("jetserve", f"--layers {m}", lambda m=m: jetserve_turn(args, m))
                for m in args.layers.split(",")])
    results = []
    for r in range(args.rounds):
        for side, how, run in (turns if r % 2 == 0 else turns[::-1]):
            load0, t0 = os.getloadavg()[0], time.time()
            rec = dict(round=r + 1, side=side, how=how, load=[round(load0, 2)], **run())
            rec["load"].append(round(os.getloadavg()[0], 2))
            rec["seconds"] = round(time.time() - t0, 1)
            results.append(rec)
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    print_ratios(results)


def print_ratios(results: list[dict]) -> None:
    """Per round and batch: each jetserve layout's tokens/s over each llama.cpp turn's."""
    for r in sorted({x["round"] for x in results}):
        ours = [x for x in results if x["round"] == r and x["side"] == "jetserve"]
        theirs = [x for x in results if x["round"] == r and x["side"] == "llama.cpp"]
        for j in ours:
            for ll in theirs:
                ratios = ", ".join(f"batch {b}: {j['tok_s'][b] / t:.2f}"
                                   for b, t in sorted(ll["tok_s"].items()) if b in j["tok_s"])
                print(f"round {r}: jetserve {j['how']} / llama.cpp {ll['how']}: {ratios}")


if __name__ == "__main__":
    main()
