"""Benchmarks that print figures: decode against its floor, jetserve against transformers,
quantized variants against the float model, KV capacity of the paged layout,
inter-token latency under chunked prefill, TTFT with the prefix cache, speculative
decoding against plain, start-up with a cold and a warm compile cache, structured
output's constrained step against the free one."""

from __future__ import annotations

import argparse
import importlib.util
import json

from jetserve import compile_cache
from jetserve.commands import bench_structured
from jetserve.commands.plan import parse_batches

OVERHEAD_MODULE = "jetserve.bench.orchestrator_overhead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)

    d = sub.add_parser("decode", help="generate-step time against the memory/compute floor")
    d.add_argument("--model", default="random:llama-156m",
                   help="HF or Orbax directory, or random:NAME")
    d.add_argument("--batch", default="1,8,32")
    d.add_argument("--context", type=int, default=192, help="live tokens in every slot")
    d.add_argument("--steps", type=int, default=24, help="timed steps per batch")
    d.add_argument("--warmup", type=int, default=4)
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    d.add_argument("--max-seq-len", type=int, default=None,
                   help="default: context + warmup + steps, rounded up to 128")
    d.add_argument("--read-gb", type=float, default=None,
                   help="bandwidth probe size in GB (default 2 GiB)")
    d.add_argument("--matmul-size", type=int, default=2048, help="FLOP/s probe matmul size")
    d.add_argument("--quantize", default="none", choices=["none", "int8", "int4"])
    d.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    d.add_argument("--kv-layout", default="contiguous", choices=["contiguous", "paged"])
    d.add_argument("--loras", type=int, default=0,
                   help="N > 0: the step with slots on N LoRA adapters against the base's")
    d.add_argument("--lora-rank", type=int, default=16, help="rank of those adapters")
    d.add_argument("--slots", type=int, default=None, help="one engine of N slots; each "
                   "batch below N is a step over its first slots (--decode-batch-sizes)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(_bench=_decode)

    c = sub.add_parser("compare-hf", help="jetserve vs transformers generate, same weights")
    c.add_argument("--model", default=None,
                   help="HF directory (default: a random llama-156m written to a temp dir)")
    c.add_argument("--batch", default="1,32")
    c.add_argument("--prompt-len", type=int, default=128)
    c.add_argument("--new-tokens", type=int, default=128)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--max-seq-len", type=int, default=1024)
    c.add_argument("--no-bf16", action="store_true", help="skip the transformers bf16 column")
    c.add_argument("--torch-threads", type=int, default=None,
                   help="transformers' intra-op threads (default: every core)")
    c.add_argument("--read-gb", type=float, default=None)
    c.add_argument("--json", action="store_true")
    c.set_defaults(_bench=_compare_hf)

    b = sub.add_parser("batch", help="a jetserve batch job vs transformers batched generate")
    b.add_argument("--model", default=None,
                   help="HF directory (default: a random llama of --preset in a temp dir)")
    b.add_argument("--preset", default="small", help="random:NAME shape when --model is not given")
    b.add_argument("--prompts", type=int, default=1000)
    b.add_argument("--min-len", type=int, default=8)
    b.add_argument("--max-len", type=int, default=64)
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--slots", type=int, default=32, help="jetserve max_concurrent_decodes")
    b.add_argument("--hf-batch", type=int, default=32, help="prompts per transformers generate")
    b.add_argument("--repeats", type=int, default=2, help="runs per side; the best counts")
    b.add_argument("--torch-threads", type=int, default=None,
                   help="transformers' intra-op threads (default: every core; on a machine "
                        "busy with other work, 1 avoids spinning threads)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(_bench=_batch)

    q = sub.add_parser("quality", help="quantized weights / KV cache vs the float model")
    q.add_argument("--model", default=None,
                   help="HF or Orbax directory, or random:NAME (default: bundled model)")
    q.add_argument("--variants", default="none,int8,int4,kv-int8,int8+kv-int8",
                   help="comma-separated, from none,int8,int4,kv-int8,int8+kv-int8")
    q.add_argument("--steps", type=int, default=256, help="decode steps per prompt")
    q.add_argument("--prompts", type=int, default=4)
    q.add_argument("--prompt-len", type=int, default=16)
    q.add_argument("--text", default=None, help="text file for perplexity")
    q.add_argument("--text-tokens", type=int, default=512)
    q.add_argument("--quant-group-size", type=int, default=32)
    q.add_argument("--json", action="store_true")
    q.set_defaults(_bench=_quality)
    k = sub.add_parser("capacity", help="concurrent sequences in one KV budget, paged vs "
                                        "contiguous")
    k.add_argument("--model", default="random:tiny", help="HF or Orbax directory, or random:NAME")
    k.add_argument("--kv-tokens", type=int, default=8192,
                   help="KV budget: cached positions per layer, the same for both layouts")
    k.add_argument("--max-seq-len", type=int, default=1024)
    k.add_argument("--page-size", type=int, default=16)
    k.add_argument("--paged-slots", type=int, default=40)
    k.add_argument("--requests", type=int, default=120)
    k.add_argument("--prompt-median", type=int, default=160)
    k.add_argument("--output-median", type=int, default=96)
    k.add_argument("--json", action="store_true")
    k.set_defaults(_bench=_capacity)

    h = sub.add_parser("chunked", help="inter-token latency while long prompts arrive, "
                                       "chunked prefill vs whole")
    h.add_argument("--model", default="random:small", help="HF or Orbax directory, or random:NAME")
    h.add_argument("--prompt-len", type=int, default=1000, help="tokens of each arriving prompt")
    h.add_argument("--chunk", type=int, default=128, help="--prefill-chunk of the chunked run")
    h.add_argument("--running", type=int, default=4, help="requests streaming meanwhile")
    h.add_argument("--arrivals", type=int, default=4, help="long prompts, one after another")
    h.add_argument("--max-seq-len", type=int, default=2048)
    h.add_argument("--json", action="store_true")
    h.set_defaults(_bench=_chunked)

    pf = sub.add_parser("prefill", help="long-prompt prefill: tokens/s, temp bytes and peak "
                                        "RSS per length, against the compute floor")
    pf.add_argument("--model", default="random:llama-156m",
                    help="HF or Orbax directory, or random:NAME")
    pf.add_argument("--lengths", default="1024,4096,16384,32768", help="prompt lengths")
    pf.add_argument("--chunk", type=int, default=2048,
                    help="prefill chunk: longer prompts go in chunks of it")
    pf.add_argument("--attention", default="auto",
                    help="prefill attention: auto, xla, plain (one-shot scores), cudnn, pallas_tpu")
    pf.add_argument("--json", action="store_true")
    pf.set_defaults(_bench=_prefill)

    x = sub.add_parser("prefix", help="TTFT with a shared system prompt: prefix cache off, "
                                      "on, host tier only")
    x.add_argument("--model", default="random:small", help="HF or Orbax directory, or random:NAME")
    x.add_argument("--system-len", type=int, default=1000, help="tokens of the shared prompt")
    x.add_argument("--question-len", type=int, default=16)
    x.add_argument("--requests", type=int, default=8)
    x.add_argument("--cache-mb", type=int, default=512, help="budget of the tier in use")
    x.add_argument("--kv-layout", choices=("paged", "contiguous"), default="paged",
                   help="paged: the cache's device tier is the engine's KV pages")
    x.add_argument("--page-size", type=int, default=16, help="KV page = cache block, tokens")
    x.add_argument("--json", action="store_true")
    x.set_defaults(_bench=_prefix)

    m = sub.add_parser("make-hf-model", help="write a random HF Llama of a random:NAME shape")
    m.add_argument("--preset", default="llama-156m")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(_bench=_make_hf_model)

    s = sub.add_parser("serve", help="load generator against a running server: latency, "
                       "throughput, goodput over request rates")
    s.add_argument("--url", required=True, help="grpc://HOST:PORT or http://HOST:PORT")
    s.add_argument("--rates", default="1,2,4", help="requests/s, comma-separated; inf: all at once")
    s.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    s.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    s.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: < 1 bursty, 1 Poisson-like")
    s.add_argument("--lengths", default="fixed", choices=["fixed", "synthetic"],
                   help="synthetic: log-normal, ShareGPT-like tails around the medians")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens shared by every prompt, in front")
    s.add_argument("--max-total", type=int, default=1024,
                   help="cap on prompt + output tokens (the server's --max-seq-len)")
    s.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this")
    s.add_argument("--slo", default=None, help="e.g. ttft_ms=500,tpot_ms=50 (goodput)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--model-name", default=None,
                   help="the HTTP requests' model field (default: the one /v1/models lists)")
    s.add_argument("--label", default=None, help="name of this run in the plot")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=0,
                   help="requests sent at once before the first rate, not counted")
    s.add_argument("--ready-timeout", type=float, default=600.0)
    s.add_argument("--out", default=None, help="write the JSON (with per-request records) here")
    s.add_argument("--plot", default=None, help="write a latency-vs-throughput PNG here")
    s.add_argument("--json", action="store_true", help="print the JSON (without per-request records)")
    s.set_defaults(_bench=_serve)

    sp = sub.add_parser("speculative", help="decode with speculative decoding vs without")
    sp.add_argument("--model", default=None,
                    help="HF or Orbax directory, or random:NAME (default: bundled model)")
    sp.add_argument("--speculative", default="ngram:4",
                    help="the drafter: ngram:K, or draft:PATH:K (a draft model: a directory "
                         "or random:NAME with the model's vocabulary)")
    sp.add_argument("--workloads", default="python,random",
                    help="comma-separated, from python (stdlib source), random (random ids)")
    sp.add_argument("--batch", type=int, default=4, help="prompts decoded together")
    sp.add_argument("--prompt-len", type=int, default=192)
    sp.add_argument("--new-tokens", type=int, default=96)
    sp.add_argument("--repeats", type=int, default=3, help="alternating runs; the best counts")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(_bench=_speculative)

    pl = sub.add_parser("plot", help="one latency-vs-throughput PNG from `bench serve --out` files")
    pl.add_argument("results", nargs="+")
    pl.add_argument("--out", required=True)
    pl.set_defaults(_bench=_plot)

    for name in ("decode", "compare-hf", "batch", "quality", "capacity", "chunked", "prefix",
                 "speculative"):  # the ones that build an engine in this process
        compile_cache.add_argument(sub.choices[name])

    st = sub.add_parser("startup", help="process start to first token with a cold and then "
                                        "a warm compile cache")
    st.add_argument("--model", default=None,
                    help="HF or Orbax directory, or random:NAME (default: bundled model)")
    st.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (one bucket)")
    st.add_argument("--max-seq-len", type=int, default=256)
    st.add_argument("--timeout", type=float, default=900.0,
                    help="seconds each `jetserve generate` may take")
    st.add_argument("--json", action="store_true")
    st.set_defaults(_bench=_startup)
    bench_structured.add_parser(sub)

    # Benchmarks whose modules parse their own flags ("+" as this parser's prefix keeps
    # it from reading theirs).
    for name, module, what in (
            ("transfer", "transfer", "KV bytes/s pulled between two processes vs one's device_put"),
            ("serve-path", "serve_path", "a served batch against the bare generate step"),
            ("prefill-rows", "prefill_rows", "one prefill call of R prompts against R calls"),
            ("window-kv", "window_kv", "sliding layers' KV page rings vs an all-global cache"),
            ("ray-batch", "ray_batch", "batch --ray with 1, 2, ... actors against one process")):
        own = sub.add_parser(name, help=f"{what} (jetserve/bench/{module}.py; its own flags)",
                             add_help=False, prefix_chars="+")
        own.add_argument("rest", nargs=argparse.REMAINDER)
        own.set_defaults(_bench=lambda a, m=f"jetserve.bench.{module}":
                         importlib.import_module(m).main(a.rest))

    if importlib.util.find_spec(OVERHEAD_MODULE) is not None:
        # Every argument goes to the module's own parser; "+" as the prefix keeps this one
        # from reading a leading "--batch" as its own option.
        o = sub.add_parser("overhead", help="orchestrator generate loop vs bare engine step",
                           add_help=False, prefix_chars="+")
        o.add_argument("rest", nargs=argparse.REMAINDER)
        o.set_defaults(_bench=_overhead)


def _read_bytes(gb: float | None) -> int | None:
    if gb is not None and not gb > 0:
        raise ValueError(f"--read-gb must be > 0, got {gb}")
    return None if gb is None else int(gb * 1e9)


def _decode(args: argparse.Namespace) -> int:
    from jetserve.bench import decode

    cfg = decode.DecodeBenchConfig(
        model=args.model, batches=tuple(parse_batches(args.batch)), context=args.context,
        steps=args.steps, warmup=args.warmup, dtype=args.dtype,
        max_seq_len=args.max_seq_len, read_bytes=_read_bytes(args.read_gb),
        matmul_size=args.matmul_size, quantize=args.quantize, kv_dtype=args.kv_dtype,
        kv_layout=args.kv_layout, slots=args.slots)
    log = (lambda *a: None) if args.json else print
    if args.loras:
        from engines.lora import LoraConfig
        from jetserve.bench import lora_decode

        lora = LoraConfig(max_loras=args.loras, max_rank=args.lora_rank)
        out = lora_decode.run(lora_decode.LoraBenchConfig(decode=cfg, lora=lora), log=log)
    else:
        out = decode.run(cfg, log=log)
    if args.json or args.loras:  # the LoRA bench prints its JSON only
        print(json.dumps(out))
        return 0
    print(f"bandwidth {out['bandwidth_gbps']} GB/s (probes {out['bandwidth_probes_gbps']}), "
          f"matmul {out['matmul_gflops']} GFLOP/s, weights read {out['weights_read_bytes'] / 1e6:.1f} MB, "
          f"load average {out['load_average_1m']} on {out['cpus']} CPUs")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'best ms':>8} {'floor ms':>8} "
          f"{'fraction':>8} {'best':>6} {'bound':>7} {'tokens/s':>9}")
    for r in out["rows"]:
        print(f"{r['batch']:>5} {r['context']:>7} {r['step_ms']:>8.2f} {r['step_ms_best']:>8.2f} "
              f"{r['floor_ms']:>8.2f} {r['fraction_of_floor']:>8.3f} "
              f"{r['fraction_of_floor_best']:>6.3f} {r['bound']:>7} {r['tokens_per_s']:>9.1f}")
    return 0


