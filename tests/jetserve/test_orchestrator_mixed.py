"""`scheduling="mixed"`: one paged engine whose steps run decode rows and prompt chunks.

Greedy tokens are checked against a contiguous engine's one-pass prefill and decode on the
same weights: prompts longer than the chunk, several at once, preempted and recomputed
requests, cancelled ones; the page accounting holds after every step, every page comes
back, and after the warm-up no step compiles a new program.
"""

import random
import time

import jax
import pytest

from engines import EngineConfig, SamplingParams, create_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request, StepDone
from jetserve.orchestrator.mixed import MixedOrchestrator
from jetserve.orchestrator.prefix_stores import block_bytes
from jetserve.scheduling.page_planner import with_pages
from jetserve.structured import Constraint
from jetserve.warmup import plan
from jetserve.warmup import run as warm_up
from tests.sharding.families import host_params, model_config, place

MAX_TOKENS = 12
SHAPES = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48)
MIXED = dict(scheduling="mixed", prefill_chunk=8, poll_interval_s=0.005)


def _engine(**config):
    return with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1],
                                    config=EngineConfig(**{**SHAPES, **config})))


def _paged(num_pages=32):
    return _engine(kv_layout="paged", page_size=4, num_pages=num_pages)


@pytest.fixture(scope="module")
def weights():
    return host_params(_engine())


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)  # 1 to 30 tokens: most longer than a chunk of 8
    return [[rng.randrange(3, 128) for _ in range(rng.randint(1, 30))] for _ in range(12)]


@pytest.fixture(scope="module")
def reference(weights, prompts):
    eng = _engine(max_prefill_length=48)
    out = generate_many(eng, place(eng, weights), prompts,
                        max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in out]


def _orch(weights, eng, **config) -> MixedOrchestrator:
    return MixedOrchestrator.from_engines(
        eng, params=place(eng, weights),
        config=OrchestratorConfig(**{**MIXED, **config}))


class StepChecker:
    """After every step, on the thread that owns the pages: the pool's counts match the
    slots' pages and the prefix cache's (if any), and the slots holding pages are the
    slots holding requests."""

    def __init__(self, orch):
        self.worker = orch._generate[0]
        self.pages = self.worker.engine.kv_pages
        self.errors: list[str] = []

    def __call__(self, event) -> None:
        if isinstance(event, StepDone):
            try:
                cache = self.worker.cache
                self.pages.check(cache.page_owners() if cache is not None else None)
                occupied = [s for s, _ in self.worker.slots.rows()]
                assert self.pages.live_slots() == occupied, (self.pages.live_slots(), occupied)
            except AssertionError as e:
                self.errors.append(str(e))


def test_mixed_steps_give_one_pass_greedy_tokens_and_compile_nothing_after_warmup(
        weights, prompts, reference):
    eng = _paged()
    orch = _orch(weights, eng)
    checker = StepChecker(orch)
    orch.add_listener(checker)
    with orch:
        warm_up(orch, progress=False)
        compiled = dict(eng.traces)
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
                   for p in prompts]
        out = [h.result(timeout=300) for h in handles]
        stats = orch.stats()["generate"][0]
    assert [c.token_ids for c in out] == reference
    assert {c.finish_reason for c in out} == {"length"}
    # Budget 4 + 8 = 12 tokens: buckets 8 and 16 and the decode-rows step (0), by widths
    # 1, 2, 4, 8, 12 pages.
    assert len(plan(orch)) == compiled["mixed"] == 3 * 5
    assert eng.traces == compiled  # no program compiled while serving
    assert compiled["prefill"] == compiled["generate"] == compiled["insert"] == 0
    assert checker.errors == []
    assert stats["kv_pages_free"] == 32 and stats["steps"] > 0


def test_preempted_and_cancelled_requests_give_their_pages_back(weights, prompts, reference):
    """A pool of 18 pages of 4 holds about one and a half full sequences: requests are
    preempted (their chunks run again) and still stream the one-pass tokens; cancelled
    ones, waiting or mid-stream, end "cancelled" and every page comes back."""
    eng = _paged(num_pages=18)
    orch = _orch(weights, eng)
    checker = StepChecker(orch)
    orch.add_listener(checker)
    long = [i for i, p in enumerate(prompts) if len(p) > 8]
    with orch:
        handles = [orch.submit(Request(prompt_ids=prompts[i], max_tokens=MAX_TOKENS,
                                       ignore_eos=True)) for i in long]
        gone = orch.submit(Request(prompt_ids=prompts[0], max_tokens=40 - len(prompts[0]),
                                   ignore_eos=True))
        while not gone.timing.token_times:
            time.sleep(0.002)
        gone.cancel()
        out = [h.result(timeout=300) for h in handles]
        cancelled = gone.result(timeout=60)
        stats = orch.stats()["generate"][0]
    assert [c.token_ids for c in out] == [reference[i] for i in long]
    assert cancelled.finish_reason == "cancelled"
    assert stats["preemptions"] >= 1  # recompute really ran
    assert stats["kv_pages_free"] == 18
    assert checker.errors == []


