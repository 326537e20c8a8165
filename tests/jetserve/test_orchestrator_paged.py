"""The orchestrator over a paged engine: admission by free pages, preemption and
recompute, page accounting after every step (prefix cache included), and chunked prefill.

Greedy tokens are checked against a contiguous engine on the same weights: a request that
was preempted (its KV dropped and recomputed from its tokens so far) or prefilled in
chunks must stream exactly what it would have streamed otherwise.
"""

import random
import time

import jax
import pytest

from engines import EngineConfig, create_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request, StepDone
from jetserve.orchestrator.prefix_stores import block_bytes
from jetserve.scheduling.page_planner import with_pages
from tests.sharding.families import host_params, model_config, place

MAX_TOKENS = 30
SHAPES = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48)
# 16 pages of 4: one sequence may take 12, four slots could want 48.
PAGED = dict(kv_layout="paged", page_size=4, num_pages=16)


def _engine(**config):
    # A paged engine with its page planner: the tests read its pages after serving.
    return with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1],
                                    config=EngineConfig(**{**SHAPES, **config})))


@pytest.fixture(scope="module")
def weights():
    return host_params(_engine())


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(1, 16))] for _ in range(40)]


@pytest.fixture(scope="module")
def reference(weights, prompts):
    """Greedy continuations from a contiguous engine, one per distinct prompt."""
    eng = _engine()
    out = generate_many(eng, place(eng, weights), prompts,
                        max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in out]


class PageChecker:
    """After every generate step (on the generate thread, which owns the pages): the pool's
    reference counts match the pages of the slots and of the prefix cache (if any), and the
    slots holding pages are exactly the slots holding requests."""

    def __init__(self, orch: Orchestrator):
        self.worker = orch._generate[0]
        self.pages = self.worker.engine.kv_pages
        self.steps = 0
        self.errors: list[str] = []

    def __call__(self, event) -> None:
        if not isinstance(event, StepDone):
            return
        self.steps += 1
        try:
            cache = self.worker.cache
            self.pages.check(cache.page_owners() if cache is not None else None)
            occupied = [slot for slot, _ in self.worker.slots.rows()]
            assert self.pages.live_slots() == occupied, (self.pages.live_slots(), occupied)
        except AssertionError as e:
            self.errors.append(f"step {self.steps}: {e}")


@pytest.mark.slow
def test_thousand_random_requests_with_cancels_and_preemption(weights, prompts, reference):
    """With a prefix cache in the pages, small enough that its blocks keep moving between
    the pool, the host and nowhere: its pages count in the invariant after every step."""
    eng = _engine(**PAGED)
    block = block_bytes(eng, PAGED["page_size"])
    config = OrchestratorConfig(poll_interval_s=0.005, prefix_cache_hbm_bytes=6 * block,
                                prefix_cache_host_bytes=8 * block, prefix_cache_key="soak")
    orch = Orchestrator.from_engines(eng, params=place(eng, weights),
                                     config=config)
    checker = PageChecker(orch)
    orch.add_listener(checker)
    rng = random.Random(11)
    waiting = list(range(1000))
    running: dict = {}  # handle -> (prompt index, max_tokens)
    done = []
    with orch:
        while waiting or running:
            while waiting and len(running) < 24:
                waiting.pop()
                p, n = rng.randrange(len(prompts)), rng.randint(1, MAX_TOKENS)
                h = orch.submit(Request(prompt_ids=prompts[p], max_tokens=n, ignore_eos=True))
                running[h] = (p, n)
                if rng.random() < 0.05:
                    h.cancel()  # before it reaches a slot, most likely
            for h in list(running):
                if h.done:
                    done.append((h.result(), *running.pop(h)))
                elif rng.random() < 0.01:
                    h.cancel()  # mid-stream
            time.sleep(0.002)
        stats = orch.stats()
    assert checker.errors == []
    assert checker.steps == stats["generate"][0]["steps"] > 0
    pages = eng.kv_pages
    pages.check()
    assert pages.free_count == pages.pool.num_pages  # every page is free again
    reasons = [c.finish_reason for c, _, _ in done]
    assert len(done) == 1000 and set(reasons) <= {"length", "cancelled"}, set(reasons)
    assert reasons.count("cancelled") >= 20
    assert stats["generate"][0]["preemptions"] >= 20  # recompute really was exercised
    cache = stats["prefix_cache"][0]
    assert cache["hits"] >= 100 and cache["host_hits"] >= 10 and cache["dropped"] >= 10, cache
    for c, p, n in done:
        want = reference[p][:n] if c.finish_reason == "length" else reference[p][:len(c.token_ids)]
        assert c.token_ids == want, (p, n, c.finish_reason)