def _speculative(args: argparse.Namespace) -> int:
    from jetserve.bench import speculative

    cfg = speculative.SpeculativeBenchConfig(
        model=args.model, speculative=args.speculative,
        workloads=tuple(w for w in args.workloads.split(",") if w), batch=args.batch,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats)
    out = speculative.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'workload':>8} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
          f"{'accepted':>9} {'tok/step':>9} {'same':>5}")
    for r in out["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        print(f"{r['workload']:>8} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} "
              f"{r['speedup']:>8.3f} {rate:>9} {r['tokens_per_step']:>9.2f} "
              f"{r['same_tokens']:>5.2f}")
    return 0


def _compare_hf(args: argparse.Namespace) -> int:
    from jetserve.bench import compare_hf

    cfg = compare_hf.CompareConfig(
        model=args.model, batches=tuple(parse_batches(args.batch)), prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, repeats=args.repeats, max_seq_len=args.max_seq_len,
        bf16=not args.no_bf16, read_bytes=_read_bytes(args.read_gb),
        torch_threads=args.torch_threads)
    out = compare_hf.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'batch':>5} {'jetserve tok/s':>15} {'hf f32 tok/s':>13} {'ratio':>6} "
          f"{'hf bf16 tok/s':>14} {'same seqs':>9}")
    for r in out["rows"]:
        print(f"{r['batch']:>5} {_cell(r['jetserve_tok_s'], 15, 1)} "
              f"{_cell(r['hf_tok_s'], 13, 1)} {_cell(r['ratio'], 6, 2)} "
              f"{_cell(r.get('hf_bf16_tok_s'), 14, 1)} {r['sequences_identical']:>9.2f}")
    return 0


