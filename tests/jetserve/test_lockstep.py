"""The lock-step driver (several processes serving one engine), inside one process.

Two LockStepOrchestrators stand in for process 0 and process 1: each has its own
MockEngine (exact arithmetic: engines/mock_engine.py) and their broadcast is a queue
between threads, so the follower gets exactly the arrays process 0 sends. Both engines
record every call; lock step means both records are identical, while process 0's streams
carry the tokens MockEngine predicts.
"""

import queue
import threading

import jax
import numpy as np
import pytest

from engines import MockEngine, SamplingParams
from jetserve.orchestrator import OrchestratorConfig, Request
from jetserve.orchestrator.lockstep import LockStepOrchestrator
from jetserve.orchestrator.step_plan import Admission, PlanCodec, StepPlan, exchange
from jetserve.structured import Constraint


def expected(prompt, n, V=256):
    t = sum(prompt) % V
    return [(t + i) % V for i in range(n)]


# ---- the plan on the wire -------------------------------------------------------------------

def test_plan_round_trip():
    codec = PlanCodec(4)
    plan = StepPlan(releases=(0, 3), admissions=(
        Admission(slot=2, prompt_ids=(1, 2, 300000), seed=2**32 - 1,
                  sampling=SamplingParams(temperature=0.5, top_k=40, top_p=0.25, min_p=0.125,
                                          repetition_penalty=1.5, frequency_penalty=-2.0,
                                          presence_penalty=0.75,
                                          logit_bias=((5, -100.0), (300000, 0.5)))),
        Admission(slot=None, prompt_ids=(7,), seed=0, sampling=SamplingParams(),
                  prompt_logprobs=True),
        Admission(slot=0, prompt_ids=(8, 9), seed=1,
                  sampling=SamplingParams(logit_bias=((0, 2.25),))),
    ))
    header, payload = codec.encode(plan)
    assert header.shape == (codec.header_size,) and header.dtype == np.uint32
    # 6 prompt tokens and 3 logit_bias pairs of 2 words, padded to the smallest bucket
    assert payload.shape == (16,)
    assert codec.decode(header, payload) == plan
    many = SamplingParams(logit_bias=tuple((t, t / 8 - 30) for t in range(300)))
    big = StepPlan(admissions=(Admission(slot=1, prompt_ids=(1,) * 40, seed=3, sampling=many),))
    header, payload = codec.encode(big)
    assert payload.shape == (1024,)  # 40 + 600 words
    assert codec.decode(header, payload) == big
    assert codec.decode(*codec.encode(StepPlan(stop=True))).stop
    idle_header, idle_payload = codec.encode(StepPlan())
    assert idle_payload is None and codec.decode(idle_header, None) == StepPlan()


def test_plan_floats_are_float32_on_every_process():
    codec = PlanCodec(2)
    plan = StepPlan(admissions=(Admission(slot=0, prompt_ids=(1,), seed=5,
                                          sampling=SamplingParams(temperature=0.7, top_p=0.9)),))
    got = codec.decode(*codec.encode(plan)).admissions[0].sampling
    assert got.temperature == float(np.float32(0.7)) and got.top_p == float(np.float32(0.9))


def test_plan_payload_sizes_are_powers_of_two():
    codec = PlanCodec(8)
    for n in (1, 16, 17, 100, 1000):
        plan = StepPlan(admissions=(Admission(slot=0, prompt_ids=(3,) * n, seed=1,
                                              sampling=SamplingParams()),))
        _, payload = codec.encode(plan)
        assert payload.shape[0] == max(16, 1 << (n - 1).bit_length())
    with pytest.raises(ValueError, match="at most 8 prompts"):
        codec.encode(StepPlan(admissions=(plan.admissions[0],) * 9))


def test_exchange_followers_pass_arrays_of_process_0s_shapes():
    codec = PlanCodec(4)
    plan = StepPlan(releases=(1,), admissions=(
        Admission(slot=1, prompt_ids=tuple(range(20)), seed=9, sampling=SamplingParams()),))
    sent = []

    def primary(x):
        sent.append(x)
        return x

    assert exchange(plan, codec, primary) == plan
    shapes = iter(sent)

    def follower(x):  # a real broadcast needs the same shape from every process
        want = next(shapes)
        assert x.shape == want.shape and x.dtype == want.dtype
        return want

    assert exchange(None, codec, follower) == plan
    assert len(sent) == 2  # header, then the payload


# ---- two drivers in lock step ---------------------------------------------------------------

