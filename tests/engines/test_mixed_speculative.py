"""Verify rows in the mixed step (n-gram speculative decoding, engines/mixed_step.py): with
`speculative="ngram:K"` each decode row of a mixed step is [last token, K drafts] and
keeps what the target accepts, beside prompt chunks in the same step.

- greedy: every prompt's tokens are the plain paged engine's prefill / insert / generate
  tokens (no speculation at all), and some verify row keeps more than one token;
- sampled: the tokens the speculative engine's own prefill / insert / verify steps give
  with the same seeds;
- token masks (one per verify position): a constrained row keeps only its mask's token,
  as the speculative generate step does;
- a step of decode rows alone runs the verify step's program (one more program); the page
  planner's lengths follow the device's;
- a token mask of one row per slot (not one per position) is refused by name.
"""

import jax
import numpy as np
import pytest

from engines import EngineConfig, create_engine
from engines.mixed_batch import MixedRow
from engines.sampling import SamplingParams
from engines.token_mask import allow_all
from jetserve.scheduling.page_planner import PagePlanner
from tests.engines.mixed_driver import _Seq, chunk_row
from tests.engines.test_mixed_step import MAX_TOKENS, PROMPTS, SHAPES, _engine, _reference
from tests.engines.test_token_mask import _mask_of
from tests.sharding.families import host_params, model_config, place

K = 3
HOT = SamplingParams(temperature=1.0)


def _spec_engine(family: str):
    eng = create_engine(model_config(family), devices=jax.devices()[:1],
                        config=EngineConfig(**SHAPES, speculative=f"ngram:{K}"))
    return eng, place(eng, host_params(eng))


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: sliding window 16
def engines(request):
    plain = _engine(request.param)
    return plain, _spec_engine(request.param)


def _run(eng, params, *, chunk: int, budget: int, sampling=None, masks=None):
    """Prompt i arrives at step 2i into a free slot; decode rows first, then chunks up to
    `budget` tokens (a verify row counts K + 1), the planner keeping the pages. masks(i,
    j): the packed row of prompt i's token j (its first position; nothing after).
    Returns (each prompt's tokens, how many tokens each verify row kept), the pages
    checked after every step."""
    planner = PagePlanner(eng)
    g = eng.page_geometry
    state = planner.init_decode_state()
    slots: dict[int, _Seq] = {}
    outputs: list[list[int] | None] = [None] * len(PROMPTS)
    waiting, step, kept = list(range(len(PROMPTS))), 0, []
    while waiting or slots:
        for s in range(g.slots):
            if s not in slots and waiting and waiting[0] * 2 <= step:
                i = waiting.pop(0)
                planner.start_prompt(s, len(PROMPTS[i]))
                slots[s] = _Seq(i, list(PROMPTS[i]))
        rows, left = [], budget
        for s, q in sorted(slots.items()):
            if q.sent == len(q.prompt):
                rows.append(MixedRow(slot=s))
                left -= K + 1
        for s, q in sorted(slots.items()):
            n = min(chunk, len(q.prompt) - q.sent, left)
            if q.sent < len(q.prompt) and n > 0:
                rows.append(chunk_row(s, q, n, sampling))
                left -= n
        prefilling = tuple(s for s, q in slots.items() if q.sent < len(q.prompt))
        kw = {}
        if masks is not None:
            mask = np.zeros((g.slots, K + 1, allow_all(1, eng.vocab_size).shape[1]), np.int32)
            mask[:] = -1
            for r in rows:
                if r.decode or r.last:
                    q = slots[r.slot]
                    mask[r.slot, 0] = masks(q.index, len(q.out))
                    mask[r.slot, 1:] = 0
            kw["token_mask"] = mask
        state, res = planner.mixed_step(params, state, rows, prefilling=prefilling, **kw)
        host = res.to_host()
        for r in rows:
            q = slots[r.slot]
            q.sent += len(r.chunk)
            toks = host.tokens(r.slot)
            assert len(toks) == (1 if r.last else 0) or r.decode
            if r.decode:
                assert 1 <= len(toks) <= K + 1
                kept.append(len(toks))
            q.out += toks
            if len(q.out) >= MAX_TOKENS:
                outputs[q.index] = q.out[:MAX_TOKENS]
                planner.free_slot(r.slot)
                del slots[r.slot]
        planner.kv_pages.check()
        step += 1
    return outputs, kept


def _spec_reference(eng, params, sampling, masks=None):
    """Each prompt alone through the speculative engine's prefill (seed = its index),
    insert and verify steps."""
    planner = PagePlanner(eng)
    state = planner.init_decode_state()
    out = []
    for i, p in enumerate(PROMPTS):
        first_mask = {} if masks is None else {"token_mask": masks(i, 0)[None]}
        prefix, first = eng.prefill(params, p, len(p), sampling=sampling, seed=i, **first_mask)
        state = planner.insert(prefix, state, 0)
        toks = [first.to_host().token(0)]
        while len(toks) < MAX_TOKENS:
            kw = {}
            if masks is not None:
                mask = np.full((SHAPES["max_concurrent_decodes"], K + 1,
                                allow_all(1, eng.vocab_size).shape[1]), -1, np.int32)
                mask[0, 0], mask[0, 1:] = masks(i, len(toks)), 0
                kw["token_mask"] = mask
            state, res = planner.generate(params, state, **kw)
            toks += res.to_host().tokens(0)
        planner.free_slot(0)
        out.append(toks[:MAX_TOKENS])
    return out


def test_greedy_verify_rows_give_the_plain_engines_tokens(engines):
    (plain, plain_params), (eng, params) = engines
    want = _reference(plain, plain_params)
    for chunk, budget in ((5, 9), (16, 28)):
        got, kept = _run(eng, params, chunk=chunk, budget=budget)
        assert got == want
        assert max(kept) > 1  # drafts were accepted: the rows verified, not only sampled