def _cell(x: float | None, width: int, digits: int) -> str:
    """A table cell; n/a for a figure the run did not resolve (or did not take)."""
    return f"{'n/a':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def _batch(args: argparse.Namespace) -> int:
    from jetserve.bench import batch_job

    cfg = batch_job.BatchBenchConfig(
        model=args.model, preset=args.preset, prompts=args.prompts, min_len=args.min_len,
        max_len=args.max_len, new_tokens=args.new_tokens, slots=args.slots,
        hf_batch=args.hf_batch, torch_threads=args.torch_threads, repeats=args.repeats)
    out = batch_job.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"tokens/s: batch job {out['batch_tok_s']}, engine loop {out['engine_loop_tok_s']}, "
          f"transformers {out['hf_tok_s']}; batch / transformers {out['batch_over_hf']:.2f}, "
          f"batch / engine loop {out['batch_over_engine_loop']:.2f}; same tokens as "
          f"transformers {out['same_as_hf']:.3f}, as the engine loop "
          f"{out['same_as_engine_loop']:.3f}")
    return 0


def _quality(args: argparse.Namespace) -> int:
    from jetserve.bench import quality

    cfg = quality.QualityConfig(
        model=args.model, variants=tuple(v for v in args.variants.split(",") if v),
        steps=args.steps, prompts=args.prompts, prompt_len=args.prompt_len, text=args.text,
        text_tokens=args.text_tokens, group=args.quant_group_size)
    out = quality.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
