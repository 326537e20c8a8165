"""The orchestrator with several prompts per prefill call (`--prefill-batch`,
EngineConfig.prefill_batch): requests waiting together share prefill calls and stream
exactly what they stream one prompt a call, while requests a shared call cannot take
(prompt scoring, a prompt longer than a chunk, a prefix-cache hit) are prefilled alone;
the warm-up compiles every shared shape (nothing more compiles than one prompt a call
compiles); decode-first, whose budget counts one prompt's tokens a call, mixed steps,
which share steps their own way, and lock step over processes refuse it by name. Offline generation (jetserve/offline.py)
shares calls as well."""

import jax
import pytest

from engines import EngineConfig, SamplingParams, create_engine
from jetserve import warmup
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator.lockstep import LockStepOrchestrator
from jetserve.orchestrator.mixed import MixedOrchestrator
from tests.sharding.families import host_params, model_config, place

SHAPES = dict(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=64,
              kv_layout="paged", page_size=8)


def _engine(prefill_batch):
    return create_engine(model_config("llama"), devices=jax.devices()[:1],
                         config=EngineConfig(**SHAPES, prefill_batch=prefill_batch))


@pytest.fixture(scope="module")
def weights():
    return host_params(_engine(1))


def _requests():
    system = list(range(3, 19))  # 16 shared tokens: two whole blocks of the cache
    plain = [[5, 9, 2], list(range(20, 34)), [7], list(range(40, 52)), [11, 12, 13, 14, 15]]
    out = [Request(prompt_ids=tuple(p), max_tokens=6, ignore_eos=True) for p in plain]
    out += [
        Request(prompt_ids=(8, 6, 4, 2, 9), max_tokens=6, ignore_eos=True,
                sampling=SamplingParams(temperature=0.9, seed=21)),
        Request(prompt_ids=(30, 31, 32), max_tokens=4, ignore_eos=True, prompt_logprobs=True),
        Request(prompt_ids=tuple(range(60, 100)), max_tokens=4, ignore_eos=True),  # 2 chunks
        Request(prompt_ids=(*system, 1, 2), max_tokens=5, ignore_eos=True),
        Request(prompt_ids=(*system, 3, 4, 5), max_tokens=5, ignore_eos=True),
    ]
    return out


def _serve(weights, prefill_batch, cache_bytes):
    eng = _engine(prefill_batch)
    orch = Orchestrator.from_engines(eng, params=place(eng, weights), config=OrchestratorConfig(
        prefix_cache_hbm_bytes=cache_bytes))
    orch.start()
    try:
        warmup.run(orch)
        warm = eng.trace_counts()
        orch.stop()  # the warm-up's requests are done; serve the test's from one queue
        orch = Orchestrator.from_engines(eng, params=place(eng, weights),
                                         config=OrchestratorConfig(
                                             prefix_cache_hbm_bytes=cache_bytes))
        handles = [orch.submit(r) for r in _requests()]  # all wait before the threads run
        orch.start()
        results = [h.result(300) for h in handles]
        calls = orch.stats()["prefill"][0]["row_calls"]
        after = {k: v - warm[k] for k, v in eng.trace_counts().items()}
        return results, calls, after
    finally:
        orch.stop()


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20], ids=["no-cache", "prefix-cache"])
def test_shared_calls_stream_what_single_calls_do(weights, cache_bytes):
    alone, none, compiled_alone = _serve(weights, 1, cache_bytes)
    shared, calls, compiled_shared = _serve(weights, 4, cache_bytes)
    assert none == 0 and calls >= 1
    # The long prompt's chunks compile on first use either way (a grown prefix); shared
    # calls add nothing to that: their shapes were all warmed up.
    assert compiled_shared == compiled_alone
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]
    assert [r.finish_reason for r in shared] == ["length"] * len(alone)
    scored = shared[6].prompt_logprobs
    assert scored is not None and len(scored) == 3
    assert scored == pytest.approx(alone[6].prompt_logprobs, abs=1e-5, nan_ok=True)


def test_warmup_plans_each_shared_shape():
    eng = _engine(4)
    orch = Orchestrator.from_engines(eng)
    labels = [s.label for s in warmup.plan(orch)]
    # At most max_prefill_length (32) tokens a call: two prompts of bucket 16.
    assert [x for x in labels if x.startswith("prefill ")] == ["prefill 2 prompts x 16"]


def test_what_shared_calls_do_not_work_with_is_refused_by_name():
    eng = _engine(4)
    with pytest.raises(ValueError, match="--prefill-batch with --step-policy decode-first"):
        Orchestrator.from_engines(eng, config=OrchestratorConfig(step_policy="decode-first"))
    with pytest.raises(ValueError, match="--prefill-batch 4: --scheduling mixed"):
        MixedOrchestrator(eng, eng.load_params())
    # Lock step takes it (its shared calls: tests/jetserve/test_lockstep.py).
    LockStepOrchestrator(eng, eng.load_params(), primary=True, broadcast=lambda x: x)
    assert Orchestrator.from_engines(eng)._prefill[0].max_rows == 2  # 2 x 16 = 32 tokens


def test_offline_generation_shares_calls_and_streams_the_same(weights, monkeypatch):
    """`jetserve generate`'s loop (jetserve/offline.py): prompts admitted together share
    calls; one longer than a prefill (two chunks) is prefilled alone."""
    prompts = [list(r.prompt_ids) for r in _requests() if not r.prompt_logprobs]
    samplings = [r.sampling for r in _requests() if not r.prompt_logprobs]
    out = {}
    for n in (1, 4):
        eng = _engine(n)
        calls = []

        def counted(*a, real=eng.prefill_rows, calls=calls, **k):
            calls.append(len(a[1]))
            return real(*a, **k)

        monkeypatch.setattr(eng, "prefill_rows", counted)
        res = generate_many(eng, place(eng, weights), prompts, max_tokens=5,
                            sampling=samplings, ignore_eos=True)
        out[n] = ([r.token_ids for r in res], calls)
    # Four slots: the first four prompts in two calls of 2 x 16 tokens; of the next four
    # the plain and the sampled one share a call, the long one (two chunks) and the
    # 18-token one (bucket 32: one a call) go alone, as does the last.
    assert out[1][1] == [] and out[4][1] == [2, 2, 2]
    assert out[4][0] == out[1][0]
