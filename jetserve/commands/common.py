"""Arguments shared by several subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import jax

from engines import EngineConfig, quantization
from engines.engine_config import LAYER_MODES, parse_decode_batch_sizes, parse_speculative
from jetserve import (
    compile_cache,
    context_length,
    distributed,
    generation_config,
    lora_adapters,
)
from jetserve.model_loading import default_model, model_config
from jetserve.scheduling.policy import PREFILL_FIRST, STEP_POLICIES
from jetserve.server import reasoning
from jetserve.server.tool_formats import DEFAULT_PARSER, NAMES

DEFAULT_SLOTS = 8  # --max-concurrent-decodes when not given


# The device budget `--enable-prefix-caching` gives the prefix cache where
# --prefix-cache-hbm-mb is not given.
PREFIX_CACHE_DEFAULT_MB = 256.0

def add_tool_parser_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-call-parser", default=DEFAULT_PARSER, choices=list(NAMES),
                   help="how the model writes tool calls, read from its text with chat "
                        "tool_choice auto: hermes <tool_call>{...}</tool_call> (the bundled "
                        "template's), llama3_json bare {\"name\", \"parameters\"}, "
                        "mistral [TOOL_CALLS][...], qwen3_coder <function=...>, pythonic "
                        "[f(x=1)], deepseek_v3, glm45 <arg_key>, openai (gpt-oss's harmony) "
                        "(default %(default)s)")


def add_reasoning_parser_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reasoning-parser", default=None, choices=list(reasoning.NAMES),
                   help="how the model writes its thinking, returned apart as "
                        "reasoning_content: deepseek_r1, qwen3 or glm45 <think>...</think>, "
                        "openai_gptoss (gpt-oss's harmony analysis channel); default: none, "
                        "the thinking stays in content")


def add_generation_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", choices=list(generation_config.MODES),
                   help="auto: the model directory's generation_config.json gives the "
                        "temperature, top_p, top_k, min_p, repetition_penalty and "
                        "max_new_tokens (as max_tokens) of requests that leave them unset, "
                        "as vLLM does; vllm: ignore the file, jetserve's own defaults "
                        "(default %(default)s)")


def generation_defaults(args: argparse.Namespace, command: str
                        ) -> generation_config.GenerationDefaults:
    """The defaults --generation-config takes from --model's directory, said once on
    stderr; a bad field in the file is a ValueError naming it, before the model loads."""
    found = generation_config.read(args.model or default_model(), args.generation_config)
    if found.given():
        print(f"jetserve {command}: default sampling parameters overridden by the model's "
              f"{found.source}: {found.describe()} (a request's own values win; "
              "--generation-config vllm ignores the file)", file=sys.stderr, flush=True)
    return found


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF or Orbax model directory, or random:NAME (default: bundled model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 on CPU, bfloat16 on TPU/GPU")
    p.add_argument("--max-concurrent-decodes", type=int, default=DEFAULT_SLOTS,
                   help=f"decode slots (default {DEFAULT_SLOTS}; generate: one per prompt, "
                        f"at most {DEFAULT_SLOTS})")
    p.add_argument("--max-prefill-length", type=int, default=None,
                   help="the prefill bucket: longer prompts are prefilled in chunks of it "
                        "(default: min(512, max-seq-len))")
    p.add_argument("--prefill-batch", type=int, default=1,
                   help="the most waiting prompts one prefill call takes (1: one a call); "
                        "N > 1 compiles calls of 2, 4 .. N prompts per bucket, each at most "
                        "--max-prefill-length tokens: short prompts, whose prefill mostly "
                        "reads the weights, then cost about one call for several")
    p.add_argument("--decode-batch-sizes", default="none",
                   help="slot counts below --max-concurrent-decodes the generate step is "
                        "compiled for too: 'auto' (1, 2, 4 ..), comma-separated counts, or "
                        "'none'. A step whose slots in use all lie below one runs only "
                        "those rows: fewer requests, a cheaper step")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int,
                   default=None,
                   help="longest prompt + generated tokens (default: the model's "
                        "max_position_embeddings, capped by what fits in memory)")
    p.add_argument("--sharding", default="replicated", help="preset name or YAML path")
    p.add_argument("--kv-layout", default="contiguous", choices=["contiguous", "paged"],
                   help="paged: KV in fixed-size pages taken as sequences grow")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16,
                   help="tokens per KV page (paged)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages in the pool (paged; default: enough for every slot at "
                        "max-seq-len)")
    add_quantize_arguments(p)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                   help="KV cache: auto (the model dtype) or int8 with a scale per token "
                        "and kv head")
    p.add_argument("--speculative", default="none",
                   help="speculative decoding: none, ngram:K (K drafts per step from "
                        "the sequence's own tokens) or draft:PATH:K (K drafts per step from "
                        "a smaller model with the same vocabulary, a directory or "
                        "random:NAME); the drafts are verified in one step")
    lora_adapters.add_arguments(p)
    p.add_argument("--layers", default="auto", choices=LAYER_MODES,
                   help="the decoder's layers: loop (unrolled), scan (one compiled body, "
                        "a compile that does not grow with the layer count; on the CPU at the "
                        "loop's decode speed where the CPU kernels run) or auto (scan, except "
                        "on a CPU without the CPU kernels (several devices, quantized or "
                        "non-float32 weights) and with LoRA)")
    compile_cache.add_argument(p)


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", default="none", choices=quantization.SCHEMES,
                   help="matmul weights: int8 per output channel, int4 group-wise "
                        "(a checkpoint converted with --quantize is loaded as stored)")
    p.add_argument("--quant-group-size", type=int, default=quantization.DEFAULT_GROUP,
                   help="int4: weights per scale along the input dimension")


def engine_config(args: argparse.Namespace,
                  devices: Sequence[jax.Device] | None = None) -> EngineConfig:
    """The EngineConfig of the model flags; max_seq_len, when not given, from the model
    and the memory of `devices` (default: all), with a line on stderr saying why."""
    seq = args.max_seq_len
    if seq is None:
        seq, why = _default_max_seq_len(args, list(devices or jax.devices()))
        # Every process must build the same programs: process 0's memory decides.
        seq = int(distributed.broadcast_from_primary([seq])[0])
        if distributed.is_primary():
            print(f"jetserve: {why}", file=sys.stderr, flush=True)
    prefill = args.max_prefill_length or min(512, seq)
    try:
        parse_speculative(args.speculative)
    except ValueError as e:
        raise ValueError(f"--speculative: {e}") from None
    try:
        sizes = parse_decode_batch_sizes(args.decode_batch_sizes, decode_slots(args))
    except ValueError as e:
        raise ValueError(f"--decode-batch-sizes: {e}") from None
    return EngineConfig(max_concurrent_decodes=decode_slots(args),
                        max_prefill_length=prefill, max_seq_len=seq,
                        dtype=args.dtype, kv_layout=args.kv_layout,
                        page_size=args.page_size, num_pages=args.num_pages,
                        quantize=args.quantize, quant_group_size=args.quant_group_size,
                        kv_dtype=args.kv_dtype, speculative=args.speculative,
                        layers=args.layers, prefill_batch=args.prefill_batch,
                        decode_batch_sizes=sizes, **lora_adapters.engine_fields(args))


def decode_slots(args: argparse.Namespace) -> int:
    """--max-concurrent-decodes; where it is left out (serve, batch), --max-num-seqs sizes
    the slots, else DEFAULT_SLOTS."""
    slots = args.max_concurrent_decodes
    if slots is None:
        slots = getattr(args, "max_num_seqs", None) or DEFAULT_SLOTS
    return slots


def _default_max_seq_len(args: argparse.Namespace, devices: list) -> tuple[int, str]:
    slots = decode_slots(args)
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"--max-concurrent-decodes must be a positive integer, got {slots!r}")
    platform = devices[0].platform
    sharding = getattr(args, "generate_sharding", None) or args.sharding
    return context_length.default_max_seq_len(
        model_config(args.model), slots=slots,
        precision=context_length.precision_of(args.dtype, args.quantize, args.kv_dtype, platform),
        memory=context_length.usable_memory(devices, sharding))


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """Chunked prefill and the prefix cache: how the orchestrator schedules prompts."""
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill prompts longer than this in chunks between decode steps "
                        "(default: chunks of --max-prefill-length)")
    p.add_argument("--prefix-cache-hbm-mb", type=float, default=0.0,
                   help="prefix cache: device memory for cached prompt KV, so prompts "
                        "sharing a prefix prefill only the rest (0: none)")
    p.add_argument("--prefix-cache-host-mb", type=float, default=0.0,
                   help="prefix cache: host memory tier for KV evicted from the device")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help=f"the prefix cache with --prefix-cache-hbm-mb's budget, "
                        f"{PREFIX_CACHE_DEFAULT_MB} MB where that is not given; "
                        f"--no-enable-prefix-caching: none, whatever the budgets")


def add_step_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The knobs of jetserve/scheduling/policy.py, for the commands that serve through the
    threaded orchestrator (serve, batch)."""
    p.set_defaults(max_concurrent_decodes=None)  # then --max-num-seqs sizes the slots
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="the most sequences decoding at once (default: every slot); "
                        "alone, it also sets --max-concurrent-decodes; with it, at most that")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="token budget of one decode step: its decode tokens plus the prefill "
                        "run since the step before (interleaved); prefill chunks are at most "
                        "N - max-num-seqs (default: no budget)")
    p.add_argument("--step-policy", default=PREFILL_FIRST, choices=STEP_POLICIES,
                   help="prefill-first (the default: lowest TTFT, free slots wait for the "
                        "prompts on their way) or decode-first (steady TPOT: a step runs as "
                        "soon as it can, after at most the budget's prefill; default budget "
                        "one chunk)")
    p.add_argument("--prefill-lookahead", type=int, default=0, metavar="STEPS",
                   help="decode-first: prefill a waiting prompt up to STEPS decode steps "
                        "before a running sequence's max_tokens ends, so its first token "
                        "streams while that sequence finishes (default 0: only into a free "
                        "sequence)")


def step_policy_fields(args: argparse.Namespace) -> dict:
    """OrchestratorConfig fields from --max-num-seqs, --max-num-batched-tokens and
    --step-policy (checked against the engine when the orchestrator is built)."""
    return dict(max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                step_policy=args.step_policy, prefill_lookahead=args.prefill_lookahead)


def prefix_cache_budgets(args: argparse.Namespace) -> dict:
    """OrchestratorConfig fields from --prefix-cache-hbm-mb / --prefix-cache-host-mb."""
    out = {}
    enabled = getattr(args, "enable_prefix_caching", None)
    for tier in ("hbm", "host"):
        mb = getattr(args, f"prefix_cache_{tier}_mb")
        if not mb >= 0:
            raise ValueError(f"--prefix-cache-{tier}-mb must be >= 0, got {mb}")
        if enabled and tier == "hbm" and not mb:
            mb = PREFIX_CACHE_DEFAULT_MB
        out[f"prefix_cache_{tier}_bytes"] = 0 if enabled is False else int(mb * 2**20)
    return out


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids
