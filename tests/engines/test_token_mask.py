"""Token masks in the jitted step (engines/token_mask.py): packed bits unpack to the
allowed set, sampling never leaves it, and steps without a mask compile as before."""

import jax
import jax.numpy as jnp
import numpy as np

from engines import EngineConfig, SamplingParams, create_engine
from engines.config import ModelConfig
from engines.sampling import SlotSampling, sample
from engines.token_mask import allow_all, apply_token_mask, mask_words


def _mask_of(allowed: list[set[int]], V: int) -> np.ndarray:
    mask = np.zeros((len(allowed), mask_words(V)), np.int32)
    for b, ids in enumerate(allowed):
        bits = np.zeros(mask_words(V) * 32, np.uint8)
        bits[list(ids)] = 1
        mask[b] = np.packbits(bits, bitorder="little").view(np.int32)
    return mask


def test_bits_unpack_to_the_allowed_tokens():
    V = 70  # not a multiple of 32: the last word is partly padding
    allowed = [{0, 31, 32, 69}, set(range(V)), {5}]
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, V)), jnp.float32)
    out = np.asarray(apply_token_mask(logits, _mask_of(allowed, V)))
    for b, ids in enumerate(allowed):
        kept = set(np.flatnonzero(out[b] > -1e29).tolist())
        assert kept == ids
        np.testing.assert_array_equal(out[b, sorted(ids)], np.asarray(logits)[b, sorted(ids)])
    assert (allow_all(2, V) == -1).all() and allow_all(2, V).shape == (2, 3)


def test_sampling_stays_in_the_mask():
    V, B = 50, 4
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
    allowed = [{3, 7}, {49}, {0, 1, 2, 3, 4}, set(range(V))]
    mask = _mask_of(allowed, V)
    rows = [SlotSampling.from_params(SamplingParams(temperature=t, top_k=k), seed=s)
            for s, (t, k) in enumerate([(0.0, 0), (1.0, 0), (2.0, 3), (0.0, 0)])]
    s = jax.tree.map(lambda *x: jnp.concatenate(x), *rows)
    none = jnp.zeros((B, V), bool)
    counts = jnp.zeros((B, V), jnp.int32)
    for _ in range(20):
        tok, key = sample(logits, s, none, counts, token_mask=mask)
        s = SlotSampling(**{**s.__dict__, "key": key})
        for b, ids in enumerate(allowed):
            assert int(tok[b]) in ids
    greedy = np.asarray(logits)
    assert int(tok[0]) == max((3, 7), key=lambda t: greedy[0, t])
    assert int(tok[3]) == int(greedy[3].argmax())  # all allowed: the free argmax


def test_masked_step_is_one_more_program_and_never_recompiles():
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    eng = create_engine(cfg, config=EngineConfig(max_concurrent_decodes=2, max_prefill_length=16,
                                                 max_seq_len=32), devices=jax.devices()[:1])
    params = eng.load_params()
    state = eng.init_decode_state()
    only = _mask_of([{42}, set(range(100))], 100)
    prefix, first = eng.prefill(params, [1, 2, 3], 3, token_mask=_mask_of([{17}], 100))
    assert first.to_host().token(0) == 17
    state = eng.insert(prefix, state, 0)
    for i in range(6):
        state, res = eng.generate(params, state, only if i % 2 else None)
        if i % 2:
            assert res.to_host().token(0) == 42
    prefix, _ = eng.prefill(params, [4, 5], 2)  # the unmasked prefill is the same program
    assert eng.trace_counts() == {"prefill": 1, "insert": 1, "generate": 2,
                                  "prompt_logprobs": 0}
