"""Token masks in the mixed step (engines/mixed_step.py `token_mask`): with the same masks,
prompts prefilled in chunks beside decode rows give the tokens prefill / insert / generate
give; a sampled token is always one its mask allows (greedy and at temperature 1); a
decode row whose mask allows nothing sits the step out and goes on as if it never had;
a step with a mask is one more program per shape, never more; bad masks are refused."""

import numpy as np
import pytest

from engines.mixed_batch import MixedRow
from engines.sampling import SamplingParams
from engines.token_mask import allow_all
from jetserve.scheduling.page_planner import PagePlanner
from tests.engines.mixed_driver import run_mixed
from tests.engines.test_mixed_step import MAX_TOKENS, PROMPTS, SHAPES, _engine
from tests.engines.test_token_mask import _mask_of

HOT = SamplingParams(temperature=1.0)


def _allowed(V: int, i: int, j: int) -> set[int]:
    """Prompt i's token j may be a quarter of the vocabulary, drawn per (i, j)."""
    rng = np.random.default_rng(1000 * i + j)
    return set(rng.choice(V, V // 4, replace=False).tolist())


@pytest.fixture(scope="module")
def engine():
    eng, params = _engine("llama")
    V = eng.vocab_size
    rows = {}

    def masks(i: int, j: int) -> np.ndarray:
        if (i, j) not in rows:
            rows[i, j] = _mask_of([_allowed(V, i, j)], V)[0]
        return rows[i, j]

    return eng, params, masks


def _reference(eng, params, masks, sampling):
    """Each prompt alone through prefill (its first token's mask), insert and masked
    generate steps, on the paged engine's planner."""
    planner = PagePlanner(eng)
    state = planner.init_decode_state()
    out = []
    for i, p in enumerate(PROMPTS):
        prefix, first = eng.prefill(params, p, len(p), sampling=sampling, seed=i,
                                    token_mask=masks(i, 0)[None])
        state = planner.insert(prefix, state, 0)
        toks = [first.to_host().token(0)]
        for j in range(1, MAX_TOKENS):
            mask = allow_all(SHAPES["max_concurrent_decodes"], eng.vocab_size)
            mask[0] = masks(i, j)
            state, res = planner.generate(params, state, token_mask=mask)
            toks.append(res.to_host().token(0))
        planner.free_slot(0)
        out.append(toks)
    return out


def _in_masks(outputs, V) -> bool:
    return all(t in _allowed(V, i, j) for i, toks in enumerate(outputs)
               for j, t in enumerate(toks))


def test_masked_mixed_steps_give_generates_tokens_within_their_masks(engine):
    eng, params, masks = engine
    V = eng.vocab_size
    want = _reference(eng, params, masks, SamplingParams())
    assert _in_masks(want, V)
    run = dict(max_tokens=MAX_TOKENS, chunk=5, budget=7, widest=True)
    before = eng.trace_counts()["mixed"]
    free = run_mixed(eng, params, PROMPTS, **run)
    plain = eng.trace_counts()["mixed"]
    assert plain - before == len(free.shapes)
    assert free.outputs != want  # the masks decide tokens here
    # Chunks of 5 under a budget of 7 beside decode rows, some of which sit steps out.
    got = run_mixed(eng, params, PROMPTS, masks=masks, pause_every=3, **run)
    assert got.mixed_steps >= 3 and got.shapes == free.shapes
    assert any(b == 0 for b, _ in got.shapes) and any(b > 0 for b, _ in got.shapes)
    assert got.outputs == want
    # The masked step: one more program per shape (decode rows alone included).
    assert eng.trace_counts()["mixed"] - plain == len(free.shapes)
    # Sampled at temperature 1, no token leaves its mask (and nothing compiles again).
    hot = run_mixed(eng, params, PROMPTS, masks=masks, pause_every=2, sampling=HOT, **run)
    assert _in_masks(hot.outputs, V) and hot.outputs != want
    assert eng.trace_counts()["mixed"] - plain == len(free.shapes)


def test_sampled_tokens_match_generates_with_the_same_seeds(engine):
    eng, params, masks = engine
    want = _reference(eng, params, masks, HOT)
    got = run_mixed(eng, params, PROMPTS, masks=masks, sampling=HOT, max_tokens=MAX_TOKENS,
                    chunk=5, budget=7, widest=True)
    assert got.outputs == want


def test_bad_masks_are_refused(engine):
    eng, params, _ = engine
    state = eng.init_decode_state()
    table = np.full((3, 4), eng.page_geometry.num_pages, np.int32)
    mask = allow_all(3, eng.vocab_size)
    with pytest.raises(ValueError, match=r"token_mask must be i32\[3, "):
        eng.mixed_step(params, state, table, [MixedRow(slot=0)], token_mask=mask[:2])
    mask[1] = 0
    with pytest.raises(ValueError, match="allows no token to slot 1, whose chunk ends"):
        eng.mixed_step(params, state, table, [MixedRow(slot=1, chunk=[1, 2], last=True,
                                                       sampling=SamplingParams())],
                       token_mask=mask)
