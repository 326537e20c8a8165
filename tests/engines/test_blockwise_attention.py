"""Blockwise prefill attention against the one-shot attention, the backend seam that
picks it, and the platform kernels' wrappers checked on the CPU (Pallas in interpret
mode, the cuDNN wrapper's masks through jax's XLA implementation)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine
from engines import attention_kernels as kernels
from engines.attention import attention, decode_attention
from engines.backend import Backend, backend_for
from engines.blockwise_attention import blockwise_attention

N, K, H = 4, 2, 8


def _inputs(T, S, q_pos, k_pos, seed=0):
    rng = np.random.default_rng(seed)
    q_pos, k_pos = np.atleast_2d(q_pos), np.atleast_2d(k_pos)
    B = q_pos.shape[0]
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    return q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)


def _sees_a_key(q_pos, k_pos, window):
    qp, kp = np.asarray(q_pos)[:, :, None], np.asarray(k_pos)[:, None, :]
    vis = (kp >= 0) & (kp <= qp)
    if window is not None:
        vis &= kp > qp - window
    return vis.any(-1)  # (B, T)


def _check(q, k, v, q_pos, k_pos, window, block_q=16, block_k=32, softcap=None, sinks=None):
    want = np.asarray(attention(q, k, v, q_pos, k_pos, window, softcap, sinks))
    f = jax.jit(functools.partial(blockwise_attention, block_q=block_q, block_k=block_k,
                                  softcap=softcap, sinks=sinks), static_argnums=(5,))
    got = np.asarray(f(q, k, v, q_pos, k_pos, window))
    rows = _sees_a_key(q_pos, k_pos, window)
    np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[~rows], 0.0)  # a row that sees nothing: zeros


def _prefix_chunk(prefix, T, S):
    """A chunk of T tokens after `prefix` ones, keys in a buffer of S entries (the
    engine's grown prefix): key j at position j, empty past the chunk."""
    j = np.arange(S)
    return prefix + np.arange(T), np.where(j < prefix + T, j, -1)


@pytest.mark.parametrize("window", [None, 7, 40])
def test_whole_prompt_uneven_lengths(window):
    T = 77  # not a multiple of either block
    j = np.arange(T)
    _check(*_inputs(T, T, j, np.where(j < 70, j, -1)), window)  # 7 padding entries


@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores(window):
    """Gemma 2's attention-logit cap, blockwise as one-shot (and it changes the result)."""
    q, k, v, q_pos, k_pos = _inputs(50, 50, np.arange(50), np.arange(50))
    q = 4 * q  # scores well past the cap
    _check(q, k, v, q_pos, k_pos, window, softcap=1.5)
    capped = attention(q, k, v, q_pos, k_pos, window, 1.5)
    assert np.max(np.abs(np.asarray(capped - attention(q, k, v, q_pos, k_pos, window)))) > 1e-2


def _sink_reference(q, k, v, q_pos, k_pos, window, sinks):
    """Attention with sinks in numpy (float64): each row's softmax over its visible keys'
    scaled scores and its head's sink logit, the sink's share dropped."""
    q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    B, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros_like(q)
    for b, t, n in np.ndindex(B, T, N):
        qp, kp = int(q_pos[b, t]), np.asarray(k_pos[b])
        vis = (kp >= 0) & (kp <= qp) & ((kp > qp - window) if window else True)
        s = k[b, vis, n // G] @ q[b, t, n] / np.sqrt(H)
        m = max(s.max(initial=-np.inf), sinks[n])
        e = np.exp(s - m)
        out[b, t, n] = e @ v[b, vis, n // G] / (e.sum() + np.exp(sinks[n] - m))
    return out


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks(window):
    """gpt-oss's sinks: the one-shot, blockwise (several key blocks, a chunk after a
    prefix, a row that sees nothing) and decode paths against a float64 reference; the
    sinks change the result."""
    sinks = jnp.asarray([1.5, -0.5, 3.0, 0.0], jnp.float32)  # [N]
    q_pos, k_pos = _prefix_chunk(20, 30, 64)
    k_pos[0] = -1  # position 0 of the chunk's prefix empty: every row still sees a key
    q, k, v, qp, kp = _inputs(30, 64, q_pos, k_pos, seed=7)
    want = _sink_reference(q, k, v, qp, kp, window, sinks)
    got = attention(q, k, v, qp, kp, window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.asarray(got - attention(q, k, v, qp, kp, window)))) > 1e-2
    _check(q, k, v, qp, kp, window, block_q=8, block_k=8, sinks=sinks)
    j = np.arange(40)
    _check(*_inputs(40, 40, j, np.where(j > 0, j, -1), seed=8), window, block_q=8, block_k=8,
           sinks=sinks)  # query 0 sees no key: zeros, as without sinks
    # One new token per row over a decode cache's layout ([B, K, H, S], [B, K, S, H]),
    # and several (speculative verification).
    for t in (slice(29, 30), slice(26, 30)):
        dec = decode_attention(q[:, t], jnp.transpose(k, (0, 2, 3, 1)),
                               jnp.transpose(v, (0, 2, 1, 3)), qp[:, t], kp, window,
                               sinks=sinks)
        np.testing.assert_allclose(np.asarray(dec), want[:, t], rtol=1e-5, atol=1e-5)
    tiled = Backend(block_q=8, block_k=8)  # the seam passes them on
    np.testing.assert_allclose(np.asarray(tiled.attention(q, k, v, qp, kp, window,
                                                          sinks=sinks)), want, atol=1e-5)


def _chunked_reference(q, k, v, q_pos, k_pos, window, chunk):
    """Attention in numpy (float64) where a query sees the keys of its own chunk of
    `chunk` positions only (causal, within the window)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    qp, kp = np.asarray(q_pos), np.asarray(k_pos)
    out = np.zeros(q.shape)
    for b, t, n in np.ndindex(*q.shape[:3]):
        vis = (kp[b] >= 0) & (kp[b] <= qp[b, t]) & (kp[b] // chunk == qp[b, t] // chunk)
        if window is not None:
            vis &= kp[b] > qp[b, t] - window
        s = k[b, vis, n // (N // K)] @ q[b, t, n] / np.sqrt(H)
        e = np.exp(s - s.max())
        out[b, t, n] = e @ v[b, vis, n // (N // K)] / e.sum()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_chunked_attention(window):
    """Llama 4's chunks of 8 positions: the one-shot, blockwise (a chunk of the prompt
    after a prefix, over several key blocks; blocks before a query's chunk skipped) and
    decode paths against a float64 reference; the chunks change the result."""
    q_pos, k_pos = _prefix_chunk(20, 30, 64)
    q, k, v, qp, kp = _inputs(30, 64, q_pos, k_pos, seed=9)
    want = _chunked_reference(q, k, v, qp, kp, window, 8)
    got = attention(q, k, v, qp, kp, window, chunk=8)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.asarray(got - attention(q, k, v, qp, kp, window)))) > 1e-2
    for bq, bk in ((8, 8), (4, 16)):
        f = jax.jit(functools.partial(blockwise_attention, block_q=bq, block_k=bk, chunk=8),
                    static_argnums=(5,))
        np.testing.assert_allclose(np.asarray(f(q, k, v, qp, kp, window)), want, rtol=1e-5,
                                   atol=1e-5)
    for t in (slice(29, 30), slice(26, 30)):  # a decode cache's layout, one or more new
        dec = decode_attention(q[:, t], jnp.transpose(k, (0, 2, 3, 1)),
                               jnp.transpose(v, (0, 2, 1, 3)), qp[:, t], kp, window, chunk=8)
        np.testing.assert_allclose(np.asarray(dec), want[:, t], rtol=1e-5, atol=1e-5)
    tiled = Backend(block_q=8, block_k=8)  # the seam keeps it off the platform kernels
    np.testing.assert_allclose(np.asarray(tiled.attention(q, k, v, qp, kp, window, chunk=8)),
                               want, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_chunk_after_an_existing_prefix(window):
    q_pos, k_pos = _prefix_chunk(45, 37, 128)
    _check(*_inputs(37, 128, q_pos, k_pos, seed=1), window)


def test_empty_entries_and_rows_of_different_lengths():
    """Two rows: different starts and lengths, holes (-1) inside each row's keys, keys
    out of index order (a gathered page table), and a query row that sees no key."""
    S, T = 96, 40
    rng = np.random.default_rng(2)
    q0, k0 = _prefix_chunk(30, T, S)
    q1, k1 = _prefix_chunk(0, T, S)
    k0 = np.where(rng.random(S) < 0.2, -1, k0)
    k1 = rng.permutation(np.where(np.arange(S) < 33, np.arange(S), -1))
    k1[k1 == 0] = -1  # query position 0 of row 1 sees nothing
    q, k, v, qp, kp = _inputs(T, S, np.stack([q0, q1]), np.stack([k0, k1]), seed=3)
    _check(q, k, v, qp, kp, None)
    _check(q, k, v, qp, kp, 11)


def test_masked_key_blocks_are_skipped():
    """Key blocks no query can see hold NaN: a block that were computed would turn every
    output NaN (0 * NaN in p.v), so finite outputs equal to the plain path's (over the
    same keys with the NaNs zeroed) show the skipped blocks were never read."""
    T, S, block = 32, 256, 32
    q_pos, k_pos = _prefix_chunk(160, T, S)  # keys 0..191 filled, 192.. empty
    q, k, v, qp, kp = _inputs(T, S, q_pos, k_pos, seed=4)
    window = 20  # queries 160..191 see keys 141..191: blocks 4 and 5 only
    outside = (np.arange(S) < 128) | (np.arange(S) >= 192)
    nan_v = jnp.where(outside[None, :, None, None], jnp.nan, v)
    got = blockwise_attention(q, k, nan_v, qp, kp, window, block_q=block, block_k=block)
    want = attention(q, k, jnp.where(outside[None, :, None, None], 0.0, v), qp, kp, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_stay_close():
    q, k, v, qp, kp = _inputs(64, 64, np.arange(64), np.arange(64), seed=5)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = blockwise_attention(q, k, v, qp, kp, None, block_q=16, block_k=16)
    want = attention(q, k, v, qp, kp, None)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=3e-2)


def test_backend_takes_the_plain_path_for_one_block_of_scores():
    q, k, v, qp, kp = _inputs(16, 32, np.arange(16) + 16, np.arange(32), seed=6)
    small = Backend(block_q=16, block_k=32)  # T * S is exactly one tile
    np.testing.assert_array_equal(np.asarray(small.attention(q, k, v, qp, kp, None)),
                                  np.asarray(attention(q, k, v, qp, kp, None)))
    tiled = Backend(block_q=8, block_k=8)
    np.testing.assert_allclose(np.asarray(tiled.attention(q, k, v, qp, kp, None)),
                               np.asarray(attention(q, k, v, qp, kp, None)), atol=1e-5)


@pytest.mark.parametrize("field,value", [("prefill_attention", "flash"), ("block_q", 0),
                                         ("block_k", 2.5)])
def test_backend_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        Backend(**{field: value})


def test_backend_for_cpu_is_xla():
    assert backend_for(jax.devices("cpu")[:1], jnp.float32) == Backend()


def test_aligned_lengths():
    j = np.arange(8)
    ok, n = kernels.aligned_lengths(jnp.asarray([j]), jnp.asarray([np.where(j < 5, j, -1)]))
    assert bool(ok) and n.tolist() == [5]
    q_pos, k_pos = _prefix_chunk(3, 8, 16)  # a chunk after a prefix is not aligned
    ok, _ = kernels.aligned_lengths(jnp.asarray([q_pos]), jnp.asarray([k_pos]))
    assert not bool(ok)


def _nan_fallback(q, *args):
    return jnp.full(q.shape, jnp.nan, q.dtype)


@pytest.mark.parametrize("window", [None, 50])
def test_cudnn_wrapper_masks_through_the_xla_implementation(window):
    """The cuDNN path's masks (causal, window, key lengths), through jax's XLA
    implementation of the same call: aligned prompts take the kernel (the fallback
    would give NaN), a chunk after a prefix takes the fallback."""
    T = 96
    j = np.arange(T)
    q, k, v, qp, kp = _inputs(T, T, j, np.where(j < 80, j, -1), seed=7)
    got = kernels.cudnn_attention(q, k, v, qp, kp, window, fallback=_nan_fallback,
                                  implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(attention(q, k, v, qp, kp, window)),
                               rtol=1e-5, atol=1e-5)
    q_pos, k_pos = _prefix_chunk(10, T, T)
    got = kernels.cudnn_attention(*_inputs(T, T, q_pos, k_pos), window,
                                  fallback=_nan_fallback, implementation="xla")
    assert np.isnan(np.asarray(got)).all()


@pytest.mark.parametrize("window", [None, 50])
def test_pallas_splash_matches_xla_in_interpret_mode(window):
    """The TPU splash kernel, run by Pallas' interpreter on the CPU: aligned prompts
    (padding included) take the kernel and match; a chunk after a prefix falls back."""
    if not kernels.splash_available():
        pytest.skip("this jax ships no Pallas TPU splash attention")
    T = 256  # whole splash tiles of 128
    j = np.arange(T)
    q, k, v, qp, kp = _inputs(T, T, j, np.where(j < 200, j, -1), seed=8)
    got = kernels.splash_attention(q, k, v, qp, kp, window, fallback=_nan_fallback,
                                   block=128, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attention(q, k, v, qp, kp, window)),
                               rtol=1e-4, atol=1e-5)
    backend = Backend(prefill_attention="pallas_tpu", interpret=True, block_q=64, block_k=64)
    q_pos, k_pos = _prefix_chunk(64, T, 2 * T)  # not aligned: the XLA blockwise path
    q, k, v, qp, kp = _inputs(T, 2 * T, q_pos, k_pos, seed=9)
    np.testing.assert_allclose(np.asarray(backend.attention(q, k, v, qp, kp, window)),
                               np.asarray(attention(q, k, v, qp, kp, window)), atol=1e-5)


TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8)


def _tiny_engine(backend, length):
    config = EngineConfig(max_concurrent_decodes=1, max_prefill_length=length,
                          max_seq_len=length, top_logprobs=0)
    return create_engine(TINY, devices=jax.devices()[:1], config=config, backend=backend)


def test_prefill_temp_memory_is_far_below_the_score_matrix():
    """XLA's temp buffer for a 4,096-token prefill: the one-shot path needs at least the
    f32 score matrix (T * S * N * 4 bytes, 268 MB); the blockwise path a small part."""
    T = 4096
    scores = T * T * TINY.num_heads * 4
    tokens = np.ones(T, np.int32)
    temps = {}
    for name in ("xla", "plain"):
        engine = _tiny_engine(Backend(prefill_attention=name), T)
        lowered = engine.lower_prefill(engine.abstract_params, tokens, T)
        temps[name] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temps["plain"] >= scores
    assert temps["xla"] < scores / 16, temps


def test_engine_outputs_equal_with_either_attention_path():
    """Prefill (whole and in chunks) and prompt scoring through the blockwise path give
    the plain path's tokens, KV and log-probs."""
    T = 600
    prompt = np.random.default_rng(10).integers(1, 64, T)
    out = {}
    for name in ("xla", "plain"):
        engine = _tiny_engine(Backend(prefill_attention=name, block_q=64, block_k=128), 1024)
        params = engine.load_params()
        whole, _ = engine.prefill(params, prompt, T, seed=0)
        part, _ = engine.prefill(params, prompt[:256], 256, seed=0)
        part, _ = engine.prefill(params, prompt[256:], T - 256, existing_prefix=part, seed=0)
        scored = engine.prompt_logprobs(params, prompt)
        out[name] = (whole, part, scored)
    for a, b in zip(out["xla"], out["plain"], strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    assert int(out["xla"][0].token) == int(out["xla"][1].token)


@pytest.mark.parametrize("preset", ["tp", "seq_tp"])
def test_blockwise_prefill_under_a_sharded_mesh(preset):
    """Heads (and, with seq_tp, the sequence) split over 2 devices: the blockwise
    path's prompt log-probs equal one device's."""
    from sharding import load_preset

    prompt = np.random.default_rng(11).integers(1, 64, 300)
    backend = Backend(block_q=32, block_k=64)
    config = EngineConfig(max_concurrent_decodes=1, max_prefill_length=512, max_seq_len=512,
                          top_logprobs=0)
    out = []
    for devices, sharding in ((jax.devices()[:1], None), (jax.devices()[:2], load_preset(preset))):
        engine = create_engine(TINY, devices=devices, sharding=sharding, config=config,
                               backend=backend)
        out.append(engine.prompt_logprobs(engine.load_params(), prompt).token_logprobs)
    np.testing.assert_allclose(out[1][1:], out[0][1:], rtol=1e-4, atol=1e-5)
