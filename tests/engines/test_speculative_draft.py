"""Speculative decoding with a draft model ("draft:PATH:K", engines/speculative.py): greedy
output equal to the plain step through the orchestrator, the draft's cache rolled back to
the kept tokens, the target's distribution at temperature 1 with the draft's non-one-hot
q, and the combinations it refuses by name."""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, SamplingParams, create_engine, layer_scan
from engines.engine_config import Speculative, parse_speculative
from engines.kv_cache import PrefillKV
from jetserve.commands.common import add_model_arguments, engine_config
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.scheduling.page_planner import with_pages
from sharding import load_preset
from tests.engines.speculative_sampling import check_first_tokens_follow, prefilled_slots

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=24)
# A smaller model of the same vocabulary: its drafts are mostly wrong.
SMALL = ModelConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8)
K = 4


def _engine(speculative, draft=None, **kw):
    config = EngineConfig(max_concurrent_decodes=3, max_prefill_length=48, max_seq_len=96,
                          speculative=speculative, **kw)
    # A paged engine is called through its page planner (which holds the page table).
    eng = with_pages(create_engine(CFG, config=config, devices=jax.devices()[:1], seed=3,
                                   draft_config=draft))
    return eng, eng.load_params()


@pytest.fixture(scope="module")
def plain():
    return _engine("none")


@pytest.fixture(scope="module")
def small():
    return _engine(f"draft:small:{K}", SMALL)


@pytest.fixture(scope="module")
def itself():
    # The target as its own draft (same config and seed: the same weights).
    return _engine(f"draft:itself:{K}", CFG)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, n).tolist() for n in (5, 30, 17, 9, 22, 3)]


LENS = (40, 25, 60, 33, 12, 50)


def _orchestrated(eng, params, prompts, lens, sampling=None):
    with Orchestrator.from_engines(eng, params=params) as orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=n, ignore_eos=True,
                                       logprobs=0, sampling=sampling or SamplingParams()))
                   for p, n in zip(prompts, lens, strict=True)]
        results = [h.result(600) for h in handles]
        return results, orch.stats()["generate"][0]


# ---- parsing and refusals -------------------------------------------------------------------


def test_draft_setting_parses_path_with_colons():
    assert parse_speculative("draft:random:tiny:3") == Speculative("draft", 3, "random:tiny")
    assert parse_speculative("draft:/m/d:16") == Speculative("draft", 16, "/m/d")
    for text, message in (("draft:4", "draft model's PATH"), ("draft:m:0", "1 <= K <= 16"),
                          ("draft:m:x", "integer K")):
        with pytest.raises(ValueError, match=message):
            parse_speculative(text)


def test_cli_builds_a_draft_engine_and_names_a_vocabulary_mismatch():
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    args = p.parse_args(["--max-seq-len", "64", "--speculative", "draft:random:tiny:3"])
    eng = build_engine("random:small", engine_config=engine_config(args),
                       devices=jax.devices()[:1])
    assert eng.has_draft_model and eng.config.spec.k == 3
    args = p.parse_args(["--max-seq-len", "64", "--speculative", "draft:random:llama-156m:3"])
    with pytest.raises(ValueError, match="vocabulary of 32000 tokens, the target 256"):
        build_engine("random:tiny", engine_config=engine_config(args))


def test_draft_model_and_setting_must_agree():
    config = EngineConfig(speculative="draft:m:2")
    with pytest.raises(ValueError, match="needs the draft model's config"):
        create_engine(CFG, config=config)
    with pytest.raises(ValueError, match="not 'draft:PATH:K'"):
        create_engine(CFG, config=EngineConfig(speculative="ngram:2"), draft_config=SMALL)


def test_mixed_engines_are_refused(plain, small):
    eng, params = small
    plain_eng, plain_params = plain
    with pytest.raises(ValueError, match="must all have the draft model"):
        Orchestrator(prefill_engines=[plain_eng], generate_engines=[eng],
                     prefill_params=[plain_params], generate_params=[params])


