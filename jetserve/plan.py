"""Capacity and roofline arithmetic for decode: what fits, and how fast it can possibly go.

Pure host math (no jax), shared by `jetserve plan` and `jetserve bench decode`.

Derivation. One decode step runs every live sequence forward by one token. Symbols: B
batch, C live context (tokens in each cache), P parameters, P_read the parameters a step
reads, P_mm the parameters a token multiplies through (matmul weights), b_w / b_a / b_kv
bits per weight / activation / KV value, Z = 2 L K H the K and V values stored per token
(L K H for a key-only cache: multi-head latent attention's),
W = HBM bandwidth, R = matmul FLOP/s (both summed over chips), F the MLP width.

* Memory read per step. Every weight matrix is read once and used by all B rows. The
  input embedding is the exception: a step gathers B rows of it, so P_read = P - V D
  when it is untied; tied, the output head reads it whole, so P_read = P. Each sequence's
  cache is read whole: B C Z b_kv / 8 bytes. With a sliding window, C is capped at it.
  Stored, a sliding layer holds every position in the contiguous layout, and in the
  paged one a ring of pages per sequence, ceil((window + chunk - 1) / page) + 1 pages
  (engines/paged_kv.py WindowRing): C_held = s min(C, ring) + (1 - s) C for a share s
  of sliding layers.
  Mixture of experts: a layer reads only the experts its tokens route to; with uniform
  routing of k of E experts, the expected share touched is 1 - (1 - k/E)^B.

      T_weights = P_read b_w / 8 / W          T_kv = B C Z b_kv / 8 / W

* Compute per step: each matmul weight is a multiply-add (2 FLOPs) per token, so
  T_compute = 2 B P_mm / R. Attention is 4 B C N H FLOPs per layer against the
  B C Z b_kv / 8 bytes it reads, an intensity of ~N/K FLOPs per byte, so it stays under
  the memory roof and is counted as T_kv.
* Weights and matmuls overlap (weights stream while the units multiply), the KV read
  does not shrink with batch, so

      step_floor = T_kv + max(T_weights, T_compute),   tokens/s = B / step_floor.

  At small B this is (bytes of weights + B x KV bytes) / W, the memory floor.
* Critical batch: T_compute = T_weights when 2 B P_mm / R = P b_w / 8 / W, i.e.
  B* = (R / W) x b_w / 16 (with P_mm ~ P_read). With R at the bf16 rate this is the
  textbook "FLOP/s / bandwidth x bits-per-weight / bits-per-activation", since the int8
  rate is twice the bf16 rate; f32 weights at the f32 rate give B* = 2 R / W.
* Capacity: weights are stored whole (P b_w / 8) plus B C Z b_kv / 8 of cache; the largest
  batch that fits is floor((chips x HBM - P b_w / 8) / (C Z b_kv / 8)).
* Kv heads under tensor parallelism (`tp`): with more chips than kv heads K (a multiple
  of K), each kv head, its k / v projections and its cache, is held by chips / K chips,
  so the cache stored and read per token is Z x chips / K values in all (Z / K per chip)
  and the k / v projections are stored chips / K times; every other weight splits over
  all chips.
* Attention data parallel (`dp_ep`): the slots and their cache split over the chips (each
  chip stores and reads 1/chips of the KV, no kv-head copies), the routed experts split
  over the same chips, and every other weight (attention, dense MLPs, embeddings) whole on
  every chip: stored and read chips times, while the compute is the same as tp's.
* Model parallelism for decode: sharding a [D, F] weight over Y chips takes D F b_w / 8 / Y
  / W_chip to read, while the activations it must gather cost ~B D b_a / 8 / ICI regardless
  of Y; communication dominates once Y > F / (B x W_chip / ICI).

The issue's textbook example treats GB (1e9) as the unit throughout; rows carry both
`*_gb` (1e9 bytes) and `*_gib` (2^30 bytes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from engines.config import ModelConfig, ring_pages
from jetserve.hardware import Hardware

GB = 1e9
GIB = 2.0**30
# How the chips hold the model (the sharding presets of the same names).
LAYOUTS = ("tp", "dp_ep")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The counts a plan needs, from a ModelConfig or stated directly (as a textbook does)."""

    name: str
    params: float  # P: every parameter, stored
    unread_params: float  # parameters a step does not read whole (untied input embedding)
    matmul_params: float  # P_mm: weights each token multiplies through (active experts only)
    kv_values_per_token: float  # Z = 2 L K H (L K H key-only)
    ffn: int  # F, the MLP width (model-parallel estimate)
    expert_params: float = 0.0  # all routed experts' weights (a subset of params)
    num_experts: int = 0
    experts_per_tok: int = 0
    sliding_window: int | None = None
    sliding_layers: float = 1.0  # the share of layers that attend over the window only
    num_kv_heads: int = 0  # K; 0: not stated (no kv-head replication is counted)
    kv_proj_params: float = 0.0  # the k / v projections (and biases) of all layers

    def __post_init__(self):
        for name in ("params", "matmul_params", "kv_values_per_token", "ffn"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelSpec {self.name!r}: {name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        if not 0 <= self.unread_params + self.expert_params <= self.params:
            raise ValueError(f"ModelSpec {self.name!r}: unread_params + expert_params must be "
                             f"in [0, params]")
        if self.num_experts and not 0 < self.experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelSpec {self.name!r}: experts_per_tok must be in "
                             f"[1, {self.num_experts}], got {self.experts_per_tok}")

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str = "model") -> ModelSpec:
        D, F, L, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                               cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
        E, k, Fe = cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size
        attn = cfg.mla_params() if cfg.mla else 2 * D * N * H + 2 * D * K * H
        routed = sum(cfg.moe_layer(i) for i in range(L))  # the others' MLP is dense
        shared = 3 * D * Fe * cfg.shared_experts  # always on, beside the routed ones
        mlp_active = (L - routed) * 3 * D * F + routed * (3 * D * Fe * k + D * E + shared)
        return cls(
            name=name,
            params=float(cfg.param_count()),
            unread_params=0.0 if cfg.tie_word_embeddings else float(V * D),
            matmul_params=float(L * attn + mlp_active + V * D),
            kv_values_per_token=float(cfg.kv_bytes_per_token(1)),
            ffn=F,
            expert_params=float(3 * D * Fe * E * routed),
            num_experts=E,
            experts_per_tok=k,
            sliding_window=cfg.sliding_window,
            sliding_layers=sum(cfg.layer_window(i) is not None for i in range(L)) / L,
            num_kv_heads=K,
            kv_proj_params=float(L * D * H if cfg.mla  # MLA: kv_a_proj_with_mqa
                                 else L * 2 * K * H * (D + int(cfg.qkv_bias))),
        )

    def kv_head_copies(self, chips: int) -> int:
        """Chips holding each kv head when `tp` splits the model over `chips`: chips / K
        where chips is a multiple of K, else 1."""
        K = self.num_kv_heads
        return chips // K if K and chips > K and chips % K == 0 else 1

    def copies(self, chips: int, layout: str = "tp") -> tuple[int, float, float]:
        """(chips holding each kv head, parameters stored beyond one copy, parameters read
        beyond one copy per step) when `layout` spreads the model over `chips`."""
        if layout == "dp_ep":  # all but the routed experts whole on every chip
            whole = self.params - self.expert_params
            return 1, whole * (chips - 1), (whole - self.unread_params) * (chips - 1)
        if layout != "tp":
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        copies = self.kv_head_copies(chips)
        extra = self.kv_proj_params * (copies - 1)
        return copies, extra, extra

    def read_params(self, batch: int) -> float:
        """P_read: parameters one step of `batch` tokens reads from memory."""
        dense = self.params - self.unread_params - self.expert_params
        if not self.num_experts:
            return dense
        touched = 1.0 - (1.0 - self.experts_per_tok / self.num_experts) ** batch
        return dense + self.expert_params * touched


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """Bits per stored weight, per activation (picks the matmul rate), per KV value."""

    weight_bits: int = 16
    act_bits: int = 16
    kv_bits: int = 16

    def __post_init__(self):
        for name in ("weight_bits", "act_bits", "kv_bits"):
            v = getattr(self, name)
            if v not in (4, 8, 16, 32):
                raise ValueError(f"{name} must be one of 4, 8, 16, 32, got {v!r}")

    @classmethod
    def from_dtype(cls, dtype: str, *, weight_bits: int | None = None,
                   kv_bits: int | None = None, act_bits: int | None = None) -> Precision:
        bits = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8}
        if dtype not in bits:
            raise ValueError(f"--dtype must be one of {list(bits)}, got {dtype!r}")
        base = bits[dtype]
        # int8 means int8 weights and cache with bf16 activations (weight-only quantization).
        act = 16 if dtype == "int8" else base
        return cls(weight_bits=weight_bits or base, act_bits=act_bits or act,
                   kv_bits=kv_bits or base)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
    batch: int
    context: int
    weights_read_gb: float
    kv_gb: float
    kv_gib: float
    total_gb: float
    total_gib: float
    fits: bool
    step_ms_memory: float  # (weights read + KV) / bandwidth
    step_ms_compute: float  # 2 B P_mm / FLOP/s
    step_ms_floor: float  # T_kv + max(T_weights, T_compute)
    tokens_per_s: float
    bound: str  # "memory" or "compute"
    model_parallel_max: float | None  # F / (B x W / ICI); None on one chip without ICI


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    hardware: Hardware
    chips: int
    layout: str  # LAYOUTS: how the chips hold the model
    precision: Precision
    context: int
    param_bytes: float
    kv_bytes_per_token: float  # on all chips together, kv-head copies included
    kv_bytes_per_token_per_chip: float
    kv_head_copies: int  # chips holding each kv head (ModelSpec.kv_head_copies)
    kv_bytes_per_seq: float
    max_batch: int
    critical_batch: float
    rows: tuple[PlanRow, ...]

    def to_json(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model),
            "hardware": self.hardware.to_json(),
            "chips": self.chips,
            "layout": self.layout,
            "precision": dataclasses.asdict(self.precision),
            "context": self.context,
            "param_bytes": self.param_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_chip": self.kv_bytes_per_token_per_chip,
            "kv_head_copies": self.kv_head_copies,
            "kv_bytes_per_seq": self.kv_bytes_per_seq,
            "max_batch": self.max_batch,
            "critical_batch": self.critical_batch,
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }


