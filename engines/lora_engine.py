"""The transformer engines serving LoRA adapters beside the base model, on either KV layout.

`LoraServing` is what adapters add to an engine, whatever its KV layout: the pool, the
registry and its pinning, prefill through adapters, the per-slot adapter row and the
choice of generate program. `LoraTransformerEngine` puts it on the contiguous engine,
`PagedLoraEngine` on the paged one (engines/paged_engine.py); each only names its
layout's insert and generate steps, which the LoRA wrappers of engines/lora_steps.py
run unchanged.

Each decode slot carries its adapter's pool row (the decode state's `adapter`, 0: the
base model), so requests for different adapters and the base model share one batched step
(engines/lora.py adds each row's own delta). A prefix carries its adapter's id
(`LoraPrefix.adapter_id`, engines/lora_registry.adapter_id), not a row: the engine that
inserts it (the prefilling one, or a generate engine of a disaggregated server, whose
pool is its own) puts that adapter's row of its own pool into the slot. The pool is an argument of the jitted prefill and generate, never
a constant baked into them: writing an adapter into a row is one more call of a jitted,
donated update, and nothing recompiles.

Adapters are kept on the host by name (engines/lora_registry.py); `prefill(adapter=NAME)`
makes one resident first, swapping out the least recently used row that nothing pins: a
row is pinned by each prefix made with it until that prefix object is dropped (inserted,
or abandoned), and by each decode slot holding it until `free_slot`.

Two generate programs: with the pool, and the plain step (no LoRA math at all), which runs
while no slot holds an adapter, so base traffic on a LoRA server costs what it did. The
engine knows which slots hold adapters on the host (insert / free_slot), so picking one
needs no read from the device. The paged engine's mixed steps (engines/mixed_step.py)
likewise, per shape: each token through its row's adapter (`lora_mixed_step`: a decode
row's slot's, a chunk's MixedRow.adapter, held for its slot from `hold_adapter` or its
first chunk until free_slot, and the slot's from its last chunk on), or plain.

Concurrency: the registry's lock is held while a call that reads or writes the pool is
dispatched (dispatch is asynchronous, so briefly), so a load never donates the pool
between another thread reading it and handing it to a device call.
"""

from __future__ import annotations

import functools
import weakref

import jax
import numpy as np

from engines import device_functions, lora
from engines.engine_config import EngineConfig
from engines.kv_cache import Prefix, insert_prefix
from engines.lora_loading import read_adapter
from engines.lora_registry import AdapterRegistry, adapter_id
from engines.lora_steps import (
    LoraPrefix,
    fields_of,
    lora_empty_prefix,
    lora_generate,
    lora_insert,
    lora_mixed_step,
    lora_prefill,
    lora_prefill_rows,
    lora_prompt_logprobs,
    lora_score_chunk,
    with_adapter,
    without_adapter,
)
from engines.paged_engine import PagedTransformerEngine
from engines.paged_kv import insert_paged
from engines.prefill_program import PrefillProgram, PrefillRows
from engines.speculative import generate_step
from engines.transformer_engine import TransformerEngine
from sharding import axes, traced_under