def test_chunked_prefill_carries_the_draft_kv(small):
    """A 40-token prompt in chunks of 16 (into an empty prefix, donated, as the chunk
    loops run it): the target's and the draft's KV and the first token of one pass."""
    eng, params = small
    prompt = np.random.default_rng(4).integers(3, 96, 40).tolist()
    whole, first = eng.prefill(params, prompt, 40, seed=1)
    prefix = eng.empty_prefix(40)
    assert len(prefix.draft_k) == SMALL.num_layers
    for s in range(0, 40, 16):
        piece = prompt[s:s + 16]
        prefix, got_first = eng.prefill(params, piece, len(piece), existing_prefix=prefix,
                                        seed=1, donate=True)
    assert int(prefix.length) == 40 and len(prefix.draft_k) == SMALL.num_layers
    for want, got in ((whole.k, prefix.k), (whole.v, prefix.v),
                      (whole.draft_k, prefix.draft_k), (whole.draft_v, prefix.draft_v)):
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(g)[:, :40], np.asarray(w)[:, :40],
                                       rtol=1e-4, atol=1e-5)
    assert got_first.to_host().token(0) == first.to_host().token(0)


def test_prefix_cache_blocks_remake_the_draft_kv(small):
    """A prefix-cache hit: the blocks hold the target's KV only, and the prefix made of
    them has the draft's KV of the cached tokens as the whole prompt's prefill makes it,
    so the continued prefill and its first token are the uncached ones."""
    eng, params = small
    prompt = np.random.default_rng(5).integers(3, 96, 37).tolist()
    whole, first = eng.prefill(params, prompt, 37, seed=2)
    donor, _ = eng.prefill(params, prompt[:32] + [1, 2], 34)
    head = eng.prefix_from_blocks(eng.stack_blocks(eng.cache_blocks(donor, 0, 2, 16)),
                                  prompt[:32])
    assert len(head.draft_k) == SMALL.num_layers
    for w, g in zip((*whole.draft_k, *whole.draft_v), (*head.draft_k, *head.draft_v),
                    strict=True):
        np.testing.assert_allclose(np.asarray(g)[:, :32], np.asarray(w)[:, :32],
                                   rtol=1e-4, atol=1e-5)
    prefix, got_first = eng.prefill(params, prompt[32:], 5, existing_prefix=head, seed=2)
    for want, got in ((whole.k, prefix.k), (whole.draft_k, prefix.draft_k),
                      (whole.draft_v, prefix.draft_v)):
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(g)[:, :37], np.asarray(w)[:, :37],
                                       rtol=1e-4, atol=1e-5)
    assert got_first.to_host().token(0) == first.to_host().token(0)


def test_prefix_cache_hits_through_the_orchestrator(plain, itself):
    """A server's prefix cache with the target as its own draft: prompts sharing a long
    head hit the cache and give the plain engine's tokens, every draft kept (so the
    draft's KV of the cached part is right)."""
    head = np.random.default_rng(6).integers(3, 96, 40).tolist()
    prompts = [head + [7, 8, 9], head + [11], head[:36] + [4, 4, 4, 4, 4]]
    lens = [12, 10, 8]
    want, _ = _orchestrated(*plain, prompts, lens)
    eng, params = itself
    config = OrchestratorConfig(prefix_cache_hbm_bytes=2**20)
    with Orchestrator.from_engines(eng, params=params, config=config) as orch:
        got = []
        for p, n in zip(prompts, lens, strict=True):  # one at a time: later ones hit
            got.append(orch.submit(Request(prompt_ids=p, max_tokens=n, ignore_eos=True,
                                           logprobs=0)).result(600))
        st = orch.stats()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert st["prefix_cache"][0]["hit_tokens"] >= 32
    assert st["generate"][0]["accepted"] >= 0.97 * st["generate"][0]["drafted"] > 0


# ---- greedy parity and the draft cache ------------------------------------------------------


