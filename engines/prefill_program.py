"""The engine's prefill as jitted programs: one that copies a continued prefix and one
that takes it over (donated), with the host-side argument checks both share.

A prefill that continues a prefix (`existing_prefix`: a cached prefix, or the previous
chunk of a long prompt) writes the new tokens' KV into that prefix's arrays at its
length. Without donation XLA must leave the input intact, so the program copies every
layer's k and v and, for a while, two copies of the prompt's KV are alive: at 32,768
tokens of llama-156m that is 0.54 GB more than the KV (docs/BENCHMARKS.md). A caller
that never reads the old prefix again (every chunk loop: the orchestrator's prefill
worker, the lock-step driver, offline batches, the benches) passes `donate=True` and the
program updates the arrays in place; the prefix cache, whose blocks other requests
share, keeps the copying program.

Growing a prefix to hold the next chunk (`grow_prefix`, to a power of two so chunked
prefill compiles few shapes) makes new, larger arrays; with `donate` the old ones are
deleted as soon as the grown ones exist, rather than when the caller lets go of them.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engines import exported_programs
from engines.config import ModelConfig
from engines.kv_cache import Prefix, grow_prefix
from engines.prefix_blocks import stack_size
from engines.sampling import SamplingParams, SlotSampling
from engines.token_mask import allow_all

# The jitted prefill's arguments: params, tokens, true_length, start, sampling row,
# prompt mask, existing prefix (or None), the first token's mask, then a draft model's
# params if any.
EXISTING_ARG = 6


class PrefillProgram:
    """The prefill of one engine, jitted twice over the same device function.

    Args:
      fn: the device function (engines.device_functions.prefill with its model bound),
        taking the arguments in the order of EXISTING_ARG's comment.
      in_shardings, out_shardings: as for jax.jit.
      bucket_for: the prefill bucket (padded length) for a chunk of n tokens.
      max_seq_len: the longest prefix a prefill may make.
      config, dtype: the model that runs (kv heads as it runs them) and its dtype, for
        `empty` prefixes.
      draft_config: a draft model's (speculative "draft:PATH:K"), whose KV of the prompt
        the prefix carries too; None without one.
      empty: (config, draft_config, dtype, capacity) -> an empty prefix of the type `fn`
        returns (a chunk loop's first chunk continues it, and out_shardings[0] lays it
        out): an engine's own for a Prefix subclass with fields of its own; None:
        `empty_prefix`.
      context: what the exported-program cache keys the prefill on besides its arguments;
        None: not through that cache (plain jax.jit).
    """

    def __init__(self, fn: Callable, *, in_shardings, out_shardings,
                 bucket_for: Callable[[int], int], max_seq_len: int, config: ModelConfig,
                 dtype, draft_config: ModelConfig | None = None, context: str | None = None,
                 empty: Callable[..., Prefix] | None = None):
        # Through the exported-program cache (engines/exported_programs.py) under `context`.
        self._copying = exported_programs.cached_jit(
            fn, name="prefill", context=context, in_shardings=in_shardings,
            out_shardings=out_shardings)
        # Only the leaves the program reads are taken over (k, v, k_pos, tokens and a
        # draft model's k, v): jit leaves unread leaves of a donated argument alone.
        self._donating = exported_programs.cached_jit(
            fn, name="prefill_donating", context=context, in_shardings=in_shardings,
            out_shardings=out_shardings, donate_argnums=(EXISTING_ARG,))
        self._grow = jax.jit(grow_prefix, static_argnums=(1,))
        self._empty = jax.jit(functools.partial(empty or empty_prefix, config, draft_config,
                                                dtype),
                              static_argnums=(0,), out_shardings=out_shardings[0])
        self._bucket_for = bucket_for
        self._max_seq_len = max_seq_len
        self._vocab_size = config.vocab_size

    def empty(self, length: int) -> Prefix:
        """A prefix holding nothing, with room for a `length`-token prompt (the next power
        of two): see Engine.empty_prefix."""
        if not 1 <= length <= self._max_seq_len:
            raise ValueError(f"a prefix for a prompt of {length} tokens: length must be in "
                             f"[1, max_seq_len {self._max_seq_len}]")
        return self._empty(stack_size(length))

    def __call__(self, params, tokens, true_length, *, sampling: SamplingParams | None,
                 existing_prefix: Prefix | None, seed: int | None, donate: bool,
                 token_mask=None, extra: tuple = ()):
        """Runs the prefill (see TransformerEngine.prefill); token_mask: None or i32[1, W]
        the first token's allowed tokens (engines/token_mask.py); `extra`: trailing
        arguments (a draft model's params)."""
        args, capacity = self.arguments(params, tokens, true_length, sampling,
                                        existing_prefix, seed, token_mask)
        if capacity is not None:
            grown = self._grow(existing_prefix, capacity)
            if donate:  # the caller gave the old arrays up: free them before the prefill
                p = existing_prefix
                for old in (*p.k, *p.v, *p.draft_k, *p.draft_v, p.k_pos, p.tokens):
                    if isinstance(old, jax.Array) and not old.is_deleted():
                        old.delete()
            args = (*args[:EXISTING_ARG], grown, *args[EXISTING_ARG + 1:])
        return self._program(donate, existing_prefix)(*args, *extra)

    def lower(self, params, tokens, true_length, *, existing_prefix: Prefix | None,
              donate: bool, extra: tuple = ()) -> jax.stages.Lowered:
        """The program these arguments run, lowered (for its memory and cost analyses);
        nothing runs, and nothing is allocated or donated."""
        args, capacity = self.arguments(params, tokens, true_length, None, existing_prefix, 0)
        if capacity is not None:
            args = (*args[:EXISTING_ARG], jax.eval_shape(
                lambda p: grow_prefix(p, capacity), existing_prefix), *args[EXISTING_ARG + 1:])
        return self._program(donate, existing_prefix).lower(*args, *extra)

    def _program(self, donate: bool, existing_prefix: Prefix | None):
        """Donating only when asked: a caller that copies keeps one program per shape
        (a grown prefix, though this call's own, goes through the same one)."""
        return self._donating if donate and existing_prefix is not None else self._copying

    def arguments(self, params, tokens, true_length, sampling, existing_prefix,
                  seed, token_mask=None) -> tuple[tuple, int | None]:
        """The checks, then (the jitted prefill's arguments without `extra`, the capacity
        the existing prefix must grow to first, or None when it holds this chunk)."""
        sampling = sampling or SamplingParams()
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        true_length = int(true_length)
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        if not 1 <= true_length <= tokens.shape[0]:
            raise ValueError(f"true_length {true_length} must be in [1, {tokens.shape[0]}]")
        if start + true_length > self._max_seq_len:
            raise ValueError(f"prompt of {start + true_length} tokens exceeds max_seq_len "
                             f"{self._max_seq_len}")
        bucket = self._bucket_for(tokens.shape[0])
        padded = np.zeros((1, bucket), np.int32)
        padded[0, : tokens.shape[0]] = tokens
        if seed is None:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        row = SlotSampling.from_params(sampling, seed)
        prior_mask = (existing_prefix.prompt_mask if existing_prefix is not None
                      else np.zeros((1, self._vocab_size), bool))
        capacity = None
        if existing_prefix is not None and existing_prefix.k_pos.shape[1] < start + bucket:
            # Room for this bucket at `start`, rounded up to a power of two (few shapes).
            capacity = stack_size(start + bucket)
        if token_mask is None:  # one program: an unconstrained prefill allows every token
            token_mask = allow_all(1, self._vocab_size)
        return (params, padded, np.int32(true_length), np.int32(start), row, prior_mask,
                existing_prefix, token_mask), capacity


def empty_prefix(config: ModelConfig, draft_config: ModelConfig | None, dtype,
                 capacity: int) -> Prefix:
    """A Prefix of `capacity` entries holding nothing yet (length 0, k_pos -1), with room
    for a draft model's KV too: a chunk loop's first chunk continues it, so the prompt's
    KV is allocated once at its final size. Only the fields a continuing prefill reads
    are meaningful."""

    def zeros(c: ModelConfig | None) -> tuple:  # one array per layer, none shared
        if c is None:
            return ()
        return tuple(jnp.zeros((1, capacity, c.num_kv_heads, c.head_dim), dtype)
                     for _ in range(c.num_layers))

    return Prefix(k=zeros(config), v=zeros(config), draft_k=zeros(draft_config),
                  draft_v=zeros(draft_config), k_pos=jnp.full((1, capacity), -1, jnp.int32),
                  tokens=jnp.zeros((1, capacity), jnp.int32), length=jnp.zeros((), jnp.int32),
                  token=jnp.zeros((), jnp.int32), sampling=SlotSampling.empty(1),
                  prompt_mask=jnp.zeros((1, config.vocab_size), bool))


class PrefillRows:
    """Several whole prompts in one prefill call (device_functions.prefill_rows), for
    prompts short enough that one call's cost is mostly reading the weights: R prompts
    then cost about what one does.

    Shapes: R rows, a power of two from 2 to `max_rows`, of a prefill bucket T, where
    R * T <= max_prefill_length (a call runs no more tokens than one prefill of the
    longest prompt, so its activations are bounded alike); one program per shape (`shapes`,
    which the warm-up compiles), counted with prefill's. Fresh prompts only: no existing
    prefix, no token mask. `extra_shardings`: those of arguments `fn`
    takes after prefill_rows' own (a LoRA engine's pool and each row's adapter), given
    to each call as `extra`.

    Args:
      fn: device_functions.prefill_rows with its model bound.
      param_shardings, sampling_sharding, prefix_sharding, replicated: the engine's.
      buckets: the engine's prefill buckets, ascending (the last is max_prefill_length).
      max_rows: the most prompts one call takes (EngineConfig.prefill_batch).
      vocab_size: for the all-allowing token mask.
    """

    def __init__(self, fn: Callable, *, param_shardings, sampling_sharding, prefix_sharding,
                 replicated, buckets: tuple[int, ...], max_rows: int, vocab_size: int,
                 extra_shardings: tuple = ()):
        self._fn = fn
        self._in = (param_shardings, replicated, replicated, sampling_sharding, replicated,
                    *extra_shardings)
        self._prefix_sharding, self._replicated = prefix_sharding, replicated
        self._buckets = buckets
        self._vocab_size = vocab_size
        self.row_counts = tuple(1 << i for i in range(1, max_rows.bit_length()))
        self._jits: dict[int, Callable] = {}

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, bucket) a call may take."""
        limit = self._buckets[-1]
        return [(r, b) for b in self._buckets for r in self.row_counts if r * b <= limit]

    def rows_for(self, waiting: int, longest: int) -> int:
        """How many of `waiting` prompts (the longest `longest` tokens) one call takes: all
        of them when a shape for their bucket holds them with at most a quarter of its rows
        padding, else the most a shape holds without padding; 1 when no shape fits."""
        bucket = next((b for b in self._buckets if longest <= b), None)
        counts = [r for r, b in self.shapes() if b == bucket]
        if any(waiting <= r and 4 * (r - waiting) <= r for r in counts):
            return waiting
        return max((r for r in counts if r <= waiting), default=1)

    def rows(self, R: int) -> int:
        """The row count a call of R prompts runs (ValueError when none takes them)."""
        rows = next((r for r in self.row_counts if R <= r), None)
        if R < 2 or rows is None:
            raise ValueError(f"a prefill of several prompts takes 2 to {self.row_counts[-1]} "
                             f"prompts, got {R}")
        return rows

    def __call__(self, params, prompts, samplings, seeds, extra: tuple = ()):
        """(R prefixes, ResultTokens whose first R rows are theirs) for R prompts (host
        token arrays) with their SamplingParams and seeds (None: the params' seed, else a
        random one); the call runs the smallest row count >= R (`rows`), padding rows of
        one token; `extra`: the arguments after prefill_rows' own, for all those rows."""
        R = len(prompts)
        rows = self.rows(R)
        if not len(samplings) == len(seeds) == R:
            raise ValueError(f"{R} prompts need {R} samplings and seeds, got "
                             f"{len(samplings)} and {len(seeds)}")
        arrays = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        longest = max(a.shape[0] for a in arrays)
        if min(a.shape[0] for a in arrays) < 1:
            raise ValueError("a prompt of a prefill of several prompts is empty")
        bucket = next((b for b in self._buckets if longest <= b), None)
        if bucket is None or rows * bucket > self._buckets[-1]:
            raise ValueError(f"{R} prompts of up to {longest} tokens (bucket {bucket}) exceed "
                             f"the {self._buckets[-1]} tokens one prefill call runs")
        padded = np.zeros((rows, bucket), np.int32)
        for i, a in enumerate(arrays):
            padded[i, : a.shape[0]] = a
        lengths = np.ones((rows,), np.int32)  # padding rows: one token
        lengths[:R] = [a.shape[0] for a in arrays]
        per_row = []
        for s, seed in zip([*samplings, *[None] * (rows - R)], [*seeds, *[0] * (rows - R)],
                           strict=True):
            s = s or SamplingParams()
            if seed is None:
                seed = s.seed if s.seed is not None else secrets.randbits(31)
            per_row.append(SlotSampling.from_params(s, seed))
        sampling = jax.tree.map(lambda *xs: np.concatenate(xs), *per_row)
        prefixes, res = self._jit(rows)(params, padded, lengths, sampling,
                                        allow_all(rows, self._vocab_size), *extra)
        return list(prefixes[:R]), res

    def _jit(self, rows: int) -> Callable:
        if rows not in self._jits:
            self._jits[rows] = jax.jit(self._fn, in_shardings=self._in, out_shardings=(
                (self._prefix_sharding,) * rows, self._replicated))
        return self._jits[rows]