def _capacity(args: argparse.Namespace) -> int:
    from jetserve.bench import capacity

    cfg = capacity.CapacityConfig(
        model=args.model, kv_tokens=args.kv_tokens, max_seq_len=args.max_seq_len,
        page_size=args.page_size, paged_slots=args.paged_slots, requests=args.requests,
        prompt_median=args.prompt_median, output_median=args.output_median)
    out = capacity.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'layout':>10} {'slots':>5} {'mean conc.':>10} {'max conc.':>9} {'steps':>6} "
          f"{'wall s':>7} {'preempt':>7}")
    for name, r in out["rows"].items():
        print(f"{name:>10} {r['slots']:>5} {r['mean_concurrency']:>10.2f} "
              f"{r['max_concurrency']:>9} {r['steps']:>6} {r['wall_s']:>7.1f} "
              f"{r['preemptions']:>7}")
    print(f"paged / contiguous concurrency: {out['concurrency_ratio']:.2f}x")
    return 0


def _chunked(args: argparse.Namespace) -> int:
    from jetserve.bench import chunked

    cfg = chunked.ChunkedConfig(model=args.model, prompt_len=args.prompt_len, chunk=args.chunk,
                                running=args.running, arrivals=args.arrivals,
                                max_seq_len=args.max_seq_len)
    out = chunked.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'prefill':>8} {'gaps':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, r in out["rows"].items():
        print(f"{name:>8} {r['gaps']:>5} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
              f"{r['max_ms']:>8.2f}")
    print(f"p99 inter-token latency, whole / chunked: {out['p99_ratio']:.2f}x")
    return 0


def _prefill(args: argparse.Namespace) -> int:
    from jetserve.bench import prefill

    cfg = prefill.PrefillBenchConfig(model=args.model, chunk=args.chunk, attention=args.attention,
                                     lengths=prefill.parse_lengths(args.lengths))
    out = prefill.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'tokens':>7} {'tokens/s':>9} {'floor':>6} {'temp MB':>9} {'RSS MB':>8} "
          f"{'weights+KV MB':>13}")
    for r in out["rows"]:
        print(f"{r['length']:>7} {r['tokens_per_s']:>9.1f} {r['fraction_of_floor']:>6.3f} "
              f"{r['temp_bytes'] / 1e6:>9.1f} {r['peak_rss_bytes'] / 1e6:>8.0f} "
              f"{(r['weights_bytes'] + r['kv_bytes']) / 1e6:>13.0f}")
    return 0


