"""Soak a real `jetserve serve` with hostile traffic; print what leaked.

Starts `jetserve serve` (the bundled model by default) on 127.0.0.1 as a subprocess, then,
all at once:

- `--requests` requests at `--concurrency` (a refused one retried after 1 s, as its
  Retry-After says, up to 3 times), mixed protocols (gRPC Decode streams, HTTP
  completions streamed and not, HTTP chat streamed), random prompts and lengths; about
  `--cancel-frac` of them leave mid-stream (the stream is closed after a few messages, or a
  non-streaming request's client times out);
- `--slow-readers` clients that ask for n=16 x 1,000 streamed tokens over a socket with a
  tiny receive buffer, never read, and hang up after a while (then come back);
- `--slowloris` connections that trickle request headers one byte a second (reconnecting
  when the server closes them);
- a prober that times `/health` and gRPC health every 100 ms.

At the end it waits for the server to go idle and reads /metrics: decode slots in use,
requests in flight, queue depths and free KV pages must all be back where they started.
RSS, threads and file descriptors of the server are sampled from /proc after a warm-up pass
and at the end. Everything goes to 127.0.0.1 and every loop is bounded in count and time.

    python scripts/soak_serve.py --requests 10000 --concurrency 300 --slots 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc

PROMPTS = ["import os\n\ndef read_file(path):\n    ", "class Stack:\n    def __init__(self):",
           "def add(a, b):\n    ", "for i in range(10):\n    ", '"""Utilities for ',
           "    return self._", "if __name__ == '__main__':\n    ", "try:\n    import "]


