"""Generate text for one or more prompts, run concurrently through the engine's slots.

One process: the prompts go through the orchestrator (interleaved on one engine), as a
server would run them. Several processes (jax.distributed) must dispatch identical
device steps in the same order, which a threaded scheduler cannot promise, so they run
the lock-step orchestrator (jetserve/orchestrator/lockstep.py: process 0 plans each step
and broadcasts it; the others follow), as `jetserve serve` and `jetserve batch` over
several processes do, the prefix cache included.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys

import jax

from engines import SamplingParams
from jetserve import distributed, generation_config, lora_adapters
from jetserve.commands.common import (
    DEFAULT_SLOTS,
    add_generation_config_argument,
    add_model_arguments,
    add_scheduling_arguments,
    engine_config,
    generation_defaults,
    parse_ids,
    prefix_cache_budgets,
)
from jetserve.compile_cache import CompileCounter
from jetserve.model_loading import build_engine, model_config
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request, keyed
from sharding import MODEL_DIMS, ShardingConfig, axes, load_preset

# What an unset flag is when the model's generation_config sets none either: greedy.
DEFAULTS = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                max_tokens=32)


class _PromptAction(argparse.Action):
    """Keeps --prompt and --prompt-ids in the order given on the command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, "prompts", None) or []
        kind = "ids" if option_string == "--prompt-ids" else "text"
        items.append((kind, values))
        namespace.prompts = items


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    # Unless given, one slot per prompt (at most DEFAULT_SLOTS): generate never runs more
    # sequences than it has prompts, and each slot holds max_seq_len positions of KV (at a
    # long context, most of the memory; see slots_for).
    p.set_defaults(max_concurrent_decodes=None)
    p.add_argument("--prompt", action=_PromptAction, dest="prompts", help="prompt text")
    p.add_argument("--prompt-ids", action=_PromptAction, dest="prompts",
                   help="comma-separated token ids, used verbatim (no BOS added)")
    # Unset sampling flags take the model's defaults (--generation-config), else these.
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"default: the model's max_new_tokens, else {DEFAULTS['max_tokens']}")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's, else 0 (greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    add_generation_config_argument(p)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--lora", default=None, metavar="NAME",
                   help="run every prompt through LoRA adapter NAME (of --lora-modules)")
    add_scheduling_arguments(p)
    distributed.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Before anything touches a device: join the other processes, pick the devices.
    devices = distributed.setup(args)
    if not args.prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    got = generation_config.resolve(vars(args), generation_defaults(args, "generate"),
                                    DEFAULTS)
    args.max_tokens = got.pop("max_tokens")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    args.max_concurrent_decodes = slots_for(args, len(devices))
    seed = args.seed
    if seed is None and got["temperature"] > 0 and jax.process_count() > 1:
        # Every process must feed the same inputs to each step: process 0 draws the seed.
        seed = int(distributed.broadcast_from_primary([secrets.randbits(31)])[0])
    got["top_k"] = max(got["top_k"], 0)  # a file's -1: off, as 0
    sampling = SamplingParams(**got, seed=seed)
    with CompileCounter() as compiled:
        results = _build_and_run(args, devices, sampling)
    if not distributed.is_primary():  # every process ran the same steps; one prints
        return 0
    # What a start costs, and how much of it the persistent compile cache saved.
    print(f"jetserve generate: {compiled.summary(compiled.compile_s)}; tracing and lowering "
          f"{compiled.trace_s:.2f} s", file=sys.stderr, flush=True)
    for prompt, token_ids, text, finish_reason, drafts in results:
        if args.json:
            row = {"prompt_ids": prompt, "token_ids": token_ids, "text": text,
                   "finish_reason": finish_reason}
            if drafts is not None:  # speculative decoding: (proposed, accepted) drafts
                row["drafted"], row["accepted"] = drafts
            print(json.dumps(row), flush=True)
        else:
            print(text, flush=True)
    return 0


def slots_for(args: argparse.Namespace, num_devices: int) -> int:
    """--max-concurrent-decodes as given, else one per prompt (at most DEFAULT_SLOTS),
    rounded up to a count the sharding splits the slots by (the extra slots stay idle)."""
    if args.max_concurrent_decodes is not None:
        return args.max_concurrent_decodes
    slots = min(DEFAULT_SLOTS, len(args.prompts))
    sharding = load_preset(args.sharding) if args.sharding else ShardingConfig()
    cfg = model_config(args.model)
    dims = {d: getattr(cfg, d) for d in MODEL_DIMS}
    ways = math.lcm(*(sharding.split_count(a, num_devices, dims)
                      for a in (axes.CACHE_BATCH, axes.BATCH)))
    return -(-slots // ways) * ways


def _build_and_run(args, devices, sampling) -> list[tuple]:
    engine = build_engine(args.model, sharding=args.sharding, devices=devices,
                          engine_config=engine_config(args, devices))
    adapters = lora_adapters.load_modules([engine], args.lora_modules)
    if args.lora is not None and args.lora not in adapters.names():
        raise ValueError(f"--lora {args.lora!r}: no such adapter; --lora-modules gave "
                         f"{adapters.names()}")
    tok = engine.tokenizer
    prompts = []
    for kind, value in args.prompts:
        if kind == "ids":
            ids = parse_ids(value)
            bad = [i for i in ids if not 0 <= i < engine.vocab_size]
            if bad:
                raise ValueError(f"--prompt-ids: ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {engine.vocab_size})")
            prompts.append(ids)
        else:
            if tok is None:
                raise ValueError("this model has no tokenizer; use --prompt-ids")
            prompts.append(tok.encode(value, add_bos=True))
    params = engine.load_params()
    config = keyed(OrchestratorConfig(max_queued_requests=max(256, len(prompts)),
                                      prefill_chunk=args.prefill_chunk,
                                      **prefix_cache_budgets(args)), args.model, engine)
    if jax.process_count() == 1:
        return _orchestrated(Orchestrator.from_engines(engine, params=params, config=config),
                             engine, prompts, args, sampling)
    from jetserve.orchestrator.lockstep import LockStepOrchestrator

    orch = LockStepOrchestrator(engine, params, config=config)
    if not distributed.is_primary():
        orch.run()  # process 0's steps, until it stops
        return []
    return _orchestrated(orch, engine, prompts, args, sampling)


def _orchestrated(orch, engine, prompts, args, sampling) -> list[tuple]:
    with orch:
        handles = [orch.submit(Request(prompt_ids=p, sampling=sampling,
                                       max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                                       lora_adapter=args.lora))
                   for p in prompts]
        done = [h.result() for h in handles]
    for i, c in enumerate(done):
        if c.finish_reason == "error":
            raise RuntimeError(f"prompt {i} failed: {c.error}")
    spec = engine.config.spec.enabled
    return [(list(p), c.token_ids, c.text, c.finish_reason,
             (c.timing.drafted, c.timing.accepted) if spec else None)
            for p, c in zip(prompts, done, strict=True)]
