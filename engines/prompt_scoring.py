"""Scoring a prompt longer than one prefill bucket, chunk by chunk, on the host side of
the engine: each chunk attends over the KV of the chunks before it (a `ScoreCache` on
the device), and its last row scores the first token of the next chunk, so the joined
rows equal one pass over the whole prompt (tests/engines/test_chunked_scoring.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from engines.device_functions import PromptLogprobs, ScoreCache
from engines.prefix_blocks import stack_size

# (padded [1, bucket] chunk, its length, its start, the token after it, cache)
#   -> (rows of the chunk, the cache with the chunk's KV)
ScoreChunk = Callable[[np.ndarray, np.int32, np.int32, np.int32, ScoreCache],
                      tuple[PromptLogprobs, ScoreCache]]


def score_prompt(tokens, true_length: int | None, *, max_prefill_length: int,
                 max_seq_len: int, bucket_for: Callable[[int], int],
                 empty_cache: Callable[[int], ScoreCache], one_pass, chunk) -> PromptLogprobs:
    """A prompt's rows (host arrays of length true_length): one_pass(tokens [1, bucket],
    n) up to max_prefill_length tokens, else in chunks of it (chunk as ScoreChunk's)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = tokens.shape[0] if true_length is None else int(true_length)
    if not 1 <= n <= tokens.shape[0]:
        raise ValueError(f"true_length {n} must be in [1, {tokens.shape[0]}]")
    if n > max_prefill_length:
        return score_in_chunks(tokens[:n], chunk=max_prefill_length, max_seq_len=max_seq_len,
                               bucket_for=bucket_for, empty_cache=empty_cache,
                               score_chunk=chunk)
    padded = np.zeros((1, bucket_for(n)), np.int32)
    padded[0, :n] = tokens[:n]
    out = jax.device_get(one_pass(padded, np.int32(n)))
    return jax.tree.map(lambda x: x[:n], out)


def score_in_chunks(tokens: np.ndarray, *, chunk: int, max_seq_len: int,
                    bucket_for: Callable[[int], int],
                    empty_cache: Callable[[int], ScoreCache],
                    score_chunk: ScoreChunk) -> PromptLogprobs:
    """Host arrays for the n = len(tokens) prompt tokens (row t describes token t; row 0
    has none), scored in chunks of `chunk` tokens."""
    n = tokens.shape[0]
    if n > max_seq_len:
        raise ValueError(f"a prompt of {n} tokens is longer than max_seq_len "
                         f"{max_seq_len} (--max-seq-len raises it)")
    starts = range(0, n, chunk)
    # Room for the last chunk's whole bucket at its start; a power of two, few shapes.
    cache = empty_cache(stack_size(starts[-1] + bucket_for(n - starts[-1])))
    parts = []
    for s in starts:
        piece = tokens[s:s + chunk]
        padded = np.zeros((1, bucket_for(len(piece))), np.int32)
        padded[0, :len(piece)] = piece
        nxt = tokens[s + chunk] if s + chunk < n else 0
        rows, cache = score_chunk(padded, np.int32(len(piece)), np.int32(s), np.int32(nxt),
                                  cache)
        parts.append((rows, len(piece)))
    rows = [jax.tree.map(lambda x, m=m: x[:m], r) for r, m in jax.device_get(parts)]
    joined = jax.tree.map(lambda *xs: np.concatenate(xs), *rows)
    # Row t scored token t + 1: shift by one so row t describes token t (row 0: none).
    shift = lambda x, fill: np.concatenate([np.full((1, *x.shape[1:]), fill, x.dtype),
                                            x[:-1]])
    return PromptLogprobs(
        token_logprobs=shift(joined.token_logprobs, np.nan),
        top_ids=shift(joined.top_ids, -1), top_logprobs=shift(joined.top_logprobs, np.nan),
        greedy=shift(joined.greedy, -1))