class LoraServing:
    """What serving adapters adds to a transformer engine of either KV layout (put it
    before the engine class among the bases). The engine's arguments; the pool's size
    and rank are config.max_loras and config.max_lora_rank. A subclass names its
    layout's steps, `_lora_steps` (the insert function and the generate step, each with
    how many inputs of its own it takes after the state), and calls `_insert_row` /
    `_generate_lora` from its insert / generate.

    A prefill whose adapter finds every row pinned waits up to `row_wait_s` for one (the
    generate thread frees rows as requests end); insert never waits (it runs on that
    thread), and fails its request instead.
    """

    row_wait_s = 60.0

    def __init__(self, model_config, *, config: EngineConfig, **kwargs):
        lora_config = lora.LoraConfig(max_loras=config.max_loras, max_rank=config.max_lora_rank)
        self.lora_config = lora_config
        self._plain = False  # True while the base class builds its own programs
        self.adapters = AdapterRegistry(lora_config.max_loras)
        self._slot_rows: dict[int, int] = {}  # decode slot -> pool row it holds
        super().__init__(model_config, config=config, **kwargs)
        make = functools.partial(lora.empty_pool, self.model_config, lora_config, self.dtype)
        self._pool = jax.jit(make, out_shardings=self.pool_shardings)()

    # ---- shardings: the base layouts plus the adapter rows (replicated) ----------------

    def decode_state_shardings(self):
        base = super().decode_state_shardings()
        if self._plain:
            return base
        return with_adapter(base, base.lengths)

    def prefix_destination_sharding(self):
        base = super().prefix_destination_sharding()
        if self._plain:
            return base
        r = self._replicated()
        return LoraPrefix(**fields_of(base, Prefix), adapter_id=r)

    def _build_jits(self):
        self._plain = True
        try:
            super()._build_jits()
        finally:
            self._plain = False
        self.pool_shardings = lora.pool_shardings(self.model_config, self.lora_config,
                                                  self.sharding, self._mesh)
        state_sh, prefix_sh = self.decode_state_shardings(), self.prefix_destination_sharding()
        pool_sh, r = self.pool_shardings, self._replicated()
        laid_out = functools.partial(traced_under, self.sharding, self._mesh)
        top_n = self.config.top_logprobs
        draft_model = self._draft.model if self._draft else None
        draft_sh = (self._draft.param_shardings,) if self._draft else ()
        self._prefill = PrefillProgram(
            self._counted("prefill", laid_out(functools.partial(
                lora_prefill, self.model, top_n, draft_model=draft_model))),
            in_shardings=(self.param_shardings, r, r, r, prefix_sh.sampling, r, None, r,
                          pool_sh, r, r, *draft_sh),
            out_shardings=(prefix_sh, r), bucket_for=self.bucket_for,
            max_seq_len=self.max_seq_len, config=self.model_config, dtype=self.dtype,
            draft_config=self._draft.model_config if self._draft else None,
            empty=lora_empty_prefix)
        self._prefill_rows = PrefillRows(
            self._counted("prefill", laid_out(functools.partial(
                lora_prefill_rows, self.model, top_n, draft_model=draft_model))),
            param_shardings=self.param_shardings, sampling_sharding=prefix_sh.sampling,
            prefix_sharding=prefix_sh, replicated=r, buckets=self.prefill_buckets(),
            max_rows=self.config.prefill_batch, vocab_size=self.model_config.vocab_size,
            extra_shardings=(pool_sh, r, r, *draft_sh))
        insert, insert_args, step, step_args = self._lora_steps(draft_model)
        self._insert_jit = jax.jit(
            self._counted("insert", functools.partial(lora_insert, insert)),
            in_shardings=(prefix_sh, state_sh, r, r) + (r,) * insert_args,
            out_shardings=state_sh, donate_argnums=(1,))
        gen = self._counted("generate", laid_out(functools.partial(lora_generate, self.model,
                                                                   step)))
        args_sh = (r,) * step_args + draft_sh  # the layout's inputs (page table, mask), a draft's
        self._generate_jit = jax.jit(gen, in_shardings=(self.param_shardings, pool_sh, state_sh,
                                                        *args_sh),
                                     out_shardings=(state_sh, r), donate_argnums=(2,))
        self._generate_plain_jit = jax.jit(gen, in_shardings=(self.param_shardings, None,
                                                              state_sh, *args_sh),
                                           out_shardings=(state_sh, r), donate_argnums=(2,))
        self._write_jit = jax.jit(lora.write_row, out_shardings=pool_sh, donate_argnums=(0,))
        score_sh = device_functions.ScoreCache(k=prefix_sh.k, v=prefix_sh.v, k_pos=r)
        self._lora_scoring = (  # prompt_logprobs' programs, with the pool and a row after
            jax.jit(self._counted("prompt_logprobs", laid_out(functools.partial(
                lora_prompt_logprobs, self.model, top_n))),
                in_shardings=(self.param_shardings, r, r, pool_sh, r), out_shardings=r),
            jax.jit(self._counted("prompt_logprobs", laid_out(functools.partial(
                lora_score_chunk, self.model, top_n))),
                in_shardings=(self.param_shardings, r, r, r, r, score_sh, pool_sh, r),
                out_shardings=(r, score_sh), donate_argnums=(5,)))

    # ---- adapters ----------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Reads and checks the PEFT adapter at `path` (ValueError naming the file and
        tensor) and keeps it under `name`; it goes to the device when first asked for."""
        weights = read_adapter(path, self.source_config, self.lora_config.max_rank)
        self.adapters.add(name, weights)

    def unload_adapter(self, name: str) -> None:
        """Forgets `name` (UnknownAdapter, a KeyError, when not loaded)."""
        self.adapters.remove(name)

    def _row(self, name: str | None, wait_s: float = 0.0) -> int:
        """The pool row of adapter `name` (0 for the base model), writing the adapter into
        the pool first when it is not resident. Hold the lock."""
        if name is None:
            return 0
        row, weights = self.adapters.row_for(name, wait_s)
        if weights is not None:
            a, b = lora.adapter_rows(weights, self.model_config, self.lora_config,
                                     self.kv_repeat, self.dtype)
            self._pool = self._write_jit(self._pool, np.int32(row), a, b,
                                         np.float32(weights.scale))
        return row

    # ---- Engine API --------------------------------------------------------------------

    def init_decode_state(self):
        """The layout's empty state, every slot on row 0 (the base model)."""
        self._plain = True
        try:
            base = super().init_decode_state()
        finally:
            self._plain = False
        B = self.config.max_concurrent_decodes
        sh = self._named((axes.CACHE_BATCH,), (B,), "slot adapters")
        return with_adapter(base, jax.device_put(np.zeros((B,), np.int32), sh))

    def prefill(self, params, tokens, true_length, *, sampling=None, existing_prefix=None,
                seed=None, donate: bool = False, token_mask=None, adapter: str | None = None):
        """As TransformerEngine.prefill, through adapter `adapter` (None: the base model;
        an unknown name raises engines.lora_registry.UnknownAdapter)."""
        ident = 0 if adapter is None else adapter_id(adapter)
        with self.adapters.lock:
            row = self._row(adapter, self.row_wait_s)
            prefix, first = self._prefill(
                self._in_layout(params), tokens, true_length, sampling=sampling,
                existing_prefix=existing_prefix, seed=seed, donate=donate,
                token_mask=token_mask,
                extra=(self._pool, np.int32(row), np.int32(ident), *self._draft_args()))
        # The id on the host too (not part of the pytree): insert need not wait for the
        # device to read it back, unless the prefix was rebuilt on the way (a transfer).
        prefix.host_adapter_id = ident
        if row:  # not swapped out while the prefix waits for its slot (or its next chunk)
            self.adapters.pin(row)
            weakref.finalize(prefix, self.adapters.unpin, row)
        return prefix, first

    def prefill_rows(self, params, prompts, *, samplings, seeds=None, adapters=None):
        """As TransformerEngine.prefill_rows, prompt i through adapter adapters[i] (None:
        the base model; no `adapters`: every prompt's). Each adapter's row is pinned as it
        is made resident, so a later prompt's adapter never swaps out an earlier one's."""
        R = len(prompts)
        names = [None] * R if adapters is None else list(adapters)
        if len(names) != R:
            raise ValueError(f"{R} prompts need {R} adapters (None: the base model), got "
                             f"{len(names)}")
        rows_n = self._prefill_rows.rows(R)
        seeds = [None] * R if seeds is None else seeds
        idents = [0 if n is None else adapter_id(n) for n in names]
        rows: list[int] = []
        with self.adapters.lock:
            try:
                for name in names:
                    rows.append(self._row(name, self.row_wait_s))
                    if rows[-1]:
                        self.adapters.pin(rows[-1])
                pad = [0] * (rows_n - R)
                prefixes, first = self._prefill_rows(
                    self._in_layout(params), prompts, samplings, seeds,
                    extra=(self._pool, np.asarray(rows + pad, np.int32),
                           np.asarray(idents + pad, np.int32), *self._draft_args()))
            except BaseException:
                for row in rows:
                    if row:
                        self.adapters.unpin(row)
                raise
        for prefix, ident, row in zip(prefixes, idents, rows, strict=True):
            prefix.host_adapter_id = ident  # as prefill's: insert need not read it back
            if row:  # held until the prefix is dropped (inserted, or abandoned)
                weakref.finalize(prefix, self.adapters.unpin, row)
        return prefixes, first

    def prompt_logprobs(self, params, tokens, true_length=None, *, adapter: str | None = None):
        """As TransformerEngine.prompt_logprobs, through adapter `adapter` (None: the base
        model). Its row stays pinned while the prompt is scored; each program call takes
        the pool as it is then (a load of another adapter donates the old one)."""
        if adapter is None:
            return super().prompt_logprobs(params, tokens, true_length)
        with self.adapters.lock:
            row = self._row(adapter, self.row_wait_s)
            self.adapters.pin(row)

        def through(program):
            def call(*args):
                with self.adapters.lock:
                    return program(*args, self._pool, np.int32(row))
            return call

        try:
            one_pass, chunk = self._lora_scoring
            return self._score(params, tokens, true_length, through(one_pass), through(chunk))
        finally:
            self.adapters.unpin(row)

    def lower_prefill(self, params, tokens, true_length, *, existing_prefix=None,
                      donate: bool = False):
        return self._prefill.lower(self._in_layout(params), tokens, true_length,
                                   existing_prefix=existing_prefix, donate=donate,
                                   extra=(self._pool, np.int32(0), np.int32(0),
                                          *self._draft_args()))

    def _insert_row(self, prefix: LoraPrefix, decode_state, slot: int, *args):
        """Inserts `prefix` into `slot` on its adapter's row of this engine's pool;
        `args`: the layout insert's own (the paged one's pages)."""
        if not isinstance(prefix, LoraPrefix):
            raise ValueError("a LoRA engine inserts prefixes of a LoRA engine's prefill "
                             f"(got {type(prefix).__name__})")
        ident = getattr(prefix, "host_adapter_id", None)
        if ident is None:
            ident = int(jax.device_get(prefix.adapter_id))
        with self.adapters.lock:
            row = self._row(self.adapters.name_of(ident)) if ident else 0
            self.free_slot(slot)
            if row:
                self.adapters.pin(row)
                self._slot_rows[slot] = row
            return self._insert_jit(prefix, decode_state, np.int32(slot), np.int32(row), *args)

    def free_slot(self, slot: int) -> None:
        with self.adapters.lock:
            row = self._slot_rows.pop(slot, None)
            if row is not None:
                self.adapters.unpin(row)

    def _generate_lora(self, params, decode_state, *args):
        """One step of the layout's generate (`args`: its page table, its token mask)."""
        params = self._in_layout(params)
        with self.adapters.lock:
            if not self._slot_rows:  # no slot holds an adapter: the base model's step
                return self._generate_plain_jit(params, None, decode_state, *args,
                                                *self._draft_args())
            return self._generate_jit(params, self._pool, decode_state, *args,
                                      *self._draft_args())


