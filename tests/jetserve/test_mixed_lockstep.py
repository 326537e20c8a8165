"""Mixed steps over several processes (orchestrator/mixed_lockstep.py), inside one process.

Two MixedLockStepOrchestrators stand in for process 0 and process 1, each over its own
paged engine with the same weights; their broadcast is a queue between threads, so the
follower gets exactly the arrays process 0 sends. Process 0's streams must carry the
one-pass greedy tokens (and a seeded sampled request the tokens of one process), and the
follower, replaying process 0's plans, must end with the same page tables and the same
decode-state lengths.
"""

import random
import time

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams, create_engine
from engines.mixed_batch import MixedRow
from jetserve.offline import generate_many
from jetserve.orchestrator import OrchestratorConfig, Request
from jetserve.orchestrator.mixed import MixedOrchestrator
from jetserve.orchestrator.mixed_lockstep import MixedLockStepOrchestrator
from jetserve.orchestrator.step_plan import (
    FREE,
    INIT,
    START,
    MixedPlan,
    MixedPlanCodec,
    exchange,
)
from jetserve.scheduling.page_planner import with_pages
from tests.jetserve.test_lockstep import _following, _queue_broadcast
from tests.sharding.families import host_params, model_config, place

MAX_TOKENS = 10
SHAPES = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=32)
MIXED = dict(scheduling="mixed", prefill_chunk=8, poll_interval_s=0.005)


def _engine(**config):
    return with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1],
                                    config=EngineConfig(**{**SHAPES, **config})))


def _paged(speculative="none", num_pages=14):
    return _engine(kv_layout="paged", page_size=4, num_pages=num_pages,
                   speculative=speculative)


@pytest.fixture(scope="module")
def weights():
    return host_params(_engine())


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)  # 1 to 30 tokens: most longer than a chunk of 8
    return [[rng.randrange(3, 128) for _ in range(rng.randint(1, 30))] for _ in range(8)]


@pytest.fixture(scope="module")
def reference(weights, prompts):
    eng = _engine(max_prefill_length=32)
    out = generate_many(eng, place(eng, weights), prompts, max_tokens=MAX_TOKENS,
                        ignore_eos=True)
    return [r.token_ids for r in out]


def _pair(weights, speculative="none", **config):
    """(process 0, the follower, the follower's thread, its errors), started."""
    send, receive = _queue_broadcast()
    config = OrchestratorConfig(**{**MIXED, **config})
    orchs = []
    for primary, broadcast in ((True, send), (False, receive)):
        eng = _paged(speculative)
        orchs.append(MixedLockStepOrchestrator(eng, place(eng, weights), config,
                                               primary=primary, broadcast=broadcast,
                                               idle_wait_s=0.01))
    lead, follower = orchs
    thread, errors = _following(follower)
    lead.start()
    return lead, follower, thread, errors


def _stop(lead, thread):
    lead.stop(drain=True, timeout=60)
    thread.join(60)
    assert not thread.is_alive(), "the follower did not leave its loop on the stop plan"


