"""Structured output through the orchestrator on the bundled model: constrained requests
match at temperature 1, greedy parity with unconstrained decoding, a mixed batch equal
to each request alone, no recompiles, and the refusals (engines that apply no masks).
Each on the contiguous and the paged KV cache, and under `scheduling="mixed"` (prompts in
chunks of the decode steps: orchestrator/mixed_worker.py)."""

import json
import re

import jax
import pytest

from engines import EngineConfig, MockEngine, SamplingParams
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator.mixed import MixedOrchestrator
from jetserve.request import InvalidArgument
from jetserve.structured import Constraint

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
HOT = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731


@pytest.fixture(scope="module", params=["contiguous", "paged", "mixed"])
def orch(request):
    mixed = request.param == "mixed"
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=96,
                       kv_layout="paged" if mixed else request.param, page_size=16)
    engine = build_engine(None, devices=jax.devices()[:1], engine_config=cfg)
    o = (MixedOrchestrator.from_engines(engine, config=OrchestratorConfig(scheduling="mixed"))
         if mixed else Orchestrator.from_engines(engine))
    o.start()
    yield o
    o.stop()


@pytest.fixture(scope="module")
def prompt(orch):
    return orch.tokenizer.encode("# user:\nA person as JSON, please.\n# assistant:\n")


def run(orch, *requests):
    return [h.result(300) for h in [orch.submit(r) for r in requests]]


