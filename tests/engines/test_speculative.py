"""Speculative decoding in the generate step (engines/speculative.py): parsing, n-gram
drafting, verification (greedy parity with the plain step, rollback of rejected drafts,
the target distribution under rejection sampling) and one compile."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engines import EngineConfig, ModelConfig, SamplingParams, create_engine
from engines.engine_config import parse_speculative
from engines.sampling import SlotSampling
from engines.speculative import ngram_drafts, running_counts, target_probs, verify
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import with_pages
from tests.engines.speculative_sampling import check_first_tokens_follow, prefilled_slots

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=24)
K = 4


def _engine(speculative, **kw):
    config = EngineConfig(max_concurrent_decodes=3, max_prefill_length=48, max_seq_len=96,
                          speculative=speculative, **kw)
    # A paged engine is called through its page planner (which holds the page table).
    eng = with_pages(create_engine(CFG, config=config, devices=jax.devices()[:1], seed=3))
    return eng, eng.load_params()


@pytest.fixture(scope="module")
def plain():
    return _engine("none")


@pytest.fixture(scope="module")
def spec():
    return _engine(f"ngram:{K}")


def _prompts(seed=0):
    """Repetitive prompts (drafts often right) and random ones (drafts mostly wrong)."""
    rng = np.random.default_rng(seed)
    rep = [rng.integers(3, 30, n).tolist() * 3 for n in (4, 7, 11)]
    rand = [rng.integers(3, 96, n).tolist() for n in (5, 30, 17)]
    return rep + rand


# ---- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("ngram:0", "1 <= K <= 16"), ("ngram:17", "1 <= K <= 16"), ("ngram:x", "integer K"),
    ("ngram", "integer K"), ("medusa:4", "'ngram:K' or 'draft:PATH:K'"), ("draft:", "draft model"),
])
def test_bad_speculative_settings_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative(text)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative=text)


def test_the_tpu_paged_kernel_refuses_speculative():
    with pytest.raises(ValueError, match="pallas_tpu paged kernel"):
        EngineConfig(kv_layout="paged", paged_attention="pallas_tpu", speculative="ngram:2")


# ---- drafting -----------------------------------------------------------------------------


def test_ngram_drafts_follow_the_most_recent_longest_match():
    S = 16
    rows = [
        # last tokens (7, 8, 9) seen before at 1..3 -> drafts 4, 5, 6
        ([1, 7, 8, 9, 4, 5, 6, 7, 8, 9], 9),
        # 3-gram (2, 3, 1) never seen earlier; 2-gram (3, 1) at 3..4 -> drafts 8, 2, 3
        ([5, 9, 7, 3, 1, 8, 2, 3, 1], 8),
        # no earlier occurrence of 6 at all: the last token repeated
        ([1, 2, 3, 4, 6], 4),
        # 1-gram only, most recent of two matches (position 3, not 1)
        ([9, 2, 5, 2, 7, 8, 2], 6),
    ]
    hist = np.zeros((len(rows), S), np.int32)
    for b, (toks, _) in enumerate(rows):
        hist[b, : len(toks)] = toks
    lengths = np.array([n for _, n in rows], np.int32)
    got = np.asarray(ngram_drafts(jnp.asarray(hist), jnp.asarray(lengths), 3))
    np.testing.assert_array_equal(got, [[4, 5, 6], [8, 2, 3], [6, 6, 6], [7, 8, 2]])


# ---- verification ---------------------------------------------------------------------------


def test_greedy_output_equals_plain_with_slots_joining_and_leaving(plain, spec):
    prompts = _prompts()
    lens = [40, 25, 60, 33, 12, 50]  # 6 requests over 3 slots: they join and leave
    want = [generate_many(*plain, [p], max_tokens=n, ignore_eos=True)[0]
            for p, n in zip(prompts, lens, strict=True)]
    got = []
    for p, n in zip(prompts, lens, strict=True):
        got += generate_many(*spec, [p], max_tokens=n, ignore_eos=True)
    batched = generate_many(*spec, prompts, max_tokens=max(lens), ignore_eos=True)
    for w, g, b, n in zip(want, got, batched, lens, strict=True):
        assert g.token_ids == w.token_ids
        assert b.token_ids[:n] == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def _steps(eng, params, prompts, steps):
    """Runs `steps` generate steps over prompts in slots 0.. and returns, per slot, the
    tokens and log-probs of every step, and every step's count."""
    state = eng.init_decode_state()
    toks = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    counts = []
    for slot, p in enumerate(prompts):
        prefix, first = eng.prefill(params, p, len(p))
        h = first.to_host()
        toks[slot].append(h.token(0))
        lps[slot].append(h.logprob(0))
        state = eng.insert(prefix, state, slot)
    for _ in range(steps):
        state, res = eng.generate(params, state)
        h = res.to_host()
        for slot in range(len(prompts)):
            n = h.count(slot)
            counts.append(n)
            toks[slot] += h.tokens(slot)
            lps[slot] += [h.logprob(slot, i) for i in range(n)]
            for i in range(n):  # greedy, no penalties: each token is its row's top entry
                top_id, top_lp = h.top_logprobs(slot, i)[0]
                assert top_id == h.token(slot, i) and top_lp == h.logprob(slot, i)
    return toks, lps, counts


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_verify_step_takes_a_mask_per_position(spec, layout):
    """Structured output in a verify step: slot 0 is constrained (its mask at position 0
    allows one token, nothing after): it keeps exactly that token; slot 1 is free (all
    ones): its tokens are the unmasked step's; slot 2 sits the step out (nothing allowed at
    position 0): its token, length and RNG key stay."""
    from engines.token_mask import mask_words

    eng, params = spec if layout == "contiguous" else _engine(f"ngram:{K}",
                                                              kv_layout="paged", page_size=8)
    prompts = _prompts()[:3]

    def filled():
        state = eng.init_decode_state()
        for slot, p in enumerate(prompts):
            prefix, _ = eng.prefill(params, p, len(p))
            state = eng.insert(prefix, state, slot)
        return state

    _, free = eng.generate(params, filled())
    W = mask_words(CFG.vocab_size)
    mask = np.full((3, K + 1, W), -1, np.int32)
    only = 41
    mask[0] = 0
    mask[0, 0, only // 32] = 1 << (only % 32)
    mask[2] = 0
    before = filled()
    lengths = np.asarray(before.lengths).copy()
    keep = (lengths[2], np.asarray(before.tokens)[2], np.asarray(before.sampling.key)[2])
    after, res = eng.generate(params, before, token_mask=mask)
    h, f = res.to_host(), free.to_host()
    assert h.tokens(0) == [only]
    assert h.tokens(1) == f.tokens(1) and len(f.tokens(1)) >= 1
    assert h.count(2) == 0
    assert (np.asarray(after.lengths)[2], np.asarray(after.tokens)[2]) == keep[:2]
    np.testing.assert_array_equal(np.asarray(after.sampling.key)[2], keep[2])
    assert np.asarray(after.lengths)[0] == lengths[0] + 1
    for slot in range(3):
        eng.free_slot(slot)


def test_rejected_drafts_are_rolled_back(plain, spec):
    # Random prompts: most drafts are wrong, so almost every step rejects mid-way, writing
    # keys and values at positions the next step must overwrite, never read. Every later
    # log-prob (a function of every attention result before it) matches the plain run.
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 96, n).tolist() for n in (9, 21, 14)]
    toks, lps, counts = _steps(*spec, prompts, 12)
    for slot, p in enumerate(prompts):
        n = len(toks[slot]) - 1
        ref = generate_many(*plain, [p], max_tokens=n + 1, ignore_eos=True)[0]
        assert toks[slot] == ref.token_ids
        np.testing.assert_allclose(lps[slot], ref.logprobs, atol=1e-5)
    assert 1 in counts  # rejected at the first draft
    assert any(1 < c <= K for c in counts) or K + 1 in counts  # and some drafts kept