class RecordingEngine(MockEngine):
    """MockEngine that logs every device call with its inputs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def prefill(self, params, tokens, true_length, *, sampling=None, existing_prefix=None,
                seed=None, donate=False):
        self.calls.append(("prefill", tuple(np.asarray(tokens).tolist()), seed,
                           None if sampling is None else sampling.temperature))
        return super().prefill(params, tokens, true_length, sampling=sampling, seed=seed)

    def insert(self, prefix, decode_state, slot):
        self.calls.append(("insert", slot))
        return super().insert(prefix, decode_state, slot)

    def generate(self, params, decode_state):
        self.calls.append(("generate",))
        return super().generate(params, decode_state)

    def free_slot(self, slot):
        self.calls.append(("free", slot))


def _queue_broadcast():
    """(process 0's broadcast, the follower's): the follower gets what process 0 sent."""
    q = queue.Queue()

    def send(x):
        q.put(np.array(x))
        return x

    def receive(x):
        got = q.get(timeout=60)
        assert got.shape == x.shape
        return got

    return send, receive


def _following(follower):
    """The follower's loop on a thread of its own: (the thread, the errors it raised)."""
    errors = []

    def follow():
        try:
            follower.run()
        except Exception as e:  # shown by the test
            errors.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    return t, errors


@pytest.fixture(params=[0, 3], ids=["plain", "speculative3"])
def pair(request):
    """Process 0 and a follower; MockEngine steps of one token, or of 1-4 (speculative)."""
    send, receive = _queue_broadcast()
    devs = jax.devices()
    engines = [RecordingEngine(devices=devs[i:i + 1], max_concurrent_decodes=3, eos_ids=(0,),
                               speculative=request.param)
               for i in range(2)]
    config = OrchestratorConfig(max_queued_requests=64)
    lead = LockStepOrchestrator(engines[0], engines[0].load_params(), config=config,
                                primary=True, broadcast=send, idle_wait_s=0.01)
    follower = LockStepOrchestrator(engines[1], engines[1].load_params(), primary=False,
                                    broadcast=receive)
    t, errors = _following(follower)
    lead.start()
    yield lead, follower, engines, t, errors
    lead.stop(drain=False, timeout=10)
    t.join(30)