def test_stop_ids_seeded_sampling_and_prompt_logprobs_as_in_turns(weights, prompts):
    """A stop id ends a request where the turns driver ends it, a seeded sampled request
    streams the same tokens in both modes (the first token's key, then each step's,
    advance alike), and prompt log-probs (score only, or before generating) agree."""
    sampled = Request(prompt_ids=prompts[3], max_tokens=10,
                      sampling=SamplingParams(temperature=0.9, top_k=20, seed=4),
                      ignore_eos=True)
    results, scored = {}, {}
    for mode in ("turns", "mixed"):
        eng = _paged()
        params = place(eng, weights)
        config = OrchestratorConfig(scheduling=mode, prefill_chunk=8)
        orch = (MixedOrchestrator.from_engines(eng, params=params, config=config)
                if mode == "mixed" else Orchestrator.from_engines(eng, params=params,
                                                                   config=config))
        with orch:
            free = orch.submit(Request(prompt_ids=prompts[1], max_tokens=MAX_TOKENS,
                                       ignore_eos=True)).result(timeout=300).token_ids
            stop = free[4]
            stopped = orch.submit(Request(prompt_ids=prompts[1], max_tokens=MAX_TOKENS,
                                          stop_token_ids=(stop,))).result(timeout=300)
            results[mode] = (free, stopped.token_ids, stopped.finish_reason,
                             orch.submit(sampled).result(timeout=300).token_ids)
            scored[mode] = [orch.submit(Request(prompt_ids=prompts[1], max_tokens=n,
                                                prompt_logprobs=True, logprobs=2,
                                                ignore_eos=True)).result(timeout=300)
                            for n in (0, 3)]
    assert results["mixed"] == results["turns"]
    assert results["mixed"][1][-1] == results["mixed"][0][4]
    for mixed, turns in zip(scored["mixed"], scored["turns"], strict=True):
        assert (mixed.token_ids, mixed.finish_reason) == (turns.token_ids, turns.finish_reason)
        assert mixed.prompt_logprobs[0] is None and len(mixed.prompt_logprobs) == len(prompts[1])
        assert mixed.prompt_logprobs[1:] == pytest.approx(turns.prompt_logprobs[1:], abs=1e-5)


def test_what_mixed_steps_cannot_run_is_refused_by_name(weights):
    with pytest.raises(ValueError, match="--kv-layout paged"):
        MixedOrchestrator.from_engines(_engine(), params=weights)
    ring = with_pages(create_engine(  # sliding layers in rings of pages
        model_config("mistral"), devices=jax.devices()[:1], config=EngineConfig(
            **{**SHAPES, "max_seq_len": 128}, kv_layout="paged", page_size=4, num_pages=64)))
    assert ring.page_geometry.ring_pages
    with pytest.raises(ValueError, match="prefix cache.*rings of pages"):
        MixedOrchestrator(ring, {}, OrchestratorConfig(**MIXED, prefix_cache_hbm_bytes=1 << 20))
    with pytest.raises(ValueError, match="scheduling"):
        OrchestratorConfig(scheduling="fused")
    orch = _orch(weights, _paged())
    # Structured output is served (on a model with a tokenizer, which grammars need).
    with pytest.raises(ValueError, match="structured output needs a tokenizer"):
        orch.submit(Request(prompt_ids=[5, 6], constraint=Constraint(kind="regex", value="[ab]+")))
    orch.stop()


def test_a_failed_step_ends_its_requests_with_the_error_and_serving_goes_on(
        weights, prompts, reference):
    eng = _paged()
    orch = _orch(weights, eng)
    real, calls = eng.engine.mixed_step, []

    def failing_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(*args, **kw)

    eng.engine.mixed_step = failing_once
    with orch:
        failed = orch.submit(Request(prompt_ids=prompts[1], max_tokens=4)).result(timeout=300)
        after = orch.submit(Request(prompt_ids=prompts[1], max_tokens=MAX_TOKENS,
                                    ignore_eos=True)).result(timeout=300)
        stats = orch.stats()["generate"][0]
    assert failed.finish_reason == "error" and "device lost" in failed.error
    assert after.token_ids == reference[1]
    assert stats["kv_pages_free"] == 32


