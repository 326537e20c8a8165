"""The transformer engine's pure device functions: prefill (shared by both KV layouts),
prompt log-probs (whole, or chunk by chunk over the cache of the chunks before) and the
contiguous cache's generate step.

Functions of (model, static sizes, params, inputs, state) only: the engine
(engines/transformer_engine.py) binds the model and sizes and jits each once with
explicit shardings. The paged generate steps sit beside their engine
(engines/paged_engine.py), the speculative ones in engines/speculative.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from engines.engine_api import ResultTokens, pack_results
from engines.kv_cache import (
    DecodeKV,
    DecodeState,
    PrefillKV,
    Prefix,
    first_slots,
    step_slot_fields,
    with_first_slots,
)
from engines.model import Decoder
from engines.sampling import sample, token_logprobs


def prefill(model: Decoder, top_n: int, params, tokens, true_length, start, sampling,
            prompt_mask, existing, token_mask, draft_params=None, *,
            draft_model: Decoder | None = None):
    """tokens i32[1, T] (padded), true_length i32[], start i32[] (existing prefix length),
    token_mask i32[1, W] the first token's allowed tokens (engines/token_mask.py).
    With a draft model (speculative decoding) the draft's KV of the prompt comes too,
    continuing the existing prefix's draft KV."""
    T = tokens.shape[1]
    idx = jnp.arange(T)[None, :]
    positions = start + idx  # (1, T)
    new_k_pos = jnp.where(idx < true_length, positions, -1)
    kv = PrefillKV(new_k_pos, existing, start)
    last = jnp.reshape(true_length - 1, (1,))
    logits = model.apply({"params": params}, tokens, positions, kv, last=last)[:, 0]  # (1, V)
    V = logits.shape[-1]
    seen = jnp.zeros((1, V), jnp.int32).at[0, tokens[0]].max((idx[0] < true_length).astype(jnp.int32))
    mask = prompt_mask | (seen > 0)
    counts = jnp.zeros((1, V), jnp.int32)
    tok, next_key = sample(logits, sampling, mask, counts, token_mask=token_mask)
    lp, top_ids, top_lp = token_logprobs(logits, tok, top_n)
    length = start + true_length
    all_tokens = (tokens if existing is None else  # placed as kv.k_pos places positions
                  jax.lax.dynamic_update_slice_in_dim(existing.tokens, tokens, start, 1))
    draft = PrefillKV(new_k_pos, None if existing is None or draft_model is None else
                      dataclasses.replace(existing, k=existing.draft_k, v=existing.draft_v),
                      start)
    if draft_model is not None:
        draft_model.apply({"params": draft_params}, tokens, positions, draft, last=last)
    prefix = Prefix(
        k=tuple(kv.k), v=tuple(kv.v), k_pos=kv.k_pos, tokens=all_tokens,
        length=length.astype(jnp.int32),
        token=tok[0], sampling=dataclasses.replace(sampling, key=next_key), prompt_mask=mask,
        draft_k=tuple(draft.k), draft_v=tuple(draft.v),
    )
    res = pack_results(tok, jnp.ones((1,), bool), jnp.reshape(length + 1, (1,)), lp, top_ids,
                       top_lp)
    return prefix, res


def prefill_rows(model: Decoder, top_n: int, params, tokens, true_lengths, sampling,
                 token_mask, draft_params=None, *, draft_model: Decoder | None = None):
    """Several whole prompts in one call, one row each: tokens i32[R, T] (padded),
    true_lengths i32[R], sampling R rows, token_mask i32[R, W]. The weights are read once
    for every row, which is what a prompt short enough to be bound by that read gains.
    Returns (R prefixes, each what `prefill` makes of its row alone; ResultTokens of R
    rows): the same KV, first token and advanced key as R calls of `prefill`. With a
    draft model its KV of every prompt comes too, as prefill's."""
    R, T = tokens.shape
    idx = jnp.arange(T)[None, :]
    positions = jnp.broadcast_to(idx, (R, T))
    new_k_pos = jnp.where(idx < true_lengths[:, None], positions, -1)
    kv = PrefillKV(new_k_pos, None, 0)
    logits = model.apply({"params": params}, tokens, positions, kv,
                         last=true_lengths - 1)[:, 0]  # (R, V)
    V = logits.shape[-1]
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, T))
    seen = jnp.zeros((R, V), jnp.int32).at[rows, tokens].max((new_k_pos >= 0).astype(jnp.int32))
    mask = seen > 0
    tok, next_key = sample(logits, sampling, mask, jnp.zeros((R, V), jnp.int32),
                           token_mask=token_mask)
    lp, top_ids, top_lp = token_logprobs(logits, tok, top_n)
    advanced = dataclasses.replace(sampling, key=next_key)
    draft = PrefillKV(new_k_pos, None, 0)
    if draft_model is not None:
        draft_model.apply({"params": draft_params}, tokens, positions, draft,
                          last=true_lengths - 1)

    def row(i: int) -> Prefix:  # row i, keeping the prefix's batch axis of one
        one = lambda x: x[i:i + 1]  # noqa: E731
        return Prefix(k=tuple(map(one, kv.k)), v=tuple(map(one, kv.v)), k_pos=one(new_k_pos),
                      tokens=one(tokens), length=true_lengths[i], token=tok[i],
                      sampling=jax.tree.map(one, advanced), prompt_mask=one(mask),
                      draft_k=tuple(map(one, draft.k)), draft_v=tuple(map(one, draft.v)))

    prefixes = tuple(row(i) for i in range(R))
    res = pack_results(tok, jnp.ones((R,), bool), true_lengths + 1, lp, top_ids, top_lp)
    return prefixes, res


