"""prefill(..., donate=True): a chunk loop gives its previous prefix up, and the engine
updates the KV in place (engines/prefill_program.py). Same prefix and first token as the
copying prefill; the donated prefix is gone afterwards while a prefix that is not donated
(the prefix cache's) stays readable; the donating program aliases the KV it writes."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, create_engine
from tests.sharding.families import model_config

CHUNK = 16


@pytest.fixture(scope="module")
def engine():
    eng = create_engine(model_config("llama"), devices=jax.devices()[:1],
                        config=EngineConfig(max_concurrent_decodes=2, max_prefill_length=CHUNK,
                                            max_seq_len=128, top_logprobs=0))
    return eng, eng.load_params()


def _chunked(eng, params, prompt, donate: bool):
    """(final prefix, first token, every intermediate prefix) of a chunked prefill."""
    prefix, seen = None, []
    for s in range(0, len(prompt), CHUNK):
        piece = prompt[s:s + CHUNK]
        prefix, first = eng.prefill(params, piece, len(piece), existing_prefix=prefix,
                                    seed=3, donate=donate)
        seen.append(prefix)
    return prefix, first, seen


def _host(prefix):
    return jax.device_get((prefix.k, prefix.v, prefix.k_pos, prefix.tokens, prefix.length,
                           prefix.token, prefix.prompt_mask))


@pytest.mark.parametrize("n", [40, 64])  # growing the prefix mid-way, and ending full
def test_donated_chunks_equal_copied_chunks(engine, n):
    eng, params = engine
    prompt = np.random.default_rng(n).integers(3, 128, n).astype(np.int32)
    want, want_first, kept = _chunked(eng, params, prompt, donate=False)
    got, got_first, given = _chunked(eng, params, prompt, donate=True)
    for a, b in zip(jax.tree.leaves(_host(got)), jax.tree.leaves(_host(want)), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(got_first.data), np.asarray(want_first.data))
    # Every prefix but the last was handed to the next chunk: its KV is gone.
    for p in given[:-1]:
        assert all(x.is_deleted() for x in (*p.k, *p.v, p.k_pos, p.tokens))
    # Without donation every intermediate prefix is still whole and readable.
    for p in kept:
        assert not any(x.is_deleted() for x in jax.tree.leaves(p))
        jax.device_get(p.k)


def test_donating_program_aliases_the_kv(engine):
    """With donation the compiled program writes into the prefix it is given (XLA aliases
    every layer's k and v); without, it aliases nothing and the prefix stays whole."""
    eng, params = engine
    prompt = np.arange(3, 15, dtype=np.int32)
    first, _ = eng.prefill(params, prompt[:4], 4)  # 16 entries (one bucket)
    prefix, _ = eng.prefill(params, prompt[4:8], 4, existing_prefix=first, donate=True)
    assert prefix.k_pos.shape[1] == 32  # grown: the next 16-token bucket fits at 8
    kv_bytes = sum(x.nbytes for x in (*prefix.k, *prefix.v))
    donating = eng.lower_prefill(params, prompt[8:], 4, existing_prefix=prefix, donate=True)
    copying = eng.lower_prefill(params, prompt[8:], 4, existing_prefix=prefix)
    assert donating.compile().memory_analysis().alias_size_in_bytes >= kv_bytes
    assert copying.compile().memory_analysis().alias_size_in_bytes == 0
    assert not any(x.is_deleted() for x in jax.tree.leaves(prefix))  # lowering runs nothing


def test_a_donated_prefix_is_refused_afterwards(engine):
    """Reading a prefix after handing it over fails loudly (jax's deleted-array error)
    instead of reading stale KV."""
    eng, params = engine
    prompt = np.arange(5, 5 + 3 * CHUNK, dtype=np.int32)
    first, _ = eng.prefill(params, prompt[:CHUNK], CHUNK)
    second, _ = eng.prefill(params, prompt[CHUNK:2 * CHUNK], CHUNK, existing_prefix=first,
                            donate=True)
    eng.prefill(params, prompt[2 * CHUNK:], CHUNK, existing_prefix=second, donate=True)
    with pytest.raises(RuntimeError, match="deleted"):
        jax.device_get(second.k[0])


def test_chunks_into_an_empty_prefix_equal_growing_chunks(engine):
    """A chunk loop that starts from `empty_prefix(n)` writes every chunk into the one
    array of the final size: one compiled program for all its chunks, and the same KV,
    positions, tokens and first token as the loop that grows its prefix."""
    eng, params = engine
    n = 100  # 7 chunks; a prefix of 128 entries (no other test of this module makes one)
    prompt = np.random.default_rng(7).integers(3, 128, n).astype(np.int32)
    empty = eng.empty_prefix(n)
    assert empty.k_pos.shape == (1, 128) and int(empty.length) == 0
    before = eng.trace_counts()["prefill"]
    prefix = empty
    for s in range(0, n, CHUNK):
        piece = prompt[s:s + CHUNK]
        prefix, first = eng.prefill(params, piece, len(piece), existing_prefix=prefix,
                                    seed=3, donate=True)
    assert eng.trace_counts()["prefill"] - before == 1  # (16, 128): every chunk's
    assert empty.k[0].is_deleted()
    want, want_first, _ = _chunked(eng, params, prompt, donate=True)  # grows 16 .. 128
    for a, b in zip(jax.tree.leaves(_host(prefix)), jax.tree.leaves(_host(want)), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(first.data), np.asarray(want_first.data))
    with pytest.raises(ValueError, match=r"129 tokens: length must be in \[1, max_seq_len 128\]"):
        eng.empty_prefix(129)
