"""The paged KV layout under the layer scan (EngineConfig(layers="scan", kv_layout="paged"),
engines/layer_scan.py): the pools are stacked [L, ...] and carried through the scan, and
prefill / insert / generate, prefix-cache pages, prompt scoring, speculative verification
and the mixed step give the loop's tokens; the generate program is one layer body and
holds no second copy of the pools; nothing recompiles after warm-up. (Against
transformers: tests/parity/test_scan_parity.py and test_mixed_step_parity.py.)"""

import dataclasses

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import PagePlanner
from tests.engines import programs
from tests.engines.mixed_driver import run_mixed

# A sliding window shorter than the longest sequence, pages of 4 tokens. (Its ring of
# pages, engines/paged_kv.py WindowRing, would be 3 slots x 12 pages, no fewer than the
# pool's 36: every layer keeps its pages in the pool, whose pages these tests read.)
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=28)
PROMPTS = [list(range(1, 30)), [5, 6, 7], [9, 2, 6, 11, 40, 3], [77, 6, 50, 1, 8]]
SHAPES = dict(max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=48,
              kv_layout="paged", page_size=4)


def _engine(layers, cfg=CFG, **kw):
    config = EngineConfig(**{**SHAPES, **kw}, layers=layers)
    return PagePlanner(create_engine(cfg, config=config, devices=jax.devices()[:1], seed=3))


@pytest.fixture(scope="module")
def engines():
    """layers mode -> (planner over a paged engine, its params); one seed, one model."""
    out = {}
    for mode in ("loop", "scan"):
        eng = _engine(mode)
        out[mode] = (eng, eng.load_params())
    return out


def _run(eng, params, prompts=PROMPTS):
    """Greedy tokens and log-probs (the 29-token prompt prefilled in two chunks; four
    prompts on three slots, so one waits for a slot and its pages)."""
    res = generate_many(eng, params, prompts, max_tokens=10, ignore_eos=True)
    return [r.token_ids for r in res], np.array([r.logprobs for r in res])


def test_the_pools_are_stacked_under_the_scan(engines):
    assert all(engines[m][0].ring is None for m in engines)
    scan, loop = engines["scan"][0], engines["loop"][0]
    assert scan.model_config.scan_layers and not loop.model_config.scan_layers
    state = scan.init_decode_state()
    K, P1, ps, H = loop.init_decode_state().k[0].shape
    assert len(state.k) == len(state.v) == 1
    assert state.k[0].shape == state.v[0].shape == (3, K, P1, ps, H)
    spec = scan.decode_state_shardings().k[0].spec
    assert len(spec) == 0 or spec[0] is None  # the layer axis is never split


def test_rings_of_pages_stacked_under_the_scan():
    """Every layer sliding (window 12): each keeps a ring of 8 pages a slot, the rings
    stacked [L, ...] under the scan, and the scan gives the loop's tokens and log-probs."""
    cfg = dataclasses.replace(CFG, sliding_window=12)
    runs = {}
    for mode in ("loop", "scan"):
        eng = _engine(mode, cfg)
        assert eng.ring is not None and eng.ring.pages == 8 and all(eng.ring.layers)
        runs[mode] = _run(eng, eng.load_params())
    state = eng.init_decode_state()
    assert state.k[0].shape[:3] == (3, 2, 3 * 8 + 1)
    assert runs["scan"][0] == runs["loop"][0]
    np.testing.assert_allclose(runs["scan"][1], runs["loop"][1], atol=1e-5)


def test_generate_gives_the_loops_tokens(engines):
    (tl, ll), (ts, ls) = (_run(*engines[m]) for m in ("loop", "scan"))
    assert ts == tl
    np.testing.assert_allclose(ls, ll, rtol=1e-5, atol=1e-5)
    for eng, _ in engines.values():
        eng.kv_pages.check()
        assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages


def _pages_and_tokens(eng, params):
    """A donor prompt inserted into slot 0, then a prompt that shares its first two pages
    (a prefix-cache hit: the page blocks joined into a prefix, continued, and the pages
    linked into slot 2): the donor's page blocks, and slot 2's greedy tokens."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    donor, _ = eng.prefill(params, prompt[:8] + [1, 2, 3], 11)
    state = eng.insert(donor, eng.init_decode_state(), 0)
    held = eng.kv_pages.pages_of(0)[:2]
    blocks = np.asarray(eng.page_blocks(state, held))[:2]
    # The pages hold what the prefill made (the blocks a prefix cache cuts from it).
    np.testing.assert_array_equal(
        blocks, np.stack([np.asarray(b) for b in eng.cache_blocks(donor, 0, 2, 4)]))
    head = eng.prefix_from_blocks(eng.page_blocks(state, held), prompt[:8])
    prefix, first = eng.prefill(params, prompt[8:], 5, existing_prefix=head)
    state = eng.insert(prefix, state, 2, shared_pages=held)
    tokens = [first.to_host().token(0)]
    for _ in range(12):
        state, res = eng.generate(params, state)
        tokens.append(res.to_host().token(2))
    # Linked pages are read, never written.
    np.testing.assert_array_equal(np.asarray(eng.page_blocks(state, held))[:2], blocks)
    eng.free_slot(0)
    eng.free_slot(2)
    return blocks, tokens


def test_prefix_cache_pages_under_the_scan(engines):
    bl, tl = _pages_and_tokens(*engines["loop"])
    bs, ts = _pages_and_tokens(*engines["scan"])
    assert bs.shape == bl.shape and bs.shape[1] == CFG.num_layers  # [n, L, 2, ps, K, H]
    np.testing.assert_allclose(bs, bl, rtol=1e-5, atol=1e-5)
    assert ts == tl


def test_insert_leaves_other_slots_pages_bit_identical_in_every_layer(engines):
    eng, params = engines["scan"]
    state = eng.insert(eng.prefill(params, [3, 1, 4, 1, 5, 9, 2], 7)[0],
                       eng.init_decode_state(), 0)
    state, _ = eng.generate(params, state)
    held = eng.kv_pages.pages_of(0)
    before = np.asarray(state.k[0])[:, :, held]  # (L, K, pages, ps, H)
    state = eng.insert(eng.prefill(params, [8, 8, 8, 8, 8], 5)[0], state, 2)
    np.testing.assert_array_equal(np.asarray(state.k[0])[:, :, held], before)
    mine = eng.kv_pages.pages_of(2)
    assert not set(held) & set(mine)
    assert np.all(np.any(np.asarray(state.k[0])[:, :, mine[0]] != 0, axis=(1, 2, 3)))
    for s in (0, 2):
        eng.free_slot(s)


def test_mixed_steps_give_the_loops_tokens(engines):
    want = _run(*engines["loop"])[0]
    for mode in ("loop", "scan"):
        eng, params = engines[mode]
        run = run_mixed(eng.engine, params, PROMPTS, max_tokens=10, chunk=5, budget=7,
                        widest=True)
        assert run.mixed_steps >= 3
        assert run.outputs == want, mode


def test_prompt_scoring_under_the_scan(engines):
    prompt = list(range(3, 40))  # longer than a prefill: scored in chunks
    got = {m: engines[m][0].prompt_logprobs(engines[m][1], prompt) for m in engines}
    for a, b in zip(jax.tree.leaves(got["loop"]), jax.tree.leaves(got["scan"]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_speculative_verification_under_the_scan():
    """Verify steps write k + 1 entries per slot into the carried pools."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [7, 7, 8]]
    out = {}
    for mode in ("loop", "scan"):
        eng = build_engine("random:tiny", devices=jax.devices()[:1], engine_config=EngineConfig(
            max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=64, kv_layout="paged",
            page_size=8, speculative="ngram:3", layers=mode))
        out[mode] = [r.token_ids for r in generate_many(eng, eng.load_params(), prompts,
                                                         max_tokens=10, ignore_eos=True)]
    assert out["scan"] == out["loop"]


def _generate_program(layers, mode="scan"):
    eng = _engine(mode, dataclasses.replace(CFG, num_layers=layers))
    table = np.zeros((SHAPES["max_concurrent_decodes"], 4), np.int32)
    return programs.generate_program(eng.engine, eng.load_params(), eng.init_decode_state(),
                                     table)


def test_generate_program_is_one_layer_body_and_writes_the_pools_in_place():
    ops2, _, _ = _generate_program(2)
    ops8, mem, pools = _generate_program(8)
    _, loop, _ = _generate_program(8, "loop")
    assert ops8 == ops2  # one body whatever L is
    # The donated pools are aliased to the new ones, and the step's temporaries are the
    # loop's (the gathered pages), not a copy of the stacked pools.
    assert mem.alias_size_in_bytes >= pools
    assert mem.temp_size_in_bytes <= loop.temp_size_in_bytes + pools / 16


def test_nothing_recompiles_after_warmup(engines):
    eng, params = engines["scan"]
    _run(eng, params)
    warm = dict(eng.trace_counts())
    _run(eng, params)
    _run(eng, params, [[4] * 18, [5, 5]])
    assert eng.trace_counts() == warm