def prompt_logprobs(model: Decoder, top_n: int, params, tokens, true_length):
    """Log-probs of each prompt token given the ones before it (echo / scoring)."""
    T = tokens.shape[1]
    idx = jnp.arange(T)[None, :]
    kv = PrefillKV(jnp.where(idx < true_length, idx, -1), None)
    logits = model.apply({"params": params}, tokens, idx, kv)[0]  # (T, V)
    rows = _next_token_rows(logits, jnp.roll(tokens[0], -1), top_n)  # t+1 scored at t
    # Shift by one so row t describes prompt token t; row 0 has no context.
    shift = lambda x, fill: jnp.concatenate([jnp.full((1,) + x.shape[1:], fill, x.dtype), x[:-1]])
    return PromptLogprobs(
        token_logprobs=shift(rows.token_logprobs, jnp.nan), top_ids=shift(rows.top_ids, -1),
        top_logprobs=shift(rows.top_logprobs, jnp.nan), greedy=shift(rows.greedy, -1),
    )


def score_chunk(model: Decoder, top_n: int, params, tokens, true_length, start, next_token,
                cache: ScoreCache):
    """One chunk of a prompt too long to score in one pass: tokens i32[1, T] (padded) at
    positions start.., attending over `cache` (the KV of the chunks before, padded with
    k_pos -1; the caller sized it to hold this chunk at `start`). next_token i32[] is the
    prompt's token after this chunk, scored by its last row (any id for the last chunk).
    Returns (rows, cache with this chunk added): row t scores the token after position
    start + t, unshifted (the caller joins the chunks and shifts once)."""
    T = tokens.shape[1]
    idx = jnp.arange(T)[None, :]
    positions = start + idx
    kv = PrefillKV(jnp.where(idx < true_length, positions, -1), cache, start)
    logits = model.apply({"params": params}, tokens, positions, kv)[0]  # (T, V)
    nxt = jnp.roll(tokens[0], -1).at[true_length - 1].set(next_token)
    return (_next_token_rows(logits, nxt, top_n),
            ScoreCache(k=tuple(kv.k), v=tuple(kv.v), k_pos=kv.k_pos))


def empty_score_cache(L: int, K: int, H: int, dtype, capacity: int) -> ScoreCache:
    """A ScoreCache of `capacity` entries holding nothing yet (k_pos -1)."""
    zeros = jnp.zeros((1, capacity, K, H), dtype)
    return ScoreCache(k=(zeros,) * L, v=(zeros,) * L,
                      k_pos=jnp.full((1, capacity), -1, jnp.int32))


def _next_token_rows(logits, nxt, top_n: int) -> PromptLogprobs:
    """logits (T, V), nxt i32[T] -> row t: log p(nxt[t]), the top-n and the argmax."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, max(top_n, 1))
    greedy = jnp.argmax(logp, axis=-1).astype(jnp.int32)
    return PromptLogprobs(token_logprobs=chosen, top_ids=top_ids[:, :top_n].astype(jnp.int32),
                          top_logprobs=top_lp[:, :top_n], greedy=greedy)


def generate(model: Decoder, top_n: int, params, state: DecodeState, token_mask=None, *,
             rows: int | None = None):
    """One step; token_mask None, or i32[B, W] each slot's allowed tokens (a separate
    program: steps without constrained slots compile and run without it); a slot whose
    row allows nothing sits the step out (token_mask.hold_paused).

    rows: step only the first `rows` slots (a decode batch size below the state's B, a
    program of its own; token_mask then has `rows` rows): their cache is written and read
    in place, the other slots' fields and cache are untouched, and their result rows say
    no token (padding: the results keep B rows). The step's matmuls, attention and
    sampling then scale with `rows`, not B."""
    B = state.lengths.shape[0]
    if rows is not None and rows < B:
        new_state, results = generate(model, top_n, params, first_slots(state, rows),
                                      token_mask)
        return (with_first_slots(state, new_state),
                ResultTokens(data=jnp.pad(results.data, ((0, B - rows), (0, 0)))))
    S = state.k[0].shape[-1]
    valid = state.lengths < S
    pos = jnp.minimum(state.lengths, S - 1)  # (B,) full slots rewrite their last entry
    cpu_kernels = model.backend.cpu_kernels  # the engine turned the CPU kernels on
    kv = DecodeKV(state, pos, cpu_attention=cpu_kernels)
    logits = model.apply({"params": params}, state.tokens[:, None], pos[:, None], kv)[:, 0]
    slot, results = step_slot_fields(state, logits, valid, top_n, cpu_kernels, token_mask,
                                     pause=True)
    new_state = DecodeState(k=tuple(kv.k), v=tuple(kv.v), k_scale=tuple(kv.k_scale),
                            v_scale=tuple(kv.v_scale), **slot)
    return new_state, results


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    """Per prompt position t: log p(token_t | tokens before t); row 0 is NaN / -1."""

    token_logprobs: Any  # f32[T]
    top_ids: Any  # i32[T, n]
    top_logprobs: Any  # f32[T, n]
    greedy: Any  # i32[T] the argmax token at t given tokens before t


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScoreCache:
    """The KV of the chunks of a prompt scored so far (score_chunk); entry j holds
    position j, k_pos -1 where nothing is yet."""

    k: tuple[Any, ...]  # L x [1, C, K, H]
    v: tuple[Any, ...]  # L x [1, C, K, H]
    k_pos: Any  # i32[1, C]
