"""The device functions of LoRA serving: the layout's own programs (prefill, insert,
generate, the mixed step, prompt scoring) run through the adapters in the pool, and the
pytrees that carry an adapter (a prefix's id, each decode slot's pool row).

A function here takes the pool and the rows (or ids) as arguments after its base
program's own; pool None runs the base model's program unchanged. engines/lora.py adds
each row's (or, in a mixed step, each token's) delta; engines/lora_engine.py jits these
and picks the rows on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engines import device_functions, lora
from engines.kv_cache import DecodeState, Prefix
from engines.mixed_batch import MODE_CHUNK, MixedInputs
from engines.paged_kv import PagedDecodeState
from engines.prefill_program import empty_prefix


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraPrefix(Prefix):
    """A Prefix and the id of the adapter that made it."""

    adapter_id: jax.Array | None = None  # i32[], 0: the base model


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraDecodeState(DecodeState):
    """A DecodeState and each slot's adapter row."""

    adapter: jax.Array | None = None  # i32[B]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraPagedDecodeState(PagedDecodeState):
    """A PagedDecodeState and each slot's adapter row."""

    adapter: jax.Array | None = None  # i32[B]


# Each layout's decode state -> that state with the slots' adapter rows.
_WITH_ADAPTER = {DecodeState: LoraDecodeState, PagedDecodeState: LoraPagedDecodeState}


def fields_of(x, cls) -> dict:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(cls)}


def with_adapter(state, adapter):
    """`state` (either layout's decode state, with or without rows) on adapter rows
    `adapter` i32[B]: the same arrays, no device work."""
    base = next(c for c in type(state).__mro__ if c in _WITH_ADAPTER)
    return _WITH_ADAPTER[base](**fields_of(state, base), adapter=adapter)


def without_adapter(state):
    """The layout's own decode state of `state` (the same arrays, the rows left out)."""
    base = next(c for c in type(state).__mro__ if c in _WITH_ADAPTER)
    return base(**fields_of(state, base))


class _WithLora:
    """A decoder whose apply adds each batch row's adapter (what the device functions see)."""

    def __init__(self, model, hook: lora.LoraBatch):
        self.model, self.hook, self.cfg, self.backend = model, hook, model.cfg, model.backend

    def apply(self, variables, *args, **kw):
        return self.model.apply(variables, *args, lora=self.hook, **kw)


def lora_prefill(model, top_n, params, tokens, true_length, start, sampling, prompt_mask,
                 existing, token_mask, pool, row, ident, *draft, draft_model=None):
    """device_functions.prefill through the adapter in pool row `row` (i32[]), whose id
    the prefix carries. The pool, row and id come after prefill's own arguments (the
    extra arguments of engines.prefill_program.PrefillProgram, before a draft model's)."""
    bound = _WithLora(model, lora.LoraBatch(pool, jnp.reshape(row, (1,))))
    prefix, res = device_functions.prefill(bound, top_n, params, tokens, true_length, start,
                                           sampling, prompt_mask, existing, token_mask,
                                           *draft, draft_model=draft_model)
    return LoraPrefix(**fields_of(prefix, Prefix), adapter_id=ident), res


def lora_prefill_rows(model, top_n, params, tokens, true_lengths, sampling, token_mask,
                      pool, rows, idents, *draft, draft_model=None):
    """device_functions.prefill_rows with each prompt row through its own adapter: pool
    rows `rows` i32[R], whose ids `idents` i32[R] the prefixes carry (0: the base model);
    a draft model's parameters last, as lora_prefill's."""
    bound = _WithLora(model, lora.LoraBatch(pool, rows))
    prefixes, res = device_functions.prefill_rows(bound, top_n, params, tokens, true_lengths,
                                                  sampling, token_mask, *draft,
                                                  draft_model=draft_model)
    return tuple(LoraPrefix(**fields_of(p, Prefix), adapter_id=idents[i])
                 for i, p in enumerate(prefixes)), res


def lora_prompt_logprobs(model, top_n, params, tokens, true_length, pool, row):
    """device_functions.prompt_logprobs through the adapter in pool row `row` (i32[])."""
    bound = _WithLora(model, lora.LoraBatch(pool, jnp.reshape(row, (1,))))
    return device_functions.prompt_logprobs(bound, top_n, params, tokens, true_length)


def lora_score_chunk(model, top_n, params, tokens, true_length, start, next_token, cache,
                     pool, row):
    """device_functions.score_chunk (a chunk of a long prompt's scoring) through the
    adapter in pool row `row`."""
    bound = _WithLora(model, lora.LoraBatch(pool, jnp.reshape(row, (1,))))
    return device_functions.score_chunk(bound, top_n, params, tokens, true_length, start,
                                        next_token, cache)


def lora_empty_prefix(config, draft_config, dtype, capacity: int) -> LoraPrefix:
    """engines.prefill_program.empty_prefix as a LoRA prefill makes prefixes, for a
    chunk loop's first chunk to continue. Its id is the base model's: each chunk's
    prefix takes the id its own prefill is given, never the one it continues."""
    base = empty_prefix(config, draft_config, dtype, capacity)
    return LoraPrefix(**fields_of(base, Prefix), adapter_id=jnp.zeros((), jnp.int32))


def lora_insert(insert, prefix: LoraPrefix, state, slot, row, *args):
    """insert(prefix, state, slot, *args) (the layout's insert: `args` are the paged
    one's pages), and the slot on pool row `row` (this engine's row of the adapter)."""
    new = insert(prefix, state, slot, *args)
    return with_adapter(new, state.adapter.at[slot].set(row))


class _TokensLora:
    """A decoder whose apply adds, in the mixed step's one row of tokens, each token's
    adapter: the pool row of its slot (`slots` i32[B]) at the token's row of the step's
    layout (the KV store's, engines/mixed_step.py RaggedPagedKV)."""

    def __init__(self, model, pool: lora.LoraPool, slots: jax.Array):
        self.model, self.pool, self.slots = model, pool, slots
        self.cfg, self.backend = model.cfg, model.backend

    def apply(self, variables, tokens, positions, kv, **kw):
        hook = lora.LoraBatch(self.pool, self.slots[kv.layout.rows], tokens=True)
        return self.model.apply(variables, tokens, positions, kv, lora=hook, **kw)


def lora_mixed_step(model, step, params, pool, state, table, inp: MixedInputs, rows,
                    token_mask=None, *draft):
    """step(model)(params, state, table, inp, token_mask) (the layout's mixed step) with
    each token through its row's adapter: a decode row's slot's (state.adapter), a
    chunk's `rows` i32[B] (the pool row of its prompt's adapter), which the slot keeps
    once the chunk that ends the prompt has run. pool None: the base model's step (the
    rows kept alike). draft: a draft model's parameters, if any (the draft runs without
    adapters)."""
    chunk = inp.mode == MODE_CHUNK
    bound = model if pool is None else _TokensLora(model, pool,
                                                   jnp.where(chunk, rows, state.adapter))
    new, res = step(bound)(params, without_adapter(state), table, inp, token_mask, *draft)
    return with_adapter(new, jnp.where(chunk & inp.sample, rows, state.adapter)), res


def lora_generate(model, step, params, pool, state, *args):
    """step(model) -> the layout's generate function (plain or speculative) over that
    model, called as step(model)(params, state, *args); pool None: the base model alone."""
    bound = model if pool is None else _WithLora(model, lora.LoraBatch(pool, state.adapter))
    new, res = step(bound)(params, state, *args)
    return with_adapter(new, state.adapter), res
