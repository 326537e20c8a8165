"""The CPU kernels (engines/cpu_kernels.py): the matmul's and the decode attention's results
against numpy for every kind of shape tail, where the engine uses them and where it must
not, and their fallbacks."""

import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, cpu_kernels, create_engine
from engines.kv_cache import PrefillKV
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import with_pages

CFG = ModelConfig(vocab_size=99, hidden_size=36, intermediate_size=70, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=10)
# The unrolled layers: the engines below share one set of weights with an engine without
# the kernels, which keeps the loop (the scanned layers: test_a_scanned_layer_...).
ENGINE = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48,
                      layers="loop")


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernels.available():
        pytest.skip("the kernel needs x86-64 with AVX2 and FMA and a C++ compiler")


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def _check(x, w):
    """matmul_nt(x, w) under jit, through the custom call, equals numpy in float64."""
    assert cpu_kernels.TARGET in _lowered(cpu_kernels.matmul_nt, x, w)
    got = np.asarray(jax.jit(cpu_kernels.matmul_nt)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == want.shape and got.dtype == np.float32
    K = x.shape[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K), err_msg=str(
        (x.shape, w.shape)))


# Widths that end in every tail: N % 4 in {0, 1, 2, 3}, K % 8 in {0, ..., 7}; K > 1024 and
# rows >= 4 take the kernel's blocks along K.
NS = (1, 2, 3, 4, 5, 7, 13, 66, 130)
KS = (1, 3, 7, 8, 9, 17, 31, 100, 1030)


def test_every_row_count_and_tail_matches_numpy(kernel):
    rng = np.random.default_rng(0)
    for m in range(1, 41):
        n, k = NS[m % len(NS)], KS[(m * 5) % len(KS)]
        _check(rng.standard_normal((m, k), dtype=np.float32),
               rng.standard_normal((n, k), dtype=np.float32))


def test_packed_blocks_and_column_tiles_match_numpy(kernel):
    # Row counts that end in one or two 16-row blocks, a part block or an 8-wide block, up to
    # MAX_ROWS; column counts past whole 6- or 12-column tiles that take the tail tiles
    # (11 = 8 + 2 + 1, 23 = 12 + 11, 29 = 24 + 4 + 1; with 6-column tiles 4 + 1 each).
    rng = np.random.default_rng(2)
    for m in (16, 24, 25, 31, 32, 47, 48, 57, 64, 72, 100, 128, 136, 520, 1024):
        for n in (11, 23, 29):
            _check(rng.standard_normal((m, 67), dtype=np.float32),
                   rng.standard_normal((n, 67), dtype=np.float32))


def test_columns_split_over_threads_and_k_blocks_match_numpy(kernel):
    rng = np.random.default_rng(1)
    for m, n, k in ((1, 1001, 515), (6, 1030, 2053), (33, 517, 1031)):
        _check(rng.standard_normal((m, k), dtype=np.float32),
               rng.standard_normal((n, k), dtype=np.float32))


def test_leading_dims_are_flattened_and_restored(kernel):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((11, 19), dtype=np.float32)
    for lead in ((2, 3), (1, 1), (3, 1, 2)):
        _check(rng.standard_normal((*lead, 19), dtype=np.float32), w)


def test_lowered_for_an_accelerator_it_is_xla_dot(kernel):
    x, w = jnp.ones((3, 20)), jnp.ones((5, 20))
    for platform in ("cuda", "tpu"):
        text = jax.jit(cpu_kernels.matmul_nt).trace(x, w).lower(
            lowering_platforms=(platform,)).as_text()
        assert cpu_kernels.TARGET not in text and "dot_general" in text


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.matmul_nt(jnp.ones((2, 4), jnp.bfloat16), jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"x \(2, 4\) and w \(3, 5\)"):
        cpu_kernels.matmul_nt(jnp.ones((2, 4)), jnp.ones((3, 5)))


def test_switch_must_be_0_or_1(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "no")
    with pytest.raises(ValueError, match="JETSERVE_CPU_KERNELS must be 0"):
        cpu_kernels.available()


# ---- decode attention ----------------------------------------------------------------