def test_constrained_requests_match_at_temperature_one(orch, prompt):
    cases = [(Constraint(kind="json_schema", value=SCHEMA), lambda t: (
                 set(json.loads(t)) == {"name", "age"} and 0 <= json.loads(t)["age"] <= 120)),
             (Constraint(kind="json_object"), lambda t: isinstance(json.loads(t), dict)),
             (Constraint(kind="regex", value=r"[0-9]{3}-[a-z]{2}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             (Constraint(kind="choice", value=["yes", "no", "maybe"]),
              lambda t: t in ("yes", "no", "maybe"))]
    reqs = [Request(prompt_ids=prompt, max_tokens=48, sampling=HOT(seed), constraint=c)
            for seed, (c, _) in enumerate(cases)]
    for (c, check), r in zip(cases, run(orch, *reqs), strict=True):
        assert r.finish_reason == "stop" and check(r.text), (c.kind, r.text)


def test_greedy_parity_when_the_free_output_already_matches(orch, prompt):
    free, = run(orch, Request(prompt_ids=prompt, max_tokens=10, ignore_eos=True))
    tok = orch.tokenizer
    text = b"".join(tok.token_bytes(t) for t in free.token_ids).decode()
    for pattern in (re.escape(text), r"(?s:.{0,200})"):
        c = Constraint(kind="regex", value=pattern)
        got, = run(orch, Request(prompt_ids=prompt, max_tokens=10, ignore_eos=True,
                                 constraint=c))
        assert got.token_ids == free.token_ids
        assert got.finish_reason == ("stop" if pattern == re.escape(text) else "length")


def test_a_mixed_batch_equals_each_request_alone(orch, prompt):
    free = Request(prompt_ids=prompt, max_tokens=12, ignore_eos=True, sampling=HOT(5))
    shaped = Request(prompt_ids=prompt, max_tokens=40, sampling=HOT(6),
                     constraint=Constraint(kind="json_schema", value=SCHEMA))
    greedy = Request(prompt_ids=prompt[:-2], max_tokens=12, ignore_eos=True)
    alone = [run(orch, r)[0] for r in (free, shaped, greedy)]
    together = run(orch, free, shaped, greedy)
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    json.loads(together[1].text)


def _loop_counts(orch):
    """The generate loop's (steps, syncs, slots that sat a step out) so far."""
    g = orch.stats()["generate"][0]
    return g["steps"], g["syncs"], g["sat_out"]


def test_free_slots_step_every_step_beside_a_constrained_one(orch, prompt):
    # On either layout a free request never waits for a constrained one's mask: no step
    # is dispatched after a read-back wait, the free slot gets a token at every step, and
    # the constrained slot sits out the steps whose mask needs its unread token.
    before = _loop_counts(orch)
    free = orch.submit(Request(prompt_ids=prompt, max_tokens=40, ignore_eos=True,
                               sampling=HOT(7)))
    seen, deltas = 0, iter(free)
    while seen < 2:  # in its slot and stepping before the constrained one arrives
        seen += len(next(deltas).token_ids)
    code = Constraint(kind="regex", value=r"[0-9]{3}-[a-z]{2}")
    shaped = orch.submit(Request(prompt_ids=prompt, max_tokens=20, sampling=HOT(8),
                                 constraint=code))
    c, f = shaped.result(300), free.result(300)
    assert c.finish_reason == "stop" and re.fullmatch(code.value, c.text)
    assert f.finish_reason == "length" and len(f.token_ids) == 40
    steps, syncs, sat_out = (a - b for a, b in zip(_loop_counts(orch), before, strict=True))
    # The first token is prefill's (mixed: the step of its prompt's chunk); one per step
    # after it.
    assert steps == 40 - (not isinstance(orch, MixedOrchestrator))
    assert syncs == 0 and sat_out >= 1
    alone = _loop_counts(orch)
    run(orch, Request(prompt_ids=prompt, max_tokens=20, sampling=HOT(8), constraint=code))
    assert _loop_counts(orch)[1] > alone[1]  # alone, it waits for its own tokens


def test_a_max_tokens_no_structure_fits_in_is_refused(orch, prompt):
    with pytest.raises(InvalidArgument) as e:
        run(orch, Request(prompt_ids=prompt, max_tokens=3, sampling=HOT(1),
                          constraint=Constraint(kind="json_schema", value=SCHEMA)))
    assert e.value.field == "max_tokens" and "at least" in str(e.value)


def test_json_object_closes_within_max_tokens(orch, prompt):
    # At temperature 1 the bundled model writes strings that rarely end: the mask steers
    # the object shut as the budget runs out (jetserve/structured/json_budget.py).
    for max_tokens in (5, 24):
        reqs = [Request(prompt_ids=prompt, max_tokens=max_tokens, sampling=HOT(seed),
                        constraint=Constraint(kind="json_object")) for seed in range(4)]
        for r in run(orch, *reqs):
            assert r.finish_reason == "stop" and len(r.token_ids) <= max_tokens
            assert isinstance(json.loads(r.text), dict), r.text


def test_stop_strings_still_end_a_constrained_request(orch, prompt):
    r, = run(orch, Request(prompt_ids=prompt, max_tokens=40, sampling=HOT(2),
                           stop_strings=('"age"',),
                           constraint=Constraint(kind="json_schema", value=SCHEMA)))
    assert r.finish_reason == "stop" and r.stop_reason == '"age"'
    assert r.text.startswith('{"name":"') and '"age"' not in r.text


def test_no_recompiles_after_both_programs(orch, prompt):
    free = Request(prompt_ids=prompt, max_tokens=4, ignore_eos=True)
    shaped = Request(prompt_ids=prompt, max_tokens=4, constraint=Constraint(kind="json_object"))
    both = lambda: (run(orch, shaped, free), run(orch, free))  # noqa: E731
    both()
    engine = orch.generate_engines[0]
    before = engine.trace_counts()
    for _ in range(2):
        both()
    if isinstance(orch, MixedOrchestrator):
        # Its step shapes vary with the arrivals: each of the warm-up's set, with a mask
        # and without, at most (tests/e2e/test_mixed_serve.py compiles them all first).
        assert engine.trace_counts()["mixed"] <= 2 * len(orch.warmup_shapes())
        assert engine.trace_counts()["generate"] == engine.trace_counts()["prefill"] == 0
        return
    assert engine.trace_counts() == before
    if engine.page_geometry is None:  # paged: one pair per page-table width
        assert before["generate"] == 2  # the step without a mask and the one with


def test_engines_that_apply_no_masks_refuse_at_admission():
    c = Constraint(kind="regex", value="a+", field="guided_regex")
    mock = Orchestrator.from_engines(MockEngine(vocab_size=64, max_concurrent_decodes=2))
    with pytest.raises(ValueError, match=r"^guided_regex: structured output .*MockEngine"):
        mock.submit(Request(prompt_ids=[1, 2], constraint=c))
    assert mock.stats()["counters"].get("submitted", 0) == 0


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_speculative_decoding_serves_constrained_requests(orch, prompt, layout):
    """n-gram speculative decoding: a constrained request keeps one token a verify step,
    under its grammar's mask, beside free requests that keep their drafts. Greedy answers
    equal the plain engine's (constrained and free, in one batch); sampled ones match
    their structure."""
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=96,
                       kv_layout=layout, page_size=16, speculative="ngram:3")
    code = Constraint(kind="regex", value=r"[0-9]{3}-[a-z]{2}")
    greedy = [Request(prompt_ids=prompt, max_tokens=10, constraint=code),
              Request(prompt_ids=prompt, max_tokens=24, ignore_eos=True),
              Request(prompt_ids=prompt[:-2], max_tokens=16,
                      constraint=Constraint(kind="choice", value=["yes", "no", "maybe"]))]
    if isinstance(orch, MixedOrchestrator):
        pytest.skip("the turns' orchestrators give this test's reference")
    want = run(orch, *greedy)
    with Orchestrator.from_engines(build_engine(None, devices=jax.devices()[:1],
                                                engine_config=cfg)) as spec:
        got = run(spec, *greedy)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        shaped = run(spec, *[Request(prompt_ids=prompt, max_tokens=40, sampling=HOT(seed),
                                     constraint=Constraint(kind="json_schema", value=SCHEMA))
                             for seed in range(3)])
        for r in shaped:
            assert r.finish_reason == "stop" and set(json.loads(r.text)) == {"name", "age"}
        stats = spec.stats()["generate"][0]
    assert stats["drafted"] > 0 and stats["accepted"] > 0


