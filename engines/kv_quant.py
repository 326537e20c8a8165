"""KV cache quantization: int8 per token and kv head, symmetric, one f32 scale each.

The contiguous cache (engines/kv_cache.py) keeps the int8 values and their scales in
arrays of their own (`quantize_kv` / `dequantize_kv`). A paged pool (engines/paged_kv.py)
keeps them in one entry per token and kv head, int8[H + SCALE_BYTES]: the H values, then
the scale's 4 bytes (`pack_entries` / `unpack_entries`), so a page of values and scales
is one slice of one array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K, H] -> (int8 [..., K, H], f32 scale [..., K]), symmetric per token and head."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xf / safe[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


SCALE_BYTES = 4  # an int8 entry's f32 scale, after its H values


def entry_width(head_dim: int, kv_dtype: str) -> int:
    """The last axis of a pool: H, or H + SCALE_BYTES for an int8 pool (0 for 0: a
    key-only cache's value pool holds nothing, not even scales)."""
    return head_dim + SCALE_BYTES if kv_dtype == "int8" and head_dim else head_dim


def pack_entries(new: jax.Array, pool_dtype) -> jax.Array:
    """new [..., H] in the model dtype -> the pool's entries (int8: [..., H + 4])."""
    if pool_dtype != jnp.int8 or new.shape[-1] == 0:  # 0: a key-only cache's values
        return new.astype(pool_dtype)
    q, scale = quantize_kv(new)
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8)], axis=-1)


def unpack_entries(entries: jax.Array, dtype) -> jax.Array:
    """Pool entries [..., H or H + 4] -> values [..., H] in `dtype` (int8 dequantized)."""
    if entries.dtype != jnp.int8 or entries.shape[-1] == 0:
        return entries.astype(dtype)
    scale = jax.lax.bitcast_convert_type(entries[..., -SCALE_BYTES:], jnp.float32)
    return dequantize_kv(entries[..., :-SCALE_BYTES], scale, dtype)
