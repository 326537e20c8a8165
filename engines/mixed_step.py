"""The mixed step: decode rows and chunks of prompts in one jitted step over paged KV.

Engine API (`PagedTransformerEngine.mixed_step`, engines/paged_engine.py):

    mixed_step(params, decode_state, page_table, rows, token_mask=None)
        -> (decode_state, ResultTokens)

  - rows: `engines.mixed_batch.MixedRow`s, at most one per slot: decode rows (one token,
    the slot's last sampled one, read from the state on the device) and prefill rows (a
    chunk of a prompt at given positions; the chunk that ends the prompt samples its
    first token). Slots in no row are left bit-identical.
  - page_table i32[B, W]: each slot's first W pages in position order, covering every
    position this step writes (chunk positions, and a decode row's length); the host's
    KV-cache manager (jetserve/scheduling) decides them, as for generate. W a power of
    two up to ceil(max_seq_len / page_size), as generate's widths.
  - The step writes every token's K/V into its row's pages, each token attends causally
    over its row's pages (engines/ragged_attention.py), and each sampling row gets one
    token. ResultTokens as generate's: a row's count is 1 where it sampled (decode rows,
    last chunks), else 0; its length column is prompt + generated tokens, as prefill's
    and generate's.
  - The decode state is donated. A slot mid-prompt (chunks sent, not the last) reads as
    not live to `generate` (length max_seq_len, as an empty slot), so plain generate
    steps may run between mixed steps; once its last chunk has run the slot is exactly
    what prefill + insert make (length, first token, sampling row with its key advanced
    past that token, prompt mask, token counts), so generate and mixed steps continue it
    alike.
  - Compiles once per (token bucket, page-table width): `engine.mixed_token_buckets` x
    the planner's widths (trace counts under "mixed"), and once more per shape for the
    steps given a token_mask. A step of decode rows alone (no chunk) runs the paged
    generate step's program instead, masked to its rows (one per width, and one more per
    width with a token_mask, also counted under "mixed"; warm-up's bucket 0).
  - token_mask: None, or i32[B, W'] (engines/token_mask.py, as generate's): one packed
    row per slot, the allowed tokens of the token its row samples (a decode row's next
    token, the first token of a chunk that ends its prompt; a row that samples nothing
    ignores its mask). A decode row whose mask allows nothing sits the step out, as in
    generate (token_mask.hold_paused: no token, length or key change); a chunk that ends
    its prompt must allow some token (the engine refuses an empty row for it). The mask
    is an argument of the program: a step with one compiles once more per shape.
  - LoRA adapters: a paged LoRA engine runs this step with each token through its row's
    adapter (engines/lora_engine.py lora_mixed_step).
  - N-gram speculative decoding (`speculative="ngram:K"`): each decode row is a verify
    row of K + 1 tokens, [last token, d1..dK] at positions length .. length + K, the
    drafts looked up on the device in the slot's history (engines/speculative.py
    ngram_drafts). It keeps what `verify_step` accepts plus one token, exactly as the
    paged verify step (greedy: the plain greedy tokens; sampled: rejection sampling);
    its ResultTokens row holds up to K + 1 tokens, a chunk's one token in column 0. The
    page table covers length + K of every decode row; keys and values written at
    rejected positions lie past the row's length and are written again. token_mask is
    then i32[B, K + 1, W'], one row per position (a chunk's first token takes position
    0's). The history gains each chunk's tokens, so drafts see the prompt; the positions
    a prefix-cache hit linked come before the step (MixedRow.context, `fill_context`).
  - A draft model (`speculative="draft:PATH:K"`): the verify rows' drafts come from the
    draft model's K + 1 single-token steps over its own contiguous cache (as the paged
    verify step's, engines/speculative.py draft_model_drafts, run for the decode rows
    only), drawn from q, which rejection sampling reads. Each chunk's tokens then run
    through the draft model too, written into its cache at the chunk's positions (one
    pass per chunk row, over a row of the step's token bucket), so the draft has seen
    the whole prompt when the slot starts decoding. The positions a prefix-cache hit
    linked (the target's pages are shared, the draft's cache is not) run through the
    draft before the step (MixedRow.context, `fill_context`).

Device-side derivations from the per-row inputs (engines/mixed_batch.py): a token's row
is found from the cumulative query lengths (rows laid out in slot order), its position is
the row's base (a decode row's length, a chunk's start) plus its offset in the row.

Letters: B slots (rows), T tokens, W pages per row, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engines import layer_scan
from engines.attention import key_only
from engines.engine_api import pack_results
from engines.kv_cache import DecodeKV, DecodeState
from engines.mixed_batch import MODE_CHUNK, MODE_DECODE, MixedInputs
from engines.model import Decoder
from engines.paged_kv import PagedDecodeState, PageTables, WindowRing, pool_shape, write_pages
from engines.ragged_attention import pallas_ragged_attention, ragged_paged_attention
from engines.sampling import sample, token_logprobs
from engines.speculative import advance_slots, draft_model_drafts, ngram_drafts, verify_step
from engines.token_mask import hold_paused


@dataclasses.dataclass
class RaggedLayout:
    """Where each of T tokens goes: its row, position (-1: padding or a full slot), id."""

    rows: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    tokens: jax.Array  # i32[T]
    q_len: jax.Array  # i32[B] tokens each row runs
    last: jax.Array  # i32[B, R] the tokens whose logits sample (module doc: R = k + 1)
    decode_live: jax.Array  # bool[B] decode rows with room (lengths < S)


def ragged_layout(inp: MixedInputs, state: PagedDecodeState, max_seq_len: int,
                  drafts: jax.Array | None = None) -> RaggedLayout:
    """drafts None, or i32[B, k] (speculative decoding): each decode row is a verify row of
    k + 1 tokens [last token, d1..dk] at positions length .. length + k, whose k + 1
    logits all sample (a prompt chunk's last token stands in each of its R columns)."""
    T = inp.tokens.shape[0]
    B = inp.mode.shape[0]
    R = 1 if drafts is None else drafts.shape[1] + 1
    decode = inp.mode == MODE_DECODE
    decode_live = decode & (state.lengths < max_seq_len)
    q_len = jnp.where(decode, R, jnp.where(inp.mode == MODE_CHUNK, inp.q_len, 0))
    cu = jnp.cumsum(q_len)  # (B,) end of each row's tokens
    begin = cu - q_len
    t = jnp.arange(T)
    rows = jnp.minimum(jnp.searchsorted(cu, t, side="right"), B - 1).astype(jnp.int32)
    base = jnp.where(decode, state.lengths, inp.start)
    off = t - begin[rows]
    pos = base[rows] + off
    runs = (t < cu[-1]) & (~decode[rows] | decode_live[rows]) & (pos < max_seq_len)
    fed = state.tokens[rows]
    if drafts is not None:  # a verify row's drafts after its last token
        fed = jnp.where(off > 0, drafts[rows, jnp.clip(off - 1, 0, R - 2)], fed)
    tokens = jnp.where(decode[rows], fed, inp.tokens)
    end = jnp.maximum(cu - 1, 0)[:, None]
    last = jnp.where(decode[:, None], jnp.minimum(begin[:, None] + jnp.arange(R), end), end)
    return RaggedLayout(rows=rows, positions=jnp.where(runs, pos, -1).astype(jnp.int32),
                        tokens=tokens, q_len=q_len, last=last.astype(jnp.int32),
                        decode_live=decode_live)


def _draft_row(draft_model: Decoder, draft_params, state: PagedDecodeState, cache, b,
               tokens: jax.Array, pos: jax.Array):
    """The draft model over tokens i32[T] at positions i32[T] (S: past the cache, not
    written) of slot b: its keys and values written into that slot of the draft's
    contiguous cache `cache` (draft_k, draft_v), sliced out and written back."""
    def slot(c):  # the slot axis leads a layer's cache, follows a stack's layer
        return jax.lax.dynamic_slice_in_dim(c, b, 1, c.ndim - 4)

    def put(c, new):
        return jax.lax.dynamic_update_slice_in_dim(c, new, b, c.ndim - 4)

    dk, dv = cache
    view = DecodeState(k=tuple(map(slot, dk)), v=tuple(map(slot, dv)), k_scale=(), v_scale=(),
                       lengths=jnp.min(pos)[None], tokens=tokens[:1],
                       sampling=state.sampling, prompt_mask=state.prompt_mask,
                       counts=state.counts, history=state.history)
    kv = DecodeKV(view, pos[None])
    draft_model.apply({"params": draft_params}, tokens[None], pos[None], kv,
                      last=jnp.zeros((1,), jnp.int32))
    return tuple(map(put, dk, kv.k)), tuple(map(put, dv, kv.v))


def draft_chunks(draft_model: Decoder, draft_params, state: PagedDecodeState,
                 lay: RaggedLayout, inp: MixedInputs, max_seq_len: int) -> dict:
    """The draft model over each chunk row's tokens (a speculative draft model's, module
    doc), their keys and values written into its contiguous cache at their positions:
    one pass per chunk row, over T tokens (the row's, then padding past the cache, which
    is dropped). Returns the new draft_k and draft_v."""
    S = max_seq_len
    T = lay.tokens.shape[0]
    t = jnp.arange(T)
    begin = jnp.cumsum(lay.q_len) - lay.q_len
    chunk = inp.mode == MODE_CHUNK
    order = jnp.argsort(~chunk, stable=True)  # the chunk rows first

    def one(i, cache):
        b = order[i]
        at = jnp.minimum(begin[b] + t, T - 1)
        pos = jnp.where(t < lay.q_len[b], lay.positions[at], -1)
        return _draft_row(draft_model, draft_params, state, cache, b, lay.tokens[at],
                          jnp.where(pos >= 0, pos, S))

    dk, dv = jax.lax.fori_loop(0, jnp.sum(chunk), one, (state.draft_k, state.draft_v))
    return dict(draft_k=dk, draft_v=dv)


def fill_context(draft_model: Decoder | None, max_seq_len: int, state: PagedDecodeState,
                 slot: jax.Array, start: jax.Array, tokens: jax.Array, n: jax.Array,
                 draft_params=None) -> PagedDecodeState:
    """A piece of a prefix-cache hit's tokens (MixedRow.context): tokens i32[P], the first
    n at positions start .. start + n - 1 of `slot`, into its token history (n-gram
    drafting reads it) and through the draft model into its cache, where there is one."""
    S = max_seq_len
    P = tokens.shape[0]
    pos = jnp.where(jnp.arange(P) < n, start + jnp.arange(P), S)
    history = state.history
    if history.shape[1]:
        history = history.at[slot, pos].set(tokens, mode="drop")
    state = dataclasses.replace(state, history=history)
    if draft_model is None:
        return state
    dk, dv = _draft_row(draft_model, draft_params, state, (state.draft_k, state.draft_v),
                        slot, tokens, pos)
    return dataclasses.replace(state, draft_k=dk, draft_v=dv)


class RaggedPagedKV(layer_scan.StackedStore, PageTables):
    """KVStore of the mixed step: writes each token's k, v into its row's page, then
    attends over its row's pages (`attend`; what `update` returns is unused). Under a
    scan over layers the stacked pools are the loop's carry (layer_scan.StackedStore)."""

    def __init__(self, state: PagedDecodeState, table: jax.Array, layout: RaggedLayout,
                 impl: str, ring: WindowRing | None = None):
        self.state, self.layout, self.impl = state, layout, impl
        ps = pool_shape(state.k)[2]
        W = table.shape[1]
        pos = layout.positions
        idx = jnp.where(pos >= 0, pos // ps, 0)
        writes = (pos >= 0) & (idx < W)

        def write_page(table, trash):
            return jnp.where(writes, table[layout.rows, jnp.minimum(idx, W - 1)], trash)

        self.set_tables(state.k, table, ring, write_page)
        self.write_off = jnp.where(pos >= 0, pos % ps, 0)
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []

    def update(self, layer, k, v):  # k, v [1, T, K, H]
        page, off = self.pages_of(layer)[1], self.write_off
        self.k.append(write_pages(self.state.k[layer], page, off, k[0], self.at))
        self.v.append(write_pages(self.state.v[layer], page, off, v[0], self.at))
        return k, v, self.layout.positions[None]

    def attend(self, layer, q, positions, sliding_window, softcap=None,
               sinks=None, chunk=None):  # q [1, T, N, H]
        del positions  # the layout's, with padding at -1
        lay = self.layout
        if self.impl == "pallas_tpu":
            if sinks is not None:  # resolve_attention keeps such models off the kernel
                raise ValueError("the mixed step's pallas_tpu ragged attention takes no "
                                 "attention sinks (a gpt-oss model); use the 'xla' path")
            if chunk is not None:  # nor chunked attention (resolve_attention)
                raise ValueError("the mixed step's pallas_tpu ragged attention takes no "
                                 "chunked attention (a Llama 4 model); use the 'xla' path")
            kv_lens = jnp.where(lay.q_len > 0, jnp.max(jnp.where(
                lay.rows[None, :] == jnp.arange(self.table.shape[0])[:, None],
                lay.positions[None, :] + 1, 0), axis=1), 0)
            # The kernel takes no layer index: under a scan, the layer's pools sliced out.
            k_pool, v_pool = self.layer_of(self.k, layer), self.layer_of(self.v, layer)
            out = pallas_ragged_attention(q[0], k_pool, k_pool if key_only(v_pool) else v_pool,
                                          self.pages_of(layer)[0], lay.q_len, kv_lens,
                                          sliding_window,
                                          softcap=softcap)
        else:
            # A key-only cache's (width-0) value pools: the keys are the values.
            v_pool = self.k[layer] if key_only(self.v[layer]) else self.v[layer]
            out = ragged_paged_attention(q[0], self.k[layer], v_pool, self.pages_of(layer)[0],
                                         lay.rows, lay.positions, sliding_window, softcap=softcap,
                                         layer=self.at, sinks=sinks, chunk=chunk)
        return out[None]


def mixed_step(model: Decoder, top_n: int, max_seq_len: int, impl: str,
               ring: WindowRing | None, k: int, draft_model: Decoder | None, params,
               state: PagedDecodeState, table: jax.Array, inp: MixedInputs,
               token_mask: jax.Array | None = None, draft_params=None):
    """The step of the module doc: (new state, ResultTokens). `ring`: the pages of the
    layers with a bounded reach (engines/paged_kv.py WindowRing), None: the shared pool's.
    k: drafts a verify row checks (speculative decoding), 0: none; they come from
    `draft_model` (with its `draft_params`) where given, else from the n-gram history.
    token_mask: None or i32[B, W'] each row's allowed tokens, with k: i32[B, k + 1, W']
    (module doc)."""
    S = max_seq_len
    q = None
    if draft_model is not None:
        # Drafted for the decode rows alone: the others' positions read as past the cache.
        rows = (inp.mode == MODE_DECODE) & (state.lengths < S)
        drafting = dataclasses.replace(state, lengths=jnp.where(rows, state.lengths, S))
        drafts, q, rest, dk, dv = draft_model_drafts(draft_model, k, draft_params, drafting)
        # A verify row draws with what drafting left of its key; other rows keep theirs.
        keys = jnp.where(rows[:, None], rest.sampling.key, state.sampling.key)
        state = dataclasses.replace(
            state, sampling=dataclasses.replace(state.sampling, key=keys),
            draft_k=tuple(dk), draft_v=tuple(dv))
    else:
        drafts = ngram_drafts(state.history, state.lengths, k) if k else None
    lay = ragged_layout(inp, state, S, drafts)
    kv = RaggedPagedKV(state, table, lay, impl, ring)
    positions = jnp.maximum(lay.positions, 0)[None]
    B, R = lay.last.shape
    logits = model.apply({"params": params}, lay.tokens[None], positions, kv,
                         last=lay.last.reshape(1, B * R))[0].reshape(B, R, -1)  # (B, R, V)
    first = logits[:, 0]  # a decode row's next token, a chunk's first
    chunk = inp.mode == MODE_CHUNK
    fresh = chunk & inp.fresh
    emit = jnp.where(inp.mode == MODE_DECODE, lay.decode_live, chunk & inp.sample)
    sampling = jax.tree.map(
        lambda new, old: jnp.where(fresh.reshape((B,) + (1,) * (old.ndim - 1)), new, old),
        inp.sampling, state.sampling)
    # The prompt mask gathers each chunk's tokens (repetition penalty, as prefill's).
    mask_rows = jnp.where(chunk[lay.rows] & (lay.positions >= 0), lay.rows, B)  # B: dropped
    prompt_mask = jnp.where(fresh[:, None], False, state.prompt_mask)
    prompt_mask = prompt_mask.at[mask_rows, lay.tokens].set(True, mode="drop")
    counts = jnp.where(fresh[:, None], 0, state.counts)
    cpu = model.backend.cpu_kernels
    row_mask = token_mask if token_mask is None or not k else token_mask[:, 0]
    tok, next_keys = sample(first, sampling, prompt_mask, counts, cpu_kernels=cpu,
                            token_mask=row_mask)
    if draft_model is not None:  # the chunks through the draft model, into its cache
        state = dataclasses.replace(state, **draft_chunks(draft_model, draft_params, state,
                                                          lay, inp, S))
    if k:
        return _verify_rows(lay, inp, state, drafts, q, logits, top_n, S, kv, tok, next_keys,
                            dataclasses.replace(state, sampling=sampling,
                                                prompt_mask=prompt_mask, counts=counts),
                            token_mask)
    if token_mask is not None:  # a decode row allowing nothing sits out (module doc)
        tok, emit, next_keys = hold_paused(token_mask, state.tokens, tok, emit,
                                           sampling.key, next_keys)
    lp, top_ids, top_lp = token_logprobs(first, tok, top_n, cpu_kernels=cpu)
    # A chunk that does not end its prompt leaves the slot not live to generate.
    lengths = jnp.where(inp.mode == MODE_DECODE, state.lengths + emit,
                        jnp.where(chunk, jnp.where(inp.sample, inp.start + lay.q_len, S),
                                  state.lengths))
    sampling = dataclasses.replace(
        sampling, key=jnp.where(emit[:, None], next_keys, sampling.key))
    new_state = PagedDecodeState(
        k=tuple(kv.k), v=tuple(kv.v), lengths=lengths.astype(jnp.int32),
        tokens=jnp.where(emit, tok, state.tokens), sampling=sampling,
        prompt_mask=prompt_mask,
        counts=counts.at[jnp.arange(B), tok].add(emit.astype(counts.dtype)),
        history=state.history, draft_k=state.draft_k, draft_v=state.draft_v)
    return new_state, pack_results(tok, emit, lengths + 1, lp, top_ids, top_lp)


def _verify_rows(lay: RaggedLayout, inp: MixedInputs, state: PagedDecodeState,
                 drafts: jax.Array, q: jax.Array | None, logits: jax.Array, top_n: int, S: int,
                 kv: RaggedPagedKV, tok: jax.Array, next_keys: jax.Array,
                 view: PagedDecodeState, token_mask: jax.Array | None):
    """The step's end with speculative decoding: decode rows keep what
    engines/speculative.py `verify_step` accepts of their drafts (as the paged verify
    step does), chunks that end their prompt their sampled first token `tok` (drawn with
    `next_keys`); q: a draft model's distributions of the drafts, None for n-gram ones.
    `view`: the state with the fresh rows' sampling, prompt mask and counts.
    The history (the drafts' source) gains each chunk's tokens and first token, and each
    verify row's kept tokens."""
    B, R = lay.last.shape
    chunk = inp.mode == MODE_CHUNK
    starts = chunk & inp.sample  # chunks that end their prompt: their first token
    verify = lay.decode_live
    v_tok, v_count, v_keys, v_lp, v_top, v_top_lp = verify_step(
        logits, view, drafts, top_n, q, token_mask)
    slot, v_count = advance_slots(view, v_tok, jnp.where(verify, v_count, 0), S)
    lp, top_ids, top_lp = token_logprobs(logits[:, 0], tok, top_n)
    pad = lambda a: jnp.concatenate(  # noqa: E731 -- a chunk's one token in column 0
        [a[:, None], jnp.zeros((B, R - 1) + a.shape[1:], a.dtype)], axis=1)
    col = lambda f, c: jnp.where(  # noqa: E731 -- a verify row's columns, else a chunk's
        verify.reshape((B,) + (1,) * (f.ndim - 1)), f, c)
    tokens = col(v_tok, pad(tok))
    count = jnp.where(verify, v_count, starts.astype(jnp.int32))
    lengths = jnp.where(chunk, jnp.where(inp.sample, inp.start + lay.q_len, S), slot["lengths"])
    # The chunks' tokens at their positions, and a first token at the prompt's length.
    hist_rows = jnp.where(chunk[lay.rows] & (lay.positions >= 0), lay.rows, B)
    history = slot["history"].at[hist_rows, lay.positions].set(lay.tokens, mode="drop")
    history = history.at[jnp.where(starts, jnp.arange(B), B), lengths].set(tok, mode="drop")
    keys = jnp.where(verify[:, None], v_keys,
                     jnp.where(starts[:, None], next_keys, view.sampling.key))
    new_state = PagedDecodeState(
        k=tuple(kv.k), v=tuple(kv.v), lengths=lengths.astype(jnp.int32),
        tokens=jnp.where(starts, tok, slot["tokens"]),
        sampling=dataclasses.replace(view.sampling, key=keys), prompt_mask=view.prompt_mask,
        counts=slot["counts"].at[jnp.arange(B), tok].add(starts.astype(view.counts.dtype)),
        history=history, draft_k=state.draft_k, draft_v=state.draft_v)
    return new_state, pack_results(tokens, count, lengths + 1, col(v_lp, pad(lp)),
                                   col(v_top, pad(top_ids)), col(v_top_lp, pad(top_lp)))