def _attention_reference(q, k, v, pos, window):
    """Softmax attention of one token per slot, in float64, from the definitions: slot b
    at position p sees cache entries j <= p (and j > p - window); p < 0: not live, zeros."""
    B, _, N, H = q.shape
    K, S = k.shape[1], k.shape[3]
    out = np.zeros((B, N, H))
    for b in range(B):
        p = min(int(pos[b]), S - 1)
        if p < 0:
            continue
        j = np.arange(S)
        seen = (j <= p) & ((j > p - window) if window else True)
        for n in range(N):
            kh = n // (N // K)
            s = q[b, 0, n].astype(np.float64) @ k[b, kh].astype(np.float64) / np.sqrt(H)
            s = np.where(seen, s, -np.inf)
            e = np.exp(s - s.max())
            out[b, n] = (e / e.sum()) @ v[b, kh].astype(np.float64)
    return out[:, None]


@pytest.mark.parametrize("B,N,K,H,S,window", [
    (5, 4, 4, 8, 16, None),     # one query head per kv head
    (3, 15, 3, 20, 50, 7),      # 5 per kv head (a group of 4 and one more), H % 16 != 0
    (4, 16, 4, 64, 300, None),  # the 156M Llama's heads; key counts with every tail of 8
    (2, 6, 2, 33, 37, 64),      # a window longer than the cache
    (2, 8, 2, 130, 40, None),   # heads wider than 64: value columns in several passes
])
def test_decode_attention_matches_numpy(kernel, B, N, K, H, S, window):
    rng = np.random.default_rng(B * S)
    q = rng.standard_normal((B, 1, N, H), dtype=np.float32)
    k = rng.standard_normal((B, K, H, S), dtype=np.float32)
    v = rng.standard_normal((B, K, S, H), dtype=np.float32)
    # live slots at assorted positions (0, the last entry, past it: clamped), one not live
    pos = np.array([0, S - 1, S + 3, -1, S // 2][:B], np.int32)
    fn = jax.jit(lambda *a: cpu_kernels.decode_attention(*a, window))
    assert cpu_kernels.ATTENTION_TARGET in _lowered(fn, q, k, v, pos)
    got = np.asarray(fn(q, k, v, pos))
    np.testing.assert_allclose(got, _attention_reference(q, k, v, pos, window), rtol=2e-5,
                               atol=2e-6)


def test_decode_attention_over_the_first_slots_of_a_larger_cache(kernel):
    """A step over the first B of Bc slots (a decode batch size below the cache's) reads
    those rows in place: the same as the attention over the cache cut to B rows, for one
    layer and for a layer of a stack."""
    rng = np.random.default_rng(11)
    L, Bc, B, N, K, H, S = 3, 8, 3, 8, 2, 16, 40
    q = rng.standard_normal((B, 1, N, H), dtype=np.float32)
    k = rng.standard_normal((L, Bc, K, H, S), dtype=np.float32)
    v = rng.standard_normal((L, Bc, K, S, H), dtype=np.float32)
    pos = np.array([5, S - 1, 20], np.int32)
    one = jax.jit(lambda q, k, v: cpu_kernels.decode_attention(q, k, v, pos, None))
    stacked = jax.jit(lambda q, k, v, i: cpu_kernels.decode_attention(q, k, v, pos, None,
                                                                      layer=i))
    for i in range(L):
        want = _attention_reference(q, k[i, :B], v[i, :B], pos, None)
        np.testing.assert_allclose(np.asarray(one(q, k[i], v[i])), want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(np.asarray(stacked(q, k, v, jnp.int32(i))), want,
                                   rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="do not agree"):  # fewer cache rows than queries
        cpu_kernels.decode_attention(q, k[0, :2], v[0, :2], pos, None)


def test_decode_attention_bad_operands_are_named():
    q, k, v = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 2, 8, 16)), jnp.ones((2, 2, 16, 8))
    with pytest.raises(ValueError, match="one float32 token"):
        cpu_kernels.decode_attention(jnp.ones((2, 3, 4, 8)), k, v, jnp.zeros(2, jnp.int32), None)
    with pytest.raises(ValueError, match="do not agree"):
        cpu_kernels.decode_attention(q, k, jnp.ones((2, 2, 8, 16)), jnp.zeros(2, jnp.int32), None)


# ---- a layer of a stack, read in place (a scanned decoder's weights and cache) ---------


def test_indexed_matmul_equals_the_sliced_one(kernel):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 40), dtype=np.float32)
    w = rng.standard_normal((3, 24, 40), dtype=np.float32)
    fn = jax.jit(cpu_kernels.matmul_nt)
    assert cpu_kernels.TARGET in _lowered(fn, x, w, jnp.int32(1))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(fn(x, w, jnp.int32(i))),
                                      np.asarray(fn(x, w[i])))
    # the whole stack goes in: no slice of it is copied out before the call
    compiled = fn.lower(x, w, jnp.int32(1)).compile().as_text()
    assert cpu_kernels.TARGET in compiled and "dynamic-slice" not in compiled


