"""MXFP4 tensors as gpt-oss checkpoints publish their experts: re-laid out, or decoded.

MXFP4 (the OCP microscaling format) stores values in blocks of 32 that share one scale:
each value is a 4-bit float (FP4 E2M1: a sign bit, two exponent bits, one mantissa bit;
the 16 codes below), and each block's scale is a power of two stored as its biased 8-bit
exponent (E8M0, bias 127). A checkpoint holds a weight W[..., rows, cols] as two tensors:

  `<name>_blocks` u8[..., rows, cols / 32, 16]: a block's 32 codes, two per byte, value
      2j in byte j's low nibble and value 2j + 1 in its high nibble;
  `<name>_scales` u8[..., rows, cols / 32]: the block's exponent e, scale 2^(e - 127).

gpt-oss's expert weights are published so ([E, 2F, D] for gate_up_proj, [E, D, F] for
down_proj: outputs first), while the float form transformers saves, and our tables read,
is [E, in, out]. The engine keeps the experts 4-bit (engines/quantization.py, scheme
"mxfp4", dequantized inside the step): `transpose_packed` moves the published bytes to
that layout without decoding them; `dequantize_transposed` decodes them to floats, for
tests and for a checkpoint read into float experts.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per scale
# FP4 E2M1 by code: 0..7 positive, 8..15 the same magnitudes negative.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """blocks u8[..., G, 16] and scales u8[..., G] -> [..., G * 32] in `dtype`, decoded one
    matrix at a time (a float32 copy of one expert's weight on the host at most)."""
    blocks, scales = _checked(blocks, scales, 2)
    if blocks.ndim <= 3:
        return _decode(blocks, scales).astype(dtype)
    out = np.empty(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK,), dtype)
    for i in range(blocks.shape[0]):
        out[i] = dequantize(blocks[i], scales[i], dtype)
    return out


def _checked(blocks, scales, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """blocks and scales as uint8 arrays, blocks [..., G, 16] (at least `ndim` axes)
    over scales [..., G]; else a ValueError naming what is wrong."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if (blocks.ndim < ndim or blocks.shape[-1] != BLOCK // 2
            or blocks.shape[:-1] != scales.shape):
        raise ValueError(f"MXFP4 blocks {blocks.shape} must be [..., G, {BLOCK // 2}] (at "
                         f"least {ndim} axes) over scales [..., G], got scales {scales.shape}")
    return blocks, scales


def _decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[..., G, 16], scales u8[..., G] -> f32[..., G * 32]."""
    values = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponent = scales.astype(np.int32)[..., None] - SCALE_BIAS
    return np.ldexp(values, exponent).reshape(blocks.shape[:-2] + (-1,))


def dequantize_transposed(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32
                          ) -> np.ndarray:
    """A published weight [..., out, in] decoded and with its last two axes swapped:
    [..., in, out] (the float form of gpt-oss's experts)."""
    return np.ascontiguousarray(np.swapaxes(dequantize(blocks, scales, dtype), -1, -2))


def transpose_packed(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A published weight's blocks u8[..., out, G, 16] and scales u8[..., out, G] ->
    (codes u8[..., G * 16, out], exponents u8[..., G, out]): the same bytes with the
    input axis before the output one. A block's 16 bytes are consecutive along the input
    axis and each holds values 2j and 2j + 1 of it (low nibble first), so the bytes
    stay whole; nothing is decoded."""
    blocks, scales = _checked(blocks, scales, 3)
    codes = blocks.reshape(blocks.shape[:-2] + (-1,))
    return (np.ascontiguousarray(np.swapaxes(codes, -1, -2)),
            np.ascontiguousarray(np.swapaxes(scales, -1, -2)))
