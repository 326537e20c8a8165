"""Speculative decoding inside the generate step: drafting, and verifying the drafts.

`EngineConfig.speculative` names the drafter: "none", "ngram:K" (prompt lookup: the
K tokens that followed the most recent earlier occurrence of the sequence's last n
tokens, n = 3, then 2, then 1), or "draft:PATH:K" (a smaller model with the target's
vocabulary: K autoregressive steps of its own, from its own contiguous cache in the
decode state, `draft_model_drafts`). The step feeds the target model [last token, d1..dK] at
positions pos..pos+K, so one forward pass scores every draft, and `verify` keeps the
longest run of drafts the target agrees with plus one token of its own:

  - greedy rows: d_i is kept while it equals the target's argmax; the first argmax that
    differs (or the one after d_K) is the extra token. The output is the plain greedy
    output, token for token.
  - sampled rows: rejection sampling (Leviathan et al., Chen et al.): d_i is kept with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn
    from norm(max(p_i - q_i, 0)), and after K kept drafts from p_{K+1}. p is the target's
    sampling distribution (penalties, temperature, top-k / top-p / min-p as
    engines.sampling applies them), q the drafter's (one-hot for n-gram drafts; the draft
    model's distribution under the same sampling parameters for a draft model), so the
    tokens follow the target's distribution exactly.

Structured output: a verify step takes one token mask per position, i32[B, K+1, W]
(engines/token_mask.py), applied after the penalties at each position as the plain
sampler applies its one. A position whose mask allows nothing ends what the row may keep
there (`mask_cap`): a constrained row gets its grammar's mask at position 0 and empty ones
after, so it keeps one token a step, drawn from the masked target distribution (a kept
draft is one p allows); a row whose position-0 mask is empty sits the step out (its token,
length and RNG key stay), as the plain step's paused rows do. Free rows get all ones.

Each slot then advances by (kept drafts + 1); keys and values written at rejected
positions lie past the slot's length, are never read (every read masks positions past the
query), and are overwritten by the next step. The draft model's cache follows the same
lengths: its steps feed [last token, d1..dK] (K + 1 steps, the last one only writing d_K's
keys and values), so it holds every kept token however many drafts are accepted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from engines import device_functions
from engines.engine_api import pack_results
from engines.kv_cache import DecodeKV, DecodeState
from engines.model import Decoder
from engines.sampling import SlotSampling, apply_penalties, filter_logits, token_logprobs
from engines.token_mask import apply_token_mask

NGRAM_SIZES = (3, 2, 1)  # longest suffix tried first


def ngram_drafts(history: jax.Array, lengths: jax.Array, k: int) -> jax.Array:
    """Prompt-lookup drafts. history i32[B, S] holds each slot's tokens at positions
    0..lengths[b] (the last one is the token fed next); returns i32[B, k]: the tokens
    after the most recent earlier match of the last n tokens (longest n first). Without
    a match the last token is repeated (drafts that are usually rejected)."""
    B, S = history.shape
    j = jnp.arange(S)[None, :]
    last = jnp.minimum(lengths, S - 1)[:, None]  # (B, 1) index of the last token
    found = jnp.full((B,), -1, jnp.int32)
    for n in NGRAM_SIZES:
        match = (j >= n - 1) & (j < last)  # an earlier position ending an n-gram
        for m in range(n):
            tail = jnp.take_along_axis(history, jnp.maximum(last - m, 0), axis=1)  # (B, 1)
            shifted = jnp.roll(history, m, axis=1)  # shifted[:, j] = history[:, j - m]
            match &= shifted == tail
        best = jnp.max(jnp.where(match & (last >= n - 1), j, -1), axis=1)
        found = jnp.where(found >= 0, found, best)
    start = jnp.where(found >= 0, found + 1, last[:, 0])  # (B,)
    idx = jnp.minimum(start[:, None] + jnp.arange(k)[None, :], last)  # never past the end
    idx = jnp.where(found[:, None] >= 0, idx, last)
    return jnp.take_along_axis(history, idx, axis=1).astype(jnp.int32)


def running_counts(counts: jax.Array, drafts: jax.Array) -> jax.Array:
    """Generated-token counts seen at each of the K+1 verify positions: position i has
    the slot's counts plus drafts d_1..d_i (as if they were kept). -> i32[B, K+1, V]."""
    V = counts.shape[-1]
    hot = jax.nn.one_hot(drafts, V, dtype=counts.dtype)  # (B, K, V)
    zero = jnp.zeros_like(hot[:, :1])
    return counts[:, None] + jnp.cumsum(jnp.concatenate([zero, hot], axis=1), axis=1)


