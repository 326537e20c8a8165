"""Sliding-window layers on the paged layout keep a ring of pages per slot
(engines/paged_kv.py WindowRing), never their whole history.

A Gemma 3 directory written by transformers (window 8, three sliding layers to one
global), pages of 4, prefill chunks of 8: each slot's ring is ceil((8 + 8 - 1) / 4) + 1 =
5 pages (20 positions), and a 100-token prompt with 24 generated tokens runs over it six
times. Greedy tokens equal transformers' on every path that writes the ring: prefill +
insert in chunks, the decode step, speculative verify steps (k + 1 positions a step),
ragged mixed steps, an int8 ring, and through the orchestrator with the prefix cache
(blocks of its own: the shared pool's pages are not every layer's) and preemption.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engines import EngineConfig, create_engine, load_hf_config
from engines.paged_kv import WindowRing
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.scheduling.page_planner import with_pages
from jetserve.server.metrics import ServerMetrics
from tests.parity.hf_models import written_case

STEPS = 24
PROMPT_LENGTHS = (100, 7, 37)


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(max_concurrent_decodes=4, max_prefill_length=8,
                                  max_seq_len=128, top_logprobs=2, kv_layout="paged",
                                  page_size=4), **kw})


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(model dir, transformers' greedy tokens of each prompt)."""
    _, d, _, want = written_case("gemma3", tmp_path_factory, _prompts(), STEPS)
    return d, want


def _engine(d, **kw):
    return create_engine(load_hf_config(d), weights=d, config=_config(**kw),
                         devices=jax.devices()[:1])


def _tokens(engine):
    return [r.token_ids for r in generate_many(engine, engine.load_params(), _prompts(),
                                               max_tokens=STEPS, ignore_eos=True)]


def test_sliding_layers_keep_a_ring_and_decode_transformers_tokens(gemma3):
    d, want = gemma3
    engine = _engine(d)
    assert engine.ring == WindowRing(pages=5, slots=4, layers=(True, True, False, True))
    g = engine.page_geometry
    assert (g.ring_pages, g.ring_layers, g.num_pages) == (5, 3, 4 * 32)
    state = engine.init_decode_state()
    # Ring layers: 4 slots x 5 pages and the trash page; the global layer: the shared pool.
    assert [k.shape[1] for k in state.k] == [21, 21, 129, 21]
    assert [v.shape[1] for v in state.v] == [21, 21, 129, 21]
    # The bytes the stats and /metrics report: every pool but its trash page.
    held = sum(a.nbytes * (a.shape[1] - 1) // a.shape[1] for a in (*state.k, *state.v))
    assert g.page_bytes * g.num_pages + g.ring_bytes == held
    assert g.ring_bytes == 3 * 20 * 2 * 4 * 24 * 2 * 4  # layers, pages, kv heads, ps, H, k+v, f32
    assert _tokens(engine) == want


def test_speculative_verify_steps_on_the_ring(gemma3):
    d, want = gemma3
    engine = _engine(d, speculative="ngram:3")
    assert engine.ring is not None
    assert _tokens(engine) == want


def test_int8_ring_equals_the_contiguous_int8_cache(gemma3):
    """An int8 KV ring quantizes as the contiguous int8 cache does: the same tokens."""
    d, _ = gemma3
    ring = _engine(d, kv_dtype="int8")
    assert ring.ring is not None
    assert _tokens(ring) == _tokens(_engine(d, kv_dtype="int8", kv_layout="contiguous"))


def test_mixed_steps_write_and_read_the_ring(gemma3):
    from tests.engines.mixed_driver import run_mixed

    d, want = gemma3
    engine = _engine(d)
    run = run_mixed(engine, engine.load_params(), _prompts(), max_tokens=STEPS, chunk=5,
                    budget=7, widest=True)
    assert run.mixed_steps >= 3
    assert run.outputs == want


def test_prefix_cache_and_preemption_with_the_ring(gemma3):
    """Through the orchestrator: a prefix shared by every prompt is cached as blocks of
    the cache's own (the ring keeps no page of its layers behind the window), hits
    continue it exactly, and a pool too small for every sequence preempts some and
    recomputes them; every request gets the greedy tokens of the engine alone."""
    d, _ = gemma3
    rng = np.random.default_rng(9)
    system = rng.integers(3, 128, size=48).tolist()
    prompts = [system + rng.integers(3, 128, size=n).tolist() for n in (5, 11, 3, 17)]
    engine = with_pages(_engine(d, num_pages=48))  # 4 sequences of up to 92 tokens: 92 pages
    params = engine.load_params()
    want = [r.token_ids for r in generate_many(engine, params, prompts, max_tokens=STEPS,
                                               ignore_eos=True)]
    config = OrchestratorConfig(prefix_cache_hbm_bytes=1 << 20, prefix_cache_block=8,
                                prefix_cache_key="ring")
    with Orchestrator.from_engines(engine, params=params, config=config) as orch:
        first = orch.submit(Request(prompt_ids=prompts[0], max_tokens=STEPS, ignore_eos=True))
        got = [first.result(timeout=300).token_ids]
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=STEPS, ignore_eos=True))
                   for p in prompts[1:]]
        got += [h.result(timeout=300).token_ids for h in handles]
        stats = orch.stats()
        metrics = ServerMetrics(orch).render()[0].decode()
    assert got == want
    cache = stats["prefix_cache"][0]
    assert cache["device_store"] == "arrays"
    assert cache["hits"] >= 3 and cache["hit_tokens"] >= 3 * 48
    gen = stats["generate"][0]
    assert gen["preemptions"] >= 1
    g = engine.page_geometry
    assert gen["kv_bytes"] == 48 * g.page_bytes + g.ring_bytes
    assert f'jetserve_kv_bytes{{engine="0"}} {float(gen["kv_bytes"])}' in metrics


