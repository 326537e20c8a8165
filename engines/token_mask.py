"""Token masks for structured output: which tokens each slot may sample next.

A mask is packed 32 tokens to an int32 word, i32[B, W] with W = ceil(V / 32): bit
(t % 32) of word t // 32 set means token t is allowed (the layout llguidance fills on the
host). The jitted step unpacks it and gives disallowed tokens -inf before sampling, so
greedy, temperature and top-k/p/min-p all pick among allowed tokens only.

The engines take a mask as an optional argument of generate (None: the step compiled
without one, so requests without constraints pay nothing) and always take one row in
prefill (all ones for a free request: one row of V selects, nothing beside a prompt). A
speculative verify step takes one mask per position it samples, i32[B, K+1, W]
(engines/speculative.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -1e30  # as engines.sampling: finite, so scaling by a temperature stays ordered


def mask_words(vocab_size: int) -> int:
    """W: int32 words of one slot's mask."""
    return -(-vocab_size // 32)


def allow_all(batch: int, vocab_size: int) -> np.ndarray:
    """A host mask allowing every token: i32[B, W] of all ones (-1)."""
    return np.full((batch, mask_words(vocab_size)), -1, np.int32)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits f32[B, V], mask i32[B, W] -> logits with disallowed tokens at -1e30."""
    V = logits.shape[-1]
    t = jnp.arange(V)
    words = jnp.take(mask, t // 32, axis=1)  # (B, V)
    allowed = (jnp.right_shift(words, (t % 32).astype(jnp.int32)) & 1) == 1
    return jnp.where(allowed, logits, _NEG_INF)


def hold_paused(token_mask: jax.Array, tokens: jax.Array, tok: jax.Array, valid: jax.Array,
                keys: jax.Array, next_keys: jax.Array):
    """A slot whose mask row allows nothing sits the step out: the host has not yet read
    its last token, so its next mask is unknown (jetserve/orchestrator/step_masks.py). It
    keeps its input token and RNG key and gains nothing (valid False: no length, count or
    result); the KV it wrote is the same position's, rewritten when it next steps.
    Returns (tokens, valid, keys) for the new state."""
    paused = ~jnp.any(token_mask != 0, axis=-1)  # (B,)
    return (jnp.where(paused, tokens, tok), valid & ~paused,
            jnp.where(paused[:, None], keys, next_keys))
