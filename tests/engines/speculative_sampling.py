"""The temperature-1 check shared by the n-gram and draft-model speculative tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from engines.kv_cache import PrefillKV


def prefilled_slots(eng, params, prompt: list[int]):
    """Every slot of `eng` holding `prompt` + its first token; also the model's softmax
    (float64) at the position after it, computed in one plain forward pass."""
    prefix, first = eng.prefill(params, prompt, len(prompt))
    seq = prompt + [first.to_host().token(0)]
    state = eng.init_decode_state()
    for slot in range(eng.max_concurrent_decodes):
        state = eng.insert(prefix, state, slot)
    pos = jnp.arange(len(seq))[None]
    logits = eng.model.apply({"params": params}, jnp.asarray([seq]), pos, PrefillKV(pos, None))
    p = np.asarray(jax.nn.softmax(logits[0, -1].astype(jnp.float32)), np.float64)
    return state, p


def check_first_tokens_follow(eng, params, state0, p: np.ndarray, rounds: int = 12) -> None:
    """Runs the speculative step at temperature 1 from `state0` with a fresh key per slot
    and round; asserts drafts were kept sometimes and replaced otherwise, and that each
    step's first token follows `p` (chi-square)."""
    B = eng.max_concurrent_decodes
    first_tokens, kept = [], 0
    for r in range(rounds):
        keys = jax.random.key_data(jax.random.split(jax.random.key(100 + r), B))
        state = jax.tree.map(jnp.copy, state0)
        state.sampling = dataclasses.replace(state.sampling, key=keys,
                                             temperature=jnp.ones((B,), jnp.float32))
        _, res = eng.generate(params, state)
        h = res.to_host()
        first_tokens += [h.token(s, 0) for s in range(B)]
        kept += sum(h.count(s) > 1 for s in range(B))
    f_obs = np.bincount(first_tokens, minlength=len(p))
    assert 0 < kept < len(first_tokens)  # drafts kept sometimes, replaced otherwise
    assert stats.chisquare(f_obs, p / p.sum() * len(first_tokens)).pvalue > 1e-3
