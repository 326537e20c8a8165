"""Platform attention kernels for whole prompts: cuDNN on GPU, Pallas splash on TPU.

Both kernels take their masks as structure (causal, a window, key lengths), aligned by
index: query i against key j. Our inputs carry positions instead (engines/attention.py),
and only a prompt prefilled from its start is aligned: queries at positions 0..T-1,
keys at the same positions then empty entries (padding). Which case an input is, is
known on the device only, so each kernel runs under `lax.cond` on that check and the
caller's `fallback` (the XLA blockwise path) takes the rest: a chunk after an existing
prefix, or anything else. Shape limits each kernel has are checked statically by the
caller (engines/backend.py) before coming here.

Letters: B, T, S, N, K, G = N/K, H as in engines/attention.py.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def cudnn_available() -> bool:
    """Whether the installed jax offers cuDNN fused attention through jax.nn."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    return "implementation" in params and "local_window_size" in params


def splash_available() -> bool:
    """Whether the installed jax ships the Pallas TPU splash attention kernel."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: F401
    except ImportError:
        return False
    return True


def aligned_lengths(q_pos: jax.Array, k_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(whether q_pos [B, T] and k_pos [B, S] are index-aligned, i32[B] keys per row).

    Aligned: query i at position i; key j at position j for j < n_b and empty after it."""
    T, S = q_pos.shape[1], k_pos.shape[1]
    n = jnp.sum(k_pos >= 0, axis=1).astype(jnp.int32)  # (B,)
    j = jnp.arange(S)[None, :]
    keys_ok = jnp.all(k_pos == jnp.where(j < n[:, None], j, -1))
    queries_ok = jnp.all(q_pos == jnp.arange(T)[None, :])
    return keys_ok & queries_ok, n


Attend = Callable[..., jax.Array]


def cudnn_attention(q, k, v, q_pos, k_pos, sliding_window: int | None, *, fallback: Attend,
                    implementation: str = "cudnn") -> jax.Array:
    """Prefill attention through jax.nn.dot_product_attention (cuDNN flash attention) for
    an aligned prompt, else `fallback`. q [B, T, N, H], k, v [B, S, K, H], T == S.

    `implementation` is "cudnn" in serving; "xla" lets a CPU test check the masks."""
    ok, n = aligned_lengths(q_pos, k_pos)
    # jax's window (left, right) keeps keys j with i - left <= j <= i + right.
    window = None if sliding_window is None else (sliding_window - 1, 0)

    def kernel(q, k, v, n):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=n, local_window_size=window,
            implementation=implementation)

    def rest(q, k, v, n):
        del n
        return fallback(q, k, v, q_pos, k_pos, sliding_window)

    return jax.lax.cond(ok, kernel, rest, q, k, v, n)


@functools.lru_cache(maxsize=32)
def _splash_kernel(G: int, T: int, S: int, sliding_window: int | None, block: int,
                   interpret: bool):
    """A splash MQA kernel (G query heads over one kv head) with a causal or local mask
    for one shape: masks are static structures, so one kernel per prompt bucket."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if sliding_window is None:
        head_mask = splash.CausalMask((T, S))
    else:
        head_mask = splash.LocalMask((T, S), window_size=(sliding_window - 1, 0), offset=0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    return splash.make_splash_mqa_single_device(
        mask=splash.MultiHeadMask([head_mask] * G), block_sizes=sizes, interpret=interpret)


def splash_attention(q, k, v, q_pos, k_pos, sliding_window: int | None, *, fallback: Attend,
                     block: int, interpret: bool = False) -> jax.Array:
    """Prefill attention through the Pallas TPU splash kernel for an aligned prompt, else
    `fallback`. q [B, T, N, H], k, v [B, S, K, H]; T and S multiples of `block`.

    Each kv head runs the MQA form of the kernel over its G query heads, so keys and
    values are never repeated per query head. Empty keys get another segment id than
    the queries, which hides them."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    ok, _ = aligned_lengths(q_pos, k_pos)
    kernel = _splash_kernel(G, T, S, sliding_window, block, interpret)
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    def one_head(qh, kh, vh, seg):  # qh [G, T, H], kh, vh [S, H]
        return kernel(qh, kh, vh, segment_ids=seg)

    def run(q, k, v):
        qs = (q * (1.0 / math.sqrt(H))).astype(q.dtype)
        qs = jnp.transpose(qs.reshape(B, T, K, G, H), (0, 2, 3, 1, 4))  # (B, K, G, T, H)
        ks, vs = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))  # (B, K, S, H)
        seg = SegmentIds(q=jnp.zeros((B, T), jnp.int32),
                         kv=jnp.where(k_pos >= 0, 0, 1).astype(jnp.int32))
        per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))  # over K
        out = jax.vmap(per_row)(qs, ks, vs, seg)  # (B, K, G, T, H)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(v.dtype)

    def rest(q, k, v):
        return fallback(q, k, v, q_pos, k_pos, sliding_window)

    return jax.lax.cond(ok, run, rest, q, k, v)


def splash_shapes_ok(T: int, S: int, block: int) -> bool:
    """Whether splash's tiling takes these lengths (whole blocks on both axes)."""
    return T == S and T % block == 0
