"""What an engine serves, beyond the model's own shapes: `EngineConfig`, checked on
construction (each error names its field), and the settings it parses: the speculative
decoding setting (`parse_speculative`) and the compute dtype (`resolve_dtype`).

Plain data and validation only: the engines (engines/transformer_engine.py,
engines/paged_engine.py) read these; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from engines import quantization

MAX_DRAFTS = 16


@dataclasses.dataclass(frozen=True)
class Speculative:
    """A parsed `speculative` setting: kind "none", "ngram" or "draft" (with the draft
    model's `path`: a directory or random:NAME), K drafts per step."""

    kind: str = "none"
    k: int = 0
    path: str = ""

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def parse_speculative(text: str) -> Speculative:
    """'none', 'ngram:K' or 'draft:PATH:K' (1 <= K <= MAX_DRAFTS); a ValueError names what
    was wrong."""
    if not isinstance(text, str):
        raise ValueError(f"speculative must be a string like 'ngram:4', got {text!r}")
    if text == "none":
        return Speculative()
    kind, _, rest = text.partition(":")
    if kind not in ("ngram", "draft"):
        raise ValueError(f"speculative must be 'none', 'ngram:K' or 'draft:PATH:K', "
                         f"got {text!r}")
    path, _, k_text = rest.rpartition(":") if kind == "draft" else ("", "", rest)
    if kind == "draft" and not path:
        raise ValueError(f"speculative 'draft:PATH:K' needs the draft model's PATH (a "
                         f"directory or random:NAME) and K, got {text!r}")
    try:
        k = int(k_text)
    except ValueError:
        raise ValueError(f"speculative '{kind}:...K' needs an integer K of drafts per step, "
                         f"got {text!r}") from None
    if not 1 <= k <= MAX_DRAFTS:
        raise ValueError(f"speculative {kind}:K needs 1 <= K <= {MAX_DRAFTS} drafts per "
                         f"step, got K={k}")
    return Speculative(kind, k, path)


def parse_decode_batch_sizes(text: str, slots: int) -> tuple[int, ...]:
    """The decode_batch_sizes of a setting: 'none' (every step runs every slot), 'auto'
    (1, 2, 4 .. below `slots`) or comma-separated slot counts, each below `slots`; a
    ValueError names what was wrong."""
    text = text.replace(" ", "")
    if text in ("none", ""):
        return ()
    if text == "auto":
        return tuple(1 << i for i in range(max(slots - 1, 0).bit_length()))
    try:
        sizes = sorted({int(x) for x in text.split(",") if x})
    except ValueError:
        raise ValueError(f"decode batch sizes must be 'none', 'auto' or comma-separated "
                         f"integers, got {text!r}") from None
    if any(not 1 <= n < slots for n in sizes):
        raise ValueError(f"decode batch sizes must each be in [1, {slots}) (below the "
                         f"slot count, whose step always exists), got {text!r}")
    return tuple(sizes)


KV_DTYPES = ("auto", "int8")

LAYER_MODES = ("auto", "loop", "scan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Serving shapes of one engine (the model's own shapes live in ModelConfig)."""

    max_concurrent_decodes: int = 8
    max_prefill_length: int = 256
    max_seq_len: int = 512
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on TPU/GPU
    top_logprobs: int = 5
    # KV layout: "contiguous" (a [S] row per slot) or "paged" (engines/paged_engine.py:
    # pages of page_size tokens from a pool of num_pages, default enough for every slot).
    kv_layout: str = "contiguous"
    page_size: int = 16
    num_pages: int | None = None
    paged_attention: str = "auto"  # auto | xla | pallas_tpu | cpu (engines/paged_kv.py)
    # Matmul weights quantized at load time (engines/quantization.py): none | int8 | int4
    # (int4 in groups of quant_group_size along the input axis).
    quantize: str = "none"
    quant_group_size: int = quantization.DEFAULT_GROUP
    # KV cache storage: auto (the model dtype) or int8 with a scale per token and kv head.
    kv_dtype: str = "auto"
    # Speculative decoding in the generate step (engines/speculative.py): "none",
    # "ngram:K" (K drafts per step from the sequence's own tokens) or "draft:PATH:K" (K
    # drafts per step from a smaller model; the engine is given its config and weights).
    speculative: str = "none"
    # LoRA adapters (engines/lora_engine.py): 0 serves the base model only; N > 0 keeps up
    # to N adapters of rank <= max_lora_rank on the device at once (either KV layout).
    max_loras: int = 0
    max_lora_rank: int = 16
    # The decoder's layers (engines/layer_scan.py): "loop" (unrolled, one copy per layer
    # in each program), "scan" (one compiled body, parameters and cache stacked) or
    # "auto": scan on accelerators and on a CPU running the CPU kernels, loop elsewhere
    # on the CPU and with LoRA (engines/layer_scan.py use_scan); either KV layout.
    layers: str = "auto"
    # The most whole prompts one prefill call takes (engines/prefill_program.py
    # PrefillRows): 1 is one prompt per call; N > 1 compiles calls of 2, 4, .. N prompts
    # per prefill bucket (at most max_prefill_length tokens a call).
    prefill_batch: int = 1
    # Slot counts below max_concurrent_decodes the generate step is compiled for as well
    # (engines/device_functions.py generate `rows`): a step whose slots in use all lie
    # below one runs only those rows, and costs what that batch does. () : every step
    # runs every slot.
    decode_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        _check_kv_layout(self)
        quantization.check_scheme("quantize", self.quantize, self.quant_group_size)
        for name in ("max_concurrent_decodes", "max_prefill_length", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_prefill_length > self.max_seq_len:
            raise ValueError(
                f"max_prefill_length ({self.max_prefill_length}) must be <= max_seq_len "
                f"({self.max_seq_len})"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.speculative != "none" and self.paged_attention in ("pallas_tpu", "cpu"):
            raise ValueError(f"speculative decoding verifies several tokens per slot, which "
                             f"the {self.paged_attention} paged kernel does not; use "
                             f"paged_attention auto or xla")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs!r}")
        parse_speculative(self.speculative)
        _check_lora(self)
        _check_prefill_batch(self)
        _check_decode_batch_sizes(self)
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {LAYER_MODES}, got {self.layers!r}")

    @property
    def spec(self) -> Speculative:
        return parse_speculative(self.speculative)


def _check_lora(c: EngineConfig) -> None:
    if not isinstance(c.max_loras, int) or c.max_loras < 0:
        raise ValueError(f"max_loras must be an integer >= 0, got {c.max_loras!r}")
    if not isinstance(c.max_lora_rank, int) or c.max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, got {c.max_lora_rank!r}")


def _check_prefill_batch(c: EngineConfig) -> None:
    n = c.prefill_batch
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"prefill_batch (--prefill-batch) must be a positive integer, "
                         f"got {n!r}")


def _check_decode_batch_sizes(c: EngineConfig) -> None:
    sizes, most = c.decode_batch_sizes, c.max_concurrent_decodes
    if not isinstance(sizes, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise ValueError(f"decode_batch_sizes (--decode-batch-sizes) must be a tuple of "
                         f"integers, got {sizes!r}")
    if any(not 1 <= n < most for n in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"decode_batch_sizes (--decode-batch-sizes) must be ascending, "
                         f"distinct and each in [1, max_concurrent_decodes={most}), got "
                         f"{sizes!r}")
    if not sizes:
        return
    why = ("kv_layout 'paged' (only the contiguous cache steps a slot subset)"
           if c.kv_layout != "contiguous" else
           f"speculative decoding ({c.speculative!r})" if c.spec.enabled else
           f"LoRA adapters (max_loras={c.max_loras})" if c.max_loras else None)
    if why:
        raise ValueError(f"decode_batch_sizes={sizes}: a step over fewer slots does not "
                         f"work with {why} yet; leave decode_batch_sizes empty")


def _check_kv_layout(c: EngineConfig) -> None:
    if c.kv_layout not in ("contiguous", "paged"):
        raise ValueError(f"kv_layout must be 'contiguous' or 'paged', got {c.kv_layout!r}")
    if not isinstance(c.page_size, int) or c.page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {c.page_size!r}")
    if c.num_pages is not None:
        need = -(-c.max_seq_len // c.page_size) if isinstance(c.max_seq_len, int) else 1
        if not isinstance(c.num_pages, int) or c.num_pages < need:
            raise ValueError(f"num_pages must be an integer >= {need} (one sequence of "
                             f"max_seq_len={c.max_seq_len} in pages of {c.page_size}), "
                             f"got {c.num_pages!r}")
    if c.paged_attention not in ("auto", "xla", "pallas_tpu", "cpu"):
        raise ValueError(f"paged_attention must be auto, xla, pallas_tpu or cpu, "
                         f"got {c.paged_attention!r}")


def resolve_dtype(name: str, devices: Sequence[jax.Device]) -> Any:
    if name == "auto":
        return jnp.float32 if devices[0].platform == "cpu" else jnp.bfloat16
    return jnp.dtype(name)
