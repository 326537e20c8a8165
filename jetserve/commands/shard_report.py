"""Show how a sharding preset lays a model out: specs, bytes per device, decode step floor."""

from __future__ import annotations

import argparse
import json

import jax

from jetserve import distributed, hardware
from jetserve.commands.common import add_model_arguments, engine_config
from jetserve.model_loading import build_engine
from jetserve.shard_report import build_report

# device_kind substrings -> hardware preset, for --hardware auto.
_KINDS = {"v5 lite": "tpu-v5e", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6 lite": "tpu-v6e",
          "v6e": "tpu-v6e", "h100": "h100", "h200": "h200"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    distributed.add_arguments(p)
    p.add_argument("--hardware", default="auto",
                   help=f"memory bandwidth for the floor: one of {list(hardware.NAMES)}, or "
                        "auto (the devices in use; cpu is measured now)")
    p.add_argument("--no-measure", action="store_true",
                   help="predict from shapes only; do not load weights or allocate the cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _hardware_name(name: str, device: jax.Device) -> str:
    if name != "auto":
        return name
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower()
    for key, preset in _KINDS.items():
        if key in kind:
            return preset
    raise ValueError(f"--hardware auto: no preset for device kind {device.device_kind!r}; "
                     f"give one of {list(hardware.NAMES)}")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} us"


def _spec(spec: list) -> str:
    return "(" + ", ".join("-" if s is None else str(s) for s in spec) + ")" if spec else "()"


def format_text(r: dict, model: str) -> str:
    lines = [
        f"model {model}   sharding {r['sharding']}   mesh {r['mesh']}   "
        f"{r['devices']} {r['platform']} devices   {r['dtype']}",
        f"KV cache: {r['max_concurrent_decodes']} slots x {r['max_seq_len']} positions",
        "",
        f"{'tensor':<44} {'shape':<20} {'spec':<28} {'per device':>12}",
    ]
    for t in r["tensors"]:
        lines.append(f"{t['name']:<44} {str(tuple(t['shape'])):<20} {_spec(t['spec']):<28} "
                     f"{_size(t['bytes_per_device']):>12}")
    lines += ["", f"{'device':>6} {'process':>7}  {'params':>11} {'measured':>11}  "
                  f"{'kv cache':>11} {'measured':>11}"]
    for d in r["per_device"]:
        lines.append(f"{d['device']:>6} {d['process']:>7}  {_size(d['param_bytes']):>11} "
                     f"{_size(d['measured_param_bytes']):>11}  {_size(d['kv_cache_bytes']):>11} "
                     f"{_size(d['measured_kv_cache_bytes']):>11}")
    lines += ["", f"parameters: {_size(r['param_bytes_total'])} in all, "
                  f"{100 * r['sharded_param_fraction']:.1f}% of the bytes sharded; "
                  f"full KV cache {_size(r['kv_cache_bytes_total'])}"]
    for row in r["param_storage"]:
        lines.append(f"  {row['storage']}: {row['params']:,} parameters in "
                     f"{_size(row['bytes'])}, {row['bytes_per_param']:.4g} bytes per parameter")
    rep = r["kv_head_replication"]
    if rep["copies"] > 1:
        lines.append(
            f"kv heads replicated: the model's {rep['stored_kv_heads']} kv heads each held "
            f"by {rep['copies']} devices ({rep['kv_heads']} run), in {len(rep['params'])} "
            f"parameters and {len(rep['kv_cache'])} cache tensors: "
            f"{_size(rep['bytes_per_device'])} per device, "
            f"{_size(rep['copy_bytes_per_device'])} of it copies")
    if "decode_step_floor_s" in r:
        hw = r["hardware"]
        lines.append(
            f"decode step floor on {hw['name']} ({hw['hbm_bandwidth'] / 1e9:.0f} GB/s): "
            f"{_size(r['step_bytes_per_device'])} per device -> "
            f"{_time(r['decode_step_floor_s'])} with a full cache, "
            f"{_time(r['decode_step_floor_params_only_s'])} for the weights alone")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    devices = distributed.setup(args)  # before anything touches a device
    engine = build_engine(args.model, sharding=args.sharding, devices=devices,
                          engine_config=engine_config(args, devices))
    hw = hardware.get_hardware(_hardware_name(args.hardware, devices[0]))
    params = state = None
    if not args.no_measure:
        params = engine.load_params()
        state = engine.init_decode_state()
    report = build_report(engine, params=params, decode_state=state, bandwidth=hw.hbm_bandwidth)
    report["model"] = args.model or "default"
    report["hardware"] = hw.to_json()
    if not distributed.is_primary():
        return 0
    print(json.dumps(report) if args.json else format_text(report, report["model"]), flush=True)
    return 0
