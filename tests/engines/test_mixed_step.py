"""The mixed step (engines/mixed_step.py): prompts prefilled in chunks while other rows
decode, in one ragged step, give the same greedy tokens as prefill / insert / generate;
idle slots are untouched; generate steps may run between mixed steps; the programs are a
fixed small set of (token bucket, page-table width); the ragged attention agrees with
plain attention and with the reference of jax's ragged paged attention kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, create_engine
from engines.attention import attention
from engines.layer_scan import cache_layers
from engines.mixed_batch import MixedRow, token_buckets
from engines.paged_kv import gather_pages
from engines.ragged_attention import pallas_ragged_attention, ragged_paged_attention
from engines.sampling import SamplingParams
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import PagePlanner
from jetserve.scheduling.page_pool import width_buckets
from tests.engines.mixed_driver import run_mixed
from tests.sharding.families import host_params, model_config, place

PROMPTS = ([5, 17, 33, 2, 9], [100, 3, 3, 64, 12, 7, 90, 1, 45, 11, 8, 19, 4], [77, 6, 120],
           [9, 4] * 8, [31, 41, 59, 26, 53, 58, 97, 93, 23, 84, 62])
SHAPES = dict(max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=40,
              kv_layout="paged", page_size=4)
MAX_TOKENS = 12


def _engine(family):
    eng = create_engine(model_config(family), devices=jax.devices()[:1],
                        config=EngineConfig(**SHAPES))
    return eng, place(eng, host_params(eng))


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: sliding window 16
def engine(request):
    return _engine(request.param)


def _reference(eng, params):
    res = generate_many(PagePlanner(eng), params, PROMPTS, max_tokens=MAX_TOKENS,
                        ignore_eos=True)
    return [r.token_ids for r in res]


def test_mixed_steps_give_the_prefill_insert_generate_tokens(engine):
    eng, params = engine
    want = _reference(eng, params)
    # Chunks of 5 under a budget of 7 tokens: prompts split across steps, beside decode
    # rows; then one chunk per prompt where it fits.
    for chunk, budget in ((5, 7), (16, 19)):
        run = run_mixed(eng, params, PROMPTS, max_tokens=MAX_TOKENS, chunk=chunk,
                        budget=budget, widest=True)
        assert run.mixed_steps >= 3
        assert run.outputs == want


def test_programs_are_a_fixed_small_set():
    eng, params = _engine("llama")
    before = eng.trace_counts()["mixed"]
    shapes = set()
    for chunk, budget in ((3, 5), (5, 7), (16, 19), (7, 9)):
        shapes |= run_mixed(eng, params, PROMPTS, max_tokens=MAX_TOKENS, chunk=chunk,
                            budget=budget).shapes
    traced = eng.trace_counts()["mixed"]
    allowed = {(b, w) for b in (0, *eng.mixed_token_buckets)  # 0: decode rows alone
               for w in width_buckets(SHAPES["max_seq_len"] // SHAPES["page_size"])}
    assert shapes <= allowed
    assert eng.mixed_token_buckets == token_buckets(16 + 3) == (8, 16, 24)
    # Every shape of those many steps compiled once.
    assert traced - before == len(shapes) >= 6
    assert any(b == 0 for b, _ in shapes) and any(b > 0 for b, _ in shapes)
    run_mixed(eng, params, PROMPTS, max_tokens=MAX_TOKENS, chunk=5, budget=7)
    assert eng.trace_counts()["mixed"] == traced  # nothing new


def test_idle_slots_untouched_and_generate_between_mixed_steps():
    eng, params = _engine("llama")
    want = _reference(eng, params)
    trash = eng.page_geometry.num_pages
    table = np.full((3, 8), trash, np.int32)
    table[0, :5] = [0, 1, 2, 3, 8]  # through position 16
    table[1, :4] = [4, 5, 6, 7]
    state = eng.init_decode_state()
    p0, p1 = PROMPTS[1], PROMPTS[4]
    # Slot 0 prefills its whole prompt in two chunks; slot 1 starts its prompt.
    state, _ = eng.mixed_step(params, state, table, [
        MixedRow(slot=0, chunk=p0[:8], sampling=SamplingParams())])
    before = jax.tree.map(np.asarray, state)
    state, res = eng.mixed_step(params, state, table, [
        MixedRow(slot=0, chunk=p0[8:], start=8, last=True),
        MixedRow(slot=1, chunk=p1[:6], sampling=SamplingParams())])
    after = jax.tree.map(np.asarray, state)
    for f in ("lengths", "tokens", "prompt_mask", "counts"):  # slot 2 is idle
        np.testing.assert_array_equal(getattr(before, f)[2], getattr(after, f)[2])
    np.testing.assert_array_equal(before.sampling.key[2], after.sampling.key[2])
    for k0, k1 in zip(cache_layers(before.k, 4), cache_layers(after.k, 4), strict=True):
        np.testing.assert_array_equal(k0[:, trash - 1], k1[:, trash - 1])  # each layer
    # Slot 1 is mid-prompt: not live to generate, which decodes slot 0 alone.
    assert int(after.lengths[1]) == SHAPES["max_seq_len"]
    out = [res.to_host().token(0)]
    for _ in range(3):
        state, res = eng.generate(params, state, table[:, :8])
        h = res.to_host()
        assert not h.valid(1) and not h.valid(2)
        out.append(h.token(0))
    state, res = eng.mixed_step(params, state, table, [
        MixedRow(slot=0), MixedRow(slot=1, chunk=p1[6:], start=6, last=True)])
    h = res.to_host()
    out.append(h.token(0))
    assert out == want[1][:5]
    assert h.token(1) == want[4][0]
    assert int(np.asarray(state.lengths)[0]) == len(p0) + 4


def test_bad_rows_are_refused():
    eng, params = _engine("llama")
    state = eng.init_decode_state()
    table = np.full((3, 4), eng.page_geometry.num_pages, np.int32)
    with pytest.raises(ValueError, match="appears twice"):
        eng.mixed_step(params, state, table, [MixedRow(slot=0), MixedRow(slot=0)])
    with pytest.raises(ValueError, match="slot 5 out of range"):
        eng.mixed_step(params, state, table, [MixedRow(slot=5)])
    with pytest.raises(ValueError, match="past max_seq_len 40"):
        eng.mixed_step(params, state, table, [MixedRow(slot=1, chunk=[1] * 4, start=38)])
    with pytest.raises(ValueError, match="exceeds the largest token bucket 24"):
        eng.mixed_step(params, state, table, [MixedRow(slot=1, chunk=[1] * 25)])
    with pytest.raises(ValueError, match="page_table must be"):
        eng.mixed_step(params, state, table[:2], [MixedRow(slot=0)])
    with pytest.raises(ValueError, match="decode row"):
        MixedRow(slot=0, last=True)


def _ragged_case(seed=0, K=2, N=4, H=8, ps=4, W=4):
    """Three rows (a 5-token chunk at 3.., one decode token at 9, a 4-token chunk from
    0), padded to 16 tokens, over random pools."""
    rng = np.random.default_rng(seed)
    P = 16
    k_pool = jnp.asarray(rng.standard_normal((K, P + 1, ps, H)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((K, P + 1, ps, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[:3 * W].reshape(3, W), jnp.int32)
    rows = np.array([0] * 5 + [1] + [2] * 4 + [0] * 6, np.int32)
    pos = np.array([3, 4, 5, 6, 7, 9, 0, 1, 2, 3] + [-1] * 6, np.int32)
    q = jnp.asarray(rng.standard_normal((16, N, H)), jnp.float32)
    return q, k_pool, v_pool, table, jnp.asarray(rows), jnp.asarray(pos)


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (3, 0.5)])
def test_ragged_attention_matches_plain_attention(window, softcap):
    q, k_pool, v_pool, table, rows, pos = _ragged_case()
    # block_k 4 = one page per key block, block_q 4: several tiles and key blocks.
    got = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, window,
                                 block_q=4, block_k=4, softcap=softcap)
    k_all, v_all = (gather_pages(p, table, p.dtype) for p in (k_pool, v_pool))  # (R, W*ps, K, H)
    S = k_all.shape[1]
    live = np.asarray(pos) >= 0
    want = attention(q[:, None], k_all[rows], v_all[rows], pos[:, None],
                     jnp.broadcast_to(jnp.arange(S), (16, S)), window, softcap)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    if softcap is not None:  # the cap changes the result (scores reach past it)
        uncapped = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, window,
                                          block_q=4, block_k=4)
        assert np.max(np.abs(np.asarray(uncapped) - np.asarray(got))[live]) > 1e-2
    assert not np.asarray(got)[~live].any()  # padding sees nothing


@pytest.mark.parametrize("window", [None, 3])
def test_ragged_attention_with_sinks_matches_plain_attention(window):
    """gpt-oss's attention sinks on the mixed step's path, as the one-shot path has them
    (and they change the result); padding still comes out zero."""
    q, k_pool, v_pool, table, rows, pos = _ragged_case(seed=1)
    sinks = jnp.asarray([2.0, -1.0, 0.5, 1.0], jnp.float32)
    got = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, window,
                                 block_q=4, block_k=4, sinks=sinks)
    k_all, v_all = (gather_pages(p, table, p.dtype) for p in (k_pool, v_pool))
    S = k_all.shape[1]
    live = np.asarray(pos) >= 0
    args = (q[:, None], k_all[rows], v_all[rows], pos[:, None],
            jnp.broadcast_to(jnp.arange(S), (16, S)), window)
    want = attention(*args, sinks=sinks)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    assert np.max(np.abs(np.asarray(attention(*args)[:, 0] - want))[live]) > 1e-2
    assert not np.asarray(got)[~live].any()


@pytest.mark.parametrize("window", [None, 3])
def test_ragged_attention_with_chunks_matches_plain_attention(window):
    """Llama 4's chunked attention (chunks of 4 positions) on the mixed step's path, as
    the one-shot path has it (and it changes the result); padding still comes out zero."""
    q, k_pool, v_pool, table, rows, pos = _ragged_case(seed=2)
    got = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, window,
                                 block_q=4, block_k=4, chunk=4)
    k_all, v_all = (gather_pages(p, table, p.dtype) for p in (k_pool, v_pool))
    S = k_all.shape[1]
    live = np.asarray(pos) >= 0
    args = (q[:, None], k_all[rows], v_all[rows], pos[:, None],
            jnp.broadcast_to(jnp.arange(S), (16, S)), window)
    want = attention(*args, chunk=4)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    assert np.max(np.abs(np.asarray(attention(*args)[:, 0] - want))[live]) > 1e-2
    assert not np.asarray(got)[~live].any()


@pytest.mark.parametrize("window", [None, 5])
def test_ragged_attention_tiles_by_row_kind(window):
    """Decode tokens beside a 23-token chunk that spans several row tiles (block_q 8, its
    last tile part full), a second chunk whose tokens are not contiguous (gathered token
    by token), and more decode tokens than a token tile (block_d 2): every live token
    equals plain attention over its row's keys; padding comes out zero."""
    rng = np.random.default_rng(3)
    K, N, H, ps, W, P = 2, 4, 8, 4, 8, 40
    pools = [jnp.asarray(rng.standard_normal((K, P + 1, ps, H)), jnp.float32)
             for _ in range(2)]
    table = jnp.asarray(rng.permutation(P)[:5 * W].reshape(5, W), jnp.int32)
    rows = np.array([0, 1] + [2] * 23 + [3, 4, 3, 3] + [0] * 3, np.int32)
    pos = np.array([30, 7] + list(range(6, 29)) + [12, 20, 13, 14] + [-1] * 3, np.int32)
    q = jnp.asarray(rng.standard_normal((32, N, H)), jnp.float32)
    got = ragged_paged_attention(q, *pools, table, jnp.asarray(rows), jnp.asarray(pos),
                                 window, block_q=8, block_d=2, block_k=8)
    k_all, v_all = (gather_pages(p, table, p.dtype) for p in pools)
    S = k_all.shape[1]
    live = pos >= 0
    want = attention(q[:, None], k_all[rows], v_all[rows], jnp.asarray(pos)[:, None],
                     jnp.broadcast_to(jnp.arange(S), (32, S)), window)[:, 0]
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
    assert not np.asarray(got)[~live].any()