def test_indexed_decode_attention_equals_the_sliced_one(kernel):
    rng = np.random.default_rng(8)
    L, B, N, K, H, S = 3, 2, 4, 2, 16, 40
    q = rng.standard_normal((B, 1, N, H), dtype=np.float32)
    k = rng.standard_normal((L, B, K, H, S), dtype=np.float32)
    v = rng.standard_normal((L, B, K, S, H), dtype=np.float32)
    pos = np.array([7, S - 1], np.int32)
    fn = jax.jit(lambda q, k, v, i: cpu_kernels.decode_attention(q, k, v, pos, 16, layer=i))
    for i in range(L):
        want = cpu_kernels.decode_attention(q, k[i], v[i], pos, 16)
        np.testing.assert_array_equal(np.asarray(fn(q, k, v, jnp.int32(i))), np.asarray(want))


def test_a_layer_outside_the_stack_is_refused(kernel):
    x, w = jnp.ones((4, 8)), jnp.ones((3, 5, 8))
    with pytest.raises(ValueError, match=r"layer 3 is outside \[0, 3\)"):
        cpu_kernels.matmul_nt(x, w, 3)
    with pytest.raises(ValueError, match="stacked"):
        cpu_kernels.matmul_nt(x, w[0], 0)
    # a traced index is checked by the kernel, which fails the step instead of reading
    for i in (3, -1):
        with pytest.raises(Exception, match=f"layer {i} is outside"):
            jax.block_until_ready(jax.jit(cpu_kernels.matmul_nt)(x, w, jnp.int32(i)))
    q, k, v = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 2, 2, 8, 16)), jnp.ones((2, 2, 2, 16, 8))
    attend = jax.jit(lambda i: cpu_kernels.decode_attention(q, k, v, jnp.zeros(2, jnp.int32),
                                                            None, layer=i))
    with pytest.raises(Exception, match="layer 2 is outside"):
        jax.block_until_ready(attend(jnp.int32(2)))


# ---- the greedy token and the log-probs of a step's logits ---------------------------


def _logits_cases():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 1003)).astype(np.float32) * 4
    x[0, 7] = x[0, 500] = x[0].max() + 1  # a tie for the maximum: the lower index
    x[1, 1:] = -np.inf
    x[2, 100:] = -np.inf
    x[3, 999] = 50.0  # the maximum in the scalar tail
    x[4] = -np.abs(x[4])
    x[4, 3] = x[4, 9] = x[4, 11] = x[4, 700] = 2.5  # ties in the top 5: lower ids first
    return [x, rng.standard_normal((32, 32000)).astype(np.float32),
            rng.standard_normal((2, 5)).astype(np.float32)]


