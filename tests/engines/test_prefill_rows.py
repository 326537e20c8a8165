"""Several prompts in one prefill call (engines/prefill_program.py PrefillRows): each row
gives what a prefill of its prompt alone gives (through its own LoRA adapter too), the
shapes are the few the config names, and what a call cannot take is refused by name."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams, create_engine
from engines.config import ModelConfig

CFG = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def _decode(eng, params, pairs, steps=6):
    """Each slot's tokens: its prefix (with the first-token results and its row there)
    inserted into slot 0, 1, ..., then `steps` generate steps; the slots freed after."""
    state = eng.init_decode_state()
    for slot, (prefix, _, _) in enumerate(pairs):
        state = eng.insert(prefix, state, slot)
    out = [[res.to_host().tokens(row)[0]] for _, res, row in pairs]
    for _ in range(steps):
        state, res = eng.generate(params, state)
        host = res.to_host()
        for slot in range(len(pairs)):
            out[slot] += host.tokens(slot)  # several with speculative decoding
    for slot in range(len(pairs)):
        eng.free_slot(slot)
    return out


@pytest.fixture(scope="module")
def engine():
    eng = create_engine(CFG, config=EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=96, prefill_batch=4),
        devices=jax.devices()[:1])
    return eng, eng.load_params()


def test_shapes_are_powers_of_two_within_one_prefills_tokens(engine):
    eng, _ = engine
    assert eng.prefill_buckets() == (16, 32, 64)
    assert eng.prefill_row_shapes() == [(2, 16), (4, 16), (2, 32)]
    assert eng.prefill_rows_for(4, 16) == 4
    assert eng.prefill_rows_for(3, 16) == 3  # padded to 4 rows: a quarter
    assert eng.prefill_rows_for(9, 10) == 4
    assert eng.prefill_rows_for(5, 20) == 2  # bucket 32 holds two
    assert eng.prefill_rows_for(3, 40) == 1  # bucket 64: one prompt a call
    one = create_engine(CFG, config=EngineConfig(max_prefill_length=64, max_seq_len=96),
                        devices=jax.devices()[:1])
    assert one.prefill_row_shapes() == [] and one.prefill_rows_for(4, 16) == 1


def test_each_row_is_its_prompt_prefilled_alone(engine):
    eng, params = engine
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, size=n).astype(np.int32) for n in (5, 16, 1)]
    samplings = [SamplingParams(), SamplingParams(temperature=0.9, seed=11),
                 SamplingParams(temperature=1.0, top_k=4)]
    seeds = [3, None, 5]  # None: the params' seed (11)
    prefixes, res = eng.prefill_rows(params, prompts, samplings=samplings, seeds=seeds)
    assert len(prefixes) == 3 and res.to_host().data.shape[0] == 4  # one padding row
    host = res.to_host()
    for i, p in enumerate(prompts):
        alone, first = eng.prefill(params, p, len(p), sampling=samplings[i], seed=seeds[i])
        one = first.to_host()
        assert host.tokens(i) == one.tokens(0)
        assert host.length(i) == one.length(0) == len(p) + 1
        assert int(prefixes[i].length) == len(p) and int(prefixes[i].token) == one.token(0)
        np.testing.assert_array_equal(prefixes[i].sampling.key, alone.sampling.key)
        np.testing.assert_array_equal(prefixes[i].prompt_mask, alone.prompt_mask)
        np.testing.assert_array_equal(prefixes[i].k_pos, alone.k_pos)
        for a, b in zip((*alone.k, *alone.v), (*prefixes[i].k, *prefixes[i].v), strict=True):
            np.testing.assert_allclose(np.asarray(b)[:, :len(p)], np.asarray(a)[:, :len(p)],
                                       rtol=1e-5, atol=1e-5)


def test_rows_decode_as_prompts_prefilled_alone(engine):
    eng, params = engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 100, size=n).astype(np.int32) for n in (9, 14, 3, 16)]

    prefixes, first = eng.prefill_rows(params, prompts, samplings=[None] * 4)
    batched = _decode(eng, params, [(p, first, row) for row, p in enumerate(prefixes)])
    alone = _decode(eng, params, [(*eng.prefill(params, p, len(p)), 0) for p in prompts])
    assert batched == alone


def test_one_trace_per_shape(engine):
    eng, params = engine
    before = eng.trace_counts()["prefill"]
    for r, b in eng.prefill_row_shapes():
        for n in range(2):
            eng.prefill_rows(params, [np.arange(1, b + 1 - n)] * r, samplings=[None] * r)
    traced = eng.trace_counts()["prefill"] - before
    assert traced <= len(eng.prefill_row_shapes())
    eng.prefill_rows(params, [np.arange(1, 4)] * 3, samplings=[None] * 3)  # padded to 4 x 16
    assert eng.trace_counts()["prefill"] - before == traced


def test_what_a_call_cannot_take_is_named(engine):
    eng, params = engine
    with pytest.raises(ValueError, match="2 to 4 prompts, got 1"):
        eng.prefill_rows(params, [np.arange(1, 4)], samplings=[None])
    with pytest.raises(ValueError, match="2 to 4 prompts, got 5"):
        eng.prefill_rows(params, [np.arange(1, 4)] * 5, samplings=[None] * 5)
    with pytest.raises(ValueError, match="exceed the 64 tokens one prefill call runs"):
        eng.prefill_rows(params, [np.arange(1, 40)] * 2, samplings=[None] * 2)
    with pytest.raises(ValueError, match="need 2 samplings and seeds"):
        eng.prefill_rows(params, [np.arange(1, 4)] * 2, samplings=[None])


@pytest.mark.parametrize("fields, match", [
    ({"prefill_batch": 0}, r"prefill_batch \(--prefill-batch\) must be a positive integer"),
])
def test_config_refusals(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)


def test_rows_through_their_own_adapters_decode_as_prompts_prefilled_alone(tmp_path):
    """A LoRA engine: rows for adapters a, b, the base model and a again give what each
    prompt gives alone through its adapter, first token and decode; the adapters change
    the answers."""
    from tests.engines.lora_files import write_adapter

    eng = create_engine(CFG, config=EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=96, prefill_batch=4,
        max_loras=2, max_lora_rank=8), devices=jax.devices()[:1], seed=3)
    for name, seed in (("a", 1), ("b", 2)):
        eng.load_adapter(name, write_adapter(tmp_path / name, CFG, ["q_proj", "v_proj",
                                                                    "down_proj"], seed=seed)[0])
    params = eng.load_params()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 100, size=n).astype(np.int32) for n in (9, 14, 3, 12)]
    names = ["a", "b", None, "a"]

    prefixes, first = eng.prefill_rows(params, prompts, samplings=[None] * 4, adapters=names)
    assert [int(p.adapter_id) != 0 for p in prefixes] == [True, True, False, True]
    batched = _decode(eng, params, [(p, first, row) for row, p in enumerate(prefixes)])
    del prefixes, first
    alone = _decode(eng, params, [(*eng.prefill(params, p, len(p), adapter=n), 0)
                                  for p, n in zip(prompts, names, strict=True)])
    assert batched == alone
    base = _decode(eng, params, [(*eng.prefill(params, p, len(p)), 0) for p in prompts])
    assert base[0] != alone[0] and base[1] != alone[1] and base[2] == alone[2]


def test_rows_carry_the_draft_models_kv():
    """With a draft model (speculative "draft:PATH:K") each row's prefix holds the draft's
    KV of its prompt as a prefill alone makes it, and the verify steps after give the same
    tokens (the draft's proposals read that KV)."""
    from jetserve.model_loading import RANDOM_MODELS

    draft_cfg = RANDOM_MODELS["tiny"]
    cfg = ModelConfig(vocab_size=draft_cfg.vocab_size, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    eng = create_engine(cfg, config=EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=96, prefill_batch=4,
        speculative="draft:random:tiny:2"), devices=jax.devices()[:1], seed=3,
        draft_config=draft_cfg)
    params = eng.load_params()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 100, size=n).astype(np.int32) for n in (9, 14, 3)]
    prefixes, first = eng.prefill_rows(params, prompts, samplings=[None] * 3)
    for p, prefix in zip(prompts, prefixes, strict=True):
        alone, _ = eng.prefill(params, p, len(p))
        assert len(prefix.draft_k) == len(alone.draft_k) == draft_cfg.num_layers
        for a, b in zip((*alone.draft_k, *alone.draft_v), (*prefix.draft_k, *prefix.draft_v),
                        strict=True):
            np.testing.assert_allclose(np.asarray(b)[:, :len(p)], np.asarray(a)[:, :len(p)],
                                       rtol=1e-5, atol=1e-5)

    batched = _decode(eng, params, [(p, first, row) for row, p in enumerate(prefixes)])
    alone = _decode(eng, params, [(*eng.prefill(params, p, len(p)), 0) for p in prompts])
    assert batched == alone
