"""Run a JSONL file of generation and scoring rows; resumable; one host or many.

Input rows (one JSON object a line), each with a unique "id":
  generation: "prompt" | "prompt_ids" | "messages" (chat template), "max_tokens",
    "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos",
    "logprobs" (true, or n for the top-n alternatives too); a constraint as on HTTP
    ("response_format", "structured_outputs", "guided_*"); with "messages", chat
    "tools", "tool_choice", "parallel_tool_calls" (calls read as --tool-call-parser says)
  scoring: "context" | "context_ids" and "continuation" | "continuation_ids": the
    continuation's summed log-likelihood, whether greedy decoding would produce it
  either may carry "metadata", copied to the output row.
A sampling field or max_tokens a row leaves unset takes --max-tokens, else the model's
default (its generation_config.json, unless --generation-config vllm), else greedy and 16.
Output rows (appended and fsync'd as each finishes, in completion order): "id" with
"text", "token_ids", "finish_reason", "logprobs", "ttft", "latency" (with tools: "content"
and "tool_calls", finish_reason "tool_calls", as the chat API answers); or "logprob",
"is_greedy", "num_tokens"; or "error" naming what is wrong with the row.

--resume continues a killed job: rows already in --output are skipped (a torn last line
is removed), so every id ends up there exactly once; --retry-failed also runs the rows
whose result is an error row again (after the input is fixed, say), replacing those rows.
--resume first verifies --output: a line that is not a result row, a second row for an
id, or a row for an id not in the input is refused, naming its line; --repair rewrites
the file to its valid rows (the first valid row of each input row) and runs the rest.

Several hosts: without --coordinator, --num-processes N --process-id I runs the rows
whose id hashes to I and writes OUTPUT.part-I-of-N; then `--merge --num-processes N`
joins the parts into OUTPUT in input order. With --coordinator, the N processes share one
model sharded over all their devices: process 0 reads the input, plans every step and
writes OUTPUT; the others follow its steps.

On Ray (pip install 'jetserve[ray]'): --ray [ADDRESS] runs the job on a Ray cluster's
actors, --ray-actors of them, one engine each (one per slice, reserving
--ray-actor-resources), handed --ray-block-rows rows at a time as they free up; this
process scans the input and is the one writer of --output, as on one host. An actor that
dies loses no row (Ray starts it again and its unfinished rows run again); a row whose
engine dies with it twice becomes an error row. See jetserve/batch/ray_job.py.

Exit status: 0 when every row succeeded, 1 when any row is an error row (including ones
written by an earlier run of a resumed job), 2 for a usage error or an output that cannot
be written (a full disk, a read-only directory: the rows written so far stay, ready for
--resume).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from jetserve import distributed
from jetserve.batch.durable import OutputError, describe
from jetserve.commands.common import (
    add_generation_config_argument,
    add_model_arguments,
    add_scheduling_arguments,
    add_step_policy_arguments,
    add_tool_parser_argument,
    engine_config,
    generation_defaults,
    prefix_cache_budgets,
    step_policy_fields,
)
from jetserve.lora_adapters import load_modules, parse_modules


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_model_arguments(p)
    add_tool_parser_argument(p)
    p.add_argument("--input", required=True, help="JSONL file of rows")
    p.add_argument("--output", required=True,
                   help="JSONL results (with --num-processes and no --coordinator: the "
                        "prefix of this process's part file)")
    p.add_argument("--resume", action="store_true",
                   help="continue an existing --output, skipping the ids it holds")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: run the rows whose result is an error row again")
    p.add_argument("--repair", action="store_true",
                   help="with --resume: rewrite an --output that fails verification to its "
                        "valid rows (dropping bad, repeated and unknown rows) and run the "
                        "rest, instead of refusing it")
    p.add_argument("--merge", action="store_true",
                   help="join OUTPUT.part-I-of-N (I < --num-processes) into OUTPUT in "
                        "input order, then exit")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens of rows that give none (default: the model's "
                        "max_new_tokens, see --generation-config, else 16)")
    add_generation_config_argument(p)
    p.add_argument("--max-queued", type=int, default=None,
                   help="admission bound: jobs submitted ahead of a free slot "
                        "(default: 4 x --max-concurrent-decodes, at least 32)")
    add_scheduling_arguments(p)
    add_step_policy_arguments(p)
    p.add_argument("--window", type=int, default=4096,
                   help="rows read, tokenized and ordered at a time")
    p.add_argument("--summary", default=None, metavar="PATH",
                   help="also write the end-of-job summary here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    distributed.add_arguments(p)
    g = p.add_argument_group("on a Ray cluster (pip install 'jetserve[ray]')")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray actors; ADDRESS: the cluster (ray://HOST:10001, "
                        "HOST:6379, auto); without it, Ray's own rule (RAY_ADDRESS, a "
                        "cluster started on this host, else a new local one)")
    g.add_argument("--ray-actors", type=int, default=1,
                   help="engine actors (one per slice; on one host, each gets --devices)")
    g.add_argument("--ray-actor-resources", default="CPU=1", metavar="NAME=N,...",
                   help="what each actor reserves, e.g. TPU=4,CPU=8 or GPU=1 (CPU, GPU: "
                        "Ray's num_cpus, num_gpus; other names: custom resources)")
    g.add_argument("--ray-block-rows", type=int, default=64,
                   help="rows handed to an actor at a time")


def run(args: argparse.Namespace) -> int:
    if args.merge and args.ray is not None:
        raise ValueError("--merge joins the parts of a run without --ray (a --ray job "
                         "writes one --output): leave out --ray")
    try:
        return _merge(args) if args.merge else _run(args)
    except OSError as e:  # a full disk, a read-only directory...: one line, no traceback
        print(f"jetserve batch: error: {_os_error(e)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from jetserve.batch import orchestrated
    from jetserve.batch.journal import part_path
    from jetserve.batch.preflight import check_coordinator_port, check_paths
    from jetserve.batch.runner import prepare

    if args.ray is not None:
        return _run_on_ray(args)
    independent = args.coordinator is None and (
        args.num_processes is not None or args.process_id is not None)
    n_proc, proc = 1, 0
    if independent:
        n_proc, proc = _independent_share(args)
    output = part_path(args.output, proc, n_proc) if independent else args.output
    _check_resume_flags(args)
    check_paths(args.input, output)
    if args.coordinator is not None:
        check_coordinator_port(args.coordinator, args.process_id)
    # Before anything touches a device: join the other processes (--coordinator only).
    shared = argparse.Namespace(**vars(args))
    if independent:
        shared.num_processes = shared.process_id = None
    devices = distributed.setup(shared)

    cfg = _config(args, output, proc, n_proc)
    # The input and output are checked (and the output opened) before the model loads:
    # a job that is refused costs no load.
    prepared = prepare(cfg) if distributed.is_primary() else None
    orch = _orchestrator(args, devices)
    if prepared is None:
        orch.run()  # process 0's steps, until it stops
        return 0
    return _finish(args, output, orchestrated.run(cfg, orch, prepared=prepared))


def _config(args: argparse.Namespace, output: str, proc: int = 0,
            n_proc: int = 1):
    from jetserve.batch.runner import BatchConfig

    return BatchConfig(input=args.input, output=output, resume=args.resume,
                       retry_failed=args.retry_failed, repair=args.repair,
                       process_id=proc, num_processes=n_proc,
                       default_max_tokens=args.max_tokens, window=args.window,
                       generation_defaults=generation_defaults(args, "batch"),
                       progress=not args.no_progress,
                       lora_adapters=tuple(n for n, _ in parse_modules(args.lora_modules)),
                       tool_call_parser=args.tool_call_parser)


def _finish(args: argparse.Namespace, output: str, summary) -> int:
    print(summary.line(), file=sys.stderr)
    if args.summary:
        _write_summary(args.summary, {"output": output, **summary.as_dict()})
    return 0 if summary.all_ok else 1


def _run_on_ray(args: argparse.Namespace) -> int:
    """The job on Ray actors (jetserve/batch/ray_job.py); this process builds no engine."""
    from jetserve.batch import ray_job
    from jetserve.batch.runner import prepare

    given = [f for f in ("coordinator", "num_processes", "process_id") if
             getattr(args, f) is not None]
    if given:
        raise ValueError(f"--ray hands rows to actors itself: leave out "
                         f"--{given[0].replace('_', '-')}")
    _check_resume_flags(args)
    pool = ray_job.RayPool(address=args.ray or None, actors=args.ray_actors,
                           resources=ray_job.parse_resources(args.ray_actor_resources),
                           block_rows=args.ray_block_rows)
    ray_job.import_ray()  # a missing extra is named before the input is read
    cfg = _config(args, args.output)
    summary = ray_job.run(cfg, functools.partial(actor_orchestrator, args), pool,
                          prepared=prepare(cfg))
    return _finish(args, args.output, summary)


def orchestrator_factory(flags: list[str]) -> functools.partial:
    """A picklable zero-argument callable that builds the orchestrator `jetserve batch`
    builds from these flags (model, devices, scheduling: e.g. ["--model", DIR,
    "--devices", "4"]), for ray_job.run's actors."""
    p = argparse.ArgumentParser(prog="jetserve batch")
    add_arguments(p)
    args = p.parse_args(["--input", "-", "--output", "-", *flags])
    return functools.partial(actor_orchestrator, args)