@pytest.mark.parametrize("case", range(3))
def test_argmax_equals_jnp_argmax(kernel, case):
    x = _logits_cases()[case]
    got = np.asarray(jax.jit(cpu_kernels.argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert cpu_kernels.ARGMAX_TARGET in _lowered(cpu_kernels.argmax, jnp.asarray(x))


def test_argmax_counts_a_nan_as_the_largest(kernel):
    x = np.zeros((4, 40), np.float32)
    x[0, 30], x[0, 31], x[0, 5] = np.nan, np.nan, np.inf
    x[1, 38] = np.nan  # in the scalar tail
    x[2, 0] = np.nan
    x[3, :] = -np.inf  # every entry -inf: index 0
    got = jax.jit(cpu_kernels.argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
    np.testing.assert_array_equal(np.asarray(got), [30, 38, 0, 0])


def _log_probs_both(x, tokens, n):
    from engines import sampling
    x, tokens = jnp.asarray(x), jnp.asarray(tokens, jnp.int32)
    on = jax.jit(lambda a, t: sampling.token_logprobs(a, t, n, cpu_kernels=True))
    off = jax.jit(lambda a, t: sampling.token_logprobs(a, t, n))
    assert cpu_kernels.LOG_PROBS_TARGET in jax.jit(on).lower(x, tokens).as_text()
    return [tuple(np.asarray(a) for a in f(x, tokens)) for f in (on, off)]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_log_probs_match_xla_and_float64(kernel, case, n):
    x = _logits_cases()[case]
    n = min(n, x.shape[1])
    tokens = np.arange(x.shape[0]) * 7 % x.shape[1]
    (c, ids, lps), (c0, ids0, lps0) = _log_probs_both(x, tokens, n)
    x64 = x.astype(np.float64)
    ref = x64 - x64.max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        ref -= np.log(np.exp(ref).sum(1, keepdims=True))
    np.testing.assert_allclose(c, ref[np.arange(len(ref)), tokens], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(c, c0, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ids, ids0)
    np.testing.assert_allclose(lps, lps0, rtol=1e-6, atol=1e-6)
    assert ids.shape == (x.shape[0], n) and lps.shape == (x.shape[0], n)
    if case == 0 and n == 5:
        np.testing.assert_array_equal(ids[4, :4], [3, 9, 11, 700])


def test_log_probs_of_a_nan_or_infinite_row_are_xla_s(kernel):
    x = np.zeros((5, 30), np.float32)
    x[0, 4] = np.nan
    x[1, :] = np.nan
    x[2, 10] = x[2, 20] = np.inf
    x[3] = np.linspace(-1, 1, 30)
    x[4, :] = -np.inf
    got, want = _log_probs_both(x, np.asarray([0, 1, 2, 3, 4]), 3)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)  # the whole step falls back to XLA


def test_log_probs_bad_operands_are_named(kernel):
    with pytest.raises(ValueError, match="top_n <= V"):
        cpu_kernels.token_logprobs(jnp.zeros((2, 4)), jnp.zeros((2,), jnp.int32), 5,
                                   fallback=None)
    with pytest.raises(ValueError, match="float32 logits"):
        cpu_kernels.argmax(jnp.zeros((2, 4), jnp.bfloat16))


# ---- the model and the engine --------------------------------------------------------


def _uses_kernel(model, params, T) -> bool:
    tokens = jnp.zeros((1, T), jnp.int32)
    pos = jnp.arange(T)[None]
    return cpu_kernels.TARGET in _lowered(
        lambda p, t: model.apply({"params": p}, t, pos, PrefillKV(pos, None)), params, tokens)


@pytest.fixture(scope="module")
def engines(kernel):
    """The same weights on one device with the kernel and without it."""
    on = create_engine(CFG, config=ENGINE, devices=jax.devices()[:1], seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_kernels.ENV_SWITCH, "0")
        off = create_engine(CFG, config=ENGINE, devices=jax.devices()[:1], seed=3)
    return on, off, on.load_params()


def test_only_steps_up_to_max_rows_use_the_kernels(engines):
    on, off, params = engines
    assert on.backend.cpu_matmul_rows == cpu_kernels.MAX_ROWS
    assert off.backend.cpu_matmul_rows == 0
    assert "cpu_matmul_rows" not in on.model_config.to_json()
    rows = cpu_kernels.MAX_ROWS
    assert _uses_kernel(on.model, params, rows) and _uses_kernel(on.model, params, 2)
    assert not _uses_kernel(on.model, params, 1)  # one row: XLA's dot streams as fast
    assert not _uses_kernel(on.model, params, rows + 1)  # prefill sizes stay with XLA
    assert not _uses_kernel(off.model, params, rows)
    state = on.init_decode_state()
    for target in (cpu_kernels.TARGET, cpu_kernels.ATTENTION_TARGET, cpu_kernels.ARGMAX_TARGET,
                   cpu_kernels.LOG_PROBS_TARGET):
        assert target in on._generate_jit.lower(params, state, None).as_text()
        assert target not in off._generate_jit.lower(params, state, None).as_text()
    paged = with_pages(create_engine(CFG, config=EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48, kv_layout="paged",
        page_size=8), devices=jax.devices()[:1], seed=3))
    table = paged.kv_pages.table[:, :paged.generate_widths()[0]]
    lowered = paged._generate_jit.lower(paged.adopt_params(params), paged.init_decode_state(),
                                        table, None)
    for target in (cpu_kernels.TARGET, cpu_kernels.ARGMAX_TARGET, cpu_kernels.LOG_PROBS_TARGET):
        assert target in lowered.as_text()  # the paged cache keeps XLA's attention


def test_greedy_tokens_and_logits_equal_xla(engines):
    on, off, params = engines
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 99, size=n).tolist() for n in (5, 13, 9, 16, 3)]
    a = generate_many(on, params, prompts, max_tokens=10, ignore_eos=True)
    b = generate_many(off, params, prompts, max_tokens=10, ignore_eos=True)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)
    seq = jnp.asarray([prompts[1] + a[1].token_ids])
    pos = jnp.arange(seq.shape[1])[None]
    logits = [np.asarray(e.model.apply({"params": params}, seq, pos, PrefillKV(pos, None)))
              for e in (on, off)]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_a_scanned_layer_reads_its_weights_and_cache_in_place(kernel):
    """Under the scan (layers "scan") even a one-row matmul takes the kernel, reading the
    stacked weights at the layer's index; nothing is copied out."""
    eng = create_engine(CFG, config=dataclasses.replace(ENGINE, layers="scan"),
                        devices=jax.devices()[:1], seed=3)
    assert eng.model_config.scan_layers
    params = eng.load_params()
    assert _uses_kernel(eng.model, params, 1)
    state = eng.init_decode_state()
    compiled = eng._generate_jit.lower(params, state, None).compile()
    text = compiled.as_text()
    assert cpu_kernels.TARGET in text and cpu_kernels.ATTENTION_TARGET in text
    # Slices left: a layer's norm weights, index scalars and one position's keys or
    # values, never a matmul kernel's [N, K] nor a layer's cache: each slice is smaller
    # than the layer's smallest weight (which of the small ones XLA keeps as slices
    # depends on its fusion emitters). The temporaries exceed the loop's by far less
    # than one layer's weights (a copied-out layer would add all of them).
    smallest = min(x.size // CFG.num_layers for x in jax.tree.leaves(params["layers"])
                   if x.ndim >= 3)
    sliced = re.findall(r"= f32\[([\d,]*)\]\S* dynamic-slice\(", text)
    assert sliced and all(math.prod(map(int, d.split(","))) < smallest for d in sliced), \
        (sliced, smallest)
    loop = create_engine(CFG, config=ENGINE, devices=jax.devices()[:1], seed=3)
    loop_temp = loop._generate_jit.lower(jax.eval_shape(loop.load_params),
                                         loop.init_decode_state(), None).compile()
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) // CFG.num_layers
    assert (compiled.memory_analysis().temp_size_in_bytes
            < loop_temp.memory_analysis().temp_size_in_bytes + layer_bytes / 4)