def test_admission_waits_for_pages_and_preempted_requests_finish(weights, prompts, reference):
    """Four long requests on a pool that holds about one and a half of them: they take
    turns, some preempted and recomputed, and every one ends with its full greedy text."""
    eng = _engine(kv_layout="paged", page_size=4, num_pages=18)
    orch = Orchestrator.from_engines(eng, params=place(eng, weights))
    checker = PageChecker(orch)
    orch.add_listener(checker)
    chosen = [i for i, p in enumerate(prompts) if len(p) >= 10][:4]
    with orch:
        handles = [orch.submit(Request(prompt_ids=prompts[i], max_tokens=MAX_TOKENS,
                                       ignore_eos=True)) for i in chosen]
        out = [h.result(timeout=300) for h in handles]
        stats = orch.stats()["generate"][0]
    assert [c.token_ids for c in out] == [reference[i] for i in chosen]
    assert stats["preemptions"] >= 1 and stats["kv_pages_free"] == 18
    assert checker.errors == []


@pytest.mark.slow
def test_chunked_prefill_same_tokens_and_running_requests_step_between_chunks(weights):
    """Prompts longer than max_prefill_length (16) are admitted with prefill_chunk=8 and give
    the tokens of a one-pass prefill; a request already streaming gains tokens while a
    40-token prompt is prefilled in 5 chunks. The generate steps are counted where the
    generate thread reads them back (StepDone, stamped as it is emitted), not by the
    detokenize thread's token times, which may lag behind a loaded machine's steps."""
    eng = _engine(kv_layout="paged", page_size=4, num_pages=32)  # no preemption here
    params = place(eng, weights)
    whole = _engine(max_prefill_length=48)
    rng = random.Random(3)
    long_prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (40, 23, 17)]
    want = [r.token_ids for r in generate_many(
        whole, place(whole, weights), long_prompts, max_tokens=6,
        ignore_eos=True)]
    orch = Orchestrator.from_engines(eng, params=params,
                                     config=OrchestratorConfig(prefill_chunk=8))
    step_times: list[float] = []
    orch.add_listener(lambda e: step_times.append(time.monotonic())
                      if isinstance(e, StepDone) else None)
    with orch:
        orch.warmup([8])
        running = orch.submit(Request(prompt_ids=[5, 6, 7], max_tokens=40, ignore_eos=True))
        while not running.timing.token_times:
            time.sleep(0.005)
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=6, ignore_eos=True))
                   for p in long_prompts]
        out = [h.result(timeout=300) for h in handles]
        first = handles[0].timing
        assert len(running.result(timeout=300).token_ids) == 40
    assert [c.token_ids for c in out] == want
    during = [t for t in step_times if first.prefill_start < t < first.prefill_end]
    assert len(during) >= 3, (len(during), first)
    with pytest.raises(ValueError, match="max_seq_len - 1"):
        orch.submit(Request(prompt_ids=[1] * 48, max_tokens=1))


def test_prefill_chunk_longer_than_engine_prefill_is_refused():
    from engines import MockEngine

    with pytest.raises(ValueError, match="prefill_chunk=32"):
        Orchestrator.from_engines(MockEngine(max_prefill_length=16),
                                  config=OrchestratorConfig(prefill_chunk=32))
    with pytest.raises(ValueError, match="prefill_chunk"):
        OrchestratorConfig(prefill_chunk=0)
