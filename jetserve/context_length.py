"""The default max_seq_len: the model's own context, capped by what fits in memory.

With no `--max-seq-len`, a server takes the model's max_position_embeddings (as vLLM
does), unless the KV cache of max_concurrent_decodes slots at that length does not fit in
the memory the weights leave; then it takes the longest length that fits, rounded down to
a multiple of GRANULE. The arithmetic is `jetserve plan`'s (plan.kv_tokens_that_fit).

Memory: on an accelerator the device's `memory_stats()["bytes_limit"]` times
DEVICE_FRACTION (room for activations and XLA's temporaries); on the CPU the host's
available memory times HOST_FRACTION (the host runs everything else too), shared by the
fake devices. A preset other than "replicated" is taken to split weights and cache over
the slice's devices; "replicated" keeps a whole copy on each.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from engines import ModelConfig
from jetserve.plan import ModelSpec, Precision, kv_tokens_that_fit

DEVICE_FRACTION = 0.9
HOST_FRACTION = 0.5
GRANULE = 16  # the default KV page size: a paged cache holds whole pages
GIB = 2.0**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes usable by one engine for weights and KV cache, and where they come from."""

    bytes: float
    where: str

    def __post_init__(self):
        if not self.bytes > 0:
            raise ValueError(f"Memory.bytes must be > 0, got {self.bytes!r}")


def host_available_bytes() -> float:
    """MemAvailable from /proc/meminfo; the physical memory where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_memory(devices: Sequence, sharding: str) -> Memory:
    """What one engine on `devices` may fill, counted as if on one device whole: the
    per-device budget times the devices a non-replicated preset splits over."""
    n = len(devices)
    shards = 1 if sharding == "replicated" else n
    d = devices[0]
    stats = d.memory_stats() if d.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        per_device = stats["bytes_limit"] * DEVICE_FRACTION
        where = (f"{DEVICE_FRACTION:.0%} of the {stats['bytes_limit'] / GIB:.1f} GiB of a "
                 f"{d.platform} device")
    else:
        host = host_available_bytes()
        per_device = host * HOST_FRACTION / n  # the fake CPU devices share the host
        where = f"{HOST_FRACTION:.0%} of the host's available {host / GIB:.1f} GiB"
        if n > 1:
            where += f" shared by {n} CPU devices"
    if shards > 1:
        where += f", split over {shards} devices ({sharding!r} sharding)"
    return Memory(bytes=per_device * shards, where=where)


def precision_of(dtype: str, quantize: str, kv_dtype: str, platform: str) -> Precision:
    """Bits per stored weight and KV value of an engine with these EngineConfig fields."""
    base = 32 if dtype == "float32" or (dtype == "auto" and platform == "cpu") else 16
    weight = {"int8": 8, "int4": 4}.get(quantize, base)
    return Precision(weight_bits=weight, act_bits=base, kv_bits=8 if kv_dtype == "int8" else base)


def default_max_seq_len(model: ModelConfig, *, slots: int, precision: Precision,
                        memory: Memory) -> tuple[int, str]:
    """(max_seq_len, why): the model's context, or the longest that fits under it."""
    spec = ModelSpec.from_config(model)
    ctx = model.max_position_embeddings
    fit = kv_tokens_that_fit(spec, precision, memory.bytes) // slots
    weights = spec.params * precision.weight_bits / 8 / GIB
    kv_gib = lambda S: S * slots * spec.kv_values_per_token * precision.kv_bits / 8 / GIB
    if fit >= ctx:
        return ctx, (f"max_seq_len={ctx}, the model's max_position_embeddings: a KV cache of "
                     f"{slots} slots x {ctx} tokens ({kv_gib(ctx):.2f} GiB) and the weights "
                     f"({weights:.2f} GiB) fit in {memory.where}")
    S = fit // GRANULE * GRANULE
    if S < GRANULE:
        raise ValueError(f"the weights ({weights:.2f} GiB) leave room for {fit} tokens of KV "
                         f"cache per slot x {slots} slots in {memory.where}: give "
                         f"--max-seq-len, fewer --max-concurrent-decodes, or --quantize")
    return S, (f"max_seq_len={S}, below the model's max_position_embeddings={ctx}: the KV "
               f"cache of {slots} slots x {S} tokens ({kv_gib(S):.2f} GiB) is what fits beside "
               f"the weights ({weights:.2f} GiB) in {memory.where}; --max-seq-len sets it, "
               f"fewer --max-concurrent-decodes lengthen it")
