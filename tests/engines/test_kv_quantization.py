"""The int8 KV cache: per token and kv head scales, error bounds, insert isolation,
decoding that stays close to the float cache (same weights, same prompts), and int8 pages
that decode as the int8 contiguous cache does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine
from engines.kv_quant import SCALE_BYTES, dequantize_kv, quantize_kv, unpack_entries
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import PagePlanner
from sharding import load_preset
from tests.engines.mixed_driver import run_mixed

CFG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28], list(range(40, 70))]


def _engine(kv_dtype, devices=1, sharding="replicated", **config):
    # The unrolled layers, whose cache is per layer as the layout checks below read it
    # (the stacked one of a scan: tests/engines/test_layer_scan.py).
    config = {"layers": "loop", **config}
    return create_engine(
        CFG, config=EngineConfig(max_concurrent_decodes=4, max_prefill_length=32,
                                 max_seq_len=64, kv_dtype=kv_dtype, **config),
        devices=jax.devices()[:devices], sharding=load_preset(sharding), seed=5)


@pytest.fixture(scope="module")
def engines():
    f, q = _engine("auto"), _engine("int8")
    return f, q, f.load_params()


def test_quantize_kv_error_bound():
    x = np.random.default_rng(0).normal(size=(3, 7, 2, 16)).astype(np.float32)
    x[0, 0, 1] = 0.0
    q, s = quantize_kv(jnp.asarray(x))
    assert q.dtype == jnp.int8 and s.shape == (3, 7, 2)
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 127, rtol=1e-6)
    dq = np.asarray(dequantize_kv(q, s, jnp.float32))
    assert np.all(np.abs(dq - x) <= np.asarray(s)[..., None] / 2 + 1e-7)
    assert np.all(dq[0, 0, 1] == 0)


def test_bad_kv_dtype_is_named():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int4")


def test_int8_cache_layout_and_insert_isolation(engines):
    _, eng, params = engines
    state = eng.init_decode_state()
    # keys [B, K, H, S], values [B, K, S, H], scales [B, K, S] (engines.kv_cache)
    assert state.k[0].dtype == jnp.int8 and state.k[0].shape == (4, 2, 16, 64)
    assert state.v[0].shape == (4, 2, 64, 16) and state.k_scale[0].shape == (4, 2, 64)
    prefix, _ = eng.prefill(params, PROMPTS[0], len(PROMPTS[0]))
    state = eng.insert(prefix, state, 0)
    state, _ = eng.generate(params, state)
    before = jax.tree.map(np.array, state)
    p2, _ = eng.prefill(params, PROMPTS[1], len(PROMPTS[1]))
    after = jax.tree.map(np.array, eng.insert(p2, state, 2))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a[[0, 1, 3]], b[[0, 1, 3]])
    # The inserted rows hold the prefix, quantized: scale * value within half a step.
    n = len(PROMPTS[1])
    ks, vs = after.k_scale[1][2, :, :n], after.v_scale[1][2, :, :n]  # (K, n)
    k = after.k[1][2, :, :, :n].astype(np.float32) * ks[:, None, :]  # (K, H, n)
    err = np.abs(k - np.transpose(np.asarray(p2.k[1][0, :n]), (1, 2, 0)))
    assert np.all(err <= ks[:, None, :] / 2 + 1e-6)
    v = dequantize_kv(after.v[1][2, :, :n], vs, jnp.float32)  # (K, n, H)
    err = np.abs(np.asarray(v) - np.transpose(np.asarray(p2.v[1][0, :n]), (1, 0, 2)))
    assert np.all(err <= vs[:, :, None] / 2 + 1e-6)


def test_int8_cache_decodes_close_to_float(engines):
    f, q, params = engines
    rf = generate_many(f, params, PROMPTS, max_tokens=24, ignore_eos=True)
    rq = generate_many(q, params, PROMPTS, max_tokens=24, ignore_eos=True)
    for a, b in zip(rf, rq, strict=True):
        # Compare the chosen token's log-prob while both runs still agree on the text.
        same = 0
        while same < len(a.token_ids) and a.token_ids[same] == b.token_ids[same]:
            same += 1
        assert same >= 8, (a.token_ids, b.token_ids)
        diff = np.abs(np.array(a.logprobs[:same]) - np.array(b.logprobs[:same]))
        assert diff.max() < 0.05, diff
    assert q.trace_counts()["generate"] == 1


@pytest.mark.slow
def test_int8_cache_tp_matches_one_device(engines):
    _, q, params = engines
    tp = _engine("int8", devices=2, sharding="tp")
    want = generate_many(q, params, PROMPTS, max_tokens=12, ignore_eos=True)
    got = generate_many(tp, tp.load_params(), PROMPTS, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("layers", ["loop", "scan"])
def test_int8_pages_decode_as_the_int8_contiguous_cache(engines, layers):
    """Paged int8 (pages of 4, unrolled and scanned layers) against the contiguous int8
    cache: the same greedy tokens and log-probs, 4 prompts on 4 slots; each page entry
    holds the prefix's values quantized with its f32 scale after them."""
    _, contiguous, params = engines
    paged = PagePlanner(_engine("int8", kv_layout="paged", page_size=4, layers=layers))
    pparams = paged.load_params()  # the same seed: the same weights
    prompts = PROMPTS + [[7] * 13]
    want = generate_many(contiguous, params, prompts, max_tokens=20, ignore_eos=True)
    got = generate_many(paged, pparams, prompts, max_tokens=20, ignore_eos=True)
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    if layers == "scan":
        return
    state = paged.engine.init_decode_state()
    K, _, ps, width = state.k[0].shape
    assert state.k[0].dtype == jnp.int8 and width == CFG.head_dim + SCALE_BYTES
    prefix, _ = paged.prefill(pparams, PROMPTS[2], len(PROMPTS[2]))
    state = paged.insert(prefix, state, 1)
    pages = paged.kv_pages.pages_of(1)
    n = len(PROMPTS[2])
    entries = np.asarray(state.k[1])[:, pages].reshape(K, -1, width)[:, :n]  # (K, n, H + 4)
    scale = entries[..., CFG.head_dim:].copy().view(np.float32)[..., 0]  # (K, n)
    exact = np.transpose(np.asarray(prefix.k[1][0, :n]), (1, 0, 2))  # (K, n, H)
    np.testing.assert_allclose(scale, np.abs(exact).max(-1) / 127, rtol=1e-6)
    got_k = np.asarray(unpack_entries(jnp.asarray(entries), jnp.float32))
    assert np.all(np.abs(got_k - exact) <= scale[..., None] / 2 + 1e-6)
    # Prefix-cache blocks read from int8 pages come back in the model dtype, dequantized.
    blocks = np.asarray(paged.page_blocks(state, pages[:2]))[:2]  # (2, L, 2, ps, K, H)
    assert blocks.dtype == np.float32
    np.testing.assert_array_equal(
        np.transpose(blocks[:, 1, 0], (2, 0, 1, 3)).reshape(K, -1, CFG.head_dim)[:, :2 * ps],
        got_k[:, :2 * ps])
    paged.free_slot(1)


def test_int8_pages_under_mixed_steps_stay_close_to_float():
    """The mixed step's chunks attend over the pool, so with int8 pages a prompt sees its
    own keys quantized (as its decode steps do): the tokens stay those of float pages for
    a while and the programs are the same small set."""
    runs = []
    for kv in ("auto", "int8"):
        eng = _engine(kv, kv_layout="paged", page_size=4)
        runs.append(run_mixed(eng, eng.load_params(), PROMPTS, max_tokens=16, chunk=8,
                              budget=12, widest=True))
    for a, b in zip(runs[0].outputs, runs[1].outputs, strict=True):
        same = 0
        while same < len(a) and a[same] == b[same]:
            same += 1
        assert same >= 6, (a, b)
    assert runs[1].mixed_steps >= 2