def held_context(model: ModelSpec, context: int, ring_tokens: int | None) -> float:
    """Positions of KV one sequence of `context` tokens keeps, averaged over its layers:
    all of them, or with `ring_tokens` (a paged engine's ring, held_ring_tokens) that
    many at most on the sliding layers."""
    if not model.sliding_window or ring_tokens is None:
        return float(context)
    s = model.sliding_layers
    return s * min(context, ring_tokens) + (1 - s) * context


def held_ring_tokens(model: ModelSpec, page_size: int, chunk: int) -> int | None:
    """Positions a paged engine's ring keeps per sequence on a sliding layer when prompts
    are prefilled in chunks of `chunk` (None: the model has no sliding layer)."""
    if not model.sliding_window:
        return None
    return ring_pages(model.sliding_window, chunk, page_size) * page_size


def step_floor(model: ModelSpec, hw: Hardware, *, chips: int = 1, batch: int, context: int,
               precision: Precision, layout: str = "tp",
               ring_tokens: int | None = None) -> PlanRow:
    """The floor for one decode step of `batch` sequences, each with `context` live
    tokens; `ring_tokens`: what a sliding layer stores per sequence (paged), else all."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    bw = hw.hbm_bandwidth * chips
    flops = hw.matmul_flops(precision.weight_bits, precision.act_bits) * chips
    copies, stored_extra, read_extra = model.copies(chips, layout)
    kv_tok = model.kv_values_per_token * copies * precision.kv_bits / 8
    read_ctx = context
    if model.sliding_window:  # sliding layers read their window, the others everything
        s = model.sliding_layers
        read_ctx = s * min(context, model.sliding_window) + (1 - s) * context
    kv_read = batch * read_ctx * kv_tok
    kv_stored = batch * held_context(model, context, ring_tokens) * kv_tok
    w_read = (model.read_params(batch) + read_extra) * precision.weight_bits / 8
    param_bytes = (model.params + stored_extra) * precision.weight_bits / 8
    total = param_bytes + kv_stored
    t_w, t_kv = w_read / bw, kv_read / bw
    t_c = 2.0 * batch * model.matmul_params / flops
    step = t_kv + max(t_w, t_c)
    mp = None
    if hw.ici_bandwidth is not None:
        mp = model.ffn / (batch * hw.hbm_bandwidth / hw.ici_bandwidth)
    return PlanRow(
        batch=batch, context=context, weights_read_gb=w_read / GB,
        kv_gb=kv_stored / GB, kv_gib=kv_stored / GIB, total_gb=total / GB,
        total_gib=total / GIB, fits=total <= hw.hbm_bytes * chips,
        step_ms_memory=(w_read + kv_read) / bw * 1e3, step_ms_compute=t_c * 1e3,
        step_ms_floor=step * 1e3, tokens_per_s=batch / step,
        bound="compute" if t_c > t_w else "memory", model_parallel_max=mp,
    )


def make_plan(model: ModelSpec, hw: Hardware, *, chips: int = 1, batches: Sequence[int],
              context: int, precision: Precision, layout: str = "tp",
              ring_tokens: int | None = None) -> Plan:
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    if not batches:
        raise ValueError("batches is empty")
    copies, stored_extra, _ = model.copies(chips, layout)
    kv_tok = model.kv_values_per_token * copies * precision.kv_bits / 8
    param_bytes = (model.params + stored_extra) * precision.weight_bits / 8
    held = held_context(model, context, ring_tokens)
    max_batch = int(kv_tokens_that_fit(model, precision, hw.hbm_bytes * chips, copies,
                                       stored_extra) // held)
    flops = hw.matmul_flops(precision.weight_bits, precision.act_bits)
    critical = flops / hw.hbm_bandwidth * precision.weight_bits / 16
    rows = tuple(step_floor(model, hw, chips=chips, batch=b, context=context,
                            precision=precision, layout=layout, ring_tokens=ring_tokens)
                 for b in batches)
    return Plan(model=model, hardware=hw, chips=chips, layout=layout, precision=precision,
                context=context,
                param_bytes=param_bytes, kv_bytes_per_token=kv_tok,
                kv_bytes_per_token_per_chip=kv_tok / chips, kv_head_copies=copies,
                kv_bytes_per_seq=held * kv_tok, max_batch=max_batch,
                critical_batch=critical, rows=rows)


def kv_tokens_that_fit(model: ModelSpec, precision: Precision, memory_bytes: float,
                       copies: int = 1, extra_params: float | None = None) -> int:
    """How many tokens of KV cache fit in memory_bytes beside the stored weights:
    floor((memory - P b_w / 8) / (Z b_kv / 8)), 0 when the weights alone do not fit. A
    batch B at context C fits when B C is at most this. `copies`: each kv head held that
    many times (tp past the kv-head count), its projections and its cache alike;
    `extra_params`: parameters stored beyond one copy (default: those projections'
    copies; ModelSpec.copies gives them for a layout)."""
    if extra_params is None:
        extra_params = model.kv_proj_params * (copies - 1)
    free = memory_bytes - (model.params + extra_params) * (precision.weight_bits / 8)
    kv_tok = model.kv_values_per_token * copies * precision.kv_bits / 8
    return max(0, math.floor(free / kv_tok)) if free > 0 else 0
