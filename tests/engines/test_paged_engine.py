"""The paged KV layout: same greedy tokens as the contiguous cache for every family (also
with the prompt prefilled in chunks, continued from prefix-cache blocks, and linking another
slot's pages), pages taken as sequences grow and given back on free_slot, and the TPU
kernel against the gather path where a TPU exists."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, TransformerEngine, create_engine
from engines.layer_scan import cache_layers
from engines.paged_engine import PagedTransformerEngine
from engines.paged_kv import pallas_decode_attention, resolve_attention, xla_decode_attention
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import PagePlanner
from jetserve.scheduling.page_pool import OutOfPages, width_buckets
from tests.sharding.families import FAMILIES, host_params, model_config, place

# Prompts and lengths that cross several 4-token pages, and a sliding window (mistral: 16).
PROMPTS = ([5, 17, 33, 2, 9], [100, 3, 3, 64, 12, 7, 90, 1, 45, 11, 8, 19, 4], [77, 6, 120],
           [9] * 16)
SHAPES = dict(max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=40)


def _engines(family, **paged):
    cfg = model_config(family)
    dev = jax.devices()[:1]
    contiguous = create_engine(cfg, devices=dev, config=EngineConfig(**SHAPES))
    p = create_engine(cfg, devices=dev, config=EngineConfig(
        **SHAPES, kv_layout="paged", page_size=4, **paged))
    return contiguous, PagePlanner(p)  # the paged engine with its page table


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_and_contiguous_give_identical_greedy_tokens(family):
    contiguous, paged = _engines(family)
    assert isinstance(paged.engine, PagedTransformerEngine)
    host = host_params(contiguous)  # per layer, as stored; placed in each one's layout
    outs = []
    for eng in (contiguous, paged):
        params = place(eng, host)
        # 4 prompts on 3 slots: the fourth joins when a slot (and its pages) frees up.
        outs.append(generate_many(eng, params, PROMPTS, max_tokens=22, ignore_eos=True))
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    prompt, params = PROMPTS[1], place(paged, host)

    def decode(prefix, first):
        state = paged.insert(prefix, paged.init_decode_state(), 2)
        tokens = [first.to_host().token(0)]
        for _ in range(21):
            state, res = paged.generate(params, state)
            tokens.append(res.to_host().token(2))
        paged.free_slot(2)
        return tokens

    want = outs[0][1].token_ids
    # Chunked: the 13-token prompt prefilled 5 tokens at a time into the paged cache.
    prefix = None
    for start in range(0, len(prompt), 5):
        piece = prompt[start:start + 5]
        prefix, first = paged.prefill(params, piece, len(piece), existing_prefix=prefix)
    assert decode(prefix, first) == want
    # Prefix-cached: another prompt's prefill, its first 8 tokens cut into two blocks of 4
    # (engines/prefix_blocks.py), joined back and continued.
    donor, _ = paged.prefill(params, prompt[:8] + [1, 2, 3], 11)
    head = paged.prefix_from_blocks(paged.stack_blocks(paged.cache_blocks(donor, 0, 2, 4)),
                                    prompt[:8])
    prefix, first = paged.prefill(params, prompt[8:], 5, existing_prefix=head)
    assert decode(prefix, first) == want
    # Paged: the donor's pages hold those blocks; a slot that links them (shared, never
    # written) decodes the same tokens, and they still hold the donor's KV afterwards.
    state = paged.insert(donor, paged.init_decode_state(), 0)
    donor_pages = paged.kv_pages.pages_of(0)[:2]
    if paged.ring is not None:  # sliding layers in a ring: no page is every layer's
        assert family == "mistral"
        with pytest.raises(ValueError, match="ring of pages"):
            paged.page_blocks(state, donor_pages)
        paged.free_slot(0)
        return
    blocks = np.asarray(paged.page_blocks(state, donor_pages))[:2]
    np.testing.assert_array_equal(
        blocks, np.stack([np.asarray(b) for b in paged.cache_blocks(donor, 0, 2, 4)]))
    head = paged.prefix_from_blocks(paged.page_blocks(state, donor_pages), prompt[:8])
    prefix, first = paged.prefill(params, prompt[8:], 5, existing_prefix=head)
    state = paged.insert(prefix, state, 2, shared_pages=donor_pages)
    assert paged.kv_pages.pages_of(2)[:2] == donor_pages
    tokens = [first.to_host().token(0)]
    for _ in range(21):
        state, res = paged.generate(params, state)
        tokens.append(res.to_host().token(2))
    assert tokens == want
    np.testing.assert_array_equal(np.asarray(paged.page_blocks(state, donor_pages))[:2], blocks)
    for slot in (0, 2):
        paged.free_slot(slot)
    paged.kv_pages.check()
    assert paged.kv_pages.free_count == paged.kv_pages.pool.num_pages


@pytest.fixture(scope="module")
def small():
    """A paged llama with a pool of 12 pages of 4 (3 slots of up to 40 tokens would need 30)."""
    _, eng = _engines("llama", num_pages=12)
    return eng, place(eng, host_params(eng))


def test_pages_follow_the_sequence_and_return_on_free(small):
    eng, params = small
    pages = eng.kv_pages
    state = eng.init_decode_state()
    prefix, _ = eng.prefill(params, list(range(1, 7)), 6)  # 6 tokens: 2 pages
    state = eng.insert(prefix, state, 1)
    assert len(pages.pages_of(1)) == 2 and pages.free_count == 10
    for _ in range(3):  # lengths 6 -> 9: the step writing position 8 takes a third page
        state, res = eng.generate(params, state)
        pages.check()
    assert len(pages.pages_of(1)) == 3 and pages.length(1) == 9
    assert int(state.lengths[1]) == 9
    eng.free_slot(1)
    pages.check()
    assert pages.free_count == 12 and pages.live_slots() == []


def test_insert_leaves_other_slots_pages_bit_identical(small):
    eng, params = small
    state = eng.init_decode_state()
    p0, _ = eng.prefill(params, [3, 1, 4, 1, 5, 9, 2], 7)
    state = eng.insert(p0, state, 0)
    state, _ = eng.generate(params, state)
    held = eng.kv_pages.pages_of(0)
    before = [np.asarray(k)[:, held] for k in cache_layers(state.k, 4)]  # each layer
    p2, _ = eng.prefill(params, [8, 8, 8, 8, 8], 5)
    state = eng.insert(p2, state, 2)
    after = [np.asarray(k)[:, held] for k in cache_layers(state.k, 4)]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not set(held) & set(eng.kv_pages.pages_of(2))
    for s in (0, 2):
        eng.free_slot(s)


def test_step_without_pages_raises_and_takes_nothing(small):
    eng, params = small
    pages = eng.kv_pages
    state = eng.init_decode_state()
    for slot in range(3):  # 3 x 16 tokens = 12 pages: the pool is full
        prefix, _ = eng.prefill(params, [slot + 1] * 16, 16)
        state = eng.insert(prefix, state, slot)
    assert pages.free_count == 0 and pages.pages_for_step() == 3
    with pytest.raises(OutOfPages):
        eng.generate(params, state)
    pages.check()  # nothing was taken
    eng.free_slot(2)  # freeing one sequence makes room for the other two to grow
    state, res = eng.generate(params, state)
    assert res.to_host().valid(0) and pages.free_count == 2
    pages.check()
    for s in (0, 1):
        eng.free_slot(s)
    assert pages.free_count == 12


def test_the_engine_holds_no_page_table(small):
    # Two planners over one engine, each with its own decode state and page table: the
    # engine keeps nothing between calls, so interleaving them changes no token.
    raw, params = small[0].engine, small[1]
    with pytest.raises(TypeError, match="PagePlanner"):
        getattr(raw, "kv_pages")  # noqa: B009 (the property raises)
    a, b = PagePlanner(raw), PagePlanner(raw)
    prefix, _ = raw.prefill(params, [3, 1, 4, 1, 5, 9, 2], 7)
    sa = a.insert(prefix, a.init_decode_state(), 0)
    prefix, _ = raw.prefill(params, [3, 1, 4, 1, 5, 9, 2], 7)
    sb = b.insert(prefix, b.init_decode_state(), 1)
    got_a, got_b = [], []
    for _ in range(6):
        sa, ra = a.generate(params, sa)
        sb, rb = b.generate(params, sb)
        got_a.append(ra.to_host().token(0))
        got_b.append(rb.to_host().token(1))
    assert got_a == got_b
    assert a.kv_pages.pages_of(0) == b.kv_pages.pages_of(1) == [0, 1, 2, 3]
    a.free_slot(0)
    b.free_slot(1)
    assert a.kv_pages.free_count == b.kv_pages.free_count == 12


def test_generate_compiles_once_per_width(small):
    eng, params = small
    assert eng.generate_widths() == width_buckets(10) == (1, 2, 4, 8, 10)
    prefix, _ = eng.prefill(params, [4] * 3, 3)
    for slot in (0, 1):  # the second run (another slot) must compile nothing new
        state = eng.insert(prefix, eng.init_decode_state(), slot)
        for _ in range(37):  # 3 -> 40 tokens: gathers 1, 2, 4, 8 then 10 pages
            state, _ = eng.generate(params, state)
        assert eng.trace_counts()["generate"] == len(eng.generate_widths())
        eng.free_slot(slot)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="ragged")
    with pytest.raises(ValueError, match="num_pages"):
        EngineConfig(kv_layout="paged", page_size=16, max_seq_len=512, num_pages=8)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(kv_layout="paged", page_size=0)
    with pytest.raises(ValueError, match="pallas_tpu"):
        resolve_attention("pallas_tpu", "cpu", None, 1)
    assert resolve_attention("auto", "cpu", None, 1) == "xla"  # the CPU kernels off
    assert resolve_attention("auto", "cpu", 16, 1, cpu_kernels=True) == "cpu"
    for no in (dict(kv_dtype="int8"), dict(softcap=50.0), dict(sinks=True), dict(chunk=8)):
        assert resolve_attention("auto", "cpu", None, 1, cpu_kernels=True, **no) == "xla"
        with pytest.raises(ValueError, match="paged_attention='cpu'"):
            resolve_attention("cpu", "cpu", None, 1, cpu_kernels=True, **no)
    assert resolve_attention("auto", "cpu", None, 2, cpu_kernels=True) == "xla"
    with pytest.raises(ValueError, match="CPU kernels off"):
        resolve_attention("cpu", "cpu", None, 1)
    with pytest.raises(ValueError, match="cpu paged kernel"):
        EngineConfig(kv_layout="paged", paged_attention="cpu", speculative="ngram:2")
    assert resolve_attention("auto", "tpu", None, 1) == "pallas_tpu"
    assert resolve_attention("auto", "tpu", 16, 1) == "xla"
    # Gemma 2's attention-logit soft cap: the gather path, the kernel refused by name
    assert resolve_attention("auto", "tpu", None, 1, softcap=50.0) == "xla"
    with pytest.raises(ValueError, match="soft cap"):
        resolve_attention("pallas_tpu", "tpu", None, 1, softcap=50.0)


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window
def test_cpu_kernel_and_gather_path_give_identical_greedy_tokens(family):
    cfg, dev = model_config(family), jax.devices()[:1]
    engines = [PagePlanner(create_engine(cfg, devices=dev, config=EngineConfig(
        **SHAPES, kv_layout="paged", page_size=4, paged_attention=impl)))
        for impl in ("cpu", "xla")]
    if not engines[0].engine.backend.cpu_kernels:
        pytest.skip("the CPU kernels are unavailable here")
    assert [e.engine.attention_impl for e in engines] == ["cpu", "xla"]
    host = host_params(engines[0])
    kernel, gather = (generate_many(e, place(e, host), PROMPTS, max_tokens=22,
                                    ignore_eos=True) for e in engines)
    for a, b in zip(kernel, gather, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.device
@pytest.mark.skipif(jax.devices()[0].platform != "tpu", reason="the kernel needs a TPU")
def test_pallas_kernel_agrees_with_gather_path():
    rng = np.random.default_rng(0)
    K, N, H, ps, P, B, W = 2, 8, 128, 16, 64, 4, 8
    k_pool = jnp.asarray(rng.standard_normal((K, P + 1, ps, H)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((K, P + 1, ps, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[: B * W].reshape(B, W), jnp.int32)
    lengths = jnp.asarray([1, 17, 64, 128], jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32)
    ref = xla_decode_attention(q, k_pool, v_pool, table, lengths)
    out = pallas_decode_attention(q[:, None], k_pool, v_pool, table, lengths)[:, 0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-2, rtol=2e-2)


def test_the_contiguous_class_refuses_a_paged_config():
    # create_engine picks the class for the layout; the base class never swaps itself.
    with pytest.raises(ValueError, match="kv_layout is 'paged'.*create_engine"):
        TransformerEngine(model_config("llama"), devices=jax.devices()[:1],
                          config=EngineConfig(**SHAPES, kv_layout="paged", page_size=4))
