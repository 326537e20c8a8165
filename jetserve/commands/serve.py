"""Serve a model over gRPC (JetStream-compatible) and HTTP (OpenAI-compatible).

Runs the orchestrator on this host's devices, interleaved on one slice or disaggregated
(prefill on N devices, generate on M others), and each server on its own asyncio loop
and thread.
Start-up: the servers listen first, with health NOT_SERVING / 503 while every program a
request needs compiles (jetserve/warmup.py, on a thread of its own; read back from the
compile cache when an earlier start wrote it), then "jetserve serve: ready" and health
SERVING / 200. With --no-warmup they are ready at once and the first requests compile.
SIGTERM or Ctrl-C: health 503 / NOT_SERVING (still taking requests for --drain-notice
seconds, so routers move away first), stop accepting, let in-flight streams finish (up to
--drain-timeout seconds), stop the orchestrator, exit 0.

Several processes (--coordinator HOST:PORT --num-processes N --process-id I, the same
other arguments on each): one engine sharded over the devices of all of them, driven in
lock step (jetserve/orchestrator/lockstep.py). Process 0 runs the servers and takes the
requests; the others follow its step plans and exit when it stops (SIGTERM process 0).

Split deployment (--role prefill | decode, jetserve/disagg/roles.py): prefill workers and
a decode process that serves the APIs and pulls each prefix from a worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading

from jetserve import distributed, lora_adapters
from jetserve.commands.common import (
    add_generation_config_argument,
    add_model_arguments,
    add_reasoning_parser_argument,
    add_scheduling_arguments,
    add_step_policy_arguments,
    add_tool_parser_argument,
    engine_config,
    generation_defaults,
    prefix_cache_budgets,
    step_policy_fields,
)
from jetserve.disagg import roles
from jetserve.generation_config import GenerationDefaults
from jetserve.orchestrator import kv_events
from jetserve.orchestrator.config import MIXED, SCHEDULING, TURNS
from jetserve.server.auth import read_api_key_file
from jetserve.server.config import LOAD_FORMATS, ServerConfig
from jetserve.server.ports import check_free


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="0.0.0.0", help="address both servers bind")
    p.add_argument("--grpc-port", type=int, default=9000, help="0: any free port; -1: off")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port; -1: off")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--interleaved", action="store_true",
                      help="prefill and generate on the same devices (the default)")
    mode.add_argument("--prefill-devices", type=int, default=None,
                      help="devices for prefill (disaggregated; with --generate-devices)")
    p.add_argument("--generate-devices", type=int, default=None,
                   help="devices for generate, disjoint from the prefill devices "
                        "(with --interleaved: the devices that do both)")
    p.add_argument("--prefill-sharding", default=None,
                   help="preset name or YAML path for the prefill slice (default: --sharding)")
    p.add_argument("--generate-sharding", default=None,
                   help="preset name or YAML path for the generate slice (default: --sharding)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help="require this key on both servers ('Authorization: Bearer KEY' or "
                           "'x-api-key: KEY'); visible in ps, so prefer --api-key-file; "
                           "default: $JETSERVE_API_KEY")
    keys.add_argument("--api-key-file", default=None, metavar="PATH",
                      help="require the key this file holds (its content, stripped)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate: serve both gRPC and HTTP (HTTPS) over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: the model directory's name)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--drain-notice", type=float, default=0.0, metavar="SECONDS",
                   help="after SIGTERM, health answers 503 (gRPC NOT_SERVING) for this long "
                        "while requests are still taken, so routers polling it stop sending "
                        "here before the servers stop accepting (default %(default)s)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a stream may wait on a client that reads nothing before "
                        "it is cancelled and its connection closed")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="admission bound: beyond it, RESOURCE_EXHAUSTED / HTTP 429")
    p.add_argument("--max-queued-per-client", type=int, default=None, metavar="N",
                   help="the most requests (prompts x samples) one client, a peer address, "
                        "may have queued; beyond it that client gets 429 / "
                        "RESOURCE_EXHAUSTED while others still get in, and clients are "
                        "served in turn (default: half of --max-queued-requests)")
    _add_limit_arguments(p)
    add_scheduling_arguments(p)
    add_tool_parser_argument(p)
    add_reasoning_parser_argument(p)
    add_generation_config_argument(p)
    add_step_policy_arguments(p)
    p.add_argument("--scheduling", default=TURNS, choices=SCHEDULING,
                   help="turns (the default: prefill, insert and generate calls, prompts "
                        "between decode steps) or mixed (one slice, --kv-layout paged: every "
                        "step runs each decoding sequence's token and chunks of waiting "
                        "prompts, up to --max-num-batched-tokens; chunks of --prefill-chunk)")
    p.add_argument("--get-load-format", default="vllm-router", choices=LOAD_FORMATS,
                   help="the shape GET /get_load answers in, for the router in front: "
                        "vllm-router's {\"load\": N} or sglang-router's list "
                        "(default %(default)s)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's KV events as vLLM does, configured as "
                        "vLLM's flag is: '{\"enable_kv_cache_events\": true, \"publisher\": "
                        "\"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"topic\": "
                        "\"kv-events\"}' (needs a prefix cache; docs/ROUTERS.md)")
    p.add_argument("--no-warmup", action="store_true",
                   help="take requests at once instead of compiling every prefill bucket, "
                        "insert and generate first (then the first requests compile)")
    distributed.add_arguments(p)
    roles.add_arguments(p)


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="HTTP: seconds a client has to send complete request headers (from "
                        "connecting, or from a keep-alive request's first byte; default "
                        "%(default)s)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="HTTP: seconds the request body may take after its headers (408; default %(default)s)")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="HTTP: seconds an idle keep-alive connection stays open (default %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="HTTP: largest request body accepted (413 above it; default %(default)s)")
    p.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="most prompts in one /v1/completions request (default %(default)s)")
    p.add_argument("--max-sub-requests", type=int, default=d.max_sub_requests,
                   help="most sequences one request may start: prompts x n (HTTP), "
                        "num_samples (gRPC); default %(default)s")


def _limits(args: argparse.Namespace) -> dict:
    return dict(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                keep_alive_timeout_s=args.keep_alive_timeout,
                max_body_bytes=args.max_body_bytes,
                max_prompts_per_request=args.max_prompts_per_request,
                max_sub_requests=args.max_sub_requests)


def _port(value: int, flag: str) -> int | None:
    if value == -1:
        return None
    if not 0 <= value <= 65535:
        raise ValueError(f"{flag} must be in [0, 65535] (or -1 for off), got {value}")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    name = args.served_model_name
    if name is None:
        from jetserve.model_loading import default_model

        model = args.model or default_model()
        name = os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model
    return ServerConfig(host=args.host, grpc_port=_port(args.grpc_port, "--grpc-port"),
                        http_port=_port(args.http_port, "--http-port"), api_key=_api_key(args),
                        tls_cert=args.tls_cert, tls_key=args.tls_key, model_name=name,
                        drain_timeout_s=args.drain_timeout,
                        drain_notice_s=args.drain_notice, load_format=args.get_load_format,
                        write_timeout_s=args.write_timeout,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        generation_defaults=_generation_defaults(args), **_limits(args))


def _generation_defaults(args: argparse.Namespace) -> GenerationDefaults:
    """The model's default sampling, where requests are taken: prefill workers sample
    as their decode process asks."""
    if args.role == "prefill":
        return GenerationDefaults()
    return generation_defaults(args, "serve")


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        return read_api_key_file(args.api_key_file)
    if args.api_key is not None:
        return args.api_key
    return os.environ.get("JETSERVE_API_KEY")


def build_orchestrator(args: argparse.Namespace, devices=None):
    """The orchestrator over `devices` (default: all); lock-step over several processes."""
    import jax

    from jetserve import orchestrator
    from jetserve.orchestrator import OrchestratorConfig

    # --interleaved (the default) may still limit the slice with --generate-devices.
    disaggregated = args.role == "both" and not args.interleaved and (
        args.prefill_devices is not None or args.generate_devices is not None)
    if disaggregated and (args.prefill_devices is None or args.generate_devices is None):
        raise ValueError("--prefill-devices and --generate-devices go together "
                         "(or add --interleaved to serve on the first --generate-devices)")
    default = args.sharding
    config = OrchestratorConfig(max_queued_requests=args.max_queued_requests,
                                max_queued_per_client=_per_client(args),
                                prefill_chunk=args.prefill_chunk, **prefix_cache_budgets(args),
                                **step_policy_fields(args), scheduling=args.scheduling)
    if args.scheduling == MIXED and args.role != "both":
        raise ValueError(f"--scheduling mixed serves with --role both (prompts and decoding "
                         f"in one step), not --role {args.role}")
    if args.role == "decode":
        return roles.build_decode(args, devices if devices is not None else jax.devices(),
                                  config)
    if jax.process_count() > 1:
        orch = _lock_step_orchestrator(args, devices, config)
    else:
        orch = orchestrator.build(
            args.model, interleaved=not disaggregated, devices=devices,
            prefill_devices=args.prefill_devices, generate_devices=args.generate_devices,
            prefill_sharding=args.prefill_sharding or default,
            generate_sharding=args.generate_sharding or default,
            engine_config=engine_config(args, devices), config=config)
    if args.lora_modules:  # into every engine (every process's): prefill and generate alike
        lora_adapters.load_modules([*orch.prefill_engines, *orch.generate_engines],
                                   args.lora_modules)
    return orch


def _per_client(args: argparse.Namespace) -> int:
    """--max-queued-per-client, by default half the queue: one client (one request of many
    prompts and samples) can never shut the others out, and can still queue a lot alone."""
    n, total = args.max_queued_per_client, args.max_queued_requests
    if n is None:
        return max(1, total // 2)
    if not 1 <= n <= total:
        raise ValueError(f"--max-queued-per-client must be in [1, --max-queued-requests="
                         f"{total}], got {n}")
    return n


def _lock_step_orchestrator(args: argparse.Namespace, devices, config):
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator import keyed
    from jetserve.orchestrator.lockstep import LockStepOrchestrator

    if args.prefill_devices is not None or args.generate_devices is not None:
        # Every process must own devices of each engine's mesh to take part in its steps.
        raise ValueError("--prefill-devices / --generate-devices: with several processes "
                         "one engine spans every device; leave them out")
    engine = build_engine(args.model, devices=devices,
                          sharding=args.generate_sharding or args.sharding,
                          engine_config=engine_config(args, devices))
    if config.scheduling == MIXED:
        from jetserve.orchestrator.mixed_lockstep import MixedLockStepOrchestrator

        return MixedLockStepOrchestrator(engine, engine.load_params(),
                                         keyed(config, args.model, engine))
    return LockStepOrchestrator(engine, engine.load_params(),
                                config=keyed(config, args.model, engine))


async def _serve(orch, config: ServerConfig, warm: bool) -> None:
    from jetserve.server.runner import Servers

    servers = Servers(orch, config, warming=warm)
    await servers.start()
    shown = "localhost" if config.host in ("0.0.0.0", "::") else config.host
    if servers.grpc_port is not None:
        scheme = "TLS" if config.tls_cert else "plaintext"
        print(f"jetserve serve: gRPC listening on {shown}:{servers.grpc_port} "
              f"({scheme}; jetstream_proto.Orchestrator/Decode)", flush=True)
    if servers.http_port is not None:
        url = f"{'https' if config.tls_cert else 'http'}://{shown}:{servers.http_port}"
        print(f"jetserve serve: HTTP listening on {url} "
              f"(OpenAI-compatible /v1, /health, /metrics)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    halt = threading.Event()  # ends a warm-up that SIGTERM interrupts, between its steps
    try:
        if warm:
            await _until_stopped(stop, _warm_up(orch, servers, halt))
        if not stop.is_set():
            print("jetserve serve: ready", flush=True)
        await stop.wait()
    finally:
        halt.set()
        print("jetserve serve: draining in-flight requests", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)  # a second Ctrl-C kills at once
        await servers.stop()


async def _until_stopped(stop: asyncio.Event, work) -> None:
    """Runs `work` unless `stop` is set first (then it is cancelled); its error is raised."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, stopped):
        t.cancel()
    if task.done() and not task.cancelled():
        task.result()