def actor_orchestrator(args: argparse.Namespace):
    """The orchestrator of one engine actor: this process's devices (--devices N of
    them), with the compile cache on, as the command's own start does."""
    from jetserve import compile_cache

    compile_cache.enable(args.compile_cache)
    devices = distributed.setup(argparse.Namespace(devices=args.devices))
    return _orchestrator(args, devices)


def _check_resume_flags(args: argparse.Namespace) -> None:
    for flag in ("retry_failed", "repair"):
        if getattr(args, flag) and not args.resume:
            raise ValueError(f"--{flag.replace('_', '-')} continues a job: add --resume")


def _write_summary(path: str, summary: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    except OSError as e:
        raise OutputError(f"cannot write --summary {path}: {describe(e)} (the job itself "
                          "finished; its rows are in the output)") from None


def _os_error(e: OSError) -> str:
    if isinstance(e, OutputError):
        return str(e)
    return f"{e.filename}: {describe(e)}" if e.filename else describe(e)


def _independent_share(args: argparse.Namespace) -> tuple[int, int]:
    n, i = args.num_processes, args.process_id
    if n is None or i is None:
        raise ValueError("--num-processes and --process-id go together (without "
                         "--coordinator each process runs its own share of the rows)")
    if n < 1:
        raise ValueError(f"--num-processes must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"--process-id must be in [0, {n}), got {i}")
    return n, i


def _orchestrator(args: argparse.Namespace, devices):
    """The threaded orchestrator on one process; with --coordinator, the lock-step one
    (one engine over the devices of every process; process 0 plans every step)."""
    import jax

    from jetserve.batch import orchestrated
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator import Orchestrator, keyed
    from jetserve.orchestrator.lockstep import LockStepOrchestrator

    engine = build_engine(args.model, sharding=args.sharding, devices=devices,
                          engine_config=engine_config(args, devices))
    load_modules([engine], args.lora_modules)
    config = orchestrated.config(engine, max_queued=args.max_queued,
                                 prefill_chunk=args.prefill_chunk,
                                 **prefix_cache_budgets(args), **step_policy_fields(args))
    config = keyed(config, args.model, engine)
    if jax.process_count() > 1:
        return LockStepOrchestrator(engine, engine.load_params(), config=config)
    return Orchestrator.from_engines(engine, config=config)


def _merge(args: argparse.Namespace) -> int:
    from jetserve.batch.merge import merge

    if args.num_processes is None:
        raise ValueError("--merge needs --num-processes N (the parts to join)")
    rows, errors = merge(args.input, args.output, args.num_processes)
    print(f"batch merge: {rows} rows ({errors} errors) from {args.num_processes} parts "
          f"into {args.output}", file=sys.stderr)
    return 0 if errors == 0 else 1
