"""Health latency of both servers while clients that read nothing hold long SSE streams.

    python scripts/slow_reader_probe.py [--clients 4] [--n 16] [--max-tokens 1000]

Starts `jetserve serve` (the bundled model, 16 slots) on 127.0.0.1, then opens `--clients`
raw sockets with a small receive buffer, each asking for a streaming completion of
`--n` samples x `--max-tokens` tokens and reading nothing. They hang up once all their
requests have ended (the server's /metrics says so) or after `--hold` seconds, unless the
server's `--write-timeout` cut them off first. Meanwhile two threads
poll HTTP /health and gRPC health every 100 ms, until `--after` seconds past the hang-up.
Prints, for each probe, how many answered, the worst and the p99 latency, and how many
got no answer within 10 s. A probe, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def silent_client(port: int, n: int, max_tokens: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small window, and a small segment size, which keeps the server's send buffer small
    # too (Linux sizes it from the peer's MSS; loopback's is 64 KB), as over a real network.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "Once upon a time", "n": n, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def finished_requests(http: httpx.Client, http_port: int) -> float:
    text = http.get(f"http://127.0.0.1:{http_port}/metrics").text
    for line in text.splitlines():
        if line.startswith("jetserve_e2e_request_latency_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def wait_finished(http: httpx.Client, http_port: int, count: int, hold: float) -> None:
    """Until `count` requests have ended (their whole output is queued) or `hold` s."""
    end = time.monotonic() + hold
    while time.monotonic() < end and finished_requests(http, http_port) < count:
        time.sleep(0.5)


def status_line(s: socket.socket) -> str:
    """The response's status line, peeked (nothing is taken off the socket)."""
    try:
        head = s.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, ConnectionError):
        return "none yet"
    return head.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"


def poll(name: str, ask, stop: threading.Event, out: dict) -> None:
    latencies, failures = [], 0  # every probe's wait, answered or not
    while not stop.is_set():
        t = time.monotonic()
        try:
            ask()
        except Exception:  # noqa: BLE001 (counted and reported)
            failures += 1
        latencies.append(time.monotonic() - t)
        stop.wait(max(0.0, 0.1 - (time.monotonic() - t)))
    out[name] = (latencies, failures)


def wait_ready(http_port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"jetserve serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"jetserve serve not ready after {timeout:g} s")


def report(name: str, latencies: list[float], failures: int) -> str:
    if not latencies:
        return f"{name}: no probes"
    worst = max(latencies)
    p99 = (statistics.quantiles(latencies, n=100)[98] if len(latencies) >= 2 else worst)
    return (f"{name}: {len(latencies)} probes, worst {worst * 1e3:.1f} ms, "
            f"p99 {p99 * 1e3:.1f} ms, {failures} unanswered within {PROBE_TIMEOUT_S:g} s "
            "(counted at the time they waited)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--hold", type=float, default=120.0,
                   help="they hang up when all their requests have ended, or after this")
    p.add_argument("--after", type=float, default=20.0, help="seconds polled after that")
    p.add_argument("--write-timeout", type=float, default=None,
                   help="passed to jetserve serve (default: its own default)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args()

    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "jetserve.cli", "serve", "--host", "127.0.0.1",
           "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--max-concurrent-decodes", "16", "--max-seq-len", "1024",
           "--drain-timeout", "5"]
    if args.write_timeout is not None:
        cmd += ["--write-timeout", str(args.write_timeout)]
    # This checkout's jetserve, unless PYTHONPATH names one (to probe another tree).
    env = {"PYTHONPATH": REPO, **os.environ}
    # `-m` puts the working directory first on sys.path: run from the tree being probed.
    proc = subprocess.Popen(cmd, env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0],
                            stdout=subprocess.DEVNULL)
    try:
        wait_ready(http_port, proc, args.startup_timeout)
        http = httpx.Client(timeout=PROBE_TIMEOUT_S)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = health_pb2_grpc.HealthStub(channel)
        stop, out = threading.Event(), {}
        probes = [
            threading.Thread(target=poll, args=("HTTP", lambda: http.get(
                f"http://127.0.0.1:{http_port}/health").raise_for_status(), stop, out)),
            threading.Thread(target=poll, args=("gRPC", lambda: stub.Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S), stop, out)),
        ]
        for t in probes:
            t.start()
        clients = [silent_client(http_port, args.n, args.max_tokens)
                   for _ in range(args.clients)]
        t0 = time.monotonic()
        wait_finished(http, http_port, args.clients * args.n, args.hold)
        held = time.monotonic() - t0
        statuses = [status_line(c) for c in clients]
        for c in clients:
            c.close()
        time.sleep(args.after)
        stop.set()
        for t in probes:
            t.join()
        channel.close()
        http.close()
        print(f"{args.clients} never-reading SSE clients, n={args.n} x max_tokens="
              f"{args.max_tokens}, held {held:.0f} s, polled {args.after:g} s more "
              f"(write timeout: {args.write_timeout or 'the default'}); their responses: "
              f"{statuses}")
        for name in ("HTTP", "gRPC"):
            print(report(f"{name} health", *out[name]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