async def _warm_up(orch, servers, halt: threading.Event) -> None:
    """Compiles on a thread of its own while the servers answer health checks, then turns
    them ready."""
    from jetserve import warmup

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def report(set_outcome, value) -> None:
        try:
            loop.call_soon_threadsafe(lambda: done.done() or set_outcome(value))
        except RuntimeError:  # the loop closed: serve stopped before the warm-up ended
            pass

    def body() -> None:
        try:
            counted = warmup.run(orch, on_plan=servers.readiness.plan,
                                 on_step=servers.readiness.step_done, stop=halt)
        except BaseException as e:  # noqa: BLE001 -- raised again on the serving loop
            report(done.set_exception, e)
        else:
            report(done.set_result, counted)

    steps = len(warmup.plan(orch))
    what = ("every mixed step's token bucket and page width" if hasattr(orch, "warmup_shapes")
            else "every prefill bucket, insert and generate")
    if shared := getattr(orch, "prefill_row_shapes", list)():
        what += ", prefill calls of " + ", ".join(f"{r} prompts x {b}" for r, b in shared)
    print(f"jetserve serve: warming up ({steps} steps: {what}); health NOT_SERVING / 503 "
          "until they compile", flush=True)
    # A daemon thread, not the loop's executor: a SIGTERM need not wait for a compile.
    threading.Thread(target=body, name="jetserve-warmup", daemon=True).start()
    counted = await done
    print(f"jetserve serve: {counted.summary()}", flush=True)
    await servers.ready()


