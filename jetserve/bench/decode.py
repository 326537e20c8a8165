"""`jetserve bench decode`: the jitted generate step against its memory and compute floors.

For each batch size B an engine with B slots is built, every slot is filled with a
`context`-token prompt (prefill once, insert into each slot), and the generate step runs
warm: its median time over `steps` steps, each blocked on, is compared with the floor of
jetserve.plan for this machine, whose bandwidth and matmul FLOP/s are probed in the same
run (jetserve.bench.bandwidth; before the first batch and after the last, best kept).

    fraction_of_floor = floor_ms / step_ms     (1.0: at the floor)

With `kv_layout="paged"` the step is the paged engine's, over pages of `page_size`
tokens (16 from the command line) that its page planner hands out as the slots fill.

With `slots`, one engine of that many slots is built instead and each batch B below it is
timed as a step over its first B slots (EngineConfig.decode_batch_sizes), what a server
with `--decode-batch-sizes` runs when only those slots are in use.

The live context grows by one token per step; floors use the mean live context of the
timed steps. Everything runs in this thread; the parameters are loaded once and shared
by the engines (same devices, same layout).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np

from engines import EngineConfig, TransformerEngine
from engines.engine_config import LAYER_MODES
from jetserve.bench import bandwidth
from jetserve.hardware import Hardware
from jetserve.model_loading import build_engine
from jetserve.plan import ModelSpec, Precision, step_floor
from jetserve.scheduling.plan import chunks


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    model: str | None = "random:llama-156m"
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 192  # midway through 128 prompt + 128 new tokens
    steps: int = 24
    warmup: int = 4
    dtype: str = "float32"
    read_bytes: int | None = None  # bandwidth probe size (default 2 GiB)
    probe_repeats: int = 5
    matmul_size: int = 2048  # the FLOP/s probe's square matmul
    max_seq_len: int | None = None  # default: context + warmup + steps, rounded up to 128
    sharding: str = "replicated"
    quantize: str = "none"  # matmul weights: none | int8 | int4
    kv_dtype: str = "auto"  # auto | int8
    kv_layout: str = "contiguous"  # contiguous | paged (pages of page_size tokens)
    page_size: int = 16
    layers: str = "auto"  # EngineConfig.layers: auto | loop | scan
    # One engine of this many slots, each batch B below it timed as a step over its first
    # B slots (EngineConfig.decode_batch_sizes); None: an engine of B slots per batch.
    slots: int | None = None

    def __post_init__(self):
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive integers, got {self.batches!r}")
        for name in ("context", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first step compiles), got {self.warmup}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {LAYER_MODES}, got {self.layers!r}")
        if self.slots is not None and not all(b <= self.slots for b in self.batches):
            raise ValueError(f"slots {self.slots} must hold every batch, got {self.batches}")
        need = self.context + self.warmup + self.steps
        if self.max_seq_len is not None and self.max_seq_len < need:
            raise ValueError(f"max_seq_len {self.max_seq_len} is below context + warmup + "
                             f"steps = {need}")

    @property
    def seq_len(self) -> int:
        need = self.context + self.warmup + self.steps
        return self.max_seq_len or -(-need // 128) * 128


def fill_slots(engine: TransformerEngine, params, context: int, seed: int = 0):
    """A decode state with every slot holding the same `context`-token prompt."""
    prompt = np.random.RandomState(seed).randint(3, engine.vocab_size, context).astype(np.int32)
    pieces = chunks(context, engine.max_prefill_length)  # long contexts: chunks
    prefix = engine.empty_prefix(context) if len(pieces) > 1 else None
    for start, end in pieces:
        piece = prompt[start:end]
        prefix, _ = engine.prefill(params, piece, len(piece), existing_prefix=prefix,
                                   donate=True)
    state = engine.init_decode_state()
    for slot in range(engine.max_concurrent_decodes):
        state = engine.insert(prefix, state, slot)
    return state


def time_steps(engine: TransformerEngine, params, state, *, warmup: int, steps: int,
               rows: int | None = None):
    """Per-step seconds of engine.generate (over the first `rows` slots, None: all), each
    blocked on; returns (times, state)."""
    rows_kw = {} if rows is None else {"rows": rows}
    for _ in range(warmup):
        state, res = engine.generate(params, state, **rows_kw)
    jax.block_until_ready(res.data)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, res = engine.generate(params, state, **rows_kw)
        jax.block_until_ready(res.data)
        times.append(time.perf_counter() - t0)
    return times, state


def probe(cfg: DecodeBenchConfig, device: jax.Device) -> tuple[bandwidth.BandwidthResult, float]:
    """Memory bandwidth of `device` (host memory for a CPU) and its matmul FLOP/s."""
    if device.platform == "cpu":
        bw = bandwidth.stream_read_bandwidth(read_bytes=cfg.read_bytes,
                                             repeats=cfg.probe_repeats)
    else:
        bw = bandwidth.device_read_bandwidth(device, read_bytes=cfg.read_bytes,
                                             repeats=cfg.probe_repeats)
    with jax.default_device(device):
        return bw, bandwidth.matmul_flops(cfg.dtype, size=cfg.matmul_size)


def run(cfg: DecodeBenchConfig, devices: Sequence[jax.Device] | None = None,
        log=print) -> dict:
    """Runs the benchmark; returns the JSON-ready result."""
    devices = list(devices or jax.devices()[:1])
    load0 = os.getloadavg()[0]
    bw0, flops0 = probe(cfg, devices[0])
    log(f"bandwidth {bw0.gbps:.1f} GB/s ({bw0.method}), f32 matmul {flops0 / 1e9:.1f} GFLOP/s"
        if cfg.dtype == "float32" else
        f"bandwidth {bw0.gbps:.1f} GB/s ({bw0.method}), {cfg.dtype} matmul "
        f"{flops0 / 1e9:.1f} GFLOP/s")
    params = engine = state = None
    raw = []
    for b in cfg.batches:
        if engine is None or cfg.slots is None:
            del engine, state  # the previous batch's cache goes before the next is made
            engine = build_engine(cfg.model, devices=devices, sharding=cfg.sharding,
                                  engine_config=_engine_config(cfg, b))
            if params is None:
                params = engine.load_params()
                spec = ModelSpec.from_config(engine.model_config)
            state = fill_slots(engine, params, cfg.context)
        t_compile = time.perf_counter()
        rows = b if cfg.slots is not None and b < cfg.slots else None
        times, state = time_steps(engine, params, state, warmup=cfg.warmup, steps=cfg.steps,
                                  rows=rows)
        raw.append((b, times))
        log(f"batch {b}: median {statistics.median(times) * 1e3:.2f} ms, best "
            f"{min(times) * 1e3:.2f} ms ({time.perf_counter() - t_compile:.1f} s with compile)")
    del state, engine
    bw1, flops1 = probe(cfg, devices[0])
    bw_best = max(bw0.best_bps, bw1.best_bps)
    flops = max(flops0, flops1)
    hw = Hardware(name="this machine", hbm_bytes=1e12, hbm_bandwidth=bw_best,
                  flops_bf16=flops, flops_int8=flops, flops_f32=flops, ici_bandwidth=None,
                  measured=True)
    # The floor counts quantized weights and cache at their stored width (scales aside).
    prec = Precision.from_dtype(cfg.dtype, weight_bits={"int8": 8, "int4": 4}.get(cfg.quantize),
                                kv_bits=8 if cfg.kv_dtype == "int8" else None)
    live = cfg.context + cfg.warmup + (cfg.steps + 1) / 2  # mean cache length while timed
    rows = []
    for b, times in raw:
        fl = step_floor(spec, hw, batch=b, context=round(live), precision=prec)
        med = statistics.median(times) * 1e3
        rows.append({
            "batch": b, "context": cfg.context, "step_ms": _sig(med),
            "step_ms_best": _sig(min(times) * 1e3), "floor_ms": _sig(fl.step_ms_floor),
            "fraction_of_floor": _sig(fl.step_ms_floor / med),
            # Best against best: on a shared machine other processes only add time, to
            # the probes and the steps alike.
            "fraction_of_floor_best": _sig(fl.step_ms_floor / (min(times) * 1e3)),
            "memory_floor_ms": _sig(fl.step_ms_memory),
            "compute_floor_ms": _sig(fl.step_ms_compute), "bound": fl.bound,
            "tokens_per_s": round(b / med * 1e3, 1),
        })
    return {
        "model": cfg.model, "dtype": cfg.dtype, "quantize": cfg.quantize,
        "kv_dtype": cfg.kv_dtype, "kv_layout": cfg.kv_layout, "layers": cfg.layers, "max_seq_len": cfg.seq_len,
        "slots": cfg.slots,
        "bandwidth_gbps": round(bw_best / 1e9, 2),
        "bandwidth_probes_gbps": [round(bw0.gbps, 2), round(bw1.gbps, 2)],
        "bandwidth_method": bw0.method if bw0.best_bps >= bw1.best_bps else bw1.method,
        "matmul_gflops": round(flops / 1e9, 1),
        "matmul_probes_gflops": [round(flops0 / 1e9, 1), round(flops1 / 1e9, 1)],
        "weights_read_bytes": int(spec.read_params(1) * prec.weight_bits / 8),
        "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],  # start, end
        "cpus": os.cpu_count(),
        "rows": rows,
    }


def _engine_config(cfg: DecodeBenchConfig, batch: int) -> EngineConfig:
    """An engine of `batch` slots, or of cfg.slots with a step for each smaller batch."""
    slots = cfg.slots or batch
    return EngineConfig(max_concurrent_decodes=slots, max_seq_len=cfg.seq_len,
                        max_prefill_length=min(512, cfg.context), dtype=cfg.dtype,
                        quantize=cfg.quantize, kv_dtype=cfg.kv_dtype, layers=cfg.layers,
                        kv_layout=cfg.kv_layout, page_size=cfg.page_size,
                        decode_batch_sizes=tuple(sorted({b for b in cfg.batches if b < slots}))
                        if cfg.slots else ())


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a tiny model's floor is far below 1 ms)."""
    return float(f"{x:.{digits}g}")