def test_lock_step_streams_and_identical_calls(pair):
    lead, follower, engines, thread, errors = pair
    prompts = [[1, 2], [10], [100, 100, 50], [7] * 5, [3], [250, 5]]  # 6 requests, 3 slots
    handles = [lead.submit(Request(prompt_ids=p, max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, [5, 1, 9, 3, 12, 4], strict=True)]
    stopped = lead.submit(Request(prompt_ids=[254], max_tokens=10))  # 254, 255, 0 = EOS
    seeded = lead.submit(Request(prompt_ids=[9], max_tokens=2, ignore_eos=True,
                                 sampling=SamplingParams(temperature=1.0)))
    for h, p, n in zip(handles, prompts, [5, 1, 9, 3, 12, 4], strict=True):
        c = h.result(timeout=60)
        assert c.token_ids == expected(p, n) and c.finish_reason == "length"
    c = stopped.result(timeout=60)
    assert c.token_ids == [254, 255, 0] and c.finish_reason == "stop"
    seeded.result(timeout=60)
    lead.stop(timeout=10)
    thread.join(30)
    assert not thread.is_alive() and not errors  # the stop plan ended the follower's loop
    lead_calls, follower_calls = engines[0].calls, engines[1].calls
    assert lead_calls == follower_calls
    assert sum(c[0] == "prefill" for c in lead_calls) == 8
    # A random request without a seed: process 0 drew one and the follower used it too.
    (random_prefill,) = [c for c in lead_calls if c[0] == "prefill" and c[3] == 1.0]
    assert random_prefill[2] is not None
    assert lead.stats()["generate"][0]["slots_in_use"] == 0


def test_lock_step_cancel(pair):
    lead, follower, engines, thread, errors = pair
    long = lead.submit(Request(prompt_ids=[1], max_tokens=100, ignore_eos=True))
    first = next(iter(long))  # streaming: it holds a slot
    assert first.token_ids == [1]
    long.cancel()
    assert long.result(timeout=30).finish_reason == "cancelled"
    after = lead.submit(Request(prompt_ids=[4, 4], max_tokens=3, ignore_eos=True))
    assert after.result(timeout=30).token_ids == [8, 9, 10]
    lead.stop(timeout=10)
    thread.join(30)
    assert not errors and engines[0].calls == engines[1].calls
    # the cancelled request's slot was freed on both processes before more steps ran
    assert ("free", 0) in engines[1].calls


def test_follower_refuses_requests(pair):
    _, follower, _, _, _ = pair
    with pytest.raises(RuntimeError, match="process 0"):
        follower.submit(Request(prompt_ids=[1]))


class _Recorded:
    """A paged engine whose prefill / insert / generate / free calls are logged with
    their inputs (pages, page tables and token masks included, as bytes); the drivers
    wrap it in its page planner."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @staticmethod
    def _bytes(x):
        return None if x is None else np.asarray(x).tobytes()

    def prefill(self, params, tokens, true_length, **kw):
        self.calls.append(("prefill", self._bytes(tokens), kw.get("seed"),
                           self._bytes(kw.get("token_mask"))))
        return self.engine.prefill(params, tokens, true_length, **kw)

    def insert(self, prefix, state, slot, *, pages, shared=0):
        self.calls.append(("insert", slot, tuple(pages), shared))
        return self.engine.insert(prefix, state, slot, pages=pages, shared=shared)

    def generate(self, params, state, table, token_mask=None):
        self.calls.append(("generate", self._bytes(token_mask), self._bytes(table)))
        return self.engine.generate(params, state, table, token_mask)


def _in_lock_step(engines, requests, *, queued=False):
    """Process 0 and a follower over `engines` (the same weights): each request's result
    through process 0 (all queued before its loop starts with `queued`); the follower
    must leave its loop at process 0's stop plan, without an error."""
    send, receive = _queue_broadcast()
    lead = LockStepOrchestrator(engines[0], engines[0].load_params(), primary=True,
                                broadcast=send, idle_wait_s=0.01)
    follower = LockStepOrchestrator(engines[1], engines[1].load_params(), primary=False,
                                    broadcast=receive)
    handles = [lead.submit(r) for r in requests] if queued else None
    t, errors = _following(follower)
    with lead:
        handles = handles or [lead.submit(r) for r in requests]
        results = [h.result(timeout=300) for h in handles]
    t.join(60)
    assert not t.is_alive() and not errors
    return results


def test_structured_output_in_lock_step_equals_one_process():
    """Constrained requests (a JSON schema at temperature 1, a regex and a choice, greedy)
    beside free ones, on two lock-step drivers over paged engines of the bundled model:
    process 0's answers equal the threaded orchestrator's on the same engine, and the
    follower made exactly process 0's calls, every token mask included."""
    import json

    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator import Orchestrator

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    cfg = EngineConfig(max_concurrent_decodes=3, max_prefill_length=32, max_seq_len=96,
                       kv_layout="paged", page_size=16)
    engines = [_Recorded(build_engine(None, devices=jax.devices()[i:i + 1],
                                      engine_config=cfg).engine) for i in range(2)]
    prompt = engines[0].tokenizer.encode("# user:\nA person as JSON, please.\n# assistant:\n")
    requests = [
        Request(prompt_ids=prompt, max_tokens=40, sampling=SamplingParams(temperature=1.0,
                                                                          seed=6),
                constraint=Constraint(kind="json_schema", value=schema)),
        Request(prompt_ids=prompt, max_tokens=12, ignore_eos=True),
        Request(prompt_ids=prompt[:-2], max_tokens=10,
                constraint=Constraint(kind="regex", value=r"[0-9]{3}-[a-z]{2}")),
        Request(prompt_ids=prompt, max_tokens=8,
                constraint=Constraint(kind="choice", value=["yes", "no", "maybe"])),
        Request(prompt_ids=prompt[:-1], max_tokens=12, ignore_eos=True,
                sampling=SamplingParams(temperature=1.0, seed=3)),
    ]
    got = _in_lock_step(engines, requests)
    assert engines[0].calls == engines[1].calls
    assert sum(c[0] == "generate" and c[1] is not None for c in engines[0].calls) >= 5
    assert sum(c[0] == "prefill" and c[3] is not None for c in engines[0].calls) == 3
    json.loads(got[0].text)
    assert got[0].finish_reason == "stop"
    assert len(got[2].text) == 6 and got[2].text[3] == "-"
    assert got[3].text in ("yes", "no", "maybe")
    threaded = Orchestrator.from_engines(engines[0].engine)
    with threaded:
        want = [h.result(timeout=300) for h in [threaded.submit(r) for r in requests]]
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason


# ---- a paged engine, chunked prefill --------------------------------------------------------

def test_lock_step_on_paged_engine_with_chunked_prefill():
    """Admission by promised pages (16 pages of 4: about two sequences at a time) and
    prompts prefilled in chunks of 8 give a contiguous engine's greedy tokens."""
    from engines import EngineConfig, create_engine
    from jetserve.offline import generate_many
    from jetserve.scheduling.page_planner import with_pages
    from tests.sharding.families import host_params, model_config, place

    shapes = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48)

    def engine(**kw):
        return with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1],
                                        config=EngineConfig(**shapes, **kw)))

    contiguous = engine()
    weights = host_params(contiguous)
    prompts = [[(7 * i + j) % 120 + 3 for j in range(n)]
               for i, n in enumerate([3, 16, 9, 1, 14, 5, 12, 8])]
    want = generate_many(contiguous, place(contiguous, weights),
                         prompts, max_tokens=12, ignore_eos=True)
    paged = engine(kv_layout="paged", page_size=4, num_pages=16)
    orch = LockStepOrchestrator(paged, place(paged, weights),
                                config=OrchestratorConfig(prefill_chunk=8), primary=True,
                                broadcast=lambda x: x, idle_wait_s=0.01)
    most = []
    orch.add_listener(lambda e: most.append(e.batch_size) if hasattr(e, "batch_size") else None)
    with orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=12, ignore_eos=True))
                   for p in prompts]
        got = [h.result(timeout=300).token_ids for h in handles]
    assert got == [r.token_ids for r in want]
    assert max(most) < 4  # pages, not slots, limited the batch
    paged.kv_pages.check()
    assert paged.kv_pages.free_count == 16


