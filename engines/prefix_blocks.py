"""KV blocks for the prefix cache: cut from a prefill's prefix, read from KV pages, and
joined back into a prefix that a prefill continues (`existing_prefix`).

A block is the KV of b consecutive positions of a prompt for every layer, one array
[L, 2, b, K, H] (keys, then values), in the model dtype; [L, 1, b, K, H] (keys alone)
for a key-only cache, whose values have width 0 (engines.attention.key_only). The
prefix cache keeps one per trie node: on the device (these arrays, or a KV page of a
paged engine, which holds the same values as a [K, ps, H] slice of each layer's pool)
or on the host (numpy, the same layout). Stacks of n blocks are [n, L, 2, b, K, H]; every function here is compiled for
a power-of-two n (`stack_size`), so the programs stay few whatever the hit lengths.
`PrefixBlocks` is the transformer engines' side of it (the Engine methods a prefix cache
calls). With a draft model (speculative "draft:PATH:K") the blocks still hold the
target's KV only: `prefix_of_blocks` remakes the draft's KV of the cached tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engines import layer_scan
from engines.attention import key_only
from engines.kv_cache import PrefillKV, Prefix
from engines.kv_quant import unpack_entries
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
    kv = jnp.stack(_entries(k, v), 1)  # (L, 2 or 1, n*b, K, H)
    L, E, _, K, H = kv.shape
    return jnp.moveaxis(kv.reshape(L, E, n, b, K, H), 2, 0)


def _entries(k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    """What a block holds of keys k and values v: both, or the keys of a key-only cache."""
    return (k,) if key_only(v) else (k, v)


def blocks_of_pages(k_pools: tuple[jax.Array, ...], v_pools: tuple[jax.Array, ...],
                    pages: jax.Array, dtype) -> jax.Array:
    """Pools L x [K, P+1, ps, H] (or one stack [L, K, P+1, ps, H], a scanned model's)
    and pages i32[n] -> [n, L, 2 (1 key-only), ps, K, H] in `dtype` (an int8 pool's
    dequantized)."""

    def take(pools):  # -> (L, K, n, ps, H)
        if layer_scan.is_stacked(pools, 4):
            return jnp.take(pools[0], pages, axis=2)
        return jnp.stack([jnp.take(p, pages, axis=1) for p in pools])

    k, v = take(k_pools), take(v_pools)
    kv = unpack_entries(jnp.stack(_entries(k, v), 1), dtype)
    return jnp.transpose(kv, (3, 0, 1, 4, 2, 5))  # (n, L, 2 or 1, ps, K, H)


def stack_blocks(blocks: tuple[jax.Array, ...]) -> jax.Array:
    """Per-node blocks -> one stack [n, L, 2, b, K, H]."""
    return jnp.stack(blocks)


def prefix_of_blocks(blocks: jax.Array, length: jax.Array, prompt_mask: jax.Array,
                     tokens: jax.Array, draft_params=None, *, draft_model=None) -> Prefix:
    """A stack [n, L, 2 (1 key-only), b, K, H] whose first `length` positions are a
    prompt's KV, and
    those tokens (i32[1, n*b], zero padded) -> the Prefix a prefill continues (later
    entries are masked). Only k, v, k_pos, tokens, length and prompt_mask are read by a
    continuing prefill; token and sampling are placeholders."""
    n, L, E, b, K, H = blocks.shape
    kv = jnp.moveaxis(blocks, 0, 2).reshape(L, E, 1, n * b, K, H)
    j = jnp.arange(n * b)[None, :]
    keys = tuple(kv[i, 0] for i in range(L))
    # E == 1: keys alone (a key-only cache), whose prefix values have width 0.
    values = tuple(kv[i, 1] for i in range(L)) if E == 2 else tuple(x[..., :0] for x in keys)
    prefix = Prefix(
        k=keys, v=values,
        k_pos=jnp.where(j < length, j, -1).astype(jnp.int32), tokens=tokens,
        length=length.astype(jnp.int32), token=jnp.zeros((), jnp.int32),
        sampling=SlotSampling.empty(1), prompt_mask=prompt_mask,
    )
    if draft_model is None:
        return prefix
    # The blocks hold the target's KV; a draft model's of the same tokens is made here,
    # by its prefill over them (a small model: cheap beside the target's cached part).
    draft = PrefillKV(prefix.k_pos, None, 0)
    draft_model.apply({"params": draft_params}, tokens, jnp.broadcast_to(j, tokens.shape),
                      draft, last=jnp.zeros((1,), jnp.int32))
    return dataclasses.replace(prefix, draft_k=tuple(draft.k), draft_v=tuple(draft.v))


class PrefixBlocks:
    """The prefix-cache block methods of the transformer engines (a mixin of
    engines/transformer_engine.py's TransformerEngine, which calls `_build_block_jits`
    with its prefixes' shardings and has `_replicated`, `_draft` and `model_config`)."""

    def _build_block_jits(self, prefix_sharding: Any) -> None:
        self._blocks_of_prefix_jit = jax.jit(blocks_of_prefix, static_argnums=(2, 3))
        self._stack_blocks_jit = jax.jit(stack_blocks)
        draft_model = self._draft.model if self._draft is not None else None
        self._prefix_of_blocks_jit = jax.jit(
            functools.partial(prefix_of_blocks, draft_model=draft_model),
            out_shardings=prefix_sharding)

    def cache_blocks(self, prefix: Prefix, first: int, n: int, block: int) -> list[jax.Array]:
        """Blocks first .. first + n - 1 (of `block` tokens) of a prefill's prefix, one
        device array [L, 2, block, K, H] each."""
        stack = self._blocks_of_prefix_jit(prefix, np.int32(first), stack_size(n), block)
        return [stack[i] for i in range(n)]

    def cache_block_sharding(self) -> jax.sharding.NamedSharding:
        """Where a prefix cache keeps this engine's blocks on the device (whole on each)."""
        return self._replicated()

    def stack_blocks(self, blocks: Sequence[Any]) -> Any:
        """Per-node blocks -> a stack of stack_size(n) blocks (zero padded): on the device
        when every block is, else on the host (numpy)."""
        m = stack_size(len(blocks))
        if all(isinstance(b, jax.Array) for b in blocks):
            pad = jnp.zeros_like(blocks[0])
            return self._stack_blocks_jit(tuple(blocks) + (pad,) * (m - len(blocks)))
        host = np.stack(jax.device_get(list(blocks)))
        return np.concatenate([host, np.zeros((m - len(blocks), *host.shape[1:]), host.dtype)])

    def prefix_from_blocks(self, stack: Any, tokens: Sequence[int]) -> Prefix:
        """A stack of blocks whose first len(tokens) positions hold those tokens' KV ->
        the Prefix that a prefill continues with `existing_prefix`."""
        mask = np.zeros((1, self.model_config.vocab_size), bool)
        mask[0, np.asarray(tokens, np.int64)] = True
        ids = np.zeros((1, stack.shape[0] * stack.shape[3]), np.int32)
        ids[0, : len(tokens)] = tokens
        return self._prefix_of_blocks_jit(stack, np.int32(len(tokens)), mask, ids,
                                          *self._draft_args())
