"""Attention of a ragged batch over a paged KV cache: every query token belongs to a row
(a decode slot) at a position, and attends causally over that row's pages.

A mixed step (engines/mixed_step.py) runs decode rows of one token and prefill rows of a
chunk of a prompt as one flat batch of T tokens. Each layer first writes every token's
key and value into its row's page (engines/paged_kv.py's pools, [K, P + 1, ps, H]), then
each token attends over the keys at positions 0..its own in the pages of its row. Since a
row's pages are in position order, key j of a row's page table is position j, and the
causal mask needs positions only (as engines/attention.py): no per-row lengths.

Implementations:
  - "xla" (`ragged_paged_attention`): runs everywhere. Tokens go in tiles by their row's
    kind, and for each tile a loop over blocks of the key pages (about `block_k` keys)
    keeps an online softmax (as engines/blockwise_attention.py):
      row tiles: a row of more than `block_d` contiguous tokens (a chunk of a prompt) in
        tiles of `block_q` of its tokens; a tile gathers its row's pages of a key block
        once for all its queries;
      token tiles: every other live token (decode rows' one token, a verify row's k + 1,
        a short chunk's; a row whose tokens are not contiguous) `block_d` at a time, each
        token gathering its own row's pages (tokens x keys of memory traffic, which a
        decode token needs anyway). A short row in a row tile of `block_q` queries would
        compute mostly padding: a verify step of 8 rows of 4 tokens took 1.59x generate
        + prefill that way, 1.23x token by token (docs/BENCHMARKS.md).
    The plan is made on the device from the rows and positions (each row's count, first
    and last token): the loops run as many tiles as there are, over arrays shaped by T
    alone, so the shapes are fixed per (T, W). A tile loops only up to the block that
    holds its furthest position (and, with a sliding window, from the first block its
    nearest position can see), so a chunk at the start of a prompt reads little.
  - "pallas_tpu" (`pallas_ragged_attention`): jax's Pallas TPU ragged paged attention
    kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention), which reads pages in
    place. It takes keys and values interleaved in one pool [P + 1, ps, 2K, H]; ours are
    two pools [K, P + 1, ps, H] (the layout the decode kernel and insert share), so each
    layer's pools are re-laid-out per call: a copy of the pool, which a shared pool
    layout would remove (TODO(#26)). Rows must be laid out in slot order (cu_q_lens).

With `layer` the pools are a scanned model's stacks [L, K, P + 1, ps, H] and the pages
are gathered from the stack at that layer (no copy of the layer's pool).

Attention sinks (engines/attention.py) start each token's running max at its head's
sink logit and its running sum at 1 (the "xla" path); the TPU kernel takes none, so a
model with sinks never reaches it (engines/paged_kv.py resolve_attention); nor one with
chunked attention (`chunk`, Llama 4), masked as engines/attention.py's `visible_keys`.

Padding tokens have position -1: they see no key and come out 0. Letters: T tokens,
R rows, W pages per row, N, K, G = N/K, H as in engines/attention.py, ps page size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engines.attention import sink_logits, softcapped, visible_keys
from engines.config import reach
from engines.kv_quant import unpack_entries

RAGGED_ATTENTION = ("xla", "pallas_tpu")


def _take_pages(pool: jax.Array, pages: jax.Array, layer: jax.Array | None,
                dtype) -> jax.Array:
    """pool [K, P + 1, ps, H] (or a stack [L, ...] read at `layer`), pages i32[...]
    -> [K, ..., ps, H] in `dtype` (an int8 pool's entries dequantized)."""
    if layer is None:
        return unpack_entries(jnp.take(pool, pages, axis=1), dtype)
    return unpack_entries(jnp.moveaxis(pool[layer, :, pages], pages.ndim, 0), dtype)


def _pad_rows(x: jax.Array, size: int, value) -> jax.Array:
    pad = [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=value)


def _key_block_range(pos: jax.Array, keys: int, nk: int,
                     sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """The key blocks [lo, hi) some live token of a tile (positions pos i32[bq]) can see."""
    live = pos >= 0
    hi = jnp.minimum((jnp.max(pos) + keys) // keys, nk)  # max -1 (all padding): 0
    if sliding_window is None:
        return jnp.int32(0), hi.astype(jnp.int32)
    nearest = jnp.min(jnp.where(live, pos, jnp.iinfo(jnp.int32).max))
    lo = jnp.maximum(nearest - sliding_window + 1, 0) // keys
    return jnp.minimum(lo, hi).astype(jnp.int32), hi.astype(jnp.int32)


def _online_softmax(q, pos, blocks, lo, hi, keys: int, shared: bool, sliding_window, softcap,
                    sinks, chunk):
    """Online softmax of tile q [bq, K, G, H] (positions pos i32[bq]) over key blocks
    lo..hi-1; blocks(j) -> block j's (k, v): [K, keys, H] the tile's one row's when
    `shared`, else [K, bq, keys, H] each token's own -> f32 (acc [bq, K, G, H], sums).
    sinks: None or the heads' sink logits f32[K, G]."""
    bq, K, G, H = q.shape
    scale = 1.0 / math.sqrt(H)
    qp = pos[:, None]  # (bq, 1)
    qk, pv_eq = (("tkgh,ksh->tkgs", "tkgs,ksh->tkgh") if shared else
                 ("tkgh,ktsh->tkgs", "tkgs,ktsh->tkgh"))

    def step(j, carry):
        m, total, acc = carry  # (bq, K, G), (bq, K, G), (bq, K, G, H)
        kj, vj = blocks(j)
        s = jnp.einsum(qk, q, kj, preferred_element_type=jnp.float32)
        kp = j * keys + jnp.arange(keys)[None, :]  # (1, keys) key positions
        visible = (qp >= 0) & visible_keys(qp, kp, sliding_window, chunk)
        s = jnp.where(visible[:, None, None, :], softcapped(s * scale, softcap), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # no key seen yet: exp -> 0
        p = jnp.exp(s - shift[..., None])
        corr = jnp.exp(m - shift)
        total = total * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum(pv_eq, p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
        return m_new, total, acc * corr[..., None] + pv

    if sinks is None:
        m0, total0 = jnp.full((bq, K, G), -jnp.inf, jnp.float32), jnp.zeros((bq, K, G))
    else:  # the sink seen first: max its logit, sum exp(0)
        m0, total0 = jnp.broadcast_to(sinks, (bq, K, G)), jnp.ones((bq, K, G))
    init = (m0, total0.astype(jnp.float32), jnp.zeros((bq, K, G, H), jnp.float32))
    _, total, acc = jax.lax.fori_loop(lo, hi, step, init)
    return acc / jnp.where(total > 0, total, 1.0)[..., None]


def _row_tile(q, pos, pages, k_pool, v_pool, c: int, nk: int, sliding_window, softcap,
              layer, sinks, chunk):
    """A tile of one row: q [bq, K, G, H] at positions pos i32[bq] (-1: not this
    row's), the row's pages i32[nk * c] -> f32 [bq, K, G, H]. Each key block's pages are
    gathered once for the whole tile."""
    bq, K, G, H = q.shape
    keys = c * k_pool.shape[-2]
    lo, hi = _key_block_range(pos, keys, nk, reach(sliding_window, chunk))

    def blocks(j):
        blk = jax.lax.dynamic_slice_in_dim(pages, j * c, c)
        return tuple(_take_pages(p, blk, layer, q.dtype).reshape(K, keys, H)
                     for p in (k_pool, v_pool))

    return _online_softmax(q, pos, blocks, lo, hi, keys, True, sliding_window, softcap,
                           sinks, chunk)


def _token_tile(q, pos, rows, table, k_pool, v_pool, c: int, nk: int, sliding_window,
                softcap, layer, sinks, chunk):
    """A tile of tokens of any rows (rows i32[bq]): each token gathers its own row's
    pages of a key block -> f32 [bq, K, G, H]."""
    bq, K, G, H = q.shape
    keys = c * k_pool.shape[-2]
    lo, hi = _key_block_range(pos, keys, nk, reach(sliding_window, chunk))
    pages = jnp.take(table, rows, axis=0)  # (bq, nk * c)

    def blocks(j):
        blk = jax.lax.dynamic_slice_in_dim(pages, j * c, c, axis=1)  # (bq, c)
        return tuple(_take_pages(p, blk, layer, q.dtype).reshape(K, bq, keys, H)
                     for p in (k_pool, v_pool))

    return _online_softmax(q, pos, blocks, lo, hi, keys, False, sliding_window, softcap,
                           sinks, chunk)


def ragged_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           table: jax.Array, rows: jax.Array, positions: jax.Array,
                           sliding_window: int | None, *, block_q: int = 64,
                           block_d: int = 8, block_k: int = 256,
                           layer: jax.Array | None = None,
                           softcap: float | None = None,
                           sinks: jax.Array | None = None,
                           chunk: int | None = None) -> jax.Array:
    """q [T, N, H]; pools [K, P + 1, ps, H]; table i32[R, W] each row's pages in position
    order; rows i32[T] each token's row; positions i32[T] (-1: padding) -> [T, N, H];
    `layer`: the pools are stacks [L, ...], read at that layer; sinks: None or f32[N];
    chunk: None or the local attention's chunk. block_q: queries of a row tile (a
    chunk's); block_d: tokens of a token tile (decode tokens); block_k: keys per block.

    Every key a token may see (positions 0..its own of its row) must already be in the
    pools: a step writes its tokens' keys before attending."""
    T, N, H = q.shape
    K, P1, ps, _ = k_pool.shape[-4:]
    G = N // K
    R, W = table.shape
    c = max(1, min(W, block_k // ps))  # pages per key block
    nk = -(-W // c)
    # Columns past W point at the trash page; their positions are past every query's.
    table = jnp.pad(table, [(0, 0), (0, nk * c - W)], constant_values=P1 - 1)
    sink = None if sinks is None else sink_logits(sinks, K)  # (K, G)
    bq, bd = min(block_q, T), min(block_d, T)
    t = jnp.arange(T)
    live = positions >= 0
    rows = jnp.clip(rows, 0, R - 1)
    # Each row's live tokens: how many, the first and the last (padding belongs to none).
    count = jax.ops.segment_sum(live.astype(jnp.int32), rows, R)
    first = jax.ops.segment_min(jnp.where(live, t, T), rows, R)
    last = jax.ops.segment_max(jnp.where(live, t, -1), rows, R)
    # Row tiles: a row of more contiguous tokens than a token tile holds (a chunk) in
    # tiles of bq; shorter rows (a verify row's k + 1) cost less token by token.
    whole = (count > bd) & (last - first + 1 == count)
    row_tiles = jnp.where(whole, -(-count // bq), 0)
    tiles_end = jnp.cumsum(row_tiles)
    # Token tiles: every other live token (decode rows), bd at a time.
    by_token = live & ~whole[rows]
    slot = jnp.where(by_token, jnp.cumsum(by_token) - 1, T)
    Tt = -(-T // bd) * bd
    token_of = jnp.full((Tt,), T, jnp.int32).at[slot].set(t.astype(jnp.int32), mode="drop")
    # One spare row (index T) past the tokens: token tiles' padding reads and writes it.
    qx = _pad_rows(q, T + bq, 0).reshape(T + bq, K, G, H)
    posx = _pad_rows(positions, T + bq, -1)
    rowsx = _pad_rows(rows, T + bq, 0)
    out = jnp.zeros((T + bq, K, G, H), q.dtype)

    def token_tile(i, out):
        idx = jax.lax.dynamic_slice_in_dim(token_of, i * bd, bd)
        o = _token_tile(qx[idx], posx[idx], rowsx[idx], table, k_pool, v_pool, c, nk,
                        sliding_window, softcap, layer, sink, chunk)
        return out.at[idx].set(o.astype(out.dtype))

    def row_tile(i, out):
        r = jnp.minimum(jnp.searchsorted(tiles_end, i, side="right"), R - 1)
        k = i - (tiles_end[r] - row_tiles[r])  # the row's k-th tile
        at = first[r] + k * bq
        mine = jnp.arange(bq) < count[r] - k * bq
        pos = jnp.where(mine, jax.lax.dynamic_slice_in_dim(posx, at, bq), -1)
        o = _row_tile(jax.lax.dynamic_slice_in_dim(qx, at, bq), pos, table[r], k_pool,
                      v_pool, c, nk, sliding_window, softcap, layer, sink, chunk)
        old = jax.lax.dynamic_slice_in_dim(out, at, bq)
        new = jnp.where(mine[:, None, None, None], o.astype(out.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, at, 0)

    out = jax.lax.fori_loop(0, -(-jnp.sum(by_token) // bd), token_tile, out)
    out = jax.lax.fori_loop(0, tiles_end[-1], row_tile, out)
    return out[:T].reshape(T, N, H)


def combined_pages(k_pool: jax.Array, v_pool: jax.Array) -> jax.Array:
    """Our two pools [K, P + 1, ps, H] as the kernel's one [P + 1, ps, 2K, H], keys of
    head i at 2i and values at 2i + 1."""
    K, P1, ps, H = k_pool.shape
    kv = jnp.stack([k_pool, v_pool], axis=1)  # (K, 2, P1, ps, H)
    return jnp.transpose(kv, (2, 3, 0, 1, 4)).reshape(P1, ps, 2 * K, H)


def pallas_ragged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                            table: jax.Array, q_lens: jax.Array, kv_lens: jax.Array,
                            sliding_window: int | None, *, softcap: float | None = None,
                            reference: bool = False,
                            blocks: tuple[int, int] | None = None):
    """The Pallas TPU kernel over our pools: q [T, N, H] with each row's tokens
    contiguous and rows in order (row r's q_lens[r] tokens at cumsum(q_lens)[r - 1]..),
    kv_lens i32[R] keys each row holds after this step (its last position + 1)
    -> [T, N, H] (entries of padding tokens are unspecified).

    `reference`: the kernel module's own plain-jnp reference of the same contract
    instead (jax ships it beside the kernel), which runs on any platform (eagerly).
    `blocks`: (kv pages, queries) per kernel block; None: the kernel's tuned table,
    which it reads for the TPU it runs on (so off a TPU, interpret mode, give them)."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    R = table.shape[0]
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens).astype(jnp.int32)])
    args = (q, combined_pages(k_pool, v_pool), kv_lens.astype(jnp.int32),
            table.astype(jnp.int32), cu, jnp.full((1,), R, jnp.int32))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if reference:
        out = rpa.ref_ragged_paged_attention(*args, sm_scale=scale,
                                             sliding_window=sliding_window, soft_cap=softcap)
    else:
        pages, queries = blocks or (None, None)
        out = rpa.ragged_paged_attention(*args, sm_scale=scale, sliding_window=sliding_window,
                                         soft_cap=softcap,
                                         num_kv_pages_per_block=pages,
                                         num_queries_per_block=queries)
    if reference:  # the reference returns the live tokens only
        out = _pad_rows(out, q.shape[0], 0)
    return out.astype(q.dtype)
