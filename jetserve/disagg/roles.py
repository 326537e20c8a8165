"""`jetserve serve --role prefill|decode|both`: the command-line side of the split
deployment.

--role prefill: one prefill engine over this process's devices (--prefill-sharding,
  default --sharding), serving jetserve_disagg.PrefillWorker on --grpc-port (no HTTP);
  each prefix is held for a pull until acknowledged or --prefix-hold-timeout passes.
--role decode --prefill-workers HOST:PORT,...: one generate engine (--generate-sharding)
  serving the usual gRPC and HTTP APIs; every worker is checked at start-up.
--role both (default): prefill and generate in this process, as before.
SIGTERM drains either role: a prefill worker refuses new prompts (the decode side sends
them elsewhere) and exits once its held prefixes were pulled or expired.

--role prefill may span several processes (--coordinator HOST:PORT --num-processes N
--process-id I, the same other arguments on each): one prefill engine over the devices of
all of them, run in lock step (prefill_lockstep.py); process 0 serves the worker on
--grpc-port, and the decode side pulls each prefix's blocks from every process. SIGTERM
process 0: the others stop with it. --role decode may span several processes too: one
generate engine over all of them, process 0 serving the APIs and pulling each prefix,
which it spreads over the others before every insert (decode_lockstep.py).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

ROLES = ("both", "prefill", "decode")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("split deployment (prefill and decode processes)")
    g.add_argument("--role", default="both", choices=ROLES,
                   help="both: prefill and generate here (default); prefill: a prefill "
                        "worker for decode processes (its internal service on --grpc-port, "
                        "no HTTP); decode: generate here, prefill on --prefill-workers")
    g.add_argument("--prefill-workers", default=None, metavar="HOST:PORT,...",
                   help="--role decode: the --grpc-port of each --role prefill worker")
    g.add_argument("--prefill-connect-timeout", type=float, default=300.0,
                   help="--role decode: seconds to wait at start-up for every prefill "
                        "worker to be reachable and ready (default %(default)s)")
    g.add_argument("--prefill-timeout", type=float, default=120.0,
                   help="--role decode: seconds one prefill call may take before its worker "
                        "counts as failed and the request goes to another (default %(default)s)")
    g.add_argument("--prefix-hold-timeout", type=float, default=60.0,
                   help="--role prefill: seconds a prefix is held for its pull before it "
                        "is freed (default %(default)s)")
    g.add_argument("--transfer-host", default="127.0.0.1",
                   help="address of this process's KV transfer server; give one the other "
                        "hosts reach when the roles run on different hosts "
                        "(default %(default)s)")
    g.add_argument("--max-transfer-bytes", type=int, default=256 << 20,
                   help="--role decode: KV bytes being pulled at once (default %(default)s)")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag that does not go with --role."""
    role = args.role
    if role == "decode" and not args.prefill_workers:
        raise ValueError("--role decode needs --prefill-workers HOST:PORT,... (the "
                         "--grpc-port of each --role prefill worker)")
    if role != "decode" and args.prefill_workers:
        raise ValueError(f"--prefill-workers goes with --role decode, not --role {role}")
    if role == "both":
        return
    from jetserve.commands.common import prefix_cache_budgets

    if (args.prefill_devices is not None or args.generate_devices is not None
            or args.interleaved):
        raise ValueError(f"--role {role}: one engine spans this process's devices (--devices "
                         "N takes the first N); leave out --prefill-devices, "
                         "--generate-devices and --interleaved")
    if role == "decode" and any(prefix_cache_budgets(args).values()):
        raise ValueError("--role decode: the prefix cache is the prefill workers' "
                         "(--prefix-cache-hbm-mb / --prefix-cache-host-mb on --role prefill)")
    for flag, v in (("--prefix-hold-timeout", args.prefix_hold_timeout),
                    ("--prefill-timeout", args.prefill_timeout),
                    ("--prefill-connect-timeout", args.prefill_connect_timeout)):
        if not v > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {v}")
    if args.max_transfer_bytes < 1:
        raise ValueError(f"--max-transfer-bytes must be >= 1, got {args.max_transfer_bytes}")


def _engine(args: argparse.Namespace, devices, sharding: str | None):
    from jetserve import lora_adapters
    from jetserve.commands.common import engine_config
    from jetserve.model_loading import build_engine

    devs = list(devices)
    engine = build_engine(args.model, devices=devs, sharding=sharding or args.sharding,
                          engine_config=engine_config(args, devs))
    if args.lora_modules:  # both roles hold the same adapters: ids cross with the prefix
        lora_adapters.load_modules([engine], args.lora_modules)
    return engine