def test_prefill_chunk_longer_than_a_prefill_is_refused():
    engine = MockEngine(devices=jax.devices()[:1], max_prefill_length=64)
    with pytest.raises(ValueError, match="prefill_chunk=100 is longer than"):
        LockStepOrchestrator(engine, engine.load_params(), primary=True,
                             config=OrchestratorConfig(prefill_chunk=100))


def test_lock_step_prefills_several_prompts_a_call():
    """--prefill-batch in lock step: consecutive whole prompts share prefill calls on both
    processes alike (the follower's calls equal process 0's), a long prompt and a scored
    one go alone, and every stream equals offline generation on one engine."""
    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.offline import generate_many

    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=128,
                       kv_layout="paged", page_size=4, prefill_batch=4)
    engines = [_Recorded(build_engine("random:tiny", devices=jax.devices()[i:i + 1],
                                      engine_config=cfg).engine) for i in range(2)]
    called = {}
    for e in engines:
        rows = e.engine.prefill_rows

        def prefill_rows(params, prompts, *, samplings, seeds, _e=e, _rows=rows):
            _e.calls.append(("prefill_rows", tuple(np.asarray(p).tobytes() for p in prompts),
                             tuple(seeds)))
            return _rows(params, prompts, samplings=samplings, seeds=seeds)

        called[id(e)] = prefill_rows
        e.prefill_rows = prefill_rows
    prompts = [[(5 * i + j) % 90 + 3 for j in range(n)]
               for i, n in enumerate([3, 9, 5, 100, 7, 2, 11, 4])]
    # All queued before the loop starts: its first turn admits the first four, of which
    # the first three share a call (the fourth is longer than a prefill).
    *got, scored = _in_lock_step(engines, [
        *[Request(prompt_ids=p, max_tokens=8, ignore_eos=True) for p in prompts],
        Request(prompt_ids=prompts[0], max_tokens=4, ignore_eos=True, prompt_logprobs=True)],
        queued=True)
    got = [r.token_ids for r in got]
    assert engines[0].calls == engines[1].calls
    shared = [c for c in engines[0].calls if c[0] == "prefill_rows"]
    assert len(shared[0][1]) == 3 and shared[0][1][0] == np.asarray(prompts[0], np.int32).tobytes()
    want = generate_many(engines[0].engine, engines[0].load_params(), prompts, max_tokens=8,
                         ignore_eos=True)
    assert got == [r.token_ids for r in want]
    assert scored.token_ids == want[0].token_ids[:4]


