"""Blockwise (flash-style) attention in plain XLA: never holds a whole [T, S] score matrix.

`engines.attention.attention` materialises f32 scores [B, K, G, T, S]; for a whole prompt
that is quadratic in its length (4 GB at 8,192 tokens on 8 heads). Here queries go in
blocks of `block_q` and keys in blocks of `block_k`: for each query block a loop over key
blocks keeps a running max, a running sum and an f32 accumulator (online softmax), so
the largest temporary is one [B, K, G, block_q, block_k] tile.

Masks come from positions, never from indices (keys may be an existing prefix followed
by a new chunk, or pages gathered in any order): a key is visible to a query when its
position is >= 0, <= the query's, and inside the sliding window. Key blocks that no query
of a block can see are skipped: each query block loops over the span of key blocks from
the first to the last one that holds a visible key, found from per-block position
ranges (so a causal prompt does about half the tiles, a sliding window a band of them).

Rows that see no key at all come out 0 (the plain path gives the mean of every value);
no caller uses such a row. Attention sinks (engines/attention.py) start a row's running
max at its sink's logit and its running sum at 1: the sink is a key with no value. Letters: B, T, S, N, K, G = N/K, H as in engines/attention.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engines.attention import sink_logits, softcapped, visible_keys
from engines.config import reach

_BIG = jnp.iinfo(jnp.int32).max


def _pad_to(x: jax.Array, axis: int, size: int, value) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _key_block_spans(q_pos, k_pos, block_q, block_k, sliding_window):
    """For each query block, the key blocks [lo, hi) that hold a key some query of it can
    see (positions over the whole batch; i32[nq] each). q_pos [B, Tp], k_pos [B, Sp]."""
    qb = q_pos.reshape(q_pos.shape[0], -1, block_q)
    q_min, q_max = jnp.min(qb, axis=(0, 2)), jnp.max(qb, axis=(0, 2))  # (nq,)
    kb = k_pos.reshape(k_pos.shape[0], -1, block_k)
    valid = kb >= 0
    k_min = jnp.min(jnp.where(valid, kb, _BIG), axis=(0, 2))  # (nk,)
    k_max = jnp.max(jnp.where(valid, kb, -1), axis=(0, 2))
    need = (k_min[None, :] <= q_max[:, None]) & (k_max[None, :] >= 0)  # (nq, nk)
    if sliding_window is not None:
        need &= k_max[None, :] > q_min[:, None] - sliding_window
    nk = k_min.shape[0]
    j = jnp.arange(nk)[None, :]
    lo = jnp.min(jnp.where(need, j, nk), axis=1)
    hi = jnp.max(jnp.where(need, j + 1, 0), axis=1)
    return lo, jnp.maximum(lo, hi)


def _query_block(q, qp, k, v, k_pos, lo, hi, block_k, sliding_window, softcap, sinks, chunk):
    """One query block q [B, K, G*bq, H] (its G heads of a kv head stacked as rows;
    positions qp [B, G*bq]) over key blocks lo..hi-1 of k, v [B, K, S, H]
    -> [B, K, G*bq, H] in v's dtype. sinks: None or each row's sink logit f32[K, G*bq]."""
    B, K, R, H = q.shape
    scale = 1.0 / math.sqrt(H)
    qpos = qp[:, None, :, None]  # (B, 1, R, 1)

    def step(j, carry):
        m, total, acc = carry  # running max, running sum (B, K, R); acc (B, K, R, H)
        kj = jax.lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=2)  # (B, K, bk, H)
        vj = jax.lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=2)
        kp = jax.lax.dynamic_slice_in_dim(k_pos, j * block_k, block_k, axis=1)
        kp = kp[:, None, None, :]  # (B, 1, 1, bk)
        # One batched matmul per kv head: its G query heads share the keys.
        s = jnp.einsum("bkrh,bksh->bkrs", q, kj, preferred_element_type=jnp.float32)
        visible = visible_keys(qpos, kp, sliding_window, chunk)
        s = jnp.where(visible, softcapped(s * scale, softcap), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # A row that has seen no visible key yet keeps max -inf; shift it by 0 instead so
        # exp() gives 0, not NaN.
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])  # (B, K, R, bk)
        corr = jnp.exp(m - shift)
        total = total * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkrs,bksh->bkrh", p.astype(v.dtype), vj,
                        preferred_element_type=jnp.float32)
        return m_new, total, acc * corr[..., None] + pv

    if sinks is None:
        m0 = jnp.full((B, K, R), -jnp.inf, jnp.float32)
        total0 = jnp.zeros((B, K, R), jnp.float32)
    else:  # the sink seen first: max its logit, sum exp(0)
        m0 = jnp.broadcast_to(sinks, (B, K, R))
        total0 = jnp.ones((B, K, R), jnp.float32)
    acc0 = jnp.zeros((B, K, R, H), jnp.float32)
    _, total, acc = jax.lax.fori_loop(lo, hi, step, (m0, total0, acc0))
    return (acc / jnp.where(total > 0, total, 1.0)[..., None]).astype(v.dtype)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                        k_pos: jax.Array, sliding_window: int | None, *, block_q: int,
                        block_k: int, softcap: float | None = None,
                        sinks: jax.Array | None = None,
                        chunk: int | None = None) -> jax.Array:
    """`engines.attention.attention`, computed block by block: q [B, T, N, H], k, v
    [B, S, K, H], q_pos i32[B, T], k_pos i32[B, S] (-1: empty), sinks None or f32[N],
    chunk None or the local attention's chunk; returns [B, T, N, H].

    T and S need not divide by the block sizes: queries are padded (their rows dropped)
    and keys padded with empty entries."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    nq, nk = -(-T // block_q), -(-S // block_k)
    Tp = nq * block_q
    # Padded queries repeat the last position, so they widen no block's span.
    q_pos = jnp.pad(q_pos, [(0, 0), (0, Tp - T)], mode="edge")
    k_pos = _pad_to(k_pos, 1, nk * block_k, -1)
    lo, hi = _key_block_spans(q_pos, k_pos, block_q, block_k, reach(sliding_window, chunk))
    # Laid out once so every tile is a plain batched matmul over (B, K): queries as
    # (nq, B, K, G*bq, H), keys and values as (B, K, S, H).
    qb = _pad_to(q, 1, Tp, 0).reshape(B, nq, block_q, K, G, H)
    qb = jnp.transpose(qb, (1, 0, 3, 4, 2, 5)).reshape(nq, B, K, G * block_q, H)
    qpb = jnp.tile(jnp.moveaxis(q_pos.reshape(B, nq, block_q), 1, 0), (1, 1, G))  # (nq, B, G*bq)
    k, v = (jnp.transpose(_pad_to(x, 1, nk * block_k, 0), (0, 2, 1, 3)) for x in (k, v))
    # Rows of a block are (g, query): each head's sink repeated over its bq queries.
    sink_rows = None if sinks is None else jnp.repeat(sink_logits(sinks, K), block_q, axis=1)

    def one(args):
        qi, qpi, lo_i, hi_i = args
        return _query_block(qi, qpi, k, v, k_pos, lo_i, hi_i, block_k, sliding_window,
                            softcap, sink_rows, chunk)

    out = jax.lax.map(one, (qb, qpb, lo, hi))  # (nq, B, K, G*bq, H)
    out = out.reshape(nq, B, K, G, block_q, H)
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, Tp, N, H)
    return out[:, :T]
