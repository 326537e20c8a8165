"""Attention math, below the model and the KV stores that both use it.

`KVStore` is the contract between a model's attention layer and the cache that holds
its keys and values (engines/kv_cache.py, engines/paged_kv.py implement it);
`attention` is causal grouped-query attention by positions over [B, S, K, H] keys and
values, `decode_attention` the same over a decode cache's own layout.

Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax
as one more key with no value, so a row's weights over its keys sum to less than one.
Every attention path takes them as `sinks` f32[N] (None: no sink); the online-softmax
paths start each row's running max at its sink's logit and its running sum at 1.

Chunked local attention (Llama 4): a query sees only the keys of its own chunk of
`chunk` positions (key // chunk == query // chunk), causally. Every attention path takes
it as `chunk` (None: none), through `visible_keys`; no query sees further back than a
chunk's length, so the paths that skip key blocks outside a sliding window skip by
`reach` (the shorter of the two).

Key-only caches (multi-head latent attention: engines.config.ModelConfig.value_dim 0):
a store's value arrays have width 0 and attention reads its values from the keys
(`key_only`); the stores write, move and transfer the empty value arrays as they do
any other, so every path keeps one shape of state while the bytes are the keys' alone.

Letters: B batch, T query length, S key length, N query heads, K kv heads, G = N/K,
H head dim.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp

_MASKED = -1e30


class KVStore(Protocol):
    """Where a layer's keys and values go, and what it attends over."""

    def update(
        self, layer: int, k: jax.Array, v: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Takes new k, v [B, T, K, H]; returns (k_all, v_all [B, S, K, H], k_pos i32[B, S]).

        k_pos holds each key's sequence position, or -1 for an empty entry.
        """
        ...


def key_only(v: jax.Array) -> bool:
    """Whether a store's values are absent (width 0): attention reads them from the keys."""
    return v.shape[-1] == 0


def softcapped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Scaled scores through cap * tanh(scores / cap) (Gemma 2's attention-logit cap)."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def sink_logits(sinks: jax.Array, num_kv_heads: int) -> jax.Array:
    """The per-head sink logits f32[N] grouped as the queries are: f32[K, G]."""
    return sinks.astype(jnp.float32).reshape(num_kv_heads, -1)


def visible_keys(qp: jax.Array, kp: jax.Array, sliding_window: int | None,
                 chunk: int | None = None) -> jax.Array:
    """Which keys (positions kp, -1: empty) each query (positions qp) sees, shapes
    broadcast: causal, within the sliding window, within the query's chunk."""
    visible = (kp >= 0) & (kp <= qp)
    if sliding_window is not None:
        visible &= kp > qp - sliding_window
    if chunk is not None:
        visible &= kp // chunk == qp // chunk
    return visible


def _attention_probs(scores: jax.Array, qp: jax.Array, kp: jax.Array, head_dim: int,
                     sliding_window: int | None, dtype: Any,
                     softcap: float | None = None, sinks: jax.Array | None = None,
                     chunk: int | None = None) -> jax.Array:
    """Scaled, causally masked softmax of raw q.k scores (last axis: keys); qp / kp are
    the query / key positions shaped to broadcast against them (key position -1: empty);
    scaled scores are soft-capped first where `softcap` is given. `sinks`: each row's
    sink logit, shaped to broadcast against scores[..., :1], in the softmax's sum only."""
    visible = visible_keys(qp, kp, sliding_window, chunk)
    scores = jnp.where(visible, softcapped(scores / math.sqrt(head_dim), softcap), _MASKED)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sink = jnp.broadcast_to(sinks, scores.shape[:-1] + (1,))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)
    return probs[..., :-1].astype(dtype)


def attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    q_pos: jax.Array,  # i32[B, T]
    k_pos: jax.Array,  # i32[B, S], -1 = empty
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    chunk: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention by positions; returns [B, T, N, H] (v of width 0:
    the keys are the values, `key_only`)."""
    v = k if key_only(v) else v
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)  # (B, T, K, G, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    qp = q_pos[:, None, None, :, None]  # (B, 1, 1, T, 1)
    kp = k_pos[:, None, None, None, :]  # (B, 1, 1, 1, S)
    sink = None if sinks is None else sink_logits(sinks, K)[None, :, :, None, None]
    probs = _attention_probs(scores, qp, kp, H, sliding_window, v.dtype, softcap, sink, chunk)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(B, T, N, H)


def decode_attention(
    q: jax.Array,  # [B, T, N, H], T = 1 but in speculative verification
    k: jax.Array,  # [B, K, H, S] positions minor
    v: jax.Array,  # [B, K, S, H]
    q_pos: jax.Array,  # i32[B, T]
    k_pos: jax.Array,  # i32[B, S], -1 = empty
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    chunk: int | None = None,
) -> jax.Array:
    """`attention` for one new token per row over a decode cache; returns [B, 1, N, H].
    (T > 1 new tokens per row, speculative verification: q [B, T, N, H], q_pos [B, T].)
    v of width 0 (`key_only`): the values are the keys, read in their own layout.

    Both contractions are batched over (B, K) and run along the cache's memory order, so
    the cache is read once and never transposed (see engines.kv_cache)."""
    B, T, N, H = q.shape
    K = k.shape[1]
    sink = None if sinks is None else sink_logits(sinks, K)[None]  # (1, K, G)
    if T > 1:
        qg = q.reshape(B, T, K, N // K, H)
        scores = jnp.einsum("btkgh,bkhs->bkgts", qg, k, preferred_element_type=jnp.float32)
        qp = q_pos[:, None, None, :, None]  # (B, 1, 1, T, 1)
        kp = k_pos[:, None, None, None, :]  # (B, 1, 1, 1, S)
        sink = None if sink is None else sink[..., None, None]
        probs = _attention_probs(scores, qp, kp, H, sliding_window, k.dtype, softcap, sink,
                                 chunk)
        if key_only(v):
            return jnp.einsum("bkgts,bkhs->btkgh", probs, k).reshape(B, T, N, H)
        return jnp.einsum("bkgts,bksh->btkgh", probs, v).reshape(B, T, N, H)
    qg = q.reshape(B, K, N // K, H)  # (B, K, G, H)
    scores = jnp.einsum("bkgh,bkhs->bkgs", qg, k, preferred_element_type=jnp.float32)
    qp = q_pos[:, :, None, None]  # (B, 1, 1, 1)
    kp = k_pos[:, None, None, :]  # (B, 1, 1, S)
    sink = None if sink is None else sink[..., None]
    probs = _attention_probs(scores, qp, kp, H, sliding_window, k.dtype, softcap, sink,
                             chunk)
    if key_only(v):
        out = jnp.einsum("bkgs,bkhs->bkgh", probs, k)  # (B, K, G, H)
    else:
        out = jnp.einsum("bkgs,bksh->bkgh", probs, v)  # (B, K, G, H)
    return out.reshape(B, 1, N, H)
