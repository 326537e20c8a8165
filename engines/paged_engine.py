"""The transformer engine with a paged KV cache (`EngineConfig(kv_layout="paged")`).

Same Engine contract and prefill as the contiguous engine; the decode state keeps each
layer's KV in a page pool (engines/paged_kv.py). The engine holds the pool's geometry
only (`page_geometry`); which pages each slot holds is decided on the host
(jetserve/scheduling/page_pool.py, planned per call by jetserve/scheduling/page_planner.py)
and passed in: insert takes the slot's pages, generate the page table of the step.

With the layers under a scan (EngineConfig.layers, engines/layer_scan.py) each of k and
v is one pool stacked [L, K, P + 1, ps, H], carried through the scan by generate, the
mixed step and insert, which write their pages into it in place.

Programs: prefill as the contiguous engine (one per bucket); insert one per prefix bucket;
generate one per page-table width W (the planner uses powers of two up to
ceil(max_seq_len / page_size)): a batch of short sequences reads few pages.

`mixed_step` runs decode rows and chunks of prompts as one ragged step over the pages
(engines/mixed_step.py documents the call): one program per token bucket
(`mixed_token_buckets`) and page-table width, and for decode rows alone generate's
program masked to the rows (`_decode_rows_paged`), one per width; each once more for
steps given a token mask (structured output).

With speculative decoding (`EngineConfig.speculative`) generate is the verify step of
engines/speculative.py over the gathered pages (never the TPU kernel, which takes one
query per slot). The page table of a step covers positions up to length + K of each
slot; how many a slot kept is the host's to read back (the planner does, before it plans
the next step), never the engine's. A draft model
("draft:PATH:K") keeps its own cache contiguous in the decode state (draft_k / draft_v,
as the contiguous engine's), carried by prefill and insert.

Concurrency: the engine keeps no per-slot host state; its functions may run from any
thread (the decode state is donated: one caller at a time per state).
`engines.create_engine(..., config=EngineConfig(kv_layout="paged"))` builds this class.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engines import layer_scan
from engines.engine_api import PageGeometry, ResultTokens, pack_results
from engines.kv_cache import Prefix, empty_slot_fields, step_slot_fields
from engines.kv_quant import entry_width
from engines.mixed_batch import MixedRow, pack_rows, token_buckets
from engines.mixed_step import fill_context, mixed_step
from engines.model import Decoder
from engines.paged_kv import (
    PagedDecodeKV,
    PagedDecodeState,
    WindowRing,
    insert_paged,
    resolve_attention,
)
from engines.prefix_blocks import blocks_of_pages, stack_size
from engines.speculative import advance_slots, draft_model_drafts, ngram_drafts, verify_step
from engines.token_mask import mask_words
from engines.transformer_engine import TransformerEngine
from sharding import axes, traced_under

POOL_AXES = (axes.CACHE_HEADS, None, None, axes.HEAD_DIM)  # [K, P+1, ps, H]


def generate_paged(model: Decoder, top_n: int, max_seq_len: int, impl: str,
                   ring: WindowRing | None, params, state: PagedDecodeState, table,
                   token_mask=None):
    """One decode step; table i32[B, W] is each slot's first W pages (trash-padded);
    token_mask None or i32[B, W'] allowed tokens (engines/token_mask.py). A slot whose row
    allows nothing sits the step out (token_mask.hold_paused); the page planner, which
    sees the same mask on the host, keeps its length (SlotPages.after_step)."""
    S = max_seq_len
    valid = state.lengths < S
    pos = jnp.minimum(state.lengths, S - 1)  # (B,)
    kv = PagedDecodeKV(state, table, pos, valid, impl, ring)
    logits = model.apply({"params": params}, state.tokens[:, None], pos[:, None], kv)[:, 0]
    slot, results = step_slot_fields(state, logits, valid, top_n, model.backend.cpu_kernels,
                                     token_mask, pause=True)
    return PagedDecodeState(k=tuple(kv.k), v=tuple(kv.v), **slot), results


def _decode_rows_paged(generate, max_seq_len: int, params, state: PagedDecodeState, table,
                       rows, token_mask=None, *draft):
    """The mixed step of decode rows alone (rows bool[B]: the slots in a decode row): the
    generate step `generate` (params, state, table, token_mask) over those slots, the
    same program and attention generate takes (the verify step with speculative
    decoding), with its token_mask (a row allowing nothing sits out) and a draft model's
    parameters if any; the slots in no row (their lengths read as full) are left
    bit-identical."""
    S = max_seq_len
    lengths = jnp.where(rows, state.lengths, S)
    new, results = generate(params, dataclasses.replace(state, lengths=lengths), table,
                            token_mask, *draft)
    ran = lengths < S
    keep = lambda new_f, old_f: jnp.where(  # noqa: E731
        ran.reshape((-1,) + (1,) * (old_f.ndim - 1)), new_f, old_f)
    return dataclasses.replace(
        new, lengths=keep(new.lengths, state.lengths), tokens=keep(new.tokens, state.tokens),
        sampling=dataclasses.replace(new.sampling, key=keep(new.sampling.key,
                                                            state.sampling.key))), results


def generate_paged_speculative(model: Decoder, top_n: int, max_seq_len: int, k: int,
                               draft_model: Decoder | None, ring: WindowRing | None, params,
                               state: PagedDecodeState, table, token_mask=None,
                               draft_params=None):
    """The verify step of engines.speculative over pages: table i32[B, W] covers every
    position up to length + k of each live slot (SlotPages.lookahead). The drafts come
    from the sequence's own tokens, or from `draft_model` (whose cache is contiguous);
    token_mask None or i32[B, k+1, W] (engines/speculative.py)."""
    S = max_seq_len
    if draft_model is None:
        drafts, q, rest = ngram_drafts(state.history, state.lengths, k), None, state
        dk, dv = state.draft_k, state.draft_v
    else:
        drafts, q, rest, dk, dv = draft_model_drafts(draft_model, k, draft_params, state)
    inp = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
    positions = state.lengths[:, None] + jnp.arange(k + 1)[None, :]
    kv = PagedDecodeKV(state, table, positions, state.lengths < S, "xla", ring)
    logits = model.apply({"params": params}, inp, positions, kv)  # (B, k+1, V)
    tokens, count, next_keys, lp, top_ids, top_lp = verify_step(logits, rest, drafts, top_n, q,
                                                                token_mask)
    slot, count = advance_slots(state, tokens, count, S)
    new_state = PagedDecodeState(
        k=tuple(kv.k), v=tuple(kv.v), sampling=dataclasses.replace(state.sampling, key=next_keys),
        prompt_mask=state.prompt_mask, draft_k=tuple(dk), draft_v=tuple(dv), **slot)
    return new_state, pack_results(tokens, count, slot["lengths"] + 1, lp, top_ids, top_lp)


def window_ring(model_config, config, geometry: PageGeometry) -> WindowRing | None:
    """The ring pages of the layers with a bounded reach (a sliding window, an attention
    chunk: engines/paged_kv.py WindowRing), where it holds fewer pages than the shared
    pool (at short max_seq_len a ring per slot could hold more); None: every layer in
    the shared pool. A step writes at most a prompt chunk or k + 1 positions per slot."""
    c = model_config
    reaches = tuple(c.layer_reach(i) for i in range(c.num_layers))
    span = max(config.max_prefill_length, config.spec.k + 1)
    ring = WindowRing.plan(reaches, span, config.page_size, config.max_concurrent_decodes)
    if ring is None or ring.num_pages >= geometry.num_pages:
        return None
    return ring


class PagedTransformerEngine(TransformerEngine):
    """TransformerEngine whose decode state is a page pool per layer (see module doc)."""

    KV_LAYOUT = "paged"

    def __init__(self, model_config, **kwargs):
        config = kwargs.get("config")
        if config is None or config.kv_layout != "paged":
            raise ValueError("PagedTransformerEngine needs config=EngineConfig(kv_layout='paged')")
        B, S, ps = config.max_concurrent_decodes, config.max_seq_len, config.page_size
        spec = config.spec
        geometry = PageGeometry(slots=B, page_size=ps, max_seq_len=S,
                                num_pages=config.num_pages, lookahead=spec.k)
        self.ring = window_ring(model_config, config, geometry)
        self._geometry = dataclasses.replace(
            geometry, ring_pages=self.ring.pages if self.ring else 0,
            ring_layers=sum(self.ring.layers) if self.ring else 0)
        super().__init__(model_config, **kwargs)
        self._geometry = dataclasses.replace(self._geometry, **self._kv_bytes())

    # ---- layout ------------------------------------------------------------------------

    def _pool_shape(self, layer: int, values: bool = False) -> tuple[int, int, int, int]:
        """Layer `layer`'s key pool shape, or with `values` its value pool's (entries of
        width 0 for a key-only cache: ModelConfig.value_dim): the ring's pages for a
        layer in the ring, else the shared pool's."""
        c = self.model_config
        g = self.page_geometry
        pages = self.ring.num_pages if self.ring and self.ring.holds(layer) else g.num_pages
        return (c.num_kv_heads, pages + 1, g.page_size,
                entry_width(c.value_dim if values else c.head_dim, self.config.kv_dtype))

    def _kv_bytes(self) -> dict:
        """PageGeometry's page_bytes and ring_bytes: what the pools hold on the device,
        trash pages aside."""
        c, g = self.model_config, self.page_geometry
        entry = sum(math.prod(self._pool_shape(0, values)[2:]) for values in (False, True))
        entry *= c.num_kv_heads * np.dtype(self._pool_dtype()).itemsize  # one page, one layer
        ring = g.ring_layers * self.ring.num_pages * entry if self.ring else 0
        return dict(page_bytes=(c.num_layers - g.ring_layers) * entry, ring_bytes=ring)

    def _pool_dtype(self):
        return jnp.int8 if self.config.kv_dtype == "int8" else self.dtype

    def decode_state_shardings(self) -> PagedDecodeState:
        base = super().decode_state_shardings()
        c = self.model_config
        L = c.num_layers
        k = tuple(self._named(POOL_AXES, self._pool_shape(i), "kv page pool") for i in range(L))
        v = tuple(self._named(POOL_AXES, self._pool_shape(i, values=True), "value page pool")
                  for i in range(L))
        return layer_scan.stack_cache(PagedDecodeState(
            k=k, v=v, lengths=base.lengths, tokens=base.tokens,
            sampling=base.sampling, prompt_mask=base.prompt_mask, counts=base.counts,
            history=base.history, draft_k=base.draft_k, draft_v=base.draft_v), c.scan_layers)

    def _build_jits(self):
        # The decode step's attention path, once the backend is known (the CPU kernels).
        # The kernels attend one query per slot: verify steps take the gather path.
        c, devices = self.model_config, self._mesh.devices.flat
        self.attention_impl = "xla" if self.config.spec.enabled else resolve_attention(
            self.config.paged_attention, devices[0].platform, c.sliding_window,
            self._mesh.devices.size, c.attn_logit_softcap, self.config.kv_dtype,
            c.attn_sinks, c.attention_chunk_size, cpu_kernels=self.backend.cpu_kernels)
        super()._build_jits()  # prefill and prompt log-probs as the contiguous engine
        state_sh = self.decode_state_shardings()
        prefix_sh = self.prefix_destination_sharding()
        r = self._replicated()
        laid_out = functools.partial(traced_under, self.sharding, self._mesh)
        self._insert_jit = jax.jit(
            self._counted("insert", functools.partial(insert_paged, ring=self.ring)),
            in_shardings=(prefix_sh, state_sh, r, r),
            out_shardings=state_sh, donate_argnums=(1,),
        )
        draft_model = self._draft.model if self._draft else None
        draft_sh = (self._draft.param_shardings,) if self._draft else ()  # _draft_args()
        gen = self.generate_step(self.model, draft_model)
        self._generate_jit = jax.jit(
            self._counted("generate", laid_out(gen)),
            in_shardings=(self.param_shardings, state_sh, r, r, *draft_sh),
            out_shardings=(state_sh, r),
            donate_argnums=(1,),
        )
        self._blocks_of_pages_jit = jax.jit(functools.partial(blocks_of_pages,
                                                              dtype=self.dtype))
        self.traces["mixed"] = 0
        self._mixed_jit = jax.jit(
            self._counted("mixed", laid_out(self.mixed_step_fn(self.model))),
            in_shardings=(self.param_shardings, state_sh, r, r, r, *draft_sh),  # r: token_mask
            out_shardings=(state_sh, r),
            donate_argnums=(1,),
        )
        # A prefix-cache hit's tokens into the history and a draft's cache (fill_context).
        self._context_jit = jax.jit(
            self._counted("mixed", laid_out(functools.partial(
                fill_context, self._draft.model if self._draft else None,
                self.config.max_seq_len))),
            in_shardings=(state_sh, r, r, r, r, *draft_sh), out_shardings=state_sh,
            donate_argnums=(0,))
        # A step of decode rows alone: one program per width, counted with the mixed ones.
        self._decode_rows_jit = jax.jit(
            self._counted("mixed", laid_out(self.decode_rows_fn(self.model))),
            in_shardings=(self.param_shardings, state_sh, r, r, r, *draft_sh),
            out_shardings=(state_sh, r),
            donate_argnums=(1,),
        )

    def mixed_step_fn(self, model: Decoder):
        """The mixed step's function over `model`, called as (params, state, table,
        MixedInputs, token_mask, *draft params): the TPU kernel where the decode step
        takes its own, else XLA's."""
        ragged = "pallas_tpu" if self.attention_impl == "pallas_tpu" else "xla"
        return functools.partial(mixed_step, model, self.config.top_logprobs,
                                 self.config.max_seq_len, ragged, self.ring,
                                 self._mixed_drafts(), self._draft.model if self._draft else None)

    def decode_rows_fn(self, model: Decoder):
        """The step of decode rows alone over `model`, called as (params, state, table,
        rows bool[B], token_mask, *draft params)."""
        return functools.partial(_decode_rows_paged, self.generate_step(
            model, self._draft.model if self._draft else None), self.config.max_seq_len)

    def _mixed_drafts(self) -> int:
        """Drafts a mixed step's verify rows check: K with speculative decoding, else 0."""
        spec = self.config.spec
        return spec.k if spec.enabled else 0

    def generate_step(self, model: Decoder, draft_model: Decoder | None):
        """generate's function over `model` (the verify step with speculative decoding),
        called as (params, state, table, token_mask, *draft params)."""
        top_n, spec, S = self.config.top_logprobs, self.config.spec, self.config.max_seq_len
        if spec.enabled:
            return functools.partial(generate_paged_speculative, model, top_n, S, spec.k,
                                     draft_model, self.ring)
        return functools.partial(generate_paged, model, top_n, S, self.attention_impl,
                                 self.ring)

    # ---- Engine API --------------------------------------------------------------------

    def init_decode_state(self) -> PagedDecodeState:
        """An empty state (the host's page table starts empty with it)."""
        c, e = self.model_config, self.config
        B, S = e.max_concurrent_decodes, e.max_seq_len
        L = c.num_layers

        def make():
            zeros = lambda i, values: jnp.zeros(self._pool_shape(i, values),  # noqa: E731
                                                self._pool_dtype())
            return layer_scan.stack_cache(PagedDecodeState(
                k=tuple(zeros(i, False) for i in range(L)),
                v=tuple(zeros(i, True) for i in range(L)),
                **empty_slot_fields(B, S, c.vocab_size, history=e.spec.enabled),
                **self._empty_draft_cache(),
            ), c.scan_layers)

        return jax.jit(make, out_shardings=self.decode_state_shardings())()

    def insert(self, prefix: Prefix, decode_state: PagedDecodeState, slot: int, *,
               pages: Sequence[int], shared: int = 0) -> PagedDecodeState:
        """Writes a prefix into `pages` (the slot's pages in position order, as the host
        gave them). shared: how many of the first pages already hold the prefix's first
        shared * page_size positions (a prefix cache hit); they are linked, never written.
        """
        return self._insert_jit(prefix, decode_state, np.int32(slot),
                                self._page_array(prefix, pages, shared))

    def _page_array(self, prefix: Prefix, pages: Sequence[int], shared: int) -> np.ndarray:
        """insert's pages as its program takes them: i32[ceil(T / ps)], trash-padded, the
        `shared` first ones past the pool (linked, never written)."""
        trash = self.page_geometry.trash
        T = prefix.k[0].shape[1]
        arr = np.full((-(-T // self.page_geometry.page_size),), trash, np.int32)
        arr[: len(pages)] = pages
        arr[:shared] = trash + 1  # past the pool: the write is dropped
        return arr

    def page_blocks(self, decode_state: PagedDecodeState, pages: Sequence[int]) -> jax.Array:
        """The KV of `pages` as prefix-cache blocks: a stack [stack_size(n), L, 2, ps, K, H]
        (padding reads the trash page). Not with a ring: its layers keep no pages behind
        their reach, so a page of the shared pool is not a block of every layer."""
        if self.ring is not None:
            raise ValueError("the KV of shared pages is not every layer's where layers with "
                             "a sliding window keep a ring of pages (a prefix cache keeps "
                             "blocks of its own for such a model)")
        idx = np.full((stack_size(len(pages)),), self.page_geometry.trash, np.int32)
        idx[: len(pages)] = pages
        return self._blocks_of_pages_jit(decode_state.k, decode_state.v, idx)

    def generate(self, params, decode_state: PagedDecodeState, page_table: np.ndarray,
                 token_mask: np.ndarray | None = None) -> tuple[PagedDecodeState, ResultTokens]:
        """One step; page_table i32[B, W]: each slot's first W pages, the pages this step
        writes included (entries a slot does not hold point at the trash page);
        token_mask as TransformerEngine.generate's."""
        return self._generate_jit(self._in_layout(params), decode_state, page_table,
                                  token_mask, *self._draft_args())

    def mixed_step(self, params, decode_state: PagedDecodeState, page_table: np.ndarray,
                   rows: Sequence[MixedRow], token_mask: np.ndarray | None = None,
                   **program) -> tuple[PagedDecodeState, ResultTokens]:
        """One ragged step of decode rows and prompt chunks (engines/mixed_step.py);
        page_table i32[B, W] as generate's, covering every position the rows write;
        token_mask None or i32[B, W'] each row's allowed tokens (engines/token_mask.py).
        `program`: a subclass's choice of program (`_run_mixed`; a LoRA engine's)."""
        table = np.asarray(page_table, np.int32)
        g = self.page_geometry
        max_w = -(-g.max_seq_len // g.page_size)
        if table.ndim != 2 or table.shape[0] != g.slots or not 1 <= table.shape[1] <= max_w:
            raise ValueError(f"page_table must be i32[{g.slots}, W] with 1 <= W <= {max_w}, "
                             f"got shape {table.shape}")
        longest = max((len(r.chunk) for r in rows), default=0)
        if self.ring is not None and longest > self.config.max_prefill_length:
            raise ValueError(f"a chunk of {longest} tokens: with sliding layers' rings of "
                             f"pages a mixed step's chunk is at most max_prefill_length "
                             f"({self.config.max_prefill_length}) tokens")
        if token_mask is not None:
            token_mask = self._mixed_mask(token_mask, rows)
        for r in rows:
            if r.context and self._mixed_drafts():
                decode_state = self._fill_context(decode_state, r)
        if all(r.decode for r in rows):  # no chunk: the generate step's program
            pack_rows(rows, slots=g.slots, max_seq_len=g.max_seq_len,  # the rows' checks
                      buckets=self.mixed_token_buckets, decode_tokens=self._mixed_drafts() + 1)
            live = np.zeros((g.slots,), bool)
            live[[r.slot for r in rows]] = True
            return self._run_mixed(params, decode_state, table, live, rows, token_mask,
                                   **program)
        inputs = pack_rows(rows, slots=g.slots, max_seq_len=g.max_seq_len,
                           buckets=self.mixed_token_buckets,
                           decode_tokens=self._mixed_drafts() + 1)
        return self._run_mixed(params, decode_state, table, inputs, rows, token_mask,
                               **program)

    def _fill_context(self, decode_state: PagedDecodeState, row: MixedRow):
        """A row's prefix-cache hit tokens (MixedRow.context) into the slot's history and
        a draft model's cache, max_prefill_length tokens a call (one program)."""
        P, ctx = self.config.max_prefill_length, np.asarray(row.context, np.int32)
        for at in range(0, len(ctx), P):
            piece = np.zeros((P,), np.int32)
            n = len(ctx[at:at + P])
            piece[:n] = ctx[at:at + P]
            decode_state = self._context_jit(decode_state, np.int32(row.slot), np.int32(at),
                                             piece, np.int32(n), *self._draft_args())
        return decode_state

    def _run_mixed(self, params, decode_state, table, inputs, rows, token_mask):
        """The mixed step's program on its inputs: MixedInputs, or bool[B] (the slots of
        decode rows alone: the generate step's program); `rows` as mixed_step's."""
        del rows  # a LoRA engine's (engines/lora_engine.py) read their adapters
        jit = self._decode_rows_jit if isinstance(inputs, np.ndarray) else self._mixed_jit
        return jit(self._in_layout(params), decode_state, table, inputs, token_mask,
                   *self._draft_args())

    def _mixed_mask(self, token_mask: np.ndarray, rows: Sequence[MixedRow]) -> np.ndarray:
        """mixed_step's token_mask checked: i32[B, W'], and some token allowed to every
        chunk that ends its prompt (only a decode row can sit a step out)."""
        mask = np.asarray(token_mask)
        k = self._mixed_drafts()
        want = (self.page_geometry.slots, *((k + 1,) if k else ()), mask_words(self.vocab_size))
        if mask.shape != want or mask.dtype != np.int32:
            raise ValueError(f"token_mask must be i32{list(want)} (one packed row per slot"
                             f"{', one per verify position' if k else ''}), "
                             f"got {mask.dtype}{list(mask.shape)}")
        empty = [r.slot for r in rows if r.last and not (mask[r.slot, 0] if k else
                                                         mask[r.slot]).any()]
        if empty:
            raise ValueError(f"token_mask allows no token to slot {empty[0]}, whose chunk "
                             "ends its prompt and must sample its first token")
        return mask

    @property
    def mixed_token_buckets(self) -> tuple[int, ...]:
        """The token counts a mixed step is padded to: up to a full prefill chunk beside
        a decode row for every slot (k + 1 tokens each with n-gram speculative decoding)."""
        decode = self.config.max_concurrent_decodes * (self._mixed_drafts() + 1)
        return token_buckets(self.config.max_prefill_length + decode, decode)

    @property
    def page_geometry(self) -> PageGeometry:
        return self._geometry

    @property
    def kv_pages(self):
        raise TypeError("a paged engine holds no page table: wrap it in "
                        "jetserve.scheduling.PagePlanner (with_pages), which does")
