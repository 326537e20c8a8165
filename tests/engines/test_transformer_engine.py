"""Engine contract on a tiny random-weight model: insert isolation, prefill/decode
consistency with one forward pass, buckets, and no recompiles after warm-up."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, layer_scan, prefill_buckets
from engines.kv_cache import PrefillKV, window_sizes
from jetserve.offline import generate_many

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=24)


def _make():
    eng = create_engine(CFG, config=EngineConfig(max_concurrent_decodes=4,
                                                 max_prefill_length=40, max_seq_len=64),
                        devices=jax.devices()[:1], seed=3)
    return eng, eng.load_params()


@pytest.fixture(scope="module")
def engine():
    return _make()


def _np_state(state):
    """The state on the host; a stacked cache (scanned layers, [L, ...]) split into its
    layers, so every leaf's first axis is the slot in either layout."""
    state = jax.tree.map(lambda x: np.array(x), state)
    if not layer_scan.is_stacked(state.k, 4):
        return state
    return dataclasses.replace(state, **{
        f: layer_scan.cache_layers(getattr(state, f), 4 if f in ("k", "v") else 3)
        for f in layer_scan.CACHE_FIELDS if getattr(state, f)})


def test_buckets_any_maximum():
    assert prefill_buckets(40) == (16, 32, 40)
    assert prefill_buckets(16) == (16,)
    assert prefill_buckets(10) == (10,)
    assert prefill_buckets(100) == (16, 32, 64, 100)


def test_insert_leaves_other_slots_bit_identical(engine):
    eng, params = engine
    state = eng.init_decode_state()
    for slot, n in ((0, 9), (2, 30)):
        prefix, _ = eng.prefill(params, list(range(1, n + 1)), n)
        state = eng.insert(prefix, state, slot)
    state, _ = eng.generate(params, state)
    before = _np_state(state)
    prefix, _ = eng.prefill(params, [5, 6, 7], 3)
    after = _np_state(eng.insert(prefix, state, 1))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        keep = [s for s in range(4) if s != 1]
        np.testing.assert_array_equal(a[keep], b[keep])
    assert after.lengths[1] == 3 and not np.array_equal(before.k[0][1], after.k[0][1])


def test_other_slots_outputs_unchanged_by_insert(engine):
    eng, params = engine

    def run(with_insert):
        state = eng.init_decode_state()
        prefix, _ = eng.prefill(params, [3, 1, 4, 1, 5], 5)
        state = eng.insert(prefix, state, 0)
        out = []
        for step in range(6):
            if with_insert and step == 2:
                p2, _ = eng.prefill(params, [9, 2, 6], 3)
                state = eng.insert(p2, state, 3)
            state, res = eng.generate(params, state)
            out.append(np.asarray(res.data)[0])
        return np.stack(out)

    np.testing.assert_array_equal(run(False), run(True))


def test_prefill_plus_decode_equals_one_forward_pass(engine):
    eng, params = engine
    prompt = list(np.random.default_rng(1).integers(1, 96, size=29))
    r = generate_many(eng, params, [prompt], max_tokens=12, ignore_eos=True)[0]
    seq = prompt + r.token_ids
    T = len(seq)
    pos = jnp.arange(T)[None]
    logits = eng.model.apply({"params": params}, jnp.asarray([seq]), pos, PrefillKV(pos, None))
    logp = jax.nn.log_softmax(logits[0], -1)
    # Each generated token is the argmax of the full pass at the position before it, and
    # its log-prob matches (the window of 24 is crossed: 29 + 12 > 24).
    for i, t in enumerate(r.token_ids):
        row = logp[len(prompt) - 1 + i]
        assert int(jnp.argmax(row)) == t
        assert abs(float(row[t]) - r.logprobs[i]) < 1e-5


def test_window_sizes():
    assert window_sizes(1024) == (128, 256, 512, 1024)
    assert window_sizes(320) == (128, 256, 320)
    assert window_sizes(64) == (64,)


