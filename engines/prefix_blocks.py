"""KV blocks for the prefix cache: cut from a prefill's prefix, read from KV pages, and
joined back into a prefix that a prefill continues (`existing_prefix`).

A block is the KV of b consecutive positions of a prompt for every layer, one array
[L, 2, b, K, H] (keys, then values), in the model dtype. The prefix cache keeps one per
trie node: on the device (these arrays, or a KV page of a paged engine, which holds the
same values as a [K, ps, H] slice of each layer's pool) or on the host (numpy, the same
layout). Stacks of n blocks are [n, L, 2, b, K, H]; every function here is compiled for
a power-of-two n (`stack_size`), so the programs stay few whatever the hit lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engines import layer_scan
from engines.kv_cache import Prefix
from engines.sampling import SlotSampling


def stack_size(n: int) -> int:
    """The compiled stack size for n blocks: the next power of two."""
    w = 1
    while w < n:
        w *= 2
    return w


def blocks_of_prefix(prefix: Prefix, first: jax.Array, n: int, b: int) -> jax.Array:
    """Blocks first .. first + n - 1 of a prefix (positions first*b onward, wherever they
    sit in its arrays: a continued prefix keeps the cached part first) -> [n, L, 2, b, K, H].
    Positions the prefix does not hold come out as whatever index 0 holds; callers ask
    only for whole blocks it has."""
    want = first * b + jnp.arange(n * b)  # (n*b,) positions
    idx = jnp.argmax(prefix.k_pos[0][None, :] == want[:, None], axis=1)  # (n*b,)
    k = jnp.stack([x[0, idx] for x in prefix.k])  # (L, n*b, K, H)
    v = jnp.stack([x[0, idx] for x in prefix.v])
    kv = jnp.stack([k, v], 1)  # (L, 2, n*b, K, H)
    L, _, _, K, H = kv.shape
    return jnp.moveaxis(kv.reshape(L, 2, n, b, K, H), 2, 0)


def blocks_of_pages(k_pools: tuple[jax.Array, ...], v_pools: tuple[jax.Array, ...],
                    pages: jax.Array) -> jax.Array:
    """Pools L x [K, P+1, ps, H] (or one stack [L, K, P+1, ps, H], a scanned model's)
    and pages i32[n] -> [n, L, 2, ps, K, H]."""

    def take(pools):  # -> (L, K, n, ps, H)
        if layer_scan.is_stacked(pools, 4):
            return jnp.take(pools[0], pages, axis=2)
        return jnp.stack([jnp.take(p, pages, axis=1) for p in pools])

    k, v = take(k_pools), take(v_pools)
    return jnp.transpose(jnp.stack([k, v], 1), (3, 0, 1, 4, 2, 5))  # (n, L, 2, ps, K, H)


def stack_blocks(blocks: tuple[jax.Array, ...]) -> jax.Array:
    """Per-node blocks -> one stack [n, L, 2, b, K, H]."""
    return jnp.stack(blocks)


def prefix_of_blocks(blocks: jax.Array, length: jax.Array, prompt_mask: jax.Array,
                     tokens: jax.Array) -> Prefix:
    """A stack [n, L, 2, b, K, H] whose first `length` positions are a prompt's KV, and
    those tokens (i32[1, n*b], zero padded) -> the Prefix a prefill continues (later
    entries are masked). Only k, v, k_pos, tokens, length and prompt_mask are read by a
    continuing prefill; token and sampling are placeholders."""
    n, L, _, b, K, H = blocks.shape
    kv = jnp.moveaxis(blocks, 0, 2).reshape(L, 2, 1, n * b, K, H)
    j = jnp.arange(n * b)[None, :]
    return Prefix(
        k=tuple(kv[i, 0] for i in range(L)), v=tuple(kv[i, 1] for i in range(L)),
        k_pos=jnp.where(j < length, j, -1).astype(jnp.int32), tokens=tokens,
        length=length.astype(jnp.int32), token=jnp.zeros((), jnp.int32),
        sampling=SlotSampling.empty(1), prompt_mask=prompt_mask,
    )