def test_greedy_output_equals_plain_through_the_orchestrator(plain, small, itself):
    prompts = _prompts()
    want, _ = _orchestrated(*plain, prompts, LENS)
    for eng, params in (small, itself):
        got, st = _orchestrated(eng, params, prompts, LENS)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        if eng is small[0]:
            assert st["accepted"] < 0.5 * st["drafted"]  # mostly rejected
        else:  # the target's own drafts: all kept (draft KV and rollback are right)
            assert st["accepted"] >= 0.97 * st["drafted"] > 0



def test_long_prompt_in_chunks_through_the_orchestrator(plain, itself):
    """A prompt past max_prefill_length (48) is prefilled in chunks with a draft model as
    without: the plain engine's greedy tokens, and the target as its own draft keeps its
    drafts (so the draft KV of every chunk is right)."""
    prompts = [np.random.default_rng(9).integers(3, 96, 70).tolist(), _prompts()[1]]
    want, _ = _orchestrated(*plain, prompts, (20, 12))
    got, st = _orchestrated(*itself, prompts, (20, 12))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert st["accepted"] >= 0.97 * st["drafted"] > 0

def _run(eng, params, prompts, steps):
    state = eng.init_decode_state()
    seqs = []
    for slot, p in enumerate(prompts):
        prefix, first = eng.prefill(params, p, len(p))
        seqs.append(list(p) + [first.to_host().token(0)])
        state = eng.insert(prefix, state, slot)
    counts = []
    for _ in range(steps):
        state, res = eng.generate(params, state)
        h = res.to_host()
        for slot in range(len(prompts)):
            counts.append(h.count(slot))
            seqs[slot] += h.tokens(slot)
    return state, seqs, counts


@pytest.fixture(scope="module")
def noisy():
    # The target as its own draft with noise on the draft's weights: drafts are kept
    # sometimes and rejected mid-way other times.
    eng, params = _engine(f"draft:noisy:{K}", CFG)
    leaves, tree = jax.tree.flatten(eng._draft_params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    eng._draft_params = jax.tree.unflatten(tree, [
        x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)])
    return eng, params


def test_the_draft_cache_holds_exactly_the_kept_tokens(plain, noisy):
    # After steps that keep some drafts and reject others mid-way, the draft cache up to
    # each slot's length equals the draft model's KV of the whole kept sequence
    # prefilled at once, and the tokens are the plain greedy ones.
    eng, params = noisy
    prompts = _prompts(2)[:3]
    state, seqs, counts = _run(eng, params, prompts, 10)
    assert 1 in counts and any(1 < c <= K for c in counts)
    draft, draft_params = eng._draft, eng._draft_params
    lengths = np.asarray(state.lengths)
    for slot, seq in enumerate(seqs):
        n = int(lengths[slot])
        assert n == len(seq) - 1  # the last token is fed next, not yet cached
        want = generate_many(*plain, [prompts[slot]], max_tokens=n + 1 - len(prompts[slot]),
                             ignore_eos=True)[0]
        assert seq[len(prompts[slot]):] == want.token_ids
        pos = jnp.arange(n)[None]
        kv = PrefillKV(pos, None)
        draft.model.apply({"params": draft_params}, jnp.asarray([seq[:n]]), pos, kv)
        # Per layer whichever layout the draft runs (a scan stacks its cache [L, ...]).
        draft_k = layer_scan.cache_layers(state.draft_k, 4)
        draft_v = layer_scan.cache_layers(state.draft_v, 4)
        for layer in range(CFG.num_layers):
            k = np.asarray(draft_k[layer][slot, :, :, :n]).transpose(2, 0, 1)
            v = np.asarray(draft_v[layer][slot, :, :n]).transpose(1, 0, 2)
            np.testing.assert_allclose(k, np.asarray(kv.k[layer][0]), atol=1e-4)
            np.testing.assert_allclose(v, np.asarray(kv.v[layer][0]), atol=1e-4)