def test_prefix_cache_hits_start_prompts_later_through_preemption_and_the_host_tier(weights):
    """Prompts sharing a 20-token prefix (whole, cut, repeated, extended) on a pool of 18
    pages of 4 with a small device tier (6 blocks) and a host tier: hits link cached pages
    and run only the rest of the prompt, requests are preempted and come back, blocks move
    to the host and back up. Tokens equal the one-pass reference, the pool's counts match
    the slots' and the cache's pages after every step, and all pages are free at the end."""
    rng = random.Random(9)
    base = [rng.randrange(3, 128) for _ in range(20)]
    shared = [base, base + [7, 9, 11], base[:13], base + [rng.randrange(3, 128) for _ in range(9)],
              base, base[:16] + [5], base + [3]]
    prompts = [p for _ in range(2) for p in shared]
    eng = _engine(max_prefill_length=48)
    reference = [r.token_ids for r in generate_many(eng, place(eng, weights), shared,
                                                    max_tokens=MAX_TOKENS, ignore_eos=True)]
    penalty = SamplingParams(repetition_penalty=1.5)
    penalized = generate_many(eng, place(eng, weights), [base], max_tokens=MAX_TOKENS,
                              sampling=penalty, ignore_eos=True)[0].token_ids
    eng = _paged(num_pages=18)
    block = block_bytes(eng, 4)
    orch = _orch(weights, eng, prefix_cache_hbm_bytes=6 * block,
                 prefix_cache_host_bytes=16 * block, prefix_cache_key="mixed")
    checker = StepChecker(orch)
    orch.add_listener(checker)
    real, ran = eng.engine.mixed_step, []

    def counting(params, state, table, rows):
        ran.extend(len(r.chunk) for r in rows)
        return real(params, state, table, rows)

    eng.engine.mixed_step = counting
    alone = []  # prompt tokens run by each request sent alone
    with orch:
        for p, sampling, want in ((base, None, reference[0]), (shared[1], None, reference[1]),
                                  (base, None, reference[0]), (base, penalty, penalized)):
            ran.clear()
            got = orch.submit(Request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      **({"sampling": sampling} if sampling else {})))
            assert got.result(timeout=300).token_ids == want
            alone.append(sum(ran))
            if len(alone) == 1:
                after_one = orch.stats()["prefix_cache"][0]
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True))
                   for p in prompts]
        out = [h.result(timeout=300).token_ids for h in handles]
        stats = orch.stats()
        cache = stats["prefix_cache"][0]
        held = eng.kv_pages.pool.num_pages - eng.kv_pages.free_count
        assert held == cache["hbm_blocks"]  # no slot holds a page; the cache holds its own
    assert out == reference * 2
    assert checker.errors == []
    # The first prompt ran whole and stored its 5 whole blocks; the next, 3 tokens
    # longer, linked all 5 and ran its last 3 tokens; the first again linked 4 and ran
    # its last 4 (a prompt cached whole still runs its last token, which samples); with a
    # repetition penalty (whose prompt mask the chunks build) it ran whole.
    assert (after_one["lookups"], after_one["hits"], after_one["inserted"]) == (1, 0, 5)
    assert alone == [20, 3, 4, 20]
    # One lookup counted per admission (a preempted request is admitted again), however
    # often a waiting prompt was looked up.
    preempted = stats["generate"][0]["preemptions"]
    assert cache["lookups"] == 3 + len(prompts) + preempted  # the penalized one: none
    assert cache["hits"] >= len(prompts) // 2
    assert cache["hit_tokens"] >= 12 * cache["hits"] and cache["device_store"] == "pages"
    assert cache["evicted_to_host"] >= 1  # 6 device blocks: the host tier was used
    assert preempted >= 1  # recompute with shared pages ran
    eng.kv_pages.check()
    assert eng.kv_pages.free_count == 18  # the cache's pages came back at stop


def test_a_prefix_cache_hit_gives_a_draft_model_the_linked_tokens(weights):
    """A draft model that is the target itself, with the prefix cache: the third prompt
    hits the first one's cached blocks, after a second, different prompt ran in the same
    slot. The hit's tokens go through the draft (MixedRow.context) before the rest of the
    prompt, so its drafts are the target's tokens again: nearly every one is kept, and
    every request gets the one-pass reference's tokens."""
    rng = random.Random(11)
    base = [rng.randrange(3, 128) for _ in range(24)]
    other = [rng.randrange(3, 128) for _ in range(24)]
    plain = _engine(max_prefill_length=48)
    want = [r.token_ids for r in generate_many(plain, place(plain, weights), [base, other],
                                               max_tokens=20, ignore_eos=True)]
    cfg = model_config("llama")
    eng = with_pages(create_engine(cfg, devices=jax.devices()[:1], draft_config=cfg,
                                   config=EngineConfig(**SHAPES, kv_layout="paged",
                                                       page_size=4, num_pages=32,
                                                       speculative="draft:itself:3")))
    eng.engine._draft_params = place(eng.engine._draft, weights)  # the target's own
    orch = _orch(weights, eng, prefix_cache_hbm_bytes=16 * block_bytes(eng, 4),
                 prefix_cache_key="mixed")
    kept = []
    with orch:
        for p, w in ((base, want[0]), (other, want[1]), (base, want[0])):
            before = orch.stats()["generate"][0]
            got = orch.submit(Request(prompt_ids=p, max_tokens=20, ignore_eos=True))
            assert got.result(timeout=300).token_ids == w
            after = orch.stats()["generate"][0]
            kept.append((after["accepted"] - before["accepted"],
                         after["drafted"] - before["drafted"]))
        assert orch.stats()["prefix_cache"][0]["hits"] == 1
    assert all(a >= 0.8 * d > 0 for a, d in kept), kept