def target_probs(logits: jax.Array, s: SlotSampling, prompt_mask: jax.Array,
                 counts: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    """The distribution the plain sampler draws from at each verify position:
    logits f32[B, T, V], counts i32[B, T, V], token_mask None or i32[B, T, W] (applied
    after the penalties, as the sampler's) -> probs f32[B, T, V] (one-hot argmax for
    greedy rows)."""
    B, T, V = logits.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), s)
    flat = apply_penalties(logits.reshape(B * T, V).astype(jnp.float32), rows,
                           jnp.repeat(prompt_mask, T, axis=0), counts.reshape(B * T, V))
    if token_mask is not None:
        flat = apply_token_mask(flat, token_mask.reshape(B * T, -1))
    greedy = jax.nn.one_hot(jnp.argmax(flat, axis=-1), V, dtype=jnp.float32)
    random = rows.temperature > 0

    def with_sampled(_):  # the filters sort the vocabulary: only when a row samples
        sampled = jax.nn.softmax(filter_logits(flat, rows), axis=-1)
        return jnp.where(random[:, None], sampled, greedy)

    probs = jax.lax.cond(jnp.any(random), with_sampled, lambda _: greedy, None)
    return probs.reshape(B, T, V)


def verify(p: jax.Array, q: jax.Array, drafts: jax.Array, keys: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """Keeps the longest run of accepted drafts and adds one token.

    p f32[B, K+1, V]: target distribution at each position; q f32[B, K, V]: the drafter's
    distribution each draft was drawn from; drafts i32[B, K]; keys u32[B, 2] (one use).
    Returns (tokens i32[B, K+1]: kept drafts, then the corrected / bonus token, then
    filler; count i32[B] = kept + 1).
    """
    B, T, V = p.shape
    K = T - 1
    # Every p and q one-hot (greedy rows, n-gram drafts): nothing is random, so the
    # random draws (slow on CPU) are skipped: u = 0 keeps d iff p(d) > 0, and the last
    # token is the residual's one token.
    degenerate = jnp.all(jnp.max(p, axis=-1) >= 1.0) & jnp.all(jnp.max(q, axis=-1) >= 1.0)
    ks = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k)))(keys)
    u = jax.lax.cond(degenerate, lambda _: jnp.zeros((B, K)),
                     lambda _: jax.vmap(lambda k: jax.random.uniform(k, (K,)))(ks[:, 0]), None)
    pd = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]  # (B, K)
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    # u < p/q without dividing: u in [0, 1), so q = 0 never accepts and p >= q always does.
    ok = u * qd < pd
    kept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # (B,)
    # The last token: from the residual at the first rejection, from p after K drafts.
    at = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]  # (B, V)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_{K+1} = 0
    q_at = jnp.take_along_axis(q_pad, kept[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(at - q_at, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    # p == q exactly leaves nothing to correct toward (then any draw from p is right).
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), at)

    def draw(_):
        logr = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)), -jnp.inf)
        return jax.vmap(jax.random.categorical)(ks[:, 1], logr).astype(jnp.int32)

    last = jax.lax.cond(degenerate, lambda _: jnp.argmax(resid, axis=-1).astype(jnp.int32),
                        draw, None)
    i = jnp.arange(T)[None, :]
    padded = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    tokens = jnp.where(i < kept[:, None], padded, last[:, None]).astype(jnp.int32)
    return tokens, kept + 1