def _prefix(args: argparse.Namespace) -> int:
    from jetserve.bench import prefix

    cfg = prefix.PrefixBenchConfig(model=args.model, system_len=args.system_len,
                                   question_len=args.question_len, requests=args.requests,
                                   cache_mb=args.cache_mb, kv_layout=args.kv_layout,
                                   page_size=args.page_size)
    out = prefix.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'cache':>5} {'miss ms':>8} {'p50 ms':>8} {'mean ms':>8} {'hit rate':>8} "
          f"{'hbm MB':>7} {'host MB':>7}")
    for name, r in out["rows"].items():
        print(f"{name:>5} {r['first_ms']:>8.2f} {r['p50_ms']:>8.2f} {r['mean_ms']:>8.2f} "
              f"{r['hit_rate']:>8.3f} {r['hbm_bytes'] / 2**20:>7.1f} "
              f"{r['host_bytes'] / 2**20:>7.1f}")
    print(f"TTFT off / on: {out['speedup_hbm']:.2f}x; off / host tier only: "
          f"{out['speedup_host']:.2f}x")
    d = out["dedup"]
    print(f"{d['prompts']} prompts through one system prompt: the cache holds "
          f"{d['held_bytes'] / 2**20:.2f} MiB ({d['held_blocks']} blocks); one copy of the "
          f"system prompt is {d['system_copy_bytes'] / 2**20:.2f} MiB; one entry per prompt "
          f"would be {d['per_entry_bytes'] / 2**20:.2f} MiB")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jetserve.bench import serve

    w = serve.Workload(num_requests=args.num_requests, prompt_len=args.prompt_len,
                       output_len=args.output_len, lengths=args.lengths,
                       shared_prefix=args.shared_prefix, max_total=args.max_total,
                       vocab=args.vocab, seed=args.seed)
    out = serve.run(args.url, serve.parse_rates(args.rates), w, arrival=args.arrival,
                    burstiness=args.burstiness, slo=serve.parse_slo(args.slo),
                    api_key=args.api_key, model=args.model_name,
                    ready_timeout_s=args.ready_timeout, label=args.label, warmup=args.warmup,
                    log=(lambda *a: None) if args.json else print)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)
    if args.plot:
        serve.plot([out], args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "requests"}))
    return 0


def _startup(args: argparse.Namespace) -> int:
    from jetserve.bench import startup

    cfg = startup.StartupConfig(model=args.model, prompt_len=args.prompt_len,
                                max_seq_len=args.max_seq_len, timeout_s=args.timeout)
    out = startup.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    for r in (out["cold"], out["warm"]):
        print(f"{r['cache']:>4}: first token {r['first_token_s']:.2f} s after the process "
              f"started, compiling {r['compile_s']:.2f} s ({r['compile_share']:.0%}), "
              f"{r['programs']} programs ({r['from_cache']} from cache)")
    print(f"warm / cold: {out['warm_over_cold']:.2f}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from jetserve.bench import serve

    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    print(f"wrote {serve.plot(results, args.out)}")
    return 0


def _make_hf_model(args: argparse.Namespace) -> int:
    from jetserve.bench.hf_model import make_hf_model

    print(f"wrote {make_hf_model(args.preset, args.out, seed=args.seed)}")
    return 0


def _overhead(args: argparse.Namespace) -> int:
    mod = importlib.import_module(OVERHEAD_MODULE)
    return int(mod.main(args.rest) or 0)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)