HTTP_CLIENTS = 8  # source addresses 127.0.0.2 ... 127.0.0.9
RETRIES = 3  # an overloaded request is retried this often before it counts as refused


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_figures(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return {"rss_mb": round(rss_kb / 1024, 1), "threads": threads,
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def parse_metrics(text: str) -> dict[str, float]:
    """Sums each gauge over its labels: `jetserve_slots_in_use{engine="0"} 0.0` -> name: 0."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{")[0]
        if "jetserve_queue_depth" in key:
            key = name  # one per queue
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Tally:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1


async def grpc_stream(stub, rng, cancel: bool) -> str:
    msg = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=rng.choice(PROMPTS)),
                           max_tokens=rng.randint(1, 32), has_bos=False)
    call = stub.Decode(msg)
    leave_after = rng.randint(1, 4) if cancel else None
    seen = 0
    try:
        async for _ in call:
            seen += 1
            if leave_after is not None and seen >= leave_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and leave_after is not None:
            return "cancelled"
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded"
        return f"grpc {e.code().name}"
    return "ok" if seen else "empty"


async def http_stream(client, rng, cancel: bool, chat: bool) -> str:
    text = rng.choice(PROMPTS)
    body = {"model": "jetserve", "max_tokens": rng.randint(1, 32), "stream": True}
    if chat:
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        url, body["prompt"] = "/v1/completions", text
    leave_after = rng.randint(1, 4) if cancel else None
    seen = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code == 429:
            return "overloaded"
        if r.status_code != 200:
            return f"http {r.status_code}"
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "ok"
            if line.startswith("data: "):
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    return "cancelled"  # leaving the block closes the connection
    return "cut"  # the stream ended without [DONE]


async def http_plain(client, rng, cancel: bool) -> str:
    body = {"model": "jetserve", "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 32)}
    try:
        r = await client.post("/v1/completions", json=body,
                              timeout=rng.uniform(0.01, 0.2) if cancel else None)
    except httpx.TimeoutException:
        return "cancelled"
    if r.status_code == 429:
        return "overloaded"
    return "ok" if r.status_code == 200 and r.json()["choices"] else f"http {r.status_code}"


async def one(kind, stub, client, rng, cancel, timeout) -> str:
    try:
        if kind == "grpc":
            coro = grpc_stream(stub, rng, cancel)
        elif kind == "http_plain":
            coro = http_plain(client, rng, cancel)
        else:
            coro = http_stream(client, rng, cancel, chat=kind == "http_chat")
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        return "hung"
    except (httpx.HTTPError, OSError) as e:
        return f"error {type(e).__name__}"


async def with_retries(kind, stub, client, rng, cancel, timeout, tally: Tally) -> str:
    """As a real client does: an overloaded answer is retried after the server's
    Retry-After (1 s), up to RETRIES times; each refusal is counted."""
    for _ in range(RETRIES):
        outcome = await one(kind, stub, client, rng, cancel, timeout)
        if outcome != "overloaded":
            return outcome
        tally.add("refused_then_retried")
        await asyncio.sleep(1.0)
    return await one(kind, stub, client, rng, cancel, timeout)


async def slow_reader(port: int, stop: asyncio.Event, tally: Tally) -> None:
    body = json.dumps({"model": "jetserve", "prompt": PROMPTS[0], "n": 16, "max_tokens": 1000,
                       "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    while not stop.is_set():
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(s, ("127.0.0.1", port))
            await loop.sock_sendall(s, head + body)
            tally.add("slow_reader_started")
            with_timeout = asyncio.ensure_future(stop.wait())
            await asyncio.wait({with_timeout}, timeout=20)  # never reads
            with_timeout.cancel()
        except OSError:
            tally.add("slow_reader_refused")
        finally:
            s.close()


async def slowloris(port: int, stop: asyncio.Event, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        s = socket.socket()
        s.setblocking(False)
        try:
            await loop.sock_connect(s, ("127.0.0.1", port))
            for ch in b"GET /health HTTP/1.1\r\nX-a: " + b"b" * 10_000:
                await loop.sock_sendall(s, bytes([ch]))
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                    return
                except TimeoutError:
                    pass
        except OSError:  # the server closed it: what a header timeout does
            tally.add("slowloris_closed_by_server")
        finally:
            s.close()


async def http_prober(http_port: int, stop: asyncio.Event, lat: list[float]) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                await c.get("/health", timeout=60)
                lat.append(time.perf_counter() - t)
            except httpx.HTTPError:
                lat.append(float("inf"))
            await asyncio.sleep(0.1)


async def grpc_prober(grpc_port: int, stop: asyncio.Event, lat: list[float]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    hs = health_pb2_grpc.HealthStub(ch)
    while not stop.is_set():
        t = time.perf_counter()
        try:
            await hs.Check(health_pb2.HealthCheckRequest(), timeout=60)
            lat.append(time.perf_counter() - t)
        except grpc.aio.AioRpcError:
            lat.append(float("inf"))
        await asyncio.sleep(0.1)
    await ch.close()


async def drive(n: int, concurrency: int, cancel_frac: float, http_port: int, grpc_port: int,
                seed: int, timeout: float, tally: Tally) -> float:
    kinds = ["grpc", "http_stream", "http_plain", "http_chat"]
    limits = httpx.Limits(max_connections=concurrency + 10, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    # HTTP clients come from several loopback addresses, so the server sees several
    # clients (its fair share is per peer address); gRPC comes from 127.0.0.1.
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", limits=limits,
                                 timeout=None,
                                 transport=httpx.AsyncHTTPTransport(
                                     local_address=f"127.0.0.{2 + k}", limits=limits))
               for k in range(HTTP_CLIENTS)]
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = pb_grpc.OrchestratorStub(ch)

    async def task(i):
        async with sem:
            r = random.Random(seed * 1_000_003 + i)
            tally.add(await with_retries(r.choice(kinds), stub, clients[i % HTTP_CLIENTS], r,
                                         r.random() < cancel_frac, timeout, tally))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(task(i) for i in range(n)))
    finally:
        elapsed = time.perf_counter() - t0
        await ch.close()
        for c in clients:
            await c.aclose()
    return elapsed


async def wait_idle(http_port: int, limit_s: float) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as c:
        end = time.monotonic() + limit_s
        while True:
            m = parse_metrics((await c.get("/metrics")).text)
            busy = (m.get("jetserve_slots_in_use", 0) + m.get("jetserve_requests_in_flight", 0)
                    + sum(v for k, v in m.items() if k.startswith("jetserve_queue_depth")))
            if busy == 0 or time.monotonic() > end:
                return m
            await asyncio.sleep(0.5)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def soak(args, http_port: int, grpc_port: int, pid: int) -> dict:
    warm = Tally()
    await drive(args.warmup, min(args.concurrency, 32), args.cancel_frac, http_port, grpc_port,
                seed=args.seed + 1, timeout=args.request_timeout, tally=warm)
    before_metrics = await wait_idle(http_port, 120)
    before = proc_figures(pid)
    tally, stop = Tally(), asyncio.Event()
    lat: dict[str, list[float]] = {"http": [], "grpc": []}
    side = [asyncio.ensure_future(slow_reader(http_port, stop, tally))
            for _ in range(args.slow_readers)]
    side += [asyncio.ensure_future(slowloris(http_port, stop, tally))
             for _ in range(args.slowloris)]
    side.append(asyncio.ensure_future(http_prober(http_port, stop, lat["http"])))
    side.append(asyncio.ensure_future(grpc_prober(grpc_port, stop, lat["grpc"])))
    elapsed = await drive(args.requests, args.concurrency, args.cancel_frac, http_port, grpc_port,
                          seed=args.seed, timeout=args.request_timeout, tally=tally)
    stop.set()
    await asyncio.gather(*side, return_exceptions=True)
    after_metrics = await wait_idle(http_port, 120)
    await asyncio.sleep(2)  # let the server close what the side clients left
    after = proc_figures(pid)
    keys = ("jetserve_slots_in_use", "jetserve_requests_in_flight", "jetserve_kv_pages_free")
    return {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(elapsed, 1),
        "outcomes": dict(sorted(tally.counts.items())),
        "hung": tally.counts.get("hung", 0),
        "health_ms": {k: {"p50": round(pct(v, 0.5) * 1e3, 1), "p99": round(pct(v, 0.99) * 1e3, 1),
                          "max": round(max(v, default=float("nan")) * 1e3, 1), "probes": len(v)}
                      for k, v in lat.items()},
        "before": before, "after": after,
        "rss_growth": round(after["rss_mb"] / before["rss_mb"] - 1, 4),
        "metrics_before": {k: before_metrics.get(k) for k in keys},
        "metrics_after": {k: after_metrics.get(k) for k in keys},
        "queues_after": {k: v for k, v in after_metrics.items()
                         if k.startswith("jetserve_queue_depth")},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=200, help="requests before the figures")
    p.add_argument("--concurrency", type=int, default=300)
    p.add_argument("--cancel-frac", type=float, default=0.2)
    p.add_argument("--slow-readers", type=int, default=4)
    p.add_argument("--slowloris", type=int, default=50)
    p.add_argument("--slots", type=int, default=4, help="--max-concurrent-decodes")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="a request still running after this long counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("serve_args", nargs="*", help="more `jetserve serve` arguments (after --)")
    args = p.parse_args()
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "jetserve", "serve", "--host", "127.0.0.1",
           "--http-port", str(http_port), "--grpc-port", str(grpc_port),
           "--max-concurrent-decodes", str(args.slots), "--kv-layout", "paged",
           "--served-model-name", "jetserve", *args.serve_args]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:  # until it takes requests (listening, then warmed up)
            print(line, end="", file=sys.stderr)
            if "jetserve serve: ready" in line:
                break
        else:
            raise SystemExit(f"jetserve serve exited with {server.wait()}")
        # Keep draining its output, so a chatty server never blocks on a full pipe.
        threading.Thread(target=lambda: [print(x, end="", file=sys.stderr) for x in server.stdout],
                         daemon=True).start()
        out = asyncio.run(soak(args, http_port, grpc_port, server.pid))
    finally:
        server.terminate()
        server.wait(120)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:>16}: {v}")
    leaked = (out["metrics_after"]["jetserve_slots_in_use"]
              or out["metrics_after"]["jetserve_requests_in_flight"]
              or any(out["queues_after"].values())
              or out["metrics_after"]["jetserve_kv_pages_free"]
              != out["metrics_before"]["jetserve_kv_pages_free"])
    return 1 if out["hung"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
