"""Sampling inside the jitted step: exact masks on hand-made logits, seeds, distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines.sampling import SamplingParams, SlotSampling, apply_penalties, filter_logits, sample

NEG = -1e29


def _rows(params: list[SamplingParams], seed=0) -> SlotSampling:
    rows = [SlotSampling.from_params(p, seed + i) for i, p in enumerate(params)]
    return jax.tree.map(lambda *x: jnp.concatenate(x), *rows)


def _kept(masked):
    return [set(np.nonzero(np.asarray(r) > NEG)[0].tolist()) for r in masked]


def test_top_k_top_p_min_p_masks_are_exact():
    # probabilities of softmax(log p) are exactly p
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = jnp.asarray(np.log(np.stack([p] * 6)), jnp.float32)
    s = _rows([
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.7),  # 0.4 + 0.3 reaches 0.7
        SamplingParams(temperature=1.0, top_p=0.71),  # needs the third token
        SamplingParams(temperature=1.0, min_p=0.3),  # keep p >= 0.12
        # applied in turn, each on the renormalized survivors: top-4 -> (.42, .32, .16,
        # .11); top-p 0.8 keeps three -> (.47, .35, .18); min-p 0.4 drops .18 < .4 x .47
        SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.4),
        SamplingParams(temperature=1.0),
    ])
    kept = _kept(filter_logits(logits, s))
    assert kept == [{0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2}, {0, 1}, {0, 1, 2, 3, 4}]


def test_temperature_scales_logits():
    logits = jnp.asarray([[1.0, 2.0, 4.0]])
    out = filter_logits(logits, _rows([SamplingParams(temperature=0.5)]))
    np.testing.assert_allclose(np.asarray(out), [[2.0, 4.0, 8.0]])


def test_penalties():
    logits = jnp.asarray([[2.0, -2.0, 1.0, 1.0]])
    s = _rows([SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                              presence_penalty=0.25)])
    prompt_mask = jnp.asarray([[True, True, False, False]])
    counts = jnp.asarray([[0, 0, 3, 0]], jnp.int32)
    out = np.asarray(apply_penalties(logits, s, prompt_mask, counts))
    # token 0: prompt, positive -> /2; token 1: prompt, negative -> *2;
    # token 2: generated 3 times -> /2 (seen), - 0.5*3, - 0.25; token 3 untouched
    np.testing.assert_allclose(out, [[1.0, -4.0, 0.5 - 1.5 - 0.25, 1.0]])


def test_greedy_rows_ignore_rng_and_seeded_rows_repeat():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
    none = jnp.zeros((3, 50), bool)
    zero = jnp.zeros((3, 50), jnp.int32)
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    a, ka = sample(logits, _rows(params, seed=7), none, zero)
    b, kb = sample(logits, _rows(params, seed=7), none, zero)
    assert int(a[0]) == int(jnp.argmax(logits[0]))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ka, kb)
    draws = {tuple(np.asarray(sample(logits, _rows(params, seed=s), none, zero)[0]))
             for s in range(10)}
    assert len(draws) > 1  # different seeds give different samples


def test_temperature_one_follows_softmax_chi_square():
    V, n = 8, 4000
    probs = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    logits = jnp.asarray(np.log(probs)[None].repeat(n, 0), jnp.float32)
    s = _rows([SamplingParams(temperature=1.0)] * 1, seed=11)
    s = jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), s)
    s.key = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(n))
    toks, _ = jax.jit(sample)(logits, s, jnp.zeros((n, V), bool), jnp.zeros((n, V), jnp.int32))
    counts = np.bincount(np.asarray(toks), minlength=V)
    expected = probs * n
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 24.3  # 99.9th percentile of chi-square with 7 degrees of freedom


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                                         ("min_p", float("nan")), ("top_k", -3),
                                         ("seed", -1), ("repetition_penalty", 0.0)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**40])
def test_a_row_built_on_the_host_holds_jax_s_key_for_its_seed(seed):
    # The prefill's sampling row is numpy (no programs to compile before the first token);
    # its key must be the one jax.random.key(seed) makes, so seeded tokens stay the same.
    row = SlotSampling.from_params(SamplingParams(temperature=0.7, top_k=5, seed=seed), seed)
    assert row.key.dtype == np.uint32 and row.key.shape == (1, 2)
    np.testing.assert_array_equal(row.key[0], jax.random.key_data(jax.random.key(seed)))
    assert row.temperature.dtype == np.float32 and row.top_k.dtype == np.int32
    assert float(row.temperature[0]) == np.float32(0.7) and int(row.top_k[0]) == 5
