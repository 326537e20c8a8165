"""`jetserve bench serve-path`: the whole serving path against the bare generate step, at
the same batch, in one program, back to back.

    jetserve bench serve-path [--model random:llama-156m] [--batch 8] [--output-len 256]
                              [--protocol grpc|http|grpc,http]

One `jetserve serve` child process (interleaved, `--batch` slots) is started and kept; this
process builds the same engine itself. Then, `--rounds` times, for each protocol in turn
(each served half right after a bare half of its own):

  bare:  every slot filled with a `--prompt-len` prompt, then `output_len - 1`
         `engine.generate` steps dispatched back to back and blocked on at the end (what
         the device makes: batch * steps / seconds);
  serve: `batch` requests at once (rate inf) from real clients (jetserve.bench.serve's
         gRPC or OpenAI HTTP streaming client), `--prompt-len` prompt tokens and
         `--output-len` new tokens each: output tokens / seconds from the first send to
         the last token, as `jetserve bench serve` reports it.

The ratio serve / bare of each round is printed, with CPU milliseconds per generated
token (far less sensitive to other load than wall time): of XLA's compute threads and of
every other thread ("host": the Python loop, servers, dispatch), for the bare loop and
the server process, and of this process's clients; and the load average. Short prompts keep the run decode-bound; the
bare loop's steps cover the same context lengths as the served requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import jax
import numpy as np

from engines import EngineConfig
from jetserve.bench import serve
from jetserve.bench.decode import fill_slots
from jetserve.model_loading import build_engine

_LISTENING = re.compile(r"(gRPC|HTTP) listening on (?:https?://)?127\.0\.0\.1:(\d+)")
_READY = "jetserve serve: ready"
PREFILL = 64  # --max-prefill-length of both engines: one small bucket for short prompts


def server_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "jetserve", "serve", "--model", args.model,
            "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
            "--max-concurrent-decodes", str(args.batch), "--max-seq-len", str(args.max_seq_len),
            "--max-prefill-length", str(PREFILL), *args.serve_arg]


def start_server(args: argparse.Namespace, timeout_s: float = 900,
                 command: list[str] | None = None) -> tuple[subprocess.Popen, dict]:
    """The child `jetserve serve` (or `command`, one that prints what serve prints) and
    its {"gRPC": port, "HTTP": port}, once it is ready."""
    proc = subprocess.Popen(command or server_command(args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ports, lines, deadline = {}, [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := _LISTENING.search(line):
            ports[m.group(1)] = int(m.group(2))
        if _READY in line:
            # Keep reading what it prints, so a full pipe never blocks the server.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, ports
    proc.kill()
    raise RuntimeError("jetserve serve did not start:\n" + "".join(lines[-40:]))


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(XLA's compute threads, every other thread) user + system CPU seconds of process
    `pid` (Linux /proc): the host loop's cost is the second."""
    xla = other = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        ticks = int(fields[11]) + int(fields[12])
        if comm.startswith("tf_XLA"):
            xla += ticks
        else:
            other += ticks
    hz = os.sysconf("SC_CLK_TCK")
    return xla / hz, other / hz


def bare_round(engine, params, args: argparse.Namespace) -> dict:
    """tokens/s of `output_len - 1` back-to-back generate steps over full slots."""
    state = fill_slots(engine, params, args.prompt_len)
    state, res = engine.generate(params, state)  # compiled in the first round
    jax.block_until_ready(res.data)
    steps = args.output_len - 1
    t0, c0 = time.perf_counter(), cpu_seconds(os.getpid())
    for _ in range(steps):
        state, res = engine.generate(params, state)
    jax.block_until_ready((state, res.data))
    wall, c1 = time.perf_counter() - t0, cpu_seconds(os.getpid())
    tokens = steps * args.batch
    return {"tok_s": tokens / wall, "xla_cpu_ms_per_token": 1e3 * (c1[0] - c0[0]) / tokens,
            "host_cpu_ms_per_token": 1e3 * (c1[1] - c0[1]) / tokens}


async def serve_round(client, args: argparse.Namespace, pid: int, seed: int) -> dict:
    """tokens/s of `batch` streamed requests sent at once, as bench serve counts them."""
    w = serve.Workload(num_requests=args.batch, prompt_len=args.prompt_len,
                       output_len=args.output_len, max_total=args.max_seq_len, seed=seed)
    reqs = serve.make_requests(w, np.random.default_rng(seed))
    s0, c0 = cpu_seconds(pid), time.process_time()
    recs, duration = await serve.run_rate(client, reqs, np.zeros(len(reqs)))
    s1, c1 = cpu_seconds(pid), time.process_time()  # this process: the clients alone
    row = serve.summarize(float("inf"), recs, duration, {})
    if row["failed"]:
        raise RuntimeError(f"a request failed: {[r['error'] for r in recs if not r['ok']][0]}")
    tokens = sum(r["output_tokens"] for r in recs)
    return {"tok_s": row["throughput_tok_s"], "tpot_p50_ms": row["tpot_ms"]["p50"],
            "ttft_p50_ms": row["ttft_ms"]["p50"],
            "xla_cpu_ms_per_token": 1e3 * (s1[0] - s0[0]) / tokens,
            "host_cpu_ms_per_token": 1e3 * (s1[1] - s0[1]) / tokens,
            "client_cpu_ms_per_token": 1e3 * (c1 - c0) / tokens}