@pytest.mark.parametrize("speculative", ["none", "ngram:3"], ids=["plain", "ngram3"])
def test_lock_step_mixed_steps_give_one_pass_tokens_and_alike_pages(
        weights, prompts, reference, speculative):
    """Warm-up steps, prompts in chunks beside decode rows (n-gram verify rows), a pool of 14
    pages of 4 that preempts, a cancelled request: process 0 streams the one-pass greedy
    tokens, and the follower ends with process 0's page tables and lengths."""
    lead, follower, thread, errors = _pair(weights, speculative)
    n = len(prompts) if speculative == "none" else 5  # verify programs compile slowly
    try:
        shapes = lead.warmup_shapes()
        for shape in (shapes[0], shapes[-1]):  # warm-up steps go out as plans of their own
            lead.warm_shape(*shape, timeout=300)
        handles = [lead.submit(Request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
                   for p in prompts[:n]]
        gone = lead.submit(Request(prompt_ids=prompts[0], max_tokens=32 - len(prompts[0]),
                                   ignore_eos=True))
        while not gone.timing.token_times:
            time.sleep(0.002)
        gone.cancel()
        out = [h.result(timeout=300) for h in handles]
        assert gone.result(timeout=60).finish_reason == "cancelled"
        stats = lead.stats()["generate"][0]
    finally:
        _stop(lead, thread)
    assert errors == []
    assert [c.token_ids for c in out] == reference[:n]
    assert stats["preemptions"] >= 1  # recompute ran in lock step too
    w0, w1 = lead._generate[0], follower._generate[0]
    assert follower.follower.plans == w0.engine.plans
    assert follower.follower.failures == 0
    pages0, pages1 = w0.engine.kv_pages, w1.engine.kv_pages
    assert np.array_equal(pages0.table, pages1.table)
    assert pages0.free_count == pages1.free_count == 14
    np.testing.assert_array_equal(np.asarray(w0.state.lengths),
                                  np.asarray(follower.follower.state.lengths))


def test_seeded_sampling_logit_bias_and_prompt_logprobs_as_in_one_process(weights, prompts):
    """Sampling parameters cross the wire as f32 and each fresh row's seed is drawn on
    process 0: a seeded sampled request with a logit bias streams what one process
    streams; prompt scoring (a call of its own) runs on every process."""
    sampled = Request(prompt_ids=prompts[3], max_tokens=8, ignore_eos=True,
                      sampling=SamplingParams(temperature=0.9, top_k=20, seed=4,
                                              logit_bias=((5, 3.0), (9, -2.5))))
    unseeded = Request(prompt_ids=prompts[2], max_tokens=6, ignore_eos=True,
                       sampling=SamplingParams(temperature=1.0))
    scored = Request(prompt_ids=prompts[1], max_tokens=3, prompt_logprobs=True, logprobs=2,
                     ignore_eos=True)
    eng = _paged()
    with MixedOrchestrator.from_engines(eng, params=place(eng, weights),
                                        config=OrchestratorConfig(**MIXED)) as one:
        alone = [one.submit(r).result(timeout=300) for r in (sampled, scored)]
    lead, follower, thread, errors = _pair(weights)
    try:
        got = [lead.submit(r).result(timeout=300) for r in (sampled, scored, unseeded)]
    finally:
        _stop(lead, thread)
    assert errors == [] and follower.follower.failures == 0
    assert got[0].token_ids == alone[0].token_ids
    assert got[1].token_ids == alone[1].token_ids
    assert got[1].prompt_logprobs[1:] == pytest.approx(alone[1].prompt_logprobs[1:], abs=1e-5)
    assert len(got[2].token_ids) == 6


def test_mixed_plan_round_trip_and_draws_seeds_before_it_is_sent():
    codec = MixedPlanCodec()
    plan = MixedPlan(kind="step", ops=((FREE, 3, 0), (START, 2, 17), (INIT, 0, 0)),
                     rows=(MixedRow(slot=1),
                           MixedRow(slot=2, chunk=(5, 6, 300000), start=8, last=True,
                                    sampling=SamplingParams(temperature=0.5, top_p=0.25,
                                                            logit_bias=((3, 1.5),)),
                                    seed=2**31 - 1, context=(9, 8, 7, 6, 5, 4, 3, 2))),
                     prefilling=(0, 2), mask_positions=4)
    header, payload = codec.encode(plan)
    assert header.shape == (2,) and payload.shape[0] == 128  # a power of two
    assert codec.decode(header, payload) == plan
    assert exchange(MixedPlan(kind="stop"), codec, lambda x: x).stop
    with pytest.raises(ValueError, match="seed is drawn before the plan is sent"):
        codec.encode(MixedPlan(kind="step", rows=(
            MixedRow(slot=0, chunk=(1,), sampling=SamplingParams()),)))


def test_prefix_cache_hits_and_evictions_alike_on_every_process(weights, prompts):
    """Each process keeps its own prefix cache in its KV pages; process 0's lookups,
    adoptions, releases and evictions go out with the plans, so a prompt that continues
    a finished one hits on every process, and after evictions (a pool of 14 pages) every
    cache holds the same blocks in the same pages."""
    shared = prompts[6][:16]
    later = [shared + [9, 8, 7], shared + [5], prompts[3], shared[:12] + [4, 4, 4, 4, 4]]
    eng = _engine(max_prefill_length=32)
    want = [r.token_ids for r in generate_many(eng, place(eng, weights), [prompts[6], *later],
                                               max_tokens=MAX_TOKENS, ignore_eos=True)]
    lead, follower, thread, errors = _pair(weights, prefix_cache_hbm_bytes=1 << 20)
    try:
        first = lead.submit(Request(prompt_ids=prompts[6], max_tokens=MAX_TOKENS,
                                    ignore_eos=True)).result(timeout=300)
        got = [lead.submit(Request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
               for p in later]
        got = [first, *(h.result(timeout=300) for h in got)]
        stats = lead.stats()["prefix_cache"][0]
    finally:
        _stop(lead, thread)
    assert errors == [] and follower.follower.failures == 0
    assert [c.token_ids for c in got] == want
    assert stats["hits"] >= 2, stats
    assert stats["dropped"] >= 1, stats  # evicted for pages, on every process alike
    w0, w1 = lead._generate[0], follower._generate[0]
    assert w1.cache.blocks() == w0.cache.blocks() and w1.cache.nodes() == w0.cache.nodes()
    assert w1.cache.page_owners().keys() != () and sorted(
        map(tuple, w1.cache.page_owners().values())) == sorted(
        map(tuple, w0.cache.page_owners().values()))
    assert np.array_equal(w0.engine.kv_pages.table, w1.engine.kv_pages.table)


def test_what_lock_step_mixed_steps_cannot_serve_is_refused_by_name(weights):
    eng = _paged()
    with pytest.raises(ValueError, match="in the KV pages alone.*--prefix-cache-host-mb"):
        MixedLockStepOrchestrator(eng, place(eng, weights),
                                  OrchestratorConfig(**MIXED, prefix_cache_hbm_bytes=1 << 20,
                                                     prefix_cache_host_bytes=1 << 20),
                                  primary=True, broadcast=lambda x: x)


def test_lora_adapters_in_lock_step_wait_for_a_row_and_give_each_request_its_tokens(
        tmp_path):
    """One LoRA pool row, requests for two adapters and the base model at once: holding a
    row is a call of its own on every process; a prompt whose adapter finds the row held
    waits (on every process alike), and each request streams what it gets alone, a
    prompt scored through an adapter too."""
    from tests.engines.test_lora import _engine as lora_engine
    from tests.engines.test_lora import _prompts as lora_prompts
    from tests.engines.test_lora import write_adapter

    a, _ = write_adapter(tmp_path / "a", ["q_proj", "v_proj", "up_proj"], seed=1)
    b, _ = write_adapter(tmp_path / "b", ["k_proj", "gate_proj"], rank=2, seed=3)

    def engine():
        eng = with_pages(lora_engine(kv_layout="paged", page_size=8, max_loras=1))
        eng.load_adapter("a", a)
        eng.load_adapter("b", b)
        return eng

    eng = engine()  # each request alone
    params = eng.load_params()
    jobs = list(zip(lora_prompts(), ["a", "b", None, "b"], strict=True))
    want = [generate_many(eng, params, [p], max_tokens=8, ignore_eos=True,
                          adapters=[n])[0].token_ids for p, n in jobs]
    scored_alone = eng.prompt_logprobs(params, np.asarray(jobs[0][0], np.int32), adapter="a")
    send, receive = _queue_broadcast()
    lead, follower = (MixedLockStepOrchestrator(
        eng, params, OrchestratorConfig(scheduling="mixed", prefill_chunk=16),
        primary=primary, broadcast=broadcast, idle_wait_s=0.01)
        for eng, primary, broadcast in ((engine(), True, send), (engine(), False, receive)))
    thread, errors = _following(follower)
    lead.start()
    try:
        handles = [lead.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True,
                                       lora_adapter=n)) for p, n in jobs]
        scored = lead.submit(Request(prompt_ids=jobs[0][0], max_tokens=0, prompt_logprobs=True,
                                     lora_adapter="a"))
        got = [h.result(timeout=300) for h in handles]
        scored = scored.result(timeout=300)
    finally:
        _stop(lead, thread)
    assert errors == []
    assert follower.follower.failures >= 1  # a prompt waited for the row, here too
    assert [c.finish_reason for c in got] == ["length"] * 4, [c.error for c in got]
    assert [c.token_ids for c in got] == want
    assert scored.prompt_logprobs[1:] == pytest.approx(
        np.asarray(scored_alone.token_logprobs)[1:].tolist(), abs=1e-5)
    for orch in (lead, follower):  # every row given back on every process
        engine = orch._generate[0].engine.engine
        assert not engine._slot_rows and not any(engine.adapters._pins)