def test_a_sharded_mesh_never_uses_the_kernel(kernel):
    eng = create_engine(CFG, config=ENGINE, devices=jax.devices()[:2], seed=3)
    assert eng.backend.cpu_matmul_rows == 0
    params = jax.eval_shape(eng.load_params)
    assert cpu_kernels.TARGET not in eng._generate_jit.lower(
        params, eng.init_decode_state(), None).as_text()


def test_quantized_or_bf16_weights_keep_xla(kernel):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    assert cpu_kernels.max_rows(mesh, jnp.float32, "none") == cpu_kernels.MAX_ROWS
    assert cpu_kernels.max_rows(mesh, jnp.float32, "int8") == 0
    assert cpu_kernels.max_rows(mesh, jnp.bfloat16, "none") == 0


# ---- building in fresh processes -------------------------------------------------------

_CHILD = textwrap.dedent("""
    import logging
    import numpy as np, jax
    from engines import cpu_kernels
    logging.basicConfig(level=logging.WARNING)
    x = np.arange(3 * 21, dtype=np.float32).reshape(3, 21) / 50
    w = np.cos(np.arange(7 * 21, dtype=np.float32)).reshape(7, 21)
    y = np.asarray(jax.jit(cpu_kernels.matmul_nt)(x, w))
    err = float(np.abs(y - x.astype(np.float64) @ w.T.astype(np.float64)).max())
    print(cpu_kernels.available(), cpu_kernels.available(), err)
""")