class LoraTransformerEngine(LoraServing, TransformerEngine):
    """The contiguous engine with LoRA adapters (LoraServing)."""

    def _lora_steps(self, draft_model):
        step = functools.partial(generate_step, top_n=self.config.top_logprobs,
                                 spec=self.config.spec, draft_model=draft_model)
        return insert_prefix, 0, step, 1  # generate's one input: the token mask

    def insert(self, prefix: LoraPrefix, decode_state, slot: int):
        return self._insert_row(prefix, decode_state, slot)

    def generate(self, params, decode_state, token_mask=None):
        return self._generate_lora(params, decode_state, token_mask)


class PagedLoraEngine(LoraServing, PagedTransformerEngine):
    """The paged engine with LoRA adapters (LoraServing): insert takes the slot's pages,
    generate the page table, as PagedTransformerEngine's. A mixed step runs each row
    through its adapter (a chunk's MixedRow.adapter, a decode row's slot's); a slot
    starting a prompt holds its adapter's row from `hold_adapter` (or its first chunk)
    until free_slot. As generate, two programs per shape: with the pool, and the plain
    one while no slot holds an adapter."""

    def _build_jits(self):
        super()._build_jits()
        state_sh, pool_sh, r = self.decode_state_shardings(), self.pool_shardings, \
            self._replicated()
        laid_out = functools.partial(traced_under, self.sharding, self._mesh)
        mixed = self._counted("mixed", laid_out(functools.partial(
            lora_mixed_step, self.model, self.mixed_step_fn)))
        rows = self._counted("mixed", laid_out(functools.partial(
            lora_generate, self.model, self.decode_rows_fn)))
        # adapters? -> (mixed program, decode-rows program): with the pool, or plain
        draft_sh = (self._draft.param_shardings,) if self._draft else ()  # _draft_args()
        self._mixed_jits = {
            on: (jax.jit(mixed, in_shardings=(self.param_shardings, pool_sh if on else None,
                                              state_sh, r, r, r, r, *draft_sh),  # r: token_mask
                         out_shardings=(state_sh, r), donate_argnums=(2,)),
                 jax.jit(rows, in_shardings=(self.param_shardings, pool_sh if on else None,
                                             state_sh, r, r, r, *draft_sh),
                         out_shardings=(state_sh, r), donate_argnums=(2,)))
            for on in (False, True)}

    def _lora_steps(self, draft_model):
        step = functools.partial(self.generate_step, draft_model=draft_model)
        insert = functools.partial(insert_paged, ring=self.ring)
        return insert, 1, step, 2  # insert's pages; generate's page table and token mask

    def insert(self, prefix: LoraPrefix, decode_state, slot: int, *,
               pages, shared: int = 0):
        return self._insert_row(prefix, decode_state, slot, self._page_array(prefix, pages,
                                                                             shared))

    def generate(self, params, decode_state, page_table, token_mask=None):
        return self._generate_lora(params, decode_state, page_table, token_mask)

    def hold_adapter(self, slot: int, adapter: str | None) -> None:
        """Mixed steps: `slot` starts a prompt through `adapter` (None: the base model):
        its row made resident (no wait) and pinned until free_slot. Raises UnknownAdapter,
        or RowsBusy (a RuntimeError) when every row holds another live request's adapter."""
        with self.adapters.lock:
            row = 0 if adapter is None else self._row(adapter)
            if self._slot_rows.get(slot, 0) != row:
                self.free_slot(slot)
                if row:
                    self.adapters.pin(row)
                    self._slot_rows[slot] = row

    def mixed_step(self, params, decode_state, page_table, rows, token_mask=None, *,
                   adapters: bool | None = None):
        """As PagedTransformerEngine.mixed_step, each chunk through its row's adapter (its
        slot holds it, `hold_adapter`, if it did not yet). `adapters`: the program with
        the pool (True) or the plain one (False); None: the plain one while no slot holds
        an adapter (warm-up compiles both)."""
        with self.adapters.lock:
            for r in rows:
                if not r.decode:
                    self.hold_adapter(r.slot, r.adapter)
            return super().mixed_step(params, decode_state, page_table, rows, token_mask,
                                      adapters=bool(self._slot_rows) if adapters is None
                                      else adapters)

    def _fill_context(self, decode_state, row):
        """As the paged engine's, on the state without its adapter rows (kept as they are)."""
        return with_adapter(super()._fill_context(without_adapter(decode_state), row),
                            decode_state.adapter)

    def _run_mixed(self, params, decode_state, table, inputs, rows, token_mask, *,
                   adapters: bool):
        """The chunks' pool rows (their slots', held above) beside the step's inputs; the
        adapters' lock is held (mixed_step)."""
        chunk_rows = np.zeros((self.page_geometry.slots,), np.int32)
        for r in rows:
            if not r.decode:
                chunk_rows[r.slot] = self._slot_rows.get(r.slot, 0)
        mixed, decode_rows = self._mixed_jits[adapters]
        pool = self._pool if adapters else None
        if isinstance(inputs, np.ndarray):  # decode rows alone
            return decode_rows(self._in_layout(params), pool, decode_state, table, inputs,
                               token_mask, *self._draft_args())
        return mixed(self._in_layout(params), pool, decode_state, table, inputs, chunk_rows,
                     token_mask, *self._draft_args())