def test_generate_compiles_once(spec):
    eng, params = spec
    before = eng.trace_counts()["generate"]
    generate_many(eng, params, _prompts(3), max_tokens=20, ignore_eos=True)
    generate_many(eng, params, _prompts(4)[:2], max_tokens=35, ignore_eos=True)
    assert eng.trace_counts()["generate"] - before <= 1  # at most this module's first


def test_int8_kv_and_sampling_seeds(plain, spec):
    eng, params = _engine(f"ngram:{K}", kv_dtype="int8")
    ref, ref_params = _engine("none", kv_dtype="int8")
    prompts = _prompts(5)[:3]
    want = generate_many(ref, ref_params, prompts, max_tokens=20, ignore_eos=True)
    got = generate_many(eng, params, prompts, max_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    s = SamplingParams(temperature=1.0, top_k=20, seed=11)
    a = generate_many(*spec, prompts, max_tokens=15, sampling=s, ignore_eos=True)
    b = generate_many(*spec, prompts, max_tokens=15, sampling=s, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    other = generate_many(*spec, prompts, max_tokens=15, ignore_eos=True,
                          sampling=dataclasses.replace(s, seed=12))
    assert [r.token_ids for r in a] != [r.token_ids for r in other]


def test_target_probs_are_the_samplers_distribution_per_row():
    # Row 0 greedy, row 1 temperature 0.5 with top-k 2, row 2 temperature 1 with a
    # presence penalty that, at the second position, sees the first draft (token 3).
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 6)), jnp.float32)
    rows = [SlotSampling.from_params(p, 0) for p in (
        SamplingParams(), SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=1.0, presence_penalty=1.5))]
    s = jax.tree.map(lambda *x: jnp.concatenate(x), *rows)
    counts = running_counts(jnp.zeros((3, 6), jnp.int32), jnp.full((3, 1), 3, jnp.int32))
    p = np.asarray(target_probs(logits, s, jnp.zeros((3, 6), bool), counts))
    lg = np.asarray(logits)
    np.testing.assert_array_equal(p[0], np.eye(6)[lg[0].argmax(-1)])
    for t in range(2):
        top2 = np.argsort(lg[1, t])[-2:]
        want = np.zeros(6)
        want[top2] = np.exp(lg[1, t, top2] / 0.5) / np.exp(lg[1, t, top2] / 0.5).sum()
        np.testing.assert_allclose(p[1, t], want, atol=1e-6)
    np.testing.assert_allclose(p[2, 0], np.exp(lg[2, 0]) / np.exp(lg[2, 0]).sum(), atol=1e-6)
    pen = lg[2, 1] - 1.5 * (np.arange(6) == 3)
    np.testing.assert_allclose(p[2, 1], np.exp(pen) / np.exp(pen).sum(), atol=1e-6)