def _start(cache, **env):
    return subprocess.Popen([sys.executable, "-c", _CHILD], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "JETSERVE_KERNEL_CACHE": str(cache), **env})


def test_fresh_processes_build_once_and_a_failed_build_falls_back(kernel, tmp_path):
    # Two processes build into one empty cache at once; a third has a compiler that fails.
    building = [_start(tmp_path / "cache") for _ in range(2)]
    failing = _start(tmp_path / "none", CXX="/bin/false")
    for p in building:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        on, again, e = out.split()
        assert (on, again) == ("True", "True") and float(e) < 1e-4
        assert "unavailable" not in err
    built = os.listdir(tmp_path / "cache")
    assert len(built) == 1 and built[0].endswith(".so") and built[0].startswith("jetserve_cpu-")
    out, err = failing.communicate(timeout=600)
    assert failing.returncode == 0, err
    on, again, e = out.split()
    assert (on, again) == ("False", "False") and float(e) < 1e-4  # XLA's dot, same result
    assert err.count("CPU kernels are unavailable") == 1 and "/bin/false" in err
    assert os.listdir(tmp_path / "none") == []  # no half-written library left behind


def test_paged_decode_attention_matches_the_gather_path(kernel):
    # Pools stacked [L, ...] read at a layer and one layer alone; pages out of order, a
    # page index past the pool (reads the trash page), a slot not live (zeros), a position
    # past the table (clamped to its last), and a sliding window.
    from engines.attention import attention
    from engines.paged_kv import gather_pages

    rng = np.random.default_rng(5)
    L, K, P1, ps, H, N, B, W = 3, 2, 30, 4, 16, 6, 5, 5
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((L, K, P1, ps, H)), jnp.float32)
                      for _ in range(2))
    pages = rng.permutation(P1 - 1)[:B * W].reshape(B, W)
    pages[4, 1] = P1 + 7  # out of the pool: the trash page (P1 - 1) is read
    table = jnp.asarray(pages, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    pos = jnp.asarray([0, 7, 19, -1, 6], jnp.int32)
    trash = jnp.asarray(np.where(pages >= P1, P1 - 1, pages), jnp.int32)
    for window in (None, 3):
        for layer in (0, 2):
            got = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, window,
                                                     layer=layer)
            one = cpu_kernels.paged_decode_attention(q, k_pool[layer], v_pool[layer], table,
                                                     pos, window)
            k_all, v_all = (gather_pages(p[layer], trash, jnp.float32) for p in (k_pool, v_pool))
            j = jnp.arange(W * ps)[None]
            want = attention(q, k_all, v_all, pos[:, None], jnp.where(j <= pos[:, None], j, -1),
                             window)
            live = np.asarray(pos) >= 0
            np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
            assert not np.asarray(got)[~live].any()
            np.testing.assert_array_equal(np.asarray(got), np.asarray(one))
    past = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table,
                                              jnp.full((B,), 10 * W * ps, jnp.int32), None,
                                              layer=1)
    last = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table,
                                              jnp.full((B,), W * ps - 1, jnp.int32), None,
                                              layer=1)
    np.testing.assert_array_equal(np.asarray(past), np.asarray(last))
    with pytest.raises(ValueError, match="one float32 token per slot"):
        cpu_kernels.paged_decode_attention(jnp.zeros((B, 2, N, H)), k_pool, v_pool, table,
                                           pos, None, layer=0)
    with pytest.raises(ValueError, match="do not agree"):
        cpu_kernels.paged_decode_attention(q, k_pool, v_pool[:, :, :, :, :8], table, pos,
                                           None, layer=0)