def pair(b: dict, s: dict, protocol: str, load: float) -> dict:
    """One round's bare and served halves side by side: the wall and the CPU ratio."""
    bare_cpu = b["xla_cpu_ms_per_token"] + b["host_cpu_ms_per_token"]
    serve_cpu = (s["xla_cpu_ms_per_token"] + s["host_cpu_ms_per_token"]
                 + s["client_cpu_ms_per_token"])
    return {"protocol": protocol, "bare": b, "serve": s, "ratio": s["tok_s"] / b["tok_s"],
            "cpu_ratio": bare_cpu / serve_cpu, "load_1m": round(load, 2)}


async def measure(engine, params, args: argparse.Namespace, proc, ports: dict, log) -> list:
    """`rounds` rounds; in each, per protocol, a bare half then a served half."""
    urls = {"grpc": f"grpc://127.0.0.1:{ports['gRPC']}",
            "http": f"http://127.0.0.1:{ports['HTTP']}"}
    clients = {p: serve.make_client(urls[p], None, None) for p in args.protocols}
    rounds = []
    try:
        for client in clients.values():
            while not await client.ready():
                await asyncio.sleep(0.2)
            await serve_round(client, args, proc.pid, seed=10_000)  # not counted: warm-up
        for i in range(args.rounds):
            for protocol, client in clients.items():
                load = os.getloadavg()[0]
                b = bare_round(engine, params, args)
                s = await serve_round(client, args, proc.pid, seed=i)
                rounds.append(pair(b, s, protocol, load))
                log(f"round {i + 1} {protocol}: bare {b['tok_s']:.1f} tok/s   serve "
                    f"{s['tok_s']:.1f} tok/s   ratio {rounds[-1]['ratio']:.3f}   (TPOT p50 "
                    f"{s['tpot_p50_ms']:.2f} ms, bare step {1e3 * args.batch / b['tok_s']:.2f} "
                    f"ms; CPU ms/token XLA + host: bare {b['xla_cpu_ms_per_token']:.3f} + "
                    f"{b['host_cpu_ms_per_token']:.3f}, server {s['xla_cpu_ms_per_token']:.3f} "
                    f"+ {s['host_cpu_ms_per_token']:.3f}, clients "
                    f"{s['client_cpu_ms_per_token']:.3f}; load {load:.2f})")
    finally:
        for client in clients.values():
            await client.close()
    return rounds


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jetserve bench serve-path",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-156m", help="HF or Orbax dir, or random:NAME")
    p.add_argument("--batch", type=int, default=8, help="slots of both engines; requests per round")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--protocol", default="grpc",
                   help="grpc, http (the OpenAI streaming API) or both: grpc,http")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="both engines (default: prompt + output rounded up to 128)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the child `jetserve serve` (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.protocols = list(dict.fromkeys(x.strip() for x in args.protocol.split(",")))
    if not args.protocols or any(x not in ("grpc", "http") for x in args.protocols):
        raise ValueError(f"--protocol must be grpc, http or both (grpc,http), "
                         f"got {args.protocol!r}")
    for name in ("batch", "prompt_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (one prefill token, one step), "
                         f"got {args.output_len}")
    if args.prompt_len > PREFILL:
        raise ValueError(f"--prompt-len must be <= {PREFILL} (short prompts keep the run "
                         f"decode-bound), got {args.prompt_len}")
    need = args.prompt_len + args.output_len
    args.max_seq_len = args.max_seq_len or -(-need // 128) * 128
    if args.max_seq_len < need:
        raise ValueError(f"--max-seq-len {args.max_seq_len} is below prompt + output = {need}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    log = (lambda *a: None) if args.json else print
    proc, ports = start_server(args)
    try:
        engine = build_engine(args.model, devices=jax.devices()[:1], engine_config=EngineConfig(
            max_concurrent_decodes=args.batch, max_seq_len=args.max_seq_len,
            max_prefill_length=PREFILL))
        params = engine.load_params()
        log(f"model {args.model}  batch {args.batch}  prompt {args.prompt_len}  output "
            f"{args.output_len}  max_seq_len {args.max_seq_len}  {args.protocol}  "
            f"{os.cpu_count()} CPUs")
        rounds = asyncio.run(measure(engine, params, args, proc, ports, log))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    medians = {}
    for protocol in args.protocols:
        mine = [r for r in rounds if r["protocol"] == protocol]
        ratios = [r["ratio"] for r in mine]
        medians[protocol] = {"ratio": round(statistics.median(ratios), 4),
                             "cpu_ratio": round(statistics.median(r["cpu_ratio"] for r in mine), 4)}
        log(f"{protocol}: serve / bare tokens/s: median {medians[protocol]['ratio']:.3f} over "
            f"{len(mine)} rounds (min {min(ratios):.3f}, max {max(ratios):.3f})")
        # What the ratio is where both are bound by the same cores: CPU per token, bare
        # over server plus its clients.
        log(f"{protocol}: CPU per token, bare / (server + clients): median "
            f"{medians[protocol]['cpu_ratio']:.3f}")
    if args.json:
        print(json.dumps({"model": args.model, "batch": args.batch, "protocols": args.protocols,
                          "prompt_len": args.prompt_len, "output_len": args.output_len,
                          "rounds": rounds, "medians": medians}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