def test_rejection_sampling_keeps_the_target_distribution():
    # Small vocabulary, a target p per position and a drafter q that differs from it (and
    # gives some tokens p lacks, and lacks some p has). Drafts are drawn from q; the first
    # output token must follow p_0, and the second (when the first draft was kept) p_1.
    V, Kd, N = 6, 2, 40000
    p = np.array([[0.30, 0.05, 0.25, 0.0, 0.15, 0.25],
                  [0.10, 0.40, 0.00, 0.20, 0.10, 0.20],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]], np.float32)
    q = np.array([[0.05, 0.40, 0.10, 0.30, 0.15, 0.00],
                  [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]], np.float32)
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.choice(V, N, p=q[i]) for i in range(Kd)], 1).astype(np.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), N))
    tokens, count = jax.jit(verify)(jnp.broadcast_to(p, (N, Kd + 1, V)),
                                    jnp.broadcast_to(q, (N, Kd, V)), jnp.asarray(drafts), keys)
    tokens, count = np.asarray(tokens), np.asarray(count)
    assert 1 <= count.min() and count.max() <= Kd + 1 and (count > 1).mean() > 0.3

    def check(observed, probs):
        f_obs = np.bincount(observed, minlength=V)
        keep = probs > 0
        assert f_obs[~keep].sum() == 0  # never a token the target cannot give
        expected = probs[keep].astype(np.float64)
        expected = expected / expected.sum() * len(observed)
        assert stats.chisquare(f_obs[keep], expected).pvalue > 1e-3

    check(tokens[:, 0], p[0])
    check(tokens[count >= 2, 1], p[1])
    check(tokens[count >= 3, 2], p[2])