def test_sampling_seeds_repeat(small):
    s = SamplingParams(temperature=1.0, top_k=20, seed=11)
    prompts, lens = _prompts(5)[:3], (15, 15, 15)
    a, b, c = ([r.token_ids for r in _orchestrated(*small, prompts, lens, seed)[0]]
               for seed in (s, s, dataclasses.replace(s, seed=12)))
    assert a == b and a != c


# ---- temperature 1 ---------------------------------------------------------------------------


def test_engine_sampling_at_temperature_1_follows_the_target():
    # The whole step at temperature 1 with a draft model's q (not one-hot): over many
    # slots holding the same sequence, each with its own key, the step's first token
    # follows the target's softmax, whether the draft was kept or replaced.
    cfg = dataclasses.replace(CFG, vocab_size=16, sliding_window=None)
    B = 128
    eng = create_engine(cfg, config=EngineConfig(
        max_concurrent_decodes=B, max_prefill_length=16, max_seq_len=32, top_logprobs=0,
        speculative="draft:small:2"), devices=jax.devices()[:1], seed=4,
        draft_config=dataclasses.replace(SMALL, vocab_size=16))
    params = eng.load_params()
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    state0, p = prefilled_slots(eng, params, prompt)
    check_first_tokens_follow(eng, params, state0, p)


def test_a_tensor_parallel_target_with_a_replicated_draft(plain):
    # The target split over 2 devices (heads, MLP, vocab, cache heads), the draft model
    # replicated on the same devices: the same greedy tokens as the plain engine.
    config = EngineConfig(max_concurrent_decodes=3, max_prefill_length=48, max_seq_len=96,
                          speculative=f"draft:itself:{K}")
    eng = create_engine(CFG, config=config, devices=jax.devices()[:2], seed=3,
                        sharding=load_preset("tp"), draft_config=CFG)
    params = eng.load_params()
    prompts, lens = _prompts(8)[:4], (20, 9, 26, 14)
    want, _ = _orchestrated(*plain, prompts, lens)
    got, st = _orchestrated(eng, params, prompts, lens)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert st["accepted"] >= 0.97 * st["drafted"] > 0


# ---- the paged layout -----------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["small", "itself"])
def test_paged_greedy_output_equals_plain_with_a_tight_page_pool(plain, draft):
    # Pages of 4 tokens and a pool of 40 (a full sequence takes 24): a verify step spans
    # two or three pages, pages of rejected positions go back, slots wait for pages.
    eng, params = _engine(f"draft:{draft}:{K}", SMALL if draft == "small" else CFG,
                          kv_layout="paged", page_size=4, num_pages=40)
    prompts = _prompts(2)
    want, _ = _orchestrated(*plain, prompts, LENS)
    got, st = _orchestrated(eng, params, prompts, LENS)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    if draft == "small":
        assert st["accepted"] < 0.5 * st["drafted"]  # mostly rejected: pages rolled back
    else:  # the target's own drafts: all kept (the paged draft KV and rollback are right)
        assert st["accepted"] >= 0.97 * st["drafted"] > 0
    eng.kv_pages.check()
    assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages  # every page came back


# ---- the int8 KV cache ----------------------------------------------------------------------


def test_int8_kv_greedy_output_equals_the_plain_int8_engine():
    # The target's cache int8 (per-token scales), the draft's in the model dtype.
    ref, ref_params = _engine("none", kv_dtype="int8")
    prompts, lens = _prompts(3)[:4], (30, 12, 41, 20)
    want, _ = _orchestrated(ref, ref_params, prompts, lens)
    for draft, config in (("small", SMALL), ("itself", CFG)):
        eng, params = _engine(f"draft:{draft}:{K}", config, kv_dtype="int8")
        assert eng.decode_state_shardings().k_scale  # the target's cache is int8
        got, st = _orchestrated(eng, params, prompts, lens)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        assert st["drafted"] > 0
        if draft == "itself":  # the float draft of an int8 target: nearly all kept
            assert st["accepted"] >= 0.9 * st["drafted"]