def test_ragged_attention_matches_the_kernel_reference():
    """The contract of jax's ragged paged attention kernel (its own plain-jnp reference,
    over our pools re-laid-out as the kernel reads them) equals the XLA path."""
    q, k_pool, v_pool, table, rows, pos = _ragged_case(seed=1)
    got = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, None)
    q_lens = jnp.asarray([5, 1, 4], jnp.int32)
    kv_lens = jnp.asarray([8, 10, 4], jnp.int32)
    ref = pallas_ragged_attention(q, k_pool, v_pool, table, q_lens, kv_lens, None,
                                  reference=True)
    np.testing.assert_allclose(np.asarray(ref)[:10], np.asarray(got)[:10], atol=1e-5)


@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError,
                   reason="jax 0.10.2's TPU interpret mode cannot run the ragged paged "
                          "attention kernel on the CPU (its kernel reshapes a VMEM ref; "
                          "the interpreter raises 'ReshapeTransform' object has no "
                          "attribute 'indices'); strict, so a jax that can shows up here")
def test_ragged_kernel_in_interpret_mode_matches_xla():
    from jax.experimental.pallas import tpu as pltpu

    q, k_pool, v_pool, table, rows, pos = _ragged_case(seed=2, H=128, ps=8, W=2)
    want = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, None)
    with pltpu.force_tpu_interpret_mode():
        got = pallas_ragged_attention(q, k_pool, v_pool, table, jnp.asarray([5, 1, 4]),
                                      jnp.asarray([8, 10, 4]), None, blocks=(2, 8))
    np.testing.assert_allclose(np.asarray(got)[:10], np.asarray(want)[:10], atol=1e-5)
