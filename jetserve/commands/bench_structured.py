"""`jetserve bench structured`: its arguments and its printout (the benchmark itself is
jetserve/bench/structured.py, imported when it runs)."""

from __future__ import annotations

import argparse
import json

from jetserve.commands.plan import parse_batches


def add_parser(sub) -> None:
    s = sub.add_parser("structured", help="decode step with every slot constrained by a "
                                          "JSON schema vs none (structured output)")
    s.add_argument("--model", default="random:llama-156m",
                   help="HF or Orbax directory, or random:NAME")
    s.add_argument("--batch", default="8,32")
    s.add_argument("--context", type=int, default=64, help="prompt tokens in every slot")
    s.add_argument("--steps", type=int, default=32, help="timed steps per loop")
    s.add_argument("--repeats", type=int, default=3, help="loops per mode; the best counts")
    s.add_argument("--kv-layout", choices=("contiguous", "paged"), default="contiguous",
                   help="the decode KV cache the loops run on")
    s.add_argument("--json", action="store_true")
    s.set_defaults(_bench=_run)


def _run(args: argparse.Namespace) -> int:
    from jetserve.bench import structured

    cfg = structured.StructuredBenchConfig(
        model=args.model, batches=tuple(parse_batches(args.batch)), context=args.context,
        steps=args.steps, repeats=args.repeats, kv_layout=args.kv_layout)
    out = structured.run(cfg, log=(lambda *a: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']} ({out['kv_layout']} KV): grammar over {out['tokenizer']} tokenizer, load average "
          f"{out['load_average_1m']} on {out['cpus']} CPUs")
    print(f"{'batch':>5} {'free ms':>8} {'masked ms':>9} {'constrained ms':>14} "
          f"{'host mask ms':>12} {'constrained/free':>16} {'masked/free':>11} "
          f"{'mixed/free':>10}")
    for r in out["rows"]:
        print(f"{r['batch']:>5} {r['free_step_ms']:>8.2f} {r['masked_step_ms']:>9.2f} "
              f"{r['constrained_step_ms']:>14.2f} {r['host_mask_ms_per_step']:>12.3f} "
              f"{r['ratio_constrained_to_free']:>16.3f} {r['ratio_masked_to_free']:>11.3f} "
              f"{r['ratio_mixed_to_free']:>10.3f}")
    return 0