# ---- the paged layout -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paged_spec():
    # Pages of 4 tokens: a verify step of 5 positions spans two or three pages.
    return _engine(f"ngram:{K}", kv_layout="paged", page_size=4)


def test_paged_greedy_output_equals_plain(plain, paged_spec):
    eng, params = paged_spec
    prompts = _prompts(1)
    want = generate_many(*plain, prompts, max_tokens=30, ignore_eos=True)
    got = generate_many(eng, params, prompts, max_tokens=30, ignore_eos=True)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    eng.kv_pages.check()
    assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages  # every page came back


def test_paged_rollback_returns_the_pages_of_rejected_positions(plain, paged_spec):
    eng, params = paged_spec
    pages = eng.kv_pages
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 96, n).tolist() for n in (6, 13, 10)]
    state = eng.init_decode_state()
    toks = []
    for slot, p in enumerate(prompts):
        prefix, first = eng.prefill(params, p, len(p))
        toks.append([first.to_host().token(0)])
        state = eng.insert(prefix, state, slot)
    returned = 0
    for _ in range(10):
        state, res = eng.generate(params, state)  # syncs the last step's lengths first
        pages.check()
        h = res.to_host()
        for slot in range(3):
            toks[slot] += h.tokens(slot)
        planned = sum(len(pages.pages_of(s)) for s in range(3))
        pages.sync(np.asarray(state.lengths))
        pages.check()
        returned += planned - sum(len(pages.pages_of(s)) for s in range(3))
        for slot in range(3):
            assert pages.length(slot) == h.length(slot) - 1  # the host agrees with the device
    assert returned > 0  # pages planned for rejected positions went back
    for slot, p in enumerate(prompts):
        ref = generate_many(*plain, [p], max_tokens=len(toks[slot]), ignore_eos=True)[0]
        assert toks[slot] == ref.token_ids
    for s in range(3):
        eng.free_slot(s)
    pages.check()


def test_history_holds_the_prompt_after_chunks_and_cached_blocks(spec):
    # n-gram drafts read each slot's token history: a prompt prefilled in chunks, or
    # continued from prefix-cache blocks, must land there whole.
    eng, params = spec
    prompt = list(range(3, 43))
    whole, first = eng.prefill(params, prompt, len(prompt))
    part, _ = eng.prefill(params, prompt[:16], 16)
    chunked, _ = eng.prefill(params, prompt[16:], 24, existing_prefix=part)
    stack = eng.stack_blocks(eng.cache_blocks(whole, 0, 4, 8))
    cached, _ = eng.prefill(params, prompt[32:], 8,
                            existing_prefix=eng.prefix_from_blocks(stack, prompt[:32]))
    want = prompt + [first.to_host().token(0)]
    state = eng.init_decode_state()
    for slot, prefix in enumerate((whole, chunked, cached)):
        state = eng.insert(prefix, state, slot)
    history = np.asarray(state.history)
    for slot in range(3):
        assert history[slot, : len(want)].tolist() == want


def test_engine_sampling_at_temperature_1_follows_the_model():
    # The whole verify step at temperature 1 (n-gram drafts: q one-hot): over many slots
    # holding the same sequence, each with its own key, the step's first token follows the
    # model's softmax at that position, whether the draft was kept or replaced.
    cfg = dataclasses.replace(CFG, vocab_size=16, sliding_window=None)
    B = 128
    eng = create_engine(cfg, config=EngineConfig(
        max_concurrent_decodes=B, max_prefill_length=16, max_seq_len=32, top_logprobs=0,
        speculative="ngram:2"), devices=jax.devices()[:1], seed=4)
    params = eng.load_params()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    state0, p = prefilled_slots(eng, params, prompt)
    drafts = np.asarray(ngram_drafts(state0.history, state0.lengths, 2))
    assert (drafts == drafts[0]).all() and p[drafts[0, 0]] > 0.05  # a draft worth testing
    check_first_tokens_follow(eng, params, state0, p)
