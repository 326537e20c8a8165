"""How long one client's short request waits behind another client's huge one.

    python scripts/fair_share_probe.py [--prompts 16] [--n 16] [--max-tokens 1000]

Starts `jetserve serve` (the bundled model) on 127.0.0.1 with per-request caps raised so
that one request may make `--prompts` x `--n` sub-requests, then:

1. client B (source address 127.0.0.2) sends a 2-token completion alone, `--repeats`
   times: its latency with an idle server;
2. client A (127.0.0.1) sends `--prompts` prompts x `--n` samples x `--max-tokens`
   tokens in one request; once A's sub-requests fill the queue, B sends the same 2-token
   request again, `--repeats` times, one after the other.

Prints B's latencies alone and behind A, A's own latency, and for scale how long one of
A's sub-requests takes to generate (A's latency divided by the rounds of slots it needed).
A probe, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(port: int, source: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600,
                        transport=httpx.HTTPTransport(local_address=source))


def short_request(c: httpx.Client) -> float:
    t = time.perf_counter()
    r = c.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 2,
                                        "ignore_eos": True, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t


def queued(c: httpx.Client) -> float:
    text = c.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("jetserve_queue_depth") and 'queue="admission"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    subs = args.prompts * args.n
    port = free_port()
    cmd = [sys.executable, "-m", "jetserve", "serve", "--host", "127.0.0.1", "--grpc-port",
           "-1", "--http-port", str(port), "--max-concurrent-decodes", str(args.slots),
           "--max-queued-requests", str(max(256, subs)), "--max-queued-per-client",
           str(subs), "--max-sub-requests", str(subs),
           "--max-prompts-per-request", str(args.prompts)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict = {"sub_requests": subs, "slots": args.slots, "max_tokens": args.max_tokens}
    try:
        for line in server.stdout:
            if "jetserve serve: ready" in line:  # listening, then warmed up
                break
        else:
            raise SystemExit(f"jetserve serve exited with {server.wait()}")
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        a, b = client(port, "127.0.0.1"), client(port, "127.0.0.2")
        short_request(b)  # compiles what a short request needs
        out["b_alone_s"] = [round(short_request(b), 3) for _ in range(args.repeats)]
        big: dict = {}

        def run_a():
            t = time.perf_counter()
            r = a.post("/v1/completions", json={
                "prompt": ["import os\n"] * args.prompts, "n": args.n,
                "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0})
            big["status"] = r.status_code
            big["seconds"] = time.perf_counter() - t

        ta = threading.Thread(target=run_a)
        ta.start()
        end = time.monotonic() + 120
        while queued(b) < subs - 2 * args.slots and time.monotonic() < end:
            time.sleep(0.05)
        out["a_queued_when_b_sent"] = queued(b)
        out["b_behind_a_s"] = [round(short_request(b), 3) for _ in range(args.repeats)]
        ta.join()
        out["a_status"] = big["status"]
        out["a_seconds"] = round(big["seconds"], 1)
        rounds = -(-subs // args.slots)
        out["one_sub_request_s"] = round(big["seconds"] / rounds, 2)
    finally:
        server.terminate()
        server.wait(120)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
