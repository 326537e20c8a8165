"""KV transfer between two processes (jax.experimental.transfer) against device_put in one.

    jetserve bench transfer [--model random:small] [--prompt-len 64,256] [--devices 2]
                            [--prefill-sharding tp] [--generate-sharding replicated]

This process runs a prefill engine on its first --devices devices and a generate engine
on the next --devices. A child process (`--sender`) runs the same prefill engine on its
own devices and holds each prefix for a pull (KVSender). For every prompt length and
repeat, the same prefix moves into the generate engine's layout two ways:
  pull:       KVReceiver.pull from the child (check, pull over TCP on 127.0.0.1, regroup,
              device_put into prefix_destination_sharding), what `--role decode` does;
  device_put: the prefix of the in-process prefill engine, regrouped and device_put into
              the same layout, what `--role both` with two slices does.
Prints the prefix's KV bytes, the median time of each and their bytes per second, and the
ratio pull / device_put. On CPU both sides share the host's memory and cores, so the pull
shows the cost of the wire path (serialize, socket, copy), not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from jetserve import distributed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jetserve bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:small")
    p.add_argument("--prompt-len", default="64,256", help="comma-separated prompt lengths")
    p.add_argument("--devices", type=int, default=2, help="devices per engine")
    p.add_argument("--prefill-sharding", default="tp")
    p.add_argument("--generate-sharding", default="replicated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    return p


def _engine(args, devices, sharding: str, longest: int):
    from engines import EngineConfig
    from jetserve.model_loading import build_engine

    bucket = 1 << (longest - 1).bit_length()  # every prompt in one prefill
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=bucket,
                       max_seq_len=2 * bucket)
    return build_engine(args.model, devices=devices, sharding=sharding, engine_config=cfg)


def _prompt(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) % 200) + 1


def _sender(args, lengths: list[int]) -> None:
    """The child: one prefix per length, registered again under a new uuid per request."""
    import jax

    from jetserve.disagg.kv_transfer import KVSender

    engine = _engine(args, jax.devices()[:args.devices], args.prefill_sharding, max(lengths))
    params = engine.load_params()
    prefixes = {n: engine.prefill(params, _prompt(n), n)[0] for n in lengths}
    sender = KVSender(engine, hold_s=600)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        n = json.loads(line)["len"]
        uuid, meta = sender.register(prefixes[n], args.devices)
        print(json.dumps({"uuid": uuid, "meta": meta, "address": sender.address}), flush=True)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args, lengths: list[int], child: subprocess.Popen, log=print) -> dict:
    import jax

    from jetserve.disagg import prefix_wire
    from jetserve.disagg.kv_transfer import KVReceiver

    devs = jax.devices()
    pe = _engine(args, devs[:args.devices], args.prefill_sharding, max(lengths))
    ge = _engine(args, devs[args.devices:2 * args.devices], args.generate_sharding,
                 max(lengths))
    params = pe.load_params()
    receiver = KVReceiver(ge)
    dest = ge.prefix_destination_sharding()
    assert json.loads(child.stdout.readline())["ready"]

    def pull(n: int) -> float:
        """Seconds of one pull; the child registers the prefix first (not timed)."""
        child.stdin.write(json.dumps({"len": n}) + "\n")
        child.stdin.flush()
        sent = json.loads(child.stdout.readline())
        t = time.perf_counter()
        receiver.pull(sent["address"], sent["uuid"], sent["meta"], "bench sender")
        return time.perf_counter() - t

    rows = []
    for n in lengths:
        prefix = pe.prefill(params, _prompt(n), n)[0]
        nbytes = prefix_wire.nbytes(prefix_wire.describe(prefix, pe))
        put = lambda p=prefix: jax.block_until_ready(  # noqa: E731
            jax.device_put(ge.receive_prefix(p), dest))
        put()
        pull(n)  # first of each: compiles the regroup and the move
        t_put = _median_s(put, args.repeats)
        t_pull = statistics.median(pull(n) for _ in range(args.repeats))
        row = {"prompt_len": n, "kv_bytes": nbytes, "pull_ms": 1e3 * t_pull,
               "device_put_ms": 1e3 * t_put, "pull_mb_s": nbytes / t_pull / 2**20,
               "device_put_mb_s": nbytes / t_put / 2**20, "pull_over_device_put": t_pull / t_put}
        rows.append(row)
        log(f"{n:>7} {nbytes / 2**20:>8.2f} {row['pull_ms']:>8.2f} {row['pull_mb_s']:>9.1f} "
            f"{row['device_put_ms']:>9.2f} {row['device_put_mb_s']:>9.1f} "
            f"{row['pull_over_device_put']:>8.2f}")
    return {"model": args.model, "devices": args.devices, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    lengths = [int(x) for x in args.prompt_len.split(",") if x]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--prompt-len: give positive lengths, got {args.prompt_len!r}")
    if args.repeats < 1 or args.devices < 1:
        raise ValueError("--repeats and --devices must be >= 1")
    if args.sender:
        distributed.request_cpu_devices(args.devices)
        _sender(args, lengths)
        return 0
    distributed.request_cpu_devices(2 * args.devices)
    argv = [sys.executable, "-m", "jetserve.bench.transfer", "--sender",
            *(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json")]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the child asks for its own --devices
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env)
    log = (lambda *a: None) if args.json else print
    log(f"{'prompt':>7} {'KV MB':>8} {'pull ms':>8} {'pull MB/s':>9} {'put ms':>9} "
        f"{'put MB/s':>9} {'pull/put':>8}")
    try:
        out = run(args, lengths, child, log)
    finally:
        child.stdin.close()
        child.wait(60)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