def test_lock_step_serves_lora_adapters(tmp_path):
    """LoRA in lock step: requests for two adapters and the base model on two drivers
    whose engines loaded the same adapters; the plan carries each admission's adapter
    (by id), the follower makes process 0's calls, and every stream equals the threaded
    orchestrator's on the same engine, which equals the merged adapter's (tests of
    engines/lora_engine.py)."""
    from engines import EngineConfig
    from jetserve.lora_adapters import load_modules
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator import Orchestrator
    from tests.engines.lora_files import write_adapter

    cfg = EngineConfig(max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=64,
                       max_loras=2, max_lora_rank=8)
    engines = [build_engine("random:tiny", devices=jax.devices()[i:i + 1], engine_config=cfg)
               for i in range(2)]
    mc = engines[0].model_config
    mods = [f"a{i}={write_adapter(tmp_path / f'a{i}', mc, ['q_proj', 'v_proj', 'down_proj'], seed=i)[0]}"
            for i in (1, 2)]
    def logged(calls, name, f):
        def call(*a, **kw):
            calls.append((name, kw.get("adapter"), kw.get("seed")))
            return f(*a, **kw)
        return call

    for e in engines:
        load_modules([e], mods)
        e.calls = []
        for name in ("prefill", "insert", "generate", "free_slot"):
            setattr(e, name, logged(e.calls, name, getattr(e, name)))
    prompts = [[(3 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 20, 8, 3, 11])]
    prompts.append(prompts[0])  # through the base model: the adapter changes its answer
    adapters = ["a1", None, "a2", "a1", "a2", None]
    requests = [Request(prompt_ids=p, max_tokens=10, ignore_eos=True, lora_adapter=a)
                for p, a in zip(prompts, adapters, strict=True)]
    got = _in_lock_step(engines, requests)
    assert engines[0].calls == engines[1].calls
    assert {c[1] for c in engines[0].calls if c[0] == "prefill"} == {"a1", "a2", None}
    threaded = Orchestrator.from_engines(engines[0])
    with threaded:
        want = [h.result(timeout=300) for h in [threaded.submit(r) for r in requests]]
    for a, b in zip(got, want, strict=True):
        assert a.finish_reason == "length" and a.token_ids == b.token_ids
    assert got[0].token_ids != got[5].token_ids


# ---- the prefix cache -----------------------------------------------------------------------

def test_lock_step_prefix_cache_hits_alike_on_every_process():
    """--prefix-cache-* in lock step: each driver keeps its own cache, and both take the
    same hit decisions without a word in the plan (the follower's calls, prefilled
    pieces included, equal process 0's; its cache ends node for node, count for count,
    as process 0's). A device tier of 3 blocks sends one prompt's blocks to the host and
    a later hit brings them back; every answer equals offline generation without a cache."""
    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.offline import generate_many
    from jetserve.orchestrator.prefix_stores import block_bytes

    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=32, max_seq_len=96,
                       kv_layout="paged", page_size=8)
    engines = [_Recorded(build_engine("random:tiny", devices=jax.devices()[i:i + 1],
                                      engine_config=cfg).engine) for i in range(2)]
    block = 16
    config = OrchestratorConfig(prefix_cache_hbm_bytes=3 * block_bytes(engines[0], block),
                                prefix_cache_host_bytes=64 * block_bytes(engines[0], block),
                                prefix_cache_block=block, prefix_cache_key="random:tiny")
    shared = [(7 * j) % 200 + 3 for j in range(3 * block)]  # 3 blocks
    other = [(11 * j) % 200 + 5 for j in range(3 * block)]
    prompts = [shared + [1, 2, 3, 4], shared + [5, 6], other + [7, 8, 9], shared + [10]]
    send, receive = _queue_broadcast()
    lead = LockStepOrchestrator(engines[0], engines[0].load_params(), config=config,
                                primary=True, broadcast=send, idle_wait_s=0.01)
    follower = LockStepOrchestrator(engines[1], engines[1].load_params(), config=config,
                                    primary=False, broadcast=receive)
    t, errors = _following(follower)
    with lead:  # one after the other: each may hit what the ones before cached
        got = [lead.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True))
               .result(timeout=300).token_ids for p in prompts]
        stats = lead.stats()["prefix_cache"][0]
    t.join(60)
    assert not t.is_alive() and not errors
    assert engines[0].calls == engines[1].calls
    pieces = [len(np.frombuffer(c[1], np.int32)) for c in engines[0].calls if c[0] == "prefill"]
    assert pieces == [32, 20, 2, 32, 19, 1]  # the hits prefill what follows 48 cached tokens
    assert stats["hits"] == 2 and stats["host_hits"] == 1 and stats["hit_tokens"] == 96
    assert stats["evicted_to_host"] >= 3 and stats["restored"] == 3
    assert follower.cache.nodes() == lead.cache.nodes()
    assert follower.cache.stats() == lead.cache.stats()
    want = generate_many(engines[0].engine, engines[0].load_params(), prompts, max_tokens=8,
                         ignore_eos=True)
    assert got == [r.token_ids for r in want]