def build_decode(args: argparse.Namespace, devices, config):
    """The decode role's orchestrator, after checking every prefill worker (over several
    processes: process 0's; the others get a DecodeFollower, whose `run` follows it)."""
    import jax

    from jetserve.disagg.decode_lockstep import DecodeFollower
    from jetserve.disagg.decode_orchestrator import DecodeOrchestrator
    from jetserve.disagg.prefill_client import PrefillWorkers, parse_addresses
    from jetserve.disagg.prefix_spread import PrefixSpreader
    from jetserve.scheduling.page_planner import with_pages

    addresses = parse_addresses(args.prefill_workers)
    engine = _engine(args, devices, args.generate_sharding)
    spreader = None
    if jax.process_count() > 1:
        spreader = PrefixSpreader(engine, host=args.transfer_host)
        if jax.process_index() != 0:
            return DecodeFollower(with_pages(engine), engine.load_params(), spreader)
    workers = PrefillWorkers(addresses, rpc_timeout_s=args.prefill_timeout)
    try:
        workers.check(engine, args.prefill_connect_timeout)
    except BaseException:
        workers.close()
        raise
    return DecodeOrchestrator(engine=engine, params=engine.load_params(), workers=workers,
                              config=config, max_bytes_in_flight=args.max_transfer_bytes,
                              transfer_host=args.transfer_host, spreader=spreader)


def run_prefill(args: argparse.Namespace, devices) -> int:
    """Serves a prefill worker until SIGTERM, then drains (process 0 of several: the
    others follow its turns until it stops)."""
    import jax

    from jetserve.disagg.kv_transfer import KVSender
    from jetserve.disagg.prefill_lockstep import LockStepPrefillRunner
    from jetserve.disagg.prefill_runner import PrefillRunner

    engine = _engine(args, devices, args.prefill_sharding)
    sender = KVSender(engine, host=args.transfer_host, hold_s=args.prefix_hold_timeout)
    if jax.process_count() > 1:
        runner = LockStepPrefillRunner(engine, engine.load_params(), sender,
                                       max_queued=args.max_queued_requests,
                                       **_prefix_cache(args, engine))
        if jax.process_index() != 0:
            print(f"jetserve serve: process {jax.process_index()} follows process 0's "
                  "prefills", file=sys.stderr, flush=True)
            runner.follow()
            print(f"jetserve serve: stopped ({sender.registered()} prefixes still held)",
                  file=sys.stderr, flush=True)
            return 0
    else:
        runner = PrefillRunner(engine, engine.load_params(), sender,
                               max_queued=args.max_queued_requests,
                               **_prefix_cache(args, engine))
    runner.start()
    try:
        asyncio.run(_serve_prefill(args, runner))
    finally:
        runner.stop()
    print("jetserve serve: stopped", file=sys.stderr, flush=True)
    return 0


def _prefix_cache(args: argparse.Namespace, engine) -> dict:
    """The prefill worker's prefix cache (cache, cache_key), when the flags budget one."""
    from jetserve.commands.common import prefix_cache_budgets
    from jetserve.orchestrator.config import OrchestratorConfig
    from jetserve.orchestrator.prefix_cache import PrefixCache, model_cache_key
    from jetserve.orchestrator.prefix_stores import ArrayStore

    budgets = prefix_cache_budgets(args)
    if not any(budgets.values()):
        return {}
    store = ArrayStore(engine, OrchestratorConfig.prefix_cache_block)
    cache = PrefixCache(store=store, hbm_bytes=budgets["prefix_cache_hbm_bytes"],
                        host_bytes=budgets["prefix_cache_host_bytes"])
    return {"cache": cache, "cache_key": model_cache_key(args.model, engine.model_config)}


async def _serve_prefill(args: argparse.Namespace, runner) -> None:
    from jetserve.disagg.prefill_service import SERVICE, PrefillServer

    port = 0 if args.grpc_port in (0, -1) else args.grpc_port
    server = PrefillServer(runner, args.host, port)
    await server.start()
    shown = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    print(f"jetserve serve: prefill worker gRPC listening on {shown}:{server.port} "
          f"({SERVICE}; KV transfer server {runner.sender.address})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if not args.no_warmup:
            print("jetserve serve: warming up (one prefill per bucket)", flush=True)
            warm = asyncio.ensure_future(asyncio.to_thread(runner.warm_up))
            await asyncio.wait({warm, asyncio.ensure_future(stop.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():
            await server.ready()
            print("jetserve serve: ready", flush=True)
            await stop.wait()
    finally:
        print("jetserve serve: draining (held prefixes wait for their pulls)", flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if not await server.drain(args.drain_timeout):
            print(f"jetserve serve: {runner.sender.registered()} prefixes still held after "
                  f"--drain-timeout {args.drain_timeout:g} s; freeing them", flush=True)
        await server.stop()