def run(args: argparse.Namespace) -> int:
    roles.check_arguments(args)
    config = server_config(args)
    # Before anything touches a device: join the other processes, pick the devices.
    devices = distributed.setup(args)
    if args.role == "prefill":  # the internal service only, on --grpc-port (process 0)
        from jetserve.orchestrator import OrchestratorConfig

        OrchestratorConfig(**step_policy_fields(args)).refuse_step_policy("--role prefill")
        if distributed.is_primary():
            check_free(config.host, {"--grpc-port": config.grpc_port})
        return roles.run_prefill(args, devices)
    if distributed.is_primary():  # it alone serves; a taken port ends it before the load
        check_free(config.host, {"--grpc-port": config.grpc_port,
                                 "--http-port": config.http_port})
    kv = kv_events.KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config \
        else None
    orch = build_orchestrator(args, devices)
    if not distributed.is_primary():
        print(f"jetserve serve: process {args.process_id} follows process 0's steps",
              file=sys.stderr, flush=True)
        orch.run()  # until process 0 stops
        print("jetserve serve: stopped", file=sys.stderr, flush=True)
        return 0
    publisher = kv_events.attach(orch, kv) if kv is not None and kv.publishes else None
    if publisher is not None:
        print(f"jetserve serve: KV events on {publisher.endpoint} (topic {kv.topic!r})",
              flush=True)
    orch.start()
    try:
        asyncio.run(_serve(orch, config, warm=not args.no_warmup))
    finally:
        orch.stop(drain=True, timeout=config.drain_timeout_s)
        if publisher is not None:
            publisher.close()
    print("jetserve serve: stopped", file=sys.stderr, flush=True)
    return 0