def mask_cap(token_mask: jax.Array) -> jax.Array:
    """token_mask i32[B, T, W] -> i32[B]: how many tokens each row may keep, the first
    position whose mask allows nothing (T when none; 0: the row sits the step out)."""
    empty = ~jnp.any(token_mask != 0, axis=-1)  # (B, T)
    B, T = empty.shape
    return jnp.argmax(jnp.concatenate([empty, jnp.ones((B, 1), bool)], axis=1),
                      axis=1).astype(jnp.int32)


def verify_step(logits, state, drafts, top_n: int, q=None, token_mask=None):
    """The speculative half shared by both cache layouts: logits f32[B, K+1, V] of
    [last token, d1..dK], q f32[B, K, V] the drafter's distributions (None: one-hot, for
    deterministic n-gram drafts), token_mask None or i32[B, K+1, W] (module doc) ->
    (tokens i32[B, K+1], count i32[B] before the cache-room cap, next keys, log-probs
    f32[B, K+1], top ids, top log-probs)."""
    B, T, V = logits.shape
    counts = running_counts(state.counts, drafts)
    p = target_probs(logits, state.sampling, state.prompt_mask, counts, token_mask)
    if q is None:
        q = jax.nn.one_hot(drafts, V, dtype=jnp.float32)
    keys = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k)))(state.sampling.key)
    tokens, count = verify(p, q, drafts, jax.vmap(jax.random.key_data)(keys[:, 1]))
    next_keys = jax.vmap(jax.random.key_data)(keys[:, 0])
    if token_mask is not None:
        count = jnp.minimum(count, mask_cap(token_mask))
        # A row that sat the step out keeps its key, as the plain step's paused rows do.
        next_keys = jnp.where((count == 0)[:, None], state.sampling.key, next_keys)
    lp, top_ids, top_lp = token_logprobs(logits.reshape(B * T, V), tokens.reshape(-1), top_n)
    return (tokens, count, next_keys, lp.reshape(B, T), top_ids.reshape(B, T, top_n),
            top_lp.reshape(B, T, top_n))


def advance_slots(state, tokens, count, max_seq_len: int):
    """Slot bookkeeping after a verify step: count capped by the room left (0 for a full
    slot); new lengths, last tokens, generated-token counts and history."""
    B, T = tokens.shape
    S = max_seq_len
    count = jnp.where(state.lengths < S, jnp.minimum(count, S - state.lengths), 0)
    lengths = state.lengths + count
    last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
    kept = jnp.arange(T)[None, :] < count[:, None]  # (B, T)
    V = state.counts.shape[1]
    counts = state.counts + jnp.sum(
        jax.nn.one_hot(tokens, V, dtype=state.counts.dtype) * kept[..., None], axis=1)
    # The kept tokens sit at positions length+1 .. length+count of the history.
    where = jnp.where(kept, state.lengths[:, None] + 1 + jnp.arange(T)[None, :], S)
    history = state.history.at[jnp.arange(B)[:, None], where].set(tokens, mode="drop")
    return dict(lengths=lengths, tokens=jnp.where(count > 0, last, state.tokens),
                counts=counts, history=history), count


