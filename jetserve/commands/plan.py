"""Capacity and roofline plan: what fits on the chips, and the decode step-time floor."""

from __future__ import annotations

import argparse
import json

from jetserve.hardware import NAMES, get_hardware
from jetserve.model_presets import MODEL_PRESETS
from jetserve.plan import GB, LAYOUTS, ModelSpec, Precision, held_ring_tokens, make_plan


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--batch must be comma-separated integers, got {text!r}") from None
    if not out or any(b < 1 for b in out):
        raise ValueError(f"--batch must list integers >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help="HF or Orbax model directory, or random:NAME (default: bundled model)")
    src.add_argument("--model-preset", choices=sorted(MODEL_PRESETS),
                     help="a published model's shapes")
    p.add_argument("--hardware", default="cpu", choices=NAMES,
                   help="accelerator preset; cpu is measured on the spot")
    p.add_argument("--chips", type=int, default=1,
                   help="chips, laid out as --sharding says (tp: past the model's kv "
                        "heads each kv head is held by several chips)")
    p.add_argument("--sharding", default="tp", choices=LAYOUTS,
                   help="how the chips hold the model, as the preset of that name: tp, or "
                        "dp_ep (the slots and their KV split over the chips, 1/chips of the "
                        "cache each; the experts split; every other weight on every chip)")
    p.add_argument("--kv-layout", default="contiguous", choices=["contiguous", "paged"],
                   help="as serve's: paged keeps a ring of pages per sequence on sliding "
                        "layers instead of every position")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (paged)")
    p.add_argument("--max-prefill-length", type=int, default=512,
                   help="prompt chunk, the most positions one step writes (paged: the "
                        "sliding layers' ring holds window + chunk - 1 of them)")
    p.add_argument("--batch", default="1,8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=2048, help="live tokens per sequence")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="auto: float32 on cpu, bfloat16 on accelerators")
    p.add_argument("--weight-bits", type=int, default=None)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--act-bits", type=int, default=None,
                   help="8 with 8-bit weights runs matmuls at the int8 rate")
    p.add_argument("--json", action="store_true", help="one JSON object")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    if args.model_preset:
        return ModelSpec.from_config(MODEL_PRESETS[args.model_preset], args.model_preset)
    from jetserve.model_loading import resolve_model  # imports jax; presets do not need it

    src = resolve_model(args.model)
    return ModelSpec.from_config(src.config, args.model or src.name)


def run(args: argparse.Namespace) -> int:
    if args.chips < 1:
        raise ValueError(f"--chips must be >= 1, got {args.chips}")
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    if args.page_size < 1 or args.max_prefill_length < 1:
        raise ValueError(f"--page-size and --max-prefill-length must be >= 1, got "
                         f"{args.page_size} and {args.max_prefill_length}")
    batches = parse_batches(args.batch)
    spec = model_spec(args)
    ring = (held_ring_tokens(spec, args.page_size, args.max_prefill_length)
            if args.kv_layout == "paged" else None)
    hw = get_hardware(args.hardware)
    dtype = args.dtype if args.dtype != "auto" else (
        "float32" if args.hardware == "cpu" else "bfloat16")
    prec = Precision.from_dtype(dtype, weight_bits=args.weight_bits, kv_bits=args.kv_bits,
                                act_bits=args.act_bits)
    plan = make_plan(spec, hw, chips=args.chips, batches=batches, context=args.context,
                     precision=prec, layout=args.sharding, ring_tokens=ring)
    if args.json:
        print(json.dumps(plan.to_json()))
        return 0
    print(f"model {spec.name}: {spec.params / 1e9:.3f}B parameters, "
          f"{plan.param_bytes / GB:.2f} GB at {prec.weight_bits}-bit weights")
    print(f"hardware {hw.name} x {args.chips}: {hw.hbm_bytes * args.chips / GB:.1f} GB, "
          f"{hw.hbm_bandwidth * args.chips / GB:.1f} GB/s, "
          f"{hw.matmul_flops(prec.weight_bits, prec.act_bits) * args.chips / 1e12:.2f} TFLOP/s"
          + (f" ({hw.note})" if hw.note else ""))
    print(f"KV cache: {plan.kv_bytes_per_token / 1e3:.1f} kB/token, "
          f"{plan.kv_bytes_per_seq / GB:.3f} GB per sequence of {args.context}")
    if ring is not None:
        print(f"paged: the {spec.sliding_layers:.0%} of layers with a window of "
              f"{spec.sliding_window} keep a ring of {ring} positions per sequence")
    if args.sharding == "dp_ep" and args.chips > 1:
        print(f"dp_ep over {args.chips} chips: the slots and their cache split, "
              f"{plan.kv_bytes_per_token_per_chip / 1e3:.2f} kB/token per chip; the "
              f"experts split; every other weight on every chip")
    if plan.kv_head_copies > 1:
        print(f"kv heads: {args.chips} chips of tensor parallelism (tp) over "
              f"{spec.num_kv_heads} kv heads hold each head, its k/v projections and its "
              f"cache, on {plan.kv_head_copies} chips: "
              f"{plan.kv_bytes_per_token_per_chip / 1e3:.2f} kB/token per chip")
    print(f"largest batch that fits: {plan.max_batch}; critical batch "
          f"(compute-bound above): {plan.critical_batch:.1f}")
    print(f"{'batch':>6} {'kv GB':>9} {'total GB':>9} {'fits':>5} {'mem ms':>9} "
          f"{'compute ms':>10} {'floor ms':>9} {'tokens/s':>10} {'max MP':>8}")
    for r in plan.rows:
        mp = f"{r.model_parallel_max:8.1f}" if r.model_parallel_max is not None else "       -"
        print(f"{r.batch:>6} {r.kv_gb:>9.2f} {r.total_gb:>9.2f} {'yes' if r.fits else 'no':>5} "
              f"{r.step_ms_memory:>9.2f} {r.step_ms_compute:>10.2f} {r.step_ms_floor:>9.2f} "
              f"{r.tokens_per_s:>10.1f} {mp}")
    return 0
