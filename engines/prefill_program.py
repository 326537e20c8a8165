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
prefill compiles few shapes) makes new, larger arrays, which only this call holds: the
prefill then always takes them over. With `donate` the old arrays are deleted as soon as
the grown ones exist, rather than when the caller lets go of them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import jax
import numpy as np

from engines.kv_cache import Prefix, grow_prefix
from engines.prefix_blocks import stack_size
from engines.sampling import SamplingParams, SlotSampling

# The jitted prefill's arguments: params, tokens, true_length, start, sampling row,
# prompt mask, existing prefix (or None), then a draft model's params if any.
EXISTING_ARG = 6


class PrefillProgram:
    """The prefill of one engine, jitted twice over the same device function.

    Args:
      fn: the device function (engines.device_functions.prefill with its model bound),
        taking the arguments in the order of EXISTING_ARG's comment.
      in_shardings, out_shardings: as for jax.jit.
      bucket_for: the prefill bucket (padded length) for a chunk of n tokens.
      max_seq_len: the longest prefix a prefill may make.
      vocab_size: the prompt mask's width.
    """

    def __init__(self, fn: Callable, *, in_shardings, out_shardings,
                 bucket_for: Callable[[int], int], max_seq_len: int, vocab_size: int):
        self._copying = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
        # Only the leaves the program reads are taken over (k, v, k_pos, tokens): jit
        # leaves unread leaves of a donated argument alone.
        self._donating = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                 donate_argnums=(EXISTING_ARG,))
        self._grow = jax.jit(grow_prefix, static_argnums=(1,))
        self._bucket_for = bucket_for
        self._max_seq_len = max_seq_len
        self._vocab_size = vocab_size

    def __call__(self, params, tokens, true_length, *, sampling: SamplingParams | None,
                 existing_prefix: Prefix | None, seed: int | None, donate: bool,
                 extra: tuple = ()):
        """Runs the prefill (see TransformerEngine.prefill); `extra`: trailing arguments
        (a draft model's params)."""
        args, capacity = self.arguments(params, tokens, true_length, sampling,
                                        existing_prefix, seed)
        if capacity is not None:
            grown = self._grow(existing_prefix, capacity)
            if donate:  # the caller gave the old arrays up: free them before the prefill
                for old in (*existing_prefix.k, *existing_prefix.v, existing_prefix.k_pos,
                            existing_prefix.tokens):
                    if isinstance(old, jax.Array) and not old.is_deleted():
                        old.delete()
            args = (*args[:EXISTING_ARG], grown)
        return self._program(donate, existing_prefix, capacity)(*args, *extra)

    def lower(self, params, tokens, true_length, *, existing_prefix: Prefix | None,
              donate: bool, extra: tuple = ()) -> jax.stages.Lowered:
        """The program these arguments run, lowered (for its memory and cost analyses);
        nothing runs, and nothing is allocated or donated."""
        args, capacity = self.arguments(params, tokens, true_length, None, existing_prefix, 0)
        if capacity is not None:
            args = (*args[:EXISTING_ARG], jax.eval_shape(
                lambda p: grow_prefix(p, capacity), existing_prefix))
        return self._program(donate, existing_prefix, capacity).lower(*args, *extra)

    def _program(self, donate: bool, existing_prefix: Prefix | None, capacity: int | None):
        """The donating program when the caller gives the prefix up, or when it grew
        first: the grown arrays are this call's own, nobody else's."""
        if existing_prefix is None:
            return self._copying
        return self._donating if donate or capacity is not None else self._copying

    def arguments(self, params, tokens, true_length, sampling, existing_prefix,
                  seed) -> tuple[tuple, int | None]:
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
        return (params, padded, np.int32(true_length), np.int32(start), row, prior_mask,
                existing_prefix), capacity