def draft_model_drafts(draft_model: Decoder, k: int, draft_params, state: DecodeState):
    """K drafts per slot from the draft model, each drawn from q, the draft's sampling
    distribution under the slot's parameters (its argmax for greedy rows). The draft
    runs K + 1 single-token steps over [last token, d1..dK] at positions pos..pos+K of
    its own cache (the last step only writes d_K's keys and values).

    Returns (drafts i32[B, K], q f32[B, K, V], the state with the RNG keys left for
    verifying, the draft cache's keys and values)."""
    split = jax.vmap(lambda key: jax.random.split(jax.random.wrap_key_data(key)))
    keys = split(state.sampling.key)  # (B, 2): drafting, the rest of the step
    rest = dataclasses.replace(state, sampling=dataclasses.replace(
        state.sampling, key=jax.vmap(jax.random.key_data)(keys[:, 1])))
    # The draft's cache as a contiguous decode state (whatever the target's layout).
    view = DecodeState(k=state.draft_k, v=state.draft_v, k_scale=(), v_scale=(),
                       lengths=state.lengths, tokens=state.tokens, sampling=state.sampling,
                       prompt_mask=state.prompt_mask, counts=state.counts,
                       history=state.history)
    random = state.sampling.temperature > 0

    def step(carry, i):
        dk, dv, token, counts = carry
        pos = (state.lengths + i)[:, None]  # (B, 1): positions past the cache are dropped
        kv = DecodeKV(dataclasses.replace(view, k=dk, v=dv), pos)
        logits = draft_model.apply({"params": draft_params}, token[:, None], pos, kv)
        q = target_probs(logits, state.sampling, state.prompt_mask, counts[:, None])[:, 0]

        def draw(_):
            step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys[:, 0], i)
            logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
            drawn = jax.vmap(jax.random.categorical)(step_keys, logq)
            return jnp.where(random, drawn, jnp.argmax(q, axis=-1)).astype(jnp.int32)

        d = jax.lax.cond(jnp.any(random), draw,
                         lambda _: jnp.argmax(q, axis=-1).astype(jnp.int32), None)
        counts = counts + jax.nn.one_hot(d, counts.shape[-1], dtype=counts.dtype)
        return (tuple(kv.k), tuple(kv.v), d, counts), (d, q)

    init = (state.draft_k, state.draft_v, state.tokens, state.counts)
    (dk, dv, _, _), (drafts, q) = jax.lax.scan(step, init, jnp.arange(k + 1))
    drafts = jnp.transpose(drafts[:k], (1, 0))  # (B, K)
    q = jnp.transpose(q[:k], (1, 0, 2))  # (B, K, V)
    return drafts, q, rest, dk, dv


def generate_speculative(model: Decoder, top_n: int, k: int, draft_model: Decoder | None,
                         params, state: DecodeState, token_mask=None, draft_params=None):
    """One verify step: the model runs over [last token, d1..dk] at positions
    pos..pos+k of every slot and keeps what engines.speculative.verify accepts. The
    drafts come from the sequence's own tokens, or from `draft_model` when given;
    token_mask None or i32[B, k+1, W] (module doc)."""
    S = state.k[0].shape[-1]
    if draft_model is None:
        drafts, q, rest = ngram_drafts(state.history, state.lengths, k), None, state
        dk, dv = state.draft_k, state.draft_v
    else:
        drafts, q, rest, dk, dv = draft_model_drafts(draft_model, k, draft_params, state)
    inp = jnp.concatenate([state.tokens[:, None], drafts], axis=1)  # (B, k+1)
    positions = state.lengths[:, None] + jnp.arange(k + 1)[None, :]
    kv = DecodeKV(state, positions)
    logits = model.apply({"params": params}, inp, positions, kv)  # (B, k+1, V)
    tokens, count, next_keys, lp, top_ids, top_lp = verify_step(logits, rest, drafts, top_n, q,
                                                                token_mask)
    slot, count = advance_slots(state, tokens, count, S)
    new_state = DecodeState(
        k=tuple(kv.k), v=tuple(kv.v), k_scale=tuple(kv.k_scale), v_scale=tuple(kv.v_scale),
        sampling=dataclasses.replace(state.sampling, key=next_keys),
        prompt_mask=state.prompt_mask, draft_k=tuple(dk), draft_v=tuple(dv), **slot,
    )
    res = pack_results(tokens, count, slot["lengths"] + 1, lp, top_ids, top_lp)
    return new_state, res


def generate_step(model: Decoder, top_n: int, spec, draft_model: Decoder | None):
    """The contiguous cache's generate function over `model` for speculative config
    `spec` (EngineConfig.spec): the verify step, or device_functions.generate."""
    if spec.enabled:
        return functools.partial(generate_speculative, model, top_n, spec.k, draft_model)
    return functools.partial(device_functions.generate, model, top_n)