def test_an_invalid_regex_is_refused_before_queueing(orch):
    before = orch.stats()["counters"].get("submitted", 0)
    with pytest.raises(ValueError, match=r"(?s)^guided_regex: invalid regex: .*unclosed group"):
        orch.submit(Request(prompt_ids=[1, 2], constraint=Constraint(
            kind="regex", value="(ab", field="guided_regex")))
    assert orch.stats()["counters"].get("submitted", 0) == before


def test_offline_generation_applies_constraints_as_the_orchestrator(orch, prompt):
    c = Constraint(kind="regex", value=r"[a-z]{2,6}\.[a-z]{2,6}\(\)")
    served = run(orch, Request(prompt_ids=prompt, max_tokens=20, constraint=c),
                 Request(prompt_ids=prompt, max_tokens=20))
    engine = orch.generate_engines[0]
    params = orch._generate[0].params
    offline = generate_many(engine, params, [prompt, prompt], max_tokens=20,
                            constraints=[c, None])
    assert [r.token_ids for r in offline] == [r.token_ids for r in served]
    assert re.fullmatch(c.value, orch.tokenizer.decode(offline[0].token_ids))


def test_mixed_preemption_resumes_constrained_requests_exactly():
    """--scheduling mixed on a pool too small for every sequence: constrained requests
    that are preempted and recomputed (their chunks run again, the grammar's state kept)
    give the tokens they give alone, beside free ones."""
    def mixed(num_pages):
        cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=96,
                           kv_layout="paged", page_size=16, num_pages=num_pages)
        engine = build_engine(None, devices=jax.devices()[:1], engine_config=cfg)
        return MixedOrchestrator.from_engines(
            engine, config=OrchestratorConfig(scheduling="mixed", prefill_chunk=16))

    small = mixed(9)  # 4 sequences of up to ~80 tokens want 20 pages of 16
    tok = small.tokenizer
    prompts = [tok.encode(f"# user:\nTell me about item {i}.\n# assistant:\n") for i in range(4)]
    reqs = [Request(prompt_ids=p, max_tokens=56, ignore_eos=True,
                    constraint=Constraint(kind="regex", value=r"[a-z ]{50,60}") if i % 2
                    else None) for i, p in enumerate(prompts)]
    with small:
        got = run(small, *reqs)
        preempted = small.stats()["generate"][0]["preemptions"]
    with mixed(None) as alone:
        want = [run(alone, r)[0] for r in reqs]
    assert preempted >= 1
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    assert all(re.fullmatch(r"[a-z ]{50,60}", g.text) for g in got[1::2])
