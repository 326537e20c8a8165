"""FP8 block-quantized weights as DeepSeek-V3 (and Qwen3's FP8 releases) publish them:
decoded to floats on load, or kept 8-bit (engines/quantization.py, scheme fp8_block).

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bm, bn]}` ([128, 128] as published).
Each quantized linear `X.weight` W[out, in] is then stored as two tensors:

  `X.weight`            float8_e4m3fn[out, in]: W divided by its block's scale;
  `X.weight_scale_inv`  float32[ceil(out / bm), ceil(in / bn)]: one scale per bm x bn
      block, the last block of a row or column partial where bm or bn does not divide
      (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 5 row blocks); with `"scale_fmt":
      "ue8m0"` the scales are powers of two, stored as float32 or as their biased 8-bit
      exponents (uint8 e: 2^(e - 127)),

so W[i, j] = fp8[i, j] * scale[i // bm, j // bn]. Which tensors are quantized is read from
the files (a weight with a `_scale_inv` beside it): as published, every attention and MLP
or expert linear, not the embeddings, the LM head, norms or the MoE router.

Activations are quantized per token at run time by FP8 kernels ("dynamic"); the decoder
here runs the dequantized weights at the model's dtype, as transformers does on a device
without FP8 matmuls (`FineGrainedFP8Config(dequantize=True)`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# The families whose published FP8 checkpoints use this layout.
FAMILIES = ("deepseek_v3", "qwen3", "qwen3_moe")
_ACCEPTED = {"fmt": ("e4m3",), "activation_scheme": ("dynamic",),
             "scale_fmt": ("float", "ue8m0")}
# Also read: which modules stay unquantized is seen in the files; `dequantize` is
# transformers' loading choice, ours is the engine's.
_KNOWN_KEYS = ("quant_method", "weight_block_size", "modules_to_not_convert",
               "ignored_layers", "dequantize", *_ACCEPTED)


def block_size(q: dict[str, Any], family: str) -> tuple[int, int]:
    """(bm, bn) of an fp8 `quantization_config`; every field the reader does not
    implement is refused by name."""
    if family not in FAMILIES:
        raise ValueError(f"config.json quantization_config with quant_method 'fp8' is not "
                         f"implemented for {family} (read for {FAMILIES})")
    for key, accepted in _ACCEPTED.items():
        if q.get(key, accepted[0]) not in accepted:
            raise ValueError(f"config.json quantization_config.{key} must be one of "
                             f"{accepted} for fp8 weights, got {q.get(key)!r}")
    unknown = sorted(set(q) - set(_KNOWN_KEYS))
    if unknown:
        raise ValueError(f"config.json quantization_config fields {unknown} are not "
                         f"implemented for fp8 weights")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                       for b in block)):
        raise ValueError(f"config.json quantization_config.weight_block_size must be two "
                         f"positive integers (e.g. [128, 128]), got {block!r}")
    return int(block[0]), int(block[1])


def scales_f32(scale_inv: np.ndarray) -> np.ndarray:
    """Stored scales as float32 (uint8: ue8m0 exponents, 2^(e - 127))."""
    s = np.asarray(scale_inv)
    if s.dtype == np.uint8:
        return np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32)
    return s.astype(np.float32)


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
               dtype: Any = np.float32, name: str = "weight") -> np.ndarray:
    """weight fp8[out, in] and scale_inv f32[ceil(out / bm), ceil(in / bn)] -> W[out, in]
    in `dtype` (the product taken in float32, exact for fp8 values times f32 scales)."""
    weight, scale_inv = np.asarray(weight), np.asarray(scale_inv)
    if weight.dtype != FP8:
        raise ValueError(f"{name}: FP8 block weights must be float8_e4m3fn, got {weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"{name}: FP8 block weights must be 2-D [out, in], got {weight.shape}")
    grid = scale_grid(weight.shape, block)
    if scale_inv.shape != grid:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {scale_inv.shape}; a weight of "
                         f"{weight.shape} in blocks of {list(block)} needs {grid}")
    return scaled(weight, scale_inv, block, np).astype(dtype)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales' shape for a weight [..., out, in]: one per block of its last two axes."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def scaled(weight: Any, scale_inv: Any, block: tuple[int, int], xp: Any = np) -> Any:
    """fp8[..., out, in] times each block's scale, in float32 (`xp`: numpy on the host,
    jax.numpy inside jit)."""
    rows, cols = weight.shape[-2:]
    full = xp.repeat(xp.repeat(scale_inv.astype(xp.float32), block[0], axis=-2), block[1],
                     axis=-1)
    return weight.astype(xp.float32) * full[..., :rows, :cols]


def quantize(w: Any, block: tuple[int, int], xp: Any = np) -> tuple[Any, Any]:
    """W[..., out, in] -> (fp8, scale_inv f32 of `scale_grid`): each block's max |W| maps
    to the largest float8_e4m3fn value, as published checkpoints are made."""
    w = w.astype(xp.float32)
    *lead, rows, cols = w.shape
    gr, gc = scale_grid(w.shape, block)[-2:]
    pad = [(0, 0)] * len(lead) + [(0, gr * block[0] - rows), (0, gc * block[1] - cols)]
    tiles = xp.pad(w, pad).reshape(*lead, gr, block[0], gc, block[1])
    amax = xp.max(xp.abs(tiles), axis=(-3, -1))
    scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)
    return (w / scaled(xp.ones_like(w), scale, block, xp)).astype(FP8), scale
