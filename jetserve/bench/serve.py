"""`jetserve bench serve`: a load generator against a running jetserve server.

Requests go out at each given rate (requests/s) with Poisson arrivals (exponential gaps)
or gamma-burst arrivals (gamma gaps of the same mean, shape `burstiness`: below 1 the
requests come in bursts, 1 is Poisson), over the gRPC `Decode` stream or the OpenAI HTTP
`/v1/completions` stream, prompts as token ids. Per request: TTFT (send to first token),
ITL (gaps between streamed messages), TPOT ((e2e - TTFT) / (tokens - 1)) and end-to-end
latency; per rate: their p50 / p90 / p99, output tokens/s, and goodput (requests/s that
met every `--slo`). Over HTTP a streamed chunk may carry several tokens, so ITL there is
per chunk; token counts come from the final usage record.

Lengths: `fixed` (every prompt `prompt_len` tokens, every output `output_len`), or
`synthetic`: log-normal prompt and output lengths with those medians and long right
tails, as in chat logs such as ShareGPT (generated here; no dataset is read). A shared
prefix (`shared_prefix` tokens, the same for every request, like a system prompt) is put
in front of every prompt. Outputs ignore EOS so every request makes its tokens.

Before the first rate the server's readiness is awaited and one request is sent alone;
its latency (which includes any compile the server left to its first request) is printed
on its own line as the cold start and kept out of the statistics. Then `warmup` requests
of the workload go out at once, also outside the statistics, so that prompt lengths the
server's own warm-up did not compile do not land in the first rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    num_requests: int = 64  # per rate
    prompt_len: int = 128  # median with synthetic lengths
    output_len: int = 128
    lengths: str = "fixed"  # or "synthetic"
    shared_prefix: int = 0  # tokens in front of every prompt
    max_total: int = 1024  # prompt + output tokens of any request (the server's max_seq_len)
    vocab: int = 256  # prompt ids are drawn from [3, vocab)
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "prompt_len", "output_len", "max_total", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 4:
            raise ValueError(f"vocab must be >= 4, got {self.vocab}")
        if self.lengths not in ("fixed", "synthetic"):
            raise ValueError(f"lengths must be fixed or synthetic, got {self.lengths!r}")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be >= 0, got {self.shared_prefix}")
        if self.shared_prefix + self.prompt_len + self.output_len > self.max_total:
            raise ValueError(f"shared_prefix + prompt_len + output_len = "
                             f"{self.shared_prefix + self.prompt_len + self.output_len} exceeds "
                             f"max_total {self.max_total}")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int


def make_requests(w: Workload, rng: np.random.Generator) -> list[BenchRequest]:
    prefix = rng.integers(3, w.vocab, w.shared_prefix).tolist()
    if w.lengths == "fixed":
        p_lens = np.full(w.num_requests, w.prompt_len)
        o_lens = np.full(w.num_requests, w.output_len)
    else:  # log-normal around the medians; sigmas give chat-like tails (p99 ~ 6-10x median)
        p_lens = np.round(w.prompt_len * rng.lognormal(0.0, 0.9, w.num_requests))
        o_lens = np.round(w.output_len * rng.lognormal(0.0, 0.7, w.num_requests))
    out = []
    room = w.max_total - w.shared_prefix
    for p, o in zip(p_lens.astype(int), o_lens.astype(int), strict=True):
        o = int(np.clip(o, 1, room - 1))
        p = int(np.clip(p, 1, room - o))
        out.append(BenchRequest(tuple(prefix + rng.integers(3, w.vocab, p).tolist()), o))
    return out


def arrival_times(n: int, rate: float, rng: np.random.Generator, *, arrival: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """Send times (s from the start) of n requests at `rate` requests/s; inf: all at once."""
    if not rate > 0:
        raise ValueError(f"rates must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif arrival == "gamma":
        if not burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    else:
        raise ValueError(f"arrival must be poisson or gamma, got {arrival!r}")
    gaps[0] = 0.0
    return np.cumsum(gaps)


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, sep, val = part.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo entries are KEY=MS with KEY one of {list(SLO_KEYS)}, "
                             f"got {part.strip()!r}")
        try:
            out[key] = float(val)
        except ValueError:
            raise ValueError(f"--slo {key}: {val!r} is not a number") from None
        if not out[key] > 0:
            raise ValueError(f"--slo {key} must be > 0, got {val}")
    return out


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates must be > 0, got {text!r}")
    return rates


# ---- clients: each streams one request and yields (arrival time, tokens) per message ----


class GrpcClient:
    def __init__(self, target: str, api_key: str | None):
        import grpc

        from protos import jetstream_pb2, jetstream_pb2_grpc

        self.pb = jetstream_pb2
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = jetstream_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def ready(self) -> bool:
        try:
            r = await self.stub.HealthCheck(self.pb.HealthCheckRequest(), timeout=5)
            return r.is_live
        except Exception:  # not listening yet
            return False

    async def stream(self, req: BenchRequest):
        msg = self.pb.DecodeRequest(
            max_tokens=req.max_tokens, has_bos=True, ignore_eos=True,
            token_content=self.pb.DecodeRequest.TokenContent(token_ids=list(req.prompt_ids)))
        async for resp in self.stub.Decode(msg, metadata=self.metadata):
            n = sum(len(s.token_ids) for s in resp.stream_content.samples)
            yield time.perf_counter(), n

    async def close(self):
        await self.channel.close()


class HttpClient:
    def __init__(self, base: str, api_key: str | None, model: str | None):
        import httpx

        # A fresh connection per request: llama.cpp's server closed a kept-alive one just
        # as the next request went out on it, which failed that request.
        self.client = httpx.AsyncClient(base_url=base, timeout=None,
                                        limits=httpx.Limits(max_keepalive_connections=0))
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model

    async def ready(self) -> bool:
        try:
            r = await self.client.get("/v1/models", headers=self.headers, timeout=5)
        except Exception:  # not listening yet
            return False
        if r.status_code != 200:
            return False
        if self.model is None:  # ask for the model the server serves
            self.model = r.json()["data"][0]["id"]
        return True

    async def stream(self, req: BenchRequest):
        body = {"model": self.model, "prompt": list(req.prompt_ids),
                "max_tokens": req.max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        async with self.client.stream("POST", "/v1/completions", json=body,
                                      headers=self.headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):  # the last record: the true token count
                    total = chunk["usage"]["completion_tokens"]
                    if total > seen:
                        yield None, total - seen
                if chunk.get("choices"):
                    seen += 1
                    yield time.perf_counter(), 1

    async def close(self):
        await self.client.aclose()


def make_client(url: str, api_key: str | None, model: str | None):
    u = urlparse(url)
    if u.scheme == "grpc" and u.netloc:
        return GrpcClient(u.netloc, api_key)
    if u.scheme in ("http", "https") and u.netloc:
        return HttpClient(url, api_key, model)
    raise ValueError(f"--url must be grpc://HOST:PORT or http://HOST:PORT, got {url!r}")


# ---- one request, one rate, the whole sweep -----------------------------------------------


async def timed_request(client, req: BenchRequest) -> dict:
    rec = {"prompt_len": len(req.prompt_ids), "max_tokens": req.max_tokens, "ok": True,
           "error": None}
    t0 = time.perf_counter()
    times, tokens = [], 0
    try:
        async for t, n in client.stream(req):
            tokens += n
            if t is not None and n > 0:
                times.append(t)
    except Exception as e:  # one failed request is a record, not the end of the run
        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    end = times[-1] if times else time.perf_counter()
    rec["output_tokens"] = tokens
    rec["send_s"] = t0
    rec["ttft_ms"] = (times[0] - t0) * 1e3 if times else None
    rec["e2e_ms"] = (end - t0) * 1e3
    rec["itl_ms"] = [round((b - a) * 1e3, 3) for a, b in zip(times, times[1:], strict=False)]
    rec["tpot_ms"] = ((end - times[0]) * 1e3 / (tokens - 1)) if times and tokens > 1 else None
    if rec["ok"] and tokens == 0:
        rec.update(ok=False, error="no tokens streamed")
    return rec


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return {f"p{p}": None for p in PERCENTILES}
    arr = np.asarray(values, float)
    return {f"p{p}": round(float(np.percentile(arr, p)), 3) for p in PERCENTILES}


def meets(rec: dict, slo: dict[str, float]) -> bool:
    if not rec["ok"]:
        return False
    for key, limit in slo.items():
        vals = rec[key] if key == "itl_ms" else [rec[key]]
        if any(v is None or v > limit for v in vals):
            return False
    return True


def summarize(rate: float, records: list[dict], duration: float, slo: dict[str, float]) -> dict:
    ok = [r for r in records if r["ok"]]
    return {
        "rate": rate, "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "duration_s": round(duration, 3),
        "throughput_tok_s": round(sum(r["output_tokens"] for r in ok) / duration, 2),
        "request_throughput": round(len(ok) / duration, 3),
        "goodput_req_s": round(sum(meets(r, slo) for r in records) / duration, 3),
        "ttft_ms": percentiles([r["ttft_ms"] for r in ok]),
        "tpot_ms": percentiles([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
        "itl_ms": percentiles([x for r in ok for x in r["itl_ms"]]),
        "e2e_ms": percentiles([r["e2e_ms"] for r in ok]),
    }


async def run_rate(client, reqs: list[BenchRequest], times: np.ndarray) -> tuple[list, float]:
    start = time.perf_counter()

    async def one(i):
        delay = start + times[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = await timed_request(client, reqs[i])
        rec["id"] = i
        rec["send_s"] = round(rec["send_s"] - start, 4)
        return rec

    records = await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return list(records), time.perf_counter() - start


async def run_async(url: str, rates: Sequence[float], w: Workload, *, arrival: str = "poisson",
                    burstiness: float = 1.0, slo: dict[str, float] | None = None,
                    api_key: str | None = None, model: str | None = None, ready_timeout_s: float = 600,
                    label: str | None = None, warmup: int = 0, log=print) -> dict:
    slo = slo or {}
    client = make_client(url, api_key, model)
    try:
        t0 = time.perf_counter()
        while not await client.ready():
            if time.perf_counter() - t0 > ready_timeout_s:
                raise RuntimeError(f"{url} was not ready within {ready_timeout_s} s")
            await asyncio.sleep(0.5)
        ready_s = time.perf_counter() - t0
        rng = np.random.default_rng(w.seed)
        cold = await timed_request(client, make_requests(
            dataclasses.replace(w, num_requests=1, lengths="fixed"), rng)[0])
        if not cold["ok"]:
            raise RuntimeError(f"the first request failed: {cold['error']}")
        log(f"cold start: ready after {ready_s:.2f} s; first request alone TTFT "
            f"{cold['ttft_ms']:.1f} ms, e2e {cold['e2e_ms']:.1f} ms")
        warm_s = 0.0
        if warmup > 0:
            warm = make_requests(dataclasses.replace(w, num_requests=warmup), rng)
            recs, warm_s = await run_rate(client, warm, np.zeros(len(warm)))
            bad = [r["error"] for r in recs if not r["ok"]]
            if bad:
                raise RuntimeError(f"a warm-up request failed: {bad[0]}")
            log(f"warm-up: {warmup} requests at once in {warm_s:.2f} s (not counted)")
        rows, records = [], []
        for rate in rates:
            reqs = make_requests(w, rng)
            times = arrival_times(len(reqs), rate, rng, arrival=arrival, burstiness=burstiness)
            recs, duration = await run_rate(client, reqs, times)
            for r in recs:
                r["rate"] = rate
            row = summarize(rate, recs, duration, slo)
            rows.append(row)
            records.extend(recs)
            log(f"rate {rate:g} req/s: {row['completed']}/{row['requests']} ok, "
                f"{row['throughput_tok_s']:.1f} tok/s, goodput {row['goodput_req_s']:.2f} req/s, "
                f"TTFT p50/p99 {row['ttft_ms']['p50']}/{row['ttft_ms']['p99']} ms, "
                f"TPOT p50/p99 {row['tpot_ms']['p50']}/{row['tpot_ms']['p99']} ms")
    finally:
        await client.close()
    return {"label": label or url, "url": url, "arrival": arrival, "burstiness": burstiness,
            "workload": dataclasses.asdict(w), "slo": slo,
            "cold_start": {"ready_s": round(ready_s, 3), "ttft_ms": round(cold["ttft_ms"], 3),
                           "e2e_ms": round(cold["e2e_ms"], 3), "warmup_requests": warmup,
                           "warmup_s": round(warm_s, 3)},
            "rows": rows, "requests": records}


def run(url: str, rates: Sequence[float], w: Workload, **kw) -> dict:
    return asyncio.run(run_async(url, rates, w, **kw))


def figure(results: Sequence[dict]):
    """Latency (TTFT, TPOT) against output tokens/s, one colour per run; p50 solid with
    circles, p99 dashed with squares. One legend under both panels, so it covers no point:
    a run per entry (its `label`), and one entry each for the p50 and p99 line styles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    handles = []
    for res in results:
        xs = [r["throughput_tok_s"] for r in res["rows"]]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            (line,) = ax.plot(xs, [r[key]["p50"] for r in res["rows"]], "o-")
            ax.plot(xs, [r[key]["p99"] for r in res["rows"]], "s--", color=line.get_color())
        handles.append(Line2D([], [], color=line.get_color(), lw=2, label=res["label"]))
    handles += [Line2D([], [], color="0.4", marker="o", ls="-", label="p50"),
                Line2D([], [], color="0.4", marker="s", ls="--", label="p99")]
    for ax, title in zip(axes, ("time to first token", "time per output token"), strict=True):
        ax.set_xlabel("throughput (output tokens/s)")
        ax.set_ylabel("ms (log scale)")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.07 * rows, 1, 1))  # room under the panels for the legend
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8,
               frameon=False)
    return fig


def plot(results: Sequence[dict], path: str) -> str:
    """Writes `figure(results)` to `path` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