def test_decode_reads_through_growing_windows():
    # Full attention (no sliding window), so every cached key counts: two live slots cross
    # the 128 and 256 windows while a third slot sits empty (length S, never widening).
    cfg = dataclasses.replace(CFG, sliding_window=None)
    eng = create_engine(cfg, config=EngineConfig(max_concurrent_decodes=3,
                                                 max_prefill_length=128, max_seq_len=320),
                        devices=jax.devices()[:1], seed=5)
    params = eng.load_params()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 96, size=n).tolist() for n in (110, 7)]
    results = generate_many(eng, params, prompts, max_tokens=180, ignore_eos=True)
    for prompt, r in zip(prompts, results, strict=True):
        seq = prompt + r.token_ids
        pos = jnp.arange(len(seq))[None]
        logits = eng.model.apply({"params": params}, jnp.asarray([seq]), pos,
                                 PrefillKV(pos, None))
        logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
        rows = logp[len(prompt) - 1:len(seq) - 1]
        np.testing.assert_array_equal(rows.argmax(-1), r.token_ids)
        np.testing.assert_allclose(rows[np.arange(len(r.token_ids)), r.token_ids], r.logprobs,
                                   atol=1e-5)
    # The compiled step moves no cache-sized array: no copy or transpose as large as one
    # window of one layer's cache (layouts in engines.kv_cache).
    hlo = eng._generate_jit.lower(params, eng.init_decode_state(), None).compile().as_text()
    window = 3 * cfg.num_kv_heads * 128 * cfg.head_dim
    for shape in re.findall(r"= \w+\[([\d,]*)\]\S* (?:copy|transpose)\(", hlo):
        assert np.prod([int(d) for d in shape.split(",") if d]) < window, shape


def test_prefix_continuation_equals_whole_prompt(engine):
    eng, params = engine
    prompt = list(range(2, 36))
    whole, first = eng.prefill(params, prompt, len(prompt))
    part, _ = eng.prefill(params, prompt[:20], 20)
    cont, first2 = eng.prefill(params, prompt[20:], 14, existing_prefix=part)
    assert first.to_host().token(0) == first2.to_host().token(0)
    assert int(cont.length) == 34
    outs = []
    for prefix in (whole, cont):
        state = eng.insert(prefix, eng.init_decode_state(), 2)
        toks = []
        for _ in range(5):
            state, res = eng.generate(params, state)
            toks.append(res.to_host().token(2))
        outs.append(toks)
    assert outs[0] == outs[1]


def test_nothing_recompiles_after_warmup():
    eng, params = _make()  # its own engine, so the counts are only this test's
    rng = np.random.default_rng(0)
    for b in eng.prefill_buckets():  # warm every bucket once
        generate_many(eng, params, [[1] * b], max_tokens=2)
    warm = eng.trace_counts()
    lengths = rng.integers(1, 41, size=12)
    prompts = [rng.integers(1, 96, size=n).tolist() for n in lengths]
    generate_many(eng, params, prompts, max_tokens=5)
    assert eng.trace_counts() == warm
    # generate once; prefill once per bucket; insert once per prefix bucket (a prefix
    # keeps its bucket's length so a short prompt moves a short cache between slices).
    n = len(eng.prefill_buckets())
    assert warm["generate"] == 1 and warm["insert"] == n and warm["prefill"] == n


def test_chunked_prefill_compiles_a_few_shapes_not_one_per_chunk():
    """A 250-token prompt in 16 chunks of 16: a continued prefix grows to powers of two
    (32, 64, 128, 256), so prefill compiles 5 programs, and a second prompt of another
    length none; the chunked prefix gives the whole prompt's tokens."""
    eng = create_engine(CFG, config=EngineConfig(max_concurrent_decodes=2,
                                                 max_prefill_length=256, max_seq_len=260),
                        devices=jax.devices()[:1], seed=3)
    params = eng.load_params()
    rng = np.random.default_rng(1)

    def chunked(prompt):
        prefix = None
        for start in range(0, len(prompt), 16):
            piece = prompt[start:start + 16]
            prefix, first = eng.prefill(params, piece, len(piece), existing_prefix=prefix)
        return prefix, first

    prompt = rng.integers(1, 96, size=250).tolist()
    before = eng.trace_counts()["prefill"]
    prefix, first = chunked(prompt)
    assert eng.trace_counts()["prefill"] - before == 5
    assert prefix.k[0].shape[1] == 256 and int(prefix.length) == 250
    chunked(rng.integers(1, 96, size=201).tolist())
    assert eng.trace_counts()["prefill"] - before == 5
    outs = []
    for p, f in (chunked(prompt), eng.prefill(params, prompt, len(prompt))):
        state = eng.insert(p, eng.init_decode_state(), 1)
        toks = [f.to_host().token(0)]
        for _ in range(4):
            state, res = eng.generate(params, state)
            toks.append(res.to_host().token(1))
        outs.append(toks)
    assert outs[0] == outs[1]


def test_full_slot_stops_being_valid(engine):
    eng, params = engine
    r = generate_many(eng, params, [list(range(1, 41))], max_tokens=100, ignore_eos=True)[0]
    assert r.finish_reason == "length"
    # max_seq_len bounds prompt + generated tokens, as a model's context length does.
    assert len(r.prompt_ids) + len(r.token_ids) == eng.max_seq_len


def test_prompt_longer_than_max_is_rejected(engine):
    eng, params = engine
    with pytest.raises(ValueError, match="max_prefill_length"):
        eng.prefill(params, list(range(41)), 41)
