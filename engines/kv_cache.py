"""Decode state, prefixes, and the KV stores the decoder writes through.

The contiguous layout: a slot's entry at index j holds sequence position j. Prefixes keep
k, v as [1, T, K, H] (as the projections make them), entry j at position j too. The decode
cache keeps each layer's keys as [B, K, H, S] and values as [B, K, S, H]: a decode step
contracts q with the keys over H and the probabilities with the values over S, and with
these layouts both are batched over (B, K) and read the cache once, in memory order. With
[B, S, K, H], XLA's CPU backend transposed the whole cache of every layer on every step
(docs/BENCHMARKS.md). Each step reads a slot's cache only up to a window: the longest live
sequence in the batch rounded up to a power of two (`window_sizes`), one compiled branch
per size, picked on the device.

`PrefillKV` and `DecodeKV` implement `engines.attention.KVStore` for the two device functions.

An int8 cache (`EngineConfig.kv_dtype="int8"`) stores each token's k and v per kv head as
int8 values with one f32 scale (max |x| over H / 127) in `k_scale`/`v_scale` [B, K, S];
the generate step dequantizes the window it attends over. Prefixes stay in the model dtype
(prefill attends over exact keys) and are quantized when inserted into a slot.

A key-only cache (multi-head latent attention, `ModelConfig.value_dim` 0) keeps v of
width 0 in prefixes and slots alike ([1, T, K, 0], [B, K, S, 0]; int8: no v_scale) and
attends with the keys as values (engines.attention.key_only).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engines import cpu_kernels, layer_scan
from engines.attention import decode_attention, key_only
from engines.engine_api import ResultTokens, pack_results
from engines.kv_quant import dequantize_kv, quantize_kv
from engines.sampling import SlotSampling, sample, token_logprobs
from engines.token_mask import hold_paused

MIN_WINDOW = 128  # smallest decode read window (engines.kv_cache.window_sizes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """A prompt's KV cache and first token, ready to be inserted into a slot."""

    k: tuple[jax.Array, ...]  # L x [1, T, K, H]
    v: tuple[jax.Array, ...]  # L x [1, T, K, H]
    k_pos: jax.Array  # i32[1, T], -1 for padding
    tokens: jax.Array  # i32[1, T] the prompt tokens, aligned with k_pos
    length: jax.Array  # i32[] tokens in the prefix (true length, all chunks)
    token: jax.Array  # i32[] the first generated token
    sampling: SlotSampling  # one row, key already advanced past the first token
    prompt_mask: jax.Array  # bool[1, V]
    # The draft model's KV of the prompt (speculative "draft:PATH:K"), as k and v; () else.
    draft_k: tuple[jax.Array, ...] = ()  # L_draft x [1, T, K_draft, H_draft]
    draft_v: tuple[jax.Array, ...] = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the generate step reads and writes, for all B slots."""

    k: tuple[jax.Array, ...]  # L x [B, K, H, S], int8 for a quantized cache
    v: tuple[jax.Array, ...]  # L x [B, K, S, H]
    k_scale: tuple[jax.Array, ...]  # L x f32[B, K, S] for an int8 cache, else ()
    v_scale: tuple[jax.Array, ...]
    lengths: jax.Array  # i32[B] tokens in each slot's cache (= position of `tokens`)
    tokens: jax.Array  # i32[B] last sampled token, fed to the next step
    sampling: SlotSampling  # per-slot parameters and RNG keys
    prompt_mask: jax.Array  # bool[B, V] tokens of the prompt (repetition penalty)
    counts: jax.Array  # i32[B, V] generated-token counts (frequency/presence penalty)
    # i32[B, S] each slot's tokens by position, up to and with `tokens` (n-gram drafting
    # of speculative decoding reads it); i32[B, 0] without speculative decoding.
    history: jax.Array
    # The draft model's cache (speculative "draft:PATH:K"), laid out as k and v and
    # following the same lengths; () without a draft model.
    draft_k: tuple[jax.Array, ...] = ()  # L_draft x [B, K_draft, H_draft, S]
    draft_v: tuple[jax.Array, ...] = ()  # L_draft x [B, K_draft, S, H_draft]


def empty_slot_fields(batch: int, max_seq_len: int, vocab_size: int,
                      history: bool = False) -> dict:
    """The per-slot fields every decode state starts with (its cache aside): empty slots
    count as full, so the step never writes into them. `history`: keep each slot's
    tokens (speculative decoding)."""
    return dict(
        lengths=jnp.full((batch,), max_seq_len, jnp.int32),
        tokens=jnp.zeros((batch,), jnp.int32),
        sampling=SlotSampling.empty(batch),
        prompt_mask=jnp.zeros((batch, vocab_size), bool),
        counts=jnp.zeros((batch, vocab_size), jnp.int32),
        history=jnp.zeros((batch, max_seq_len if history else 0), jnp.int32),
    )


def insert_history(history: jax.Array, prefix: Prefix, slot: jax.Array) -> jax.Array:
    """Writes a prefix's tokens and first generated token into a slot's history row (a
    no-op on the empty history of a state without speculative decoding)."""
    S = history.shape[1]
    if S == 0:
        return history
    idx = jnp.where(prefix.k_pos[0] >= 0, prefix.k_pos[0], S)  # padding dropped
    row = jnp.zeros((S,), history.dtype).at[idx].set(prefix.tokens[0], mode="drop")
    row = row.at[prefix.length].set(prefix.token, mode="drop")
    return jax.lax.dynamic_update_index_in_dim(history, row, slot, 0)


class PrefillKV:
    """Prefill: attend over an existing prefix (if any) and the new tokens.

    Every prefix keeps the entry of position j at index j (padding: k_pos -1). The new
    tokens' entries go to their positions, start onward: after an existing prefix, into
    its arrays, which the caller sized to hold them (`grow_prefix`), so a continued prefix
    keeps a power-of-two length and chunked prefill compiles a few shapes, not one per
    chunk.
    """

    def __init__(self, new_k_pos: jax.Array, existing: Prefix | None,
                 start: jax.Array | int = 0):
        self.new_k_pos = new_k_pos  # i32[B, T]
        self.existing = existing
        self.start = start  # i32[] the existing prefix's length
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []

    def _place(self, old: jax.Array, new: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), self.start, 1)

    def update(self, layer, k, v):
        if self.existing is not None:
            k = self._place(self.existing.k[layer], k)
            v = self._place(self.existing.v[layer], v)
        self.k.append(k)
        self.v.append(v)
        return k, v, self.k_pos

    @property
    def k_pos(self) -> jax.Array:
        if self.existing is None:
            return self.new_k_pos
        return self._place(self.existing.k_pos, self.new_k_pos)

    # Under a scan over layers (engines/layer_scan.py): nothing carried; an existing
    # prefix's k, v go in stacked and each layer's k, v come out stacked, then split
    # back into the per-layer tuples prefixes keep.
    def scan_init(self):
        if self.existing is None:
            return None, None
        return None, (jnp.stack(self.existing.k), jnp.stack(self.existing.v))

    def scan_layer(self, carry, xs, i):
        del carry, i
        return _PrefillLayer(self, xs)

    def scan_finish(self, carry, ys):
        self.k, self.v = list(ys[0]), list(ys[1])


class _PrefillLayer:
    """PrefillKV's store for one layer under a scan: xs, that layer's slice of the
    existing prefix (k, v) or None."""

    def __init__(self, parent: PrefillKV, xs):
        self.parent, self.xs, self.out = parent, xs, None

    def update(self, layer, k, v):
        del layer  # the scan's layer: xs is its slice
        if self.xs is not None:
            k, v = self.parent._place(self.xs[0], k), self.parent._place(self.xs[1], v)
        self.out = (k, v)
        return k, v, self.parent.k_pos

    def scan_carry(self):
        return None

    def scan_ys(self):
        return self.out


def grow_prefix(prefix: Prefix, capacity: int) -> Prefix:
    """The prefix with its arrays padded to `capacity` entries (k_pos -1 for the new ones)."""
    extra = capacity - prefix.k_pos.shape[1]

    def pad(x, value=0):
        return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    return dataclasses.replace(prefix, k=tuple(map(pad, prefix.k)), v=tuple(map(pad, prefix.v)),
                               k_pos=pad(prefix.k_pos, -1), tokens=pad(prefix.tokens),
                               draft_k=tuple(map(pad, prefix.draft_k)),
                               draft_v=tuple(map(pad, prefix.draft_v)))


def window_sizes(S: int, first: int = MIN_WINDOW) -> tuple[int, ...]:
    """The decode read windows of a cache of S entries: `first`, doubling, then S
    (as well: a mixed step's token buckets, engines/mixed_batch.py)."""
    sizes = []
    w = first
    while w < S:
        sizes.append(w)
        w *= 2
    return (*sizes, S)


class DecodeKV(layer_scan.StackedStore):
    """Generate: write each slot's new k, v at its own position, attend over its row.

    Attention reads the first W entries of every slot, W the smallest of window_sizes(S)
    that holds every live slot's position; slots that are not live (length S) do not widen
    it, and their outputs are not used. With `cpu_attention` (the engine's choice, on one
    CPU device: engines.cpu_kernels) a decode step's attention over a float32 cache runs
    on the CPU kernel instead, which reads each live slot's own entries only.
    """

    def __init__(self, state: DecodeState, pos: jax.Array, cpu_attention: bool = False):
        self.state = state
        self.cpu_attention = cpu_attention
        # i32[B]: one token per slot; i32[B, T]: T consecutive positions per slot
        # (speculative verification; positions past the cache are not written).
        self.pos = pos
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []
        self.k_scale: list[jax.Array] = []
        self.v_scale: list[jax.Array] = []
        S = state.k[0].shape[-1]
        j = jnp.arange(S)[None, :]
        last = pos if pos.ndim == 1 else pos[:, -1]
        self.k_pos = jnp.where(j <= last[:, None], j, -1)  # (B, S)
        self.sizes = window_sizes(S)
        end = last + 1 if pos.ndim == 1 else jnp.minimum(last + 1, S)
        live = jnp.max(jnp.where(state.lengths < S, end, 1))
        # The CPU attention kernel's positions: each slot's, or -1 where it is not live.
        self.live_pos = jnp.where(state.lengths < S, pos, -1) if pos.ndim == 1 else None
        self.window = jnp.searchsorted(jnp.asarray(self.sizes), live)  # index into sizes

    def update(self, layer, k, v):
        """Writes the new k, v; returns the protocol's [B, S, K, H] views (the model
        attends through `attend`, so XLA drops them)."""
        rows = jnp.arange(k.shape[0])
        st = self.state
        if self.pos.ndim == 1:
            k, v, drop = k[:, 0], v[:, 0], {}
        else:  # [B, T] positions: the new entries index as [B, T, ...]
            rows, drop = rows[:, None], {"mode": "drop"}
        at = () if self.at is None else (self.at,)  # a stack's layer, written in place
        every = slice(None)
        k_at, v_at = (*at, rows, every, every, self.pos), (*at, rows, every, self.pos)
        if st.k_scale:  # int8 cache: store quantized, attend over the dequantized window
            kq, ks = quantize_kv(k)
            self.k.append(st.k[layer].at[k_at].set(kq, **drop))
            self.k_scale.append(st.k_scale[layer].at[v_at].set(ks, **drop))
            if st.v_scale:
                vq, vs = quantize_kv(v)
                self.v.append(st.v[layer].at[v_at].set(vq, **drop))
                self.v_scale.append(st.v_scale[layer].at[v_at].set(vs, **drop))
            else:  # key-only: no values (width 0), no scales
                self.v.append(st.v[layer])
        else:
            self.k.append(st.k[layer].at[k_at].set(k, **drop))  # (B, K, H, S)
            self.v.append(st.v[layer].at[v_at].set(v, **drop))  # (B, K, S, H)
        k_all, v_all = self._read(layer, self.sizes[-1], k.dtype)
        return jnp.transpose(k_all, (0, 3, 1, 2)), jnp.transpose(v_all, (0, 2, 1, 3)), self.k_pos

    # Under a scan over layers the stacked cache [L, ...] is the loop's carry
    # (layer_scan.StackedStore): layer i's store writes its entries into the stack at
    # layer i and the CPU attention kernel reads them there.

    def _read(self, layer, w, dtype):
        """The first w entries of this layer's keys [B, K, H, w] and values [B, K, w, H]
        (of the step's B slots: the first B of the cache's, engines.kv_cache.first_slots)."""
        B = self.state.lengths.shape[0]
        k, v = self.layer_of(self.k, layer)[:B, ..., :w], self.layer_of(self.v, layer)[:B, :, :w]
        if self.k_scale:
            k_scale = self.layer_of(self.k_scale, layer)[:B]
            k = (k.astype(jnp.float32) * k_scale[:, :, None, :w]).astype(dtype)
            v = (dequantize_kv(v, self.layer_of(self.v_scale, layer)[:B, :, :w], dtype)
                 if self.v_scale else v.astype(dtype))  # key-only: no values to scale
        return k, v

    def attend(self, layer, q, positions, sliding_window, softcap=None, sinks=None,
               chunk=None):
        # The CPU kernel takes no soft cap, attention sinks, chunked attention nor a
        # key-only cache (it reads values in their own layout): those take XLA's.
        if (self.cpu_attention and self.live_pos is not None and not self.k_scale
                and softcap is None and sinks is None and chunk is None
                and not key_only(self.v[layer])
                and q.dtype == self.k[layer].dtype == jnp.float32):
            return cpu_kernels.decode_attention(q, self.k[layer], self.v[layer], self.live_pos,
                                                sliding_window, layer=self.at)

        def within(w):
            def branch(q):
                k, v = self._read(layer, w, q.dtype)
                return decode_attention(q, k, v, positions, self.k_pos[:, :w], sliding_window,
                                        softcap, sinks, chunk)
            return branch

        branches = [within(w) for w in self.sizes]
        if len(branches) == 1:
            return branches[0](q)
        return jax.lax.switch(self.window, branches, q)


def insert_prefix(prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
    """Scatters a prefix into one slot's rows; other slots are untouched."""
    S = state.k[0].shape[-1]
    # Each prefix entry goes to the index of its position; padding (-1) is dropped.
    idx = jnp.where(prefix.k_pos[0] >= 0, prefix.k_pos[0], S)  # (T,)

    def put_k(cache, new):  # cache [B, K, H, S], new [1, T, K, H]
        return cache.at[slot, :, :, idx].set(new[0], mode="drop")

    def put(cache, new):  # cache [B, K, S, H] (or scales [B, K, S]), new [1, T, K, ...]
        return cache.at[slot, :, idx].set(new[0], mode="drop")

    kq, vq, k_scale, v_scale = prefix.k, prefix.v, (), ()
    if state.k_scale:
        kq, ks = zip(*map(quantize_kv, prefix.k), strict=True)
        k_scale = put_layers(put, state.k_scale, ks)
    if state.v_scale:  # int8 but key-only: none
        vq, vs = zip(*map(quantize_kv, prefix.v), strict=True)
        v_scale = put_layers(put, state.v_scale, vs)

    return DecodeState(
        k=put_layers(put_k, state.k, kq),
        # A key-only cache's values (width 0, no scales) have nothing to write.
        v=state.v if key_only(state.v[0]) else put_layers(put, state.v, vq),
        k_scale=k_scale,
        v_scale=v_scale,
        **insert_slot_fields(state, prefix, slot),
    )


SLOT_FIELDS = ("lengths", "tokens", "sampling", "prompt_mask", "counts", "history")


def first_slots(state: DecodeState, rows: int) -> DecodeState:
    """A step's view of the first `rows` slots: their per-slot fields, and the whole cache
    (DecodeKV writes and reads rows 0 .. rows - 1 of it in place)."""
    return dataclasses.replace(state, **{
        f: jax.tree.map(lambda a: a[:rows], getattr(state, f)) for f in SLOT_FIELDS})


def with_first_slots(state: DecodeState, stepped: DecodeState) -> DecodeState:
    """`state` after a step over its first slots (`stepped`, from first_slots): the
    stepped cache, and the stepped per-slot fields written over the first rows."""
    put = lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b, 0, 0)  # noqa: E731
    return dataclasses.replace(stepped, **{
        f: jax.tree.map(put, getattr(state, f), getattr(stepped, f)) for f in SLOT_FIELDS})


# Each cache field's per-layer rank; a scanned model's stack [L, ...] has one more.
CACHE_RANKS = {"k": 4, "v": 4, "k_scale": 3, "v_scale": 3, "draft_k": 4, "draft_v": 4}


def move_slot(state: DecodeState, src: jax.Array, dst: jax.Array) -> DecodeState:
    """Slot `src`'s cache and fields copied into slot `dst` (src keeps its copy; the caller
    frees it): a running sequence moved to a lower slot, so the slots in use stay few
    and low and a step over the first ones holds them (first_slots)."""
    def move(a, axis):
        row = jax.lax.dynamic_slice_in_dim(a, src, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(a, row, dst, axis)

    fields = {f: jax.tree.map(lambda a: move(a, 0), getattr(state, f)) for f in SLOT_FIELDS}
    for f, rank in CACHE_RANKS.items():
        cache = getattr(state, f)
        axis = 1 if layer_scan.is_stacked(cache, rank) else 0
        fields[f] = tuple(move(a, axis) for a in cache)
    return dataclasses.replace(state, **fields)


def insert_slot_fields(state, prefix: Prefix, slot: jax.Array) -> dict:
    """A prefix's per-slot fields (length, last token, sampling row, prompt mask, token
    counts, history) and draft KV, written into one slot's rows of a decode state of
    either layout (contiguous here, paged in engines/paged_kv.py): what every layout
    shares besides its own cache."""

    def row(arr, value):
        return jax.lax.dynamic_update_index_in_dim(arr, value.astype(arr.dtype), slot, 0)

    V = state.counts.shape[1]
    first = jax.nn.one_hot(prefix.token, V, dtype=state.counts.dtype)
    return dict(
        lengths=row(state.lengths, prefix.length),
        tokens=row(state.tokens, prefix.token),
        sampling=jax.tree.map(lambda a, p: row(a, p[0]), state.sampling, prefix.sampling),
        prompt_mask=row(state.prompt_mask, prefix.prompt_mask[0]),
        counts=row(state.counts, first),
        history=insert_history(state.history, prefix, slot),
        **insert_draft(state, prefix, slot),
    )


def step_slot_fields(state, logits: jax.Array, valid: jax.Array, top_n: int,
                     cpu_kernels: bool, token_mask: jax.Array | None = None,
                     pause: bool = False) -> tuple[dict, ResultTokens]:
    """One decode step's token per slot from its logits f32[B, V] (valid bool[B]: slots
    with room; a full slot keeps its length and counts): the per-slot fields after the
    step, for a decode state of either layout, and the step's packed results.
    token_mask: None or i32[B, W] each slot's allowed tokens (engines/token_mask.py);
    `pause`: a slot whose row allows nothing sits the step out (token_mask.hold_paused)."""
    tok, next_keys = sample(logits, state.sampling, state.prompt_mask, state.counts,
                            cpu_kernels=cpu_kernels, token_mask=token_mask)
    if token_mask is not None and pause:
        tok, valid, next_keys = hold_paused(token_mask, state.tokens, tok, valid,
                                            state.sampling.key, next_keys)
    lp, top_ids, top_lp = token_logprobs(logits, tok, top_n, cpu_kernels=cpu_kernels)
    B = tok.shape[0]
    lengths = jnp.where(valid, state.lengths + 1, state.lengths)
    fields = dict(
        lengths=lengths, tokens=tok,
        sampling=dataclasses.replace(state.sampling, key=next_keys),
        prompt_mask=state.prompt_mask,
        counts=state.counts.at[jnp.arange(B), tok].add(valid.astype(jnp.int32)),
        history=state.history,
    )
    return fields, pack_results(tok, valid, lengths + 1, lp, top_ids, top_lp)


def put_layers(put, caches: tuple, news: tuple) -> tuple:
    """put(cache, new) of each layer's new entries [1, T, ...] into a decode cache field:
    L per-layer arrays, or one stacked [L, ...] (a scanned model's), written as one
    batched scatter."""
    if layer_scan.is_stacked(caches, news[0].ndim):
        return (jax.vmap(put)(caches[0], jnp.stack(news)),)
    return tuple(put(c, n) for c, n in zip(caches, news, strict=True))


def insert_draft(state, prefix: Prefix, slot: jax.Array) -> dict:
    """The draft model's cache (contiguous, in either decode layout) with a prefix's draft
    KV scattered into one slot's rows: draft_k and draft_v ({} parts for no draft)."""
    S = state.draft_k[0].shape[-1] if state.draft_k else 0
    idx = jnp.where(prefix.k_pos[0] >= 0, prefix.k_pos[0], S)  # (T,)
    if not state.draft_k:
        return dict(draft_k=(), draft_v=())
    return dict(
        draft_k=put_layers(lambda c, n: c.at[slot, :, :, idx].set(n[0], mode="drop"),
                           state.draft_k, prefix.draft_k),
        draft_v=put_layers(lambda c, n: c.at[slot, :, idx].set(n[0], mode="drop"),
                           state.draft_v, prefix.draft_v),
    )

