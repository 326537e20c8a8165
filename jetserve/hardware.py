"""Accelerator presets for `jetserve plan` and `jetserve shard-report`: memory, bandwidth, FLOP/s.

Per-chip figures from the vendors' spec sheets, in the units those sheets use (decimal
GB, bytes/s, FLOP/s). `cpu` is not a preset: `measure_cpu()` probes this machine on the
spot (streaming-read bandwidth and an f32 matmul through XLA, see jetserve.bench.bandwidth).

Which FLOP/s a matmul runs at depends on its operands: int8 x int8 runs at the int8 rate;
a bf16 activation against bf16 or int8 weights (dequantized on the fly) at the bf16 rate;
f32 at `flops_f32` (XLA's default precision: one bf16 pass on TPU, TF32 on Hopper).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One chip of an accelerator (all rates per chip; a plan multiplies by --chips)."""

    name: str
    hbm_bytes: float  # memory capacity
    hbm_bandwidth: float  # bytes/s, streaming read
    flops_bf16: float  # dense matmul FLOP/s
    flops_int8: float
    flops_f32: float
    ici_bandwidth: float | None  # bytes/s between neighbouring chips; None: single chip
    measured: bool = False  # probed on this machine rather than read from a spec sheet
    note: str = ""

    def __post_init__(self):
        for name in ("hbm_bytes", "hbm_bandwidth", "flops_bf16", "flops_int8", "flops_f32"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"Hardware {self.name!r}: {name} must be > 0, got {v!r}")
        if self.ici_bandwidth is not None and not self.ici_bandwidth > 0:
            raise ValueError(
                f"Hardware {self.name!r}: ici_bandwidth must be > 0 or None, "
                f"got {self.ici_bandwidth!r}"
            )

    def matmul_flops(self, weight_bits: int, act_bits: int) -> float:
        """FLOP/s of a matmul whose activations have act_bits and weights weight_bits."""
        if act_bits <= 8 and weight_bits <= 8:
            return self.flops_int8
        if act_bits <= 16:
            return self.flops_bf16
        return self.flops_f32

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ICI: one link's bidirectional bandwidth along one mesh axis, which is what a 1-D
# model-parallel ring uses (TPU); NVLink: the whole per-GPU NVLink bandwidth (NVSwitch
# connects every pair). HBM of the TPUs is the decimal GB of Google's tables.
PRESETS: dict[str, Hardware] = {
    "tpu-v5e": Hardware(name="tpu-v5e", hbm_bytes=16e9, hbm_bandwidth=8.2e11,
                        flops_bf16=1.97e14, flops_int8=3.94e14, flops_f32=1.97e14,
                        ici_bandwidth=9e10),
    "tpu-v5p": Hardware(name="tpu-v5p", hbm_bytes=95e9, hbm_bandwidth=2.765e12,
                        flops_bf16=4.59e14, flops_int8=9.18e14, flops_f32=4.59e14,
                        ici_bandwidth=1.8e11),
    "tpu-v6e": Hardware(name="tpu-v6e", hbm_bytes=32e9, hbm_bandwidth=1.64e12,
                        flops_bf16=9.18e14, flops_int8=1.836e15, flops_f32=9.18e14,
                        ici_bandwidth=1.8e11),
    # SXM parts, dense (no 2:4 sparsity) tensor-core rates; f32 runs as TF32.
    "h100": Hardware(name="h100", hbm_bytes=80e9, hbm_bandwidth=3.35e12,
                     flops_bf16=9.89e14, flops_int8=1.979e15, flops_f32=4.95e14,
                     ici_bandwidth=9e11),
    "h200": Hardware(name="h200", hbm_bytes=141e9, hbm_bandwidth=4.8e12,
                     flops_bf16=9.89e14, flops_int8=1.979e15, flops_f32=4.95e14,
                     ici_bandwidth=9e11),
}

NAMES = (*PRESETS, "cpu")


def measure_cpu(*, read_bytes: int | None = None, repeats: int = 5) -> Hardware:
    """This machine, probed now: memory size, streaming-read bandwidth, matmul FLOP/s.

    bf16 and int8 matmuls under XLA's CPU backend run far below f32 (see DESIGN.md 8), so
    they are measured too rather than assumed.
    """
    from jetserve.bench import bandwidth  # imports jax; only when a CPU plan asks

    bw = bandwidth.stream_read_bandwidth(read_bytes=read_bytes, repeats=repeats)
    f32 = bandwidth.matmul_flops("float32")
    bf16 = bandwidth.matmul_flops("bfloat16", size=512)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name="cpu", hbm_bytes=float(mem), hbm_bandwidth=bw.best_bps,
                    flops_bf16=bf16, flops_int8=bf16, flops_f32=f32, ici_bandwidth=None,
                    measured=True,
                    note=f"{os.cpu_count()} cores; bandwidth {bw.method}, best of {bw.repeats}")


def get_hardware(name: str) -> Hardware:
    """A preset by name, or `cpu` measured now."""
    if name == "cpu":
        return measure_cpu()
    if name not in PRESETS:
        raise ValueError(f"--hardware {name!r} is unknown; expected one of {list(NAMES)}")
    return PRESETS[name]
