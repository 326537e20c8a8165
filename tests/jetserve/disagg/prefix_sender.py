"""A prefill-side process for the transfer tests: prefills prompts on random:tiny and
holds each prefix for a pull (KVSender), answering one JSON line per command line:

  {"prompt": [ids], "receiver_devices": N} -> {"uuid", "address", "meta", "first"}
  {"ack": uuid}                            -> {"freed": bool, "registered": n}
  {"expire": true}                         -> {"expired": n, "registered": n}

Usage: python -m tests.jetserve.disagg.prefix_sender SHARDING DEVICES HOLD_S
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from engines import EngineConfig  # noqa: E402
from jetserve.disagg.kv_transfer import KVSender  # noqa: E402
from jetserve.model_loading import build_engine  # noqa: E402

ENGINE = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=64)


def main() -> None:
    sharding, n, hold_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    engine = build_engine("random:tiny", devices=jax.devices()[:n], sharding=sharding,
                          engine_config=ENGINE)
    params = engine.load_params()
    sender = KVSender(engine, hold_s=hold_s)
    print(json.dumps({"ready": sender.address}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "prompt" in cmd:
            ids = np.asarray(cmd["prompt"], np.int32)
            prefix, first = engine.prefill(params, ids, len(ids))
            uuid, meta = sender.register(prefix, cmd["receiver_devices"])
            out = {"uuid": uuid, "address": sender.address, "meta": meta,
                   "first": first.to_host().token(0)}
        elif "ack" in cmd:
            out = {"freed": sender.ack(cmd["ack"]), "registered": sender.registered()}
        else:
            out = {"expired": sender.expire(), "registered": sender.registered()}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