def test_window_kv_bench_figures():
    """`jetserve bench window-kv` on small shapes: what its figures are made of (the
    rings and the global layer's pool as allocated), and jetserve plan within 5%."""
    from jetserve.bench import window_kv

    cfg = window_kv.WindowKVConfig(layers=6, window=32, prompt_len=1024, max_tokens=4,
                                   page_size=8, chunk=32)
    r = window_kv.run(cfg, log=lambda *a: None)
    assert r["tokens_out"] == 4
    assert r["ring_pages_per_slot"] == 9 and r["shared_pool_pages"] == 129
    page = 2 * 8 * 64 * 4  # kv heads, ps, H, f32: one page of one layer's k or v
    assert r["kv_store_bytes"] == 2 * page * (1 * 130 + 5 * 10)
    assert r["all_global_bytes"] == 2 * page * 6 * 130
    assert r["kv_ratio"] < 0.25 and abs(r["plan_error"]) < 0.05


def test_a_chunk_longer_than_the_ring_allows_is_refused(gemma3):
    from engines.mixed_batch import MixedRow

    engine = with_pages(_engine(gemma3[0]))
    engine.start_prompt(0, 12)
    with pytest.raises(ValueError, match="at most max_prefill_length"):
        engine.mixed_step(engine.load_params(), engine.init_decode_state(),
                          [MixedRow(slot=0, chunk=tuple(range(3, 15)), start=0)])


def test_lock_step_over_two_drivers_on_the_ring(gemma3):
    """Lock step (process 0 and a follower, each on a device of its own, the plan passed
    as the broadcast would) on ring engines, prompts in chunks of 8: process 0 streams transformers' tokens and the follower's calls, pages and
    tables are exactly process 0's."""
    from tests.jetserve.test_lockstep import _in_lock_step, _Recorded

    d, want = gemma3
    engines = [_Recorded(create_engine(load_hf_config(d), weights=d, config=_config(),
                                       devices=jax.devices()[i:i + 1])) for i in range(2)]
    assert engines[0].ring is not None
    requests = [Request(prompt_ids=p, max_tokens=STEPS, ignore_eos=True) for p in _prompts()]
    got = _in_lock_step(engines, requests)
    assert [r.token_ids for r in got] == want
    assert engines[0].calls == engines[1].calls
    assert sum(c[0] == "prefill" for c in engines[0].calls) >= 100 // 8