def test_sampled_verify_rows_give_the_verify_steps_tokens(engines):
    _, (eng, params) = engines
    want = _spec_reference(eng, params, HOT)
    got, _ = _run(eng, params, chunk=5, budget=9, sampling=HOT)
    assert got == want
    greedy, _ = _run(eng, params, chunk=5, budget=9)
    assert got != greedy  # sampling did sample


def _allowed(V: int, i: int, j: int) -> set[int]:
    rng = np.random.default_rng(1000 * i + j)
    return set(rng.choice(V, V // 4, replace=False).tolist())


def test_masked_verify_rows_keep_their_masks_token(engines):
    _, (eng, params) = engines
    V = eng.vocab_size
    cache = {}

    def masks(i, j):
        if (i, j) not in cache:
            cache[i, j] = _mask_of([_allowed(V, i, j)], V)[0]
        return cache[i, j]

    want = _spec_reference(eng, params, HOT, masks)
    got, kept = _run(eng, params, chunk=5, budget=9, sampling=HOT, masks=masks)
    assert got == want
    assert max(kept) == 1  # a constrained row keeps one token a step
    assert all(t in _allowed(V, i, j) for i, toks in enumerate(got) for j, t in enumerate(toks))


def test_decode_rows_alone_and_a_bad_mask():
    eng, params = _spec_engine("llama")
    planner = PagePlanner(eng)
    state = planner.init_decode_state()
    planner.start_prompt(0, 16)
    state, _ = planner.mixed_step(params, state, [MixedRow(slot=0, chunk=[9, 4] * 8,
                                                           last=True,
                                                           sampling=SamplingParams())],
                                  prefilling=(0,))
    before = eng.trace_counts()["mixed"]
    kept = 1
    for _ in range(3):  # decode rows alone: the verify step's program, masked to the rows
        state, res = planner.mixed_step(params, state, [MixedRow(slot=0)])
        kept += res.to_host().count(0)
        planner.kv_pages.sync(np.asarray(state.lengths))
        assert planner.kv_pages.length(0) == 16 + kept - 1  # rejected positions given back
        planner.kv_pages.check()
    assert kept >= 4  # at least one token a step
    assert eng.trace_counts()["mixed"] == before + 1
    with pytest.raises(ValueError, match=r"token_mask must be i32\[3, 4, "):
        planner.mixed_step(params, state, [MixedRow(slot=0)],
                           token_mask=allow_all(3, eng.vocab_size))


# ---- a draft model ("draft:PATH:K") --------------------------------------------------------


@pytest.fixture(scope="module")
def drafted():
    """(plain engine, engine drafting with the target itself, engine drafting with a noisy
    copy of the target), each with its params: the weights host_params draws, the noisy
    draft's with noise added (its drafts kept sometimes, rejected mid-way other times)."""
    cfg = model_config("llama")

    def make(speculative="none", noise=0.0):
        eng = create_engine(cfg, devices=jax.devices()[:1], draft_config=cfg if noise
                            or speculative != "none" else None,
                            config=EngineConfig(**SHAPES, speculative=speculative))
        if eng._draft is not None:  # the draft's params, as load_params would keep them
            rng = np.random.default_rng(7)
            eng._draft_params = place(eng._draft, jax.tree.map(
                lambda w: w + noise * w.std() * rng.standard_normal(w.shape).astype(w.dtype),
                host_params(eng._draft)))
        return eng, place(eng, host_params(eng))

    return make(), make(f"draft:itself:{K}"), make(f"draft:noisy:{K}", noise=0.5)


def test_a_draft_models_verify_rows_give_the_plain_tokens(drafted):
    (plain, plain_params), itself, noisy = drafted
    want = _reference(plain, plain_params)
    got, kept = _run(*noisy, chunk=5, budget=9)
    assert got == want
    assert 1 in kept and max(kept) > 1  # drafts rejected and kept
    # The target drafting for itself: the chunks ran through the draft, so its cache
    # holds the prompts and nearly every verify row keeps all K drafts and one more.
    got, kept = _run(*itself, chunk=5, budget=9)
    assert got == want
    assert sum(n == K + 1 for n in kept) >= 0.9 * len(kept), kept


def test_sampled_draft_verify_rows_give_the_verify_steps_tokens(drafted):
    _, _, (eng, params) = drafted
    want = _spec_reference(eng, params, HOT)
    got, kept = _run(eng, params, chunk=5, budget=9, sampling=HOT)
    assert got == want
    assert 1 in kept and max(kept) > 1  # drafts rejected and kept


def test_a_rows_context_goes_into_the_history():
    """A first chunk after a prefix-cache hit (MixedRow.context, the linked positions'
    tokens): the slot's token history holds the whole prompt, which n-gram drafts read."""
    eng, params = _spec_engine("llama")
    planner = PagePlanner(eng)
    state = planner.init_decode_state()
    prompt = [9, 4, 7, 1] * 5
    planner.start_prompt(1, len(prompt))
    state, _ = planner.mixed_step(params, state, [MixedRow(
        slot=1, chunk=prompt[12:], start=12, context=prompt[:12], last=True,
        sampling=SamplingParams())], prefilling=(1,))
    assert np.asarray(state.history)[1, :len(prompt)].tolist() == prompt
    with pytest.raises(ValueError, match=r"slot 1: context is the tokens before a prompt's "
                                         r"first chunk \(start 12\), got 3 tokens"):
        MixedRow(slot=1, chunk=prompt[12:], start=12, context=prompt[:3],
                 sampling=SamplingParams())
