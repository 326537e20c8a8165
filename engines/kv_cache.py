"""Decode state, prefixes, and the KV stores the decoder writes through.

The contiguous layout: each layer keeps k, v as [B, S, K, H] (slot, position, kv head,
head dim); a slot's key at index j holds sequence position j. `PrefillKV` and `DecodeKV`
implement `engines.model.KVStore` for the two device functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engines.sampling import SlotSampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prompt's KV cache and first token, ready to be inserted into a slot."""

    k: tuple[jax.Array, ...]  # L x [1, T, K, H]
    v: tuple[jax.Array, ...]  # L x [1, T, K, H]
    k_pos: jax.Array  # i32[1, T], -1 for padding
    length: jax.Array  # i32[] tokens in the prefix (true length, all chunks)
    token: jax.Array  # i32[] the first generated token
    sampling: SlotSampling  # one row, key already advanced past the first token
    prompt_mask: jax.Array  # bool[1, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the generate step reads and writes, for all B slots."""

    k: tuple[jax.Array, ...]  # L x [B, S, K, H]
    v: tuple[jax.Array, ...]  # L x [B, S, K, H]
    lengths: jax.Array  # i32[B] tokens in each slot's cache (= position of `tokens`)
    tokens: jax.Array  # i32[B] last sampled token, fed to the next step
    sampling: SlotSampling  # per-slot parameters and RNG keys
    prompt_mask: jax.Array  # bool[B, V] tokens of the prompt (repetition penalty)
    counts: jax.Array  # i32[B, V] generated-token counts (frequency/presence penalty)


class PrefillKV:
    """Prefill: attend over an existing prefix (if any) followed by the new tokens."""

    def __init__(self, new_k_pos: jax.Array, existing: Prefix | None):
        self.new_k_pos = new_k_pos  # i32[B, T]
        self.existing = existing
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []

    def update(self, layer, k, v):
        if self.existing is not None:
            k = jnp.concatenate([self.existing.k[layer], k], axis=1)
            v = jnp.concatenate([self.existing.v[layer], v], axis=1)
        self.k.append(k)
        self.v.append(v)
        return k, v, self.k_pos

    @property
    def k_pos(self) -> jax.Array:
        if self.existing is None:
            return self.new_k_pos
        return jnp.concatenate([self.existing.k_pos, self.new_k_pos], axis=1)


class DecodeKV:
    """Generate: write each slot's new k, v at its own position, attend over its row."""

    def __init__(self, state: DecodeState, pos: jax.Array):
        self.state = state
        self.pos = pos  # i32[B]
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []

    def update(self, layer, k, v):
        B = k.shape[0]
        rows = jnp.arange(B)
        k_all = self.state.k[layer].at[rows, self.pos].set(k[:, 0])
        v_all = self.state.v[layer].at[rows, self.pos].set(v[:, 0])
        self.k.append(k_all)
        self.v.append(v_all)
        S = k_all.shape[1]
        j = jnp.arange(S)[None, :]
        k_pos = jnp.where(j <= self.pos[:, None], j, -1)  # (B, S)
        return k_all, v_all, k_pos


def insert_prefix(prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
    """Scatters a prefix into one slot's rows; other slots are untouched."""
    S = state.k[0].shape[1]
    # Each prefix entry goes to the index of its position; padding (-1) is dropped.
    idx = jnp.where(prefix.k_pos[0] >= 0, prefix.k_pos[0], S)  # (T,)

    def put(cache, new):  # cache [B, S, K, H], new [1, T, K, H]
        return cache.at[slot, idx].set(new[0], mode="drop")

    def row(arr, value):
        return jax.lax.dynamic_update_index_in_dim(arr, value.astype(arr.dtype), slot, 0)

    sampling = jax.tree.map(lambda a, p: row(a, p[0]), state.sampling, prefix.sampling)
    V = state.counts.shape[1]
    first = jax.nn.one_hot(prefix.token, V, dtype=state.counts.dtype)
    return DecodeState(
        k=tuple(put(c, n) for c, n in zip(state.k, prefix.k)),
        v=tuple(put(c, n) for c, n in zip(state.v, prefix.v)),
        lengths=row(state.lengths, prefix.length),
        tokens=row(state.tokens, prefix.token),
        sampling=sampling,
        prompt_mask=row(state.prompt_mask, prefix.prompt_mask[0]),
        counts=row(state.counts, first),
    )
