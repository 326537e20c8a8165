"""Prompt log-probs of prompts longer than max_prefill_length: scored chunk by chunk, each
chunk over the KV of the ones before, they equal one pass over the whole prompt."""

import jax
import numpy as np
import pytest

from engines import EngineConfig
from jetserve.model_loading import build_engine

FIELDS = ("token_logprobs", "top_ids", "top_logprobs", "greedy")


def _engine(prefill: int, seq: int = 128, devices: int = 1, sharding: str = "replicated"):
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=prefill, max_seq_len=seq)
    e = build_engine("random:tiny", devices=jax.devices()[:devices], sharding=sharding,
                     engine_config=cfg)
    return e, e.load_params()


@pytest.fixture(scope="module")
def whole():
    return _engine(prefill=128)


@pytest.fixture(scope="module")
def chunked():
    # The paged engine scores with the contiguous engine's programs (it inherits them).
    return _engine(prefill=16)


@pytest.mark.parametrize("n", [100, 17])
def test_chunked_scores_equal_one_pass(whole, chunked, n):
    """Chunks of 16 (n = 17: a last chunk of one token, scored by the previous chunk's
    last logit; no bucket of this engine holds a whole prompt) against one pass of 128."""
    chunked, params = chunked
    tokens = np.random.default_rng(n).integers(1, 256, size=n)
    _check_equal(chunked.prompt_logprobs(params, tokens), whole[0].prompt_logprobs(whole[1], tokens))


def test_chunked_scores_with_kv_heads_sharded(whole):
    """tp over 2 devices (random:tiny's 2 kv heads, one per device): the chunks' cache is
    sharded by kv head as a prefix is."""
    eng, params = _engine(prefill=16, devices=2, sharding="tp")
    tokens = np.random.default_rng(3).integers(1, 256, size=70)
    _check_equal(eng.prompt_logprobs(params, tokens), whole[0].prompt_logprobs(whole[1], tokens))


def _check_equal(got, want):
    for f in FIELDS:
        a, b = np.asarray(getattr(got, f)), np.asarray(getattr(want, f))
        assert a.shape == b.shape, f
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f)
        else:
            np.testing.assert_array_equal(a, b, err_msg=f)
    assert np.isnan(got.token_logprobs[0]) and got.greedy[0] == -1


def test_scoring_past_max_seq_len_names_the_limit():
    e, params = _engine(prefill=16, seq=64)
    with pytest.raises(ValueError, match=r"65 tokens is longer than max_seq_len 64.*--max-seq-len"):
        e.prompt_logprobs(params, np.ones(65, np.int32))
