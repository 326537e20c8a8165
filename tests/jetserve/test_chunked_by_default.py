"""Prompts longer than max_prefill_length with no prefill_chunk: prefilled and scored in
chunks of max_prefill_length on every path (threaded orchestrator interleaved and
disaggregated, lock step, offline), with the tokens and log-probs of one whole pass; a
prompt past max_seq_len - 1 is refused naming the limit and --max-seq-len, and what was
admitted before carries on."""

import random

import jax
import numpy as np
import pytest

from engines import EngineConfig, create_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, Request
from jetserve.orchestrator.lockstep import LockStepOrchestrator
from tests.sharding.families import host_params, model_config, place

SHAPES = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=64)
LENGTHS = (40, 23, 17, 5)


def _engine(device: int = 0, **kw):
    return create_engine(model_config("llama"), devices=jax.devices()[device:device + 1],
                         config=EngineConfig(**{**SHAPES, **kw}))


@pytest.fixture(scope="module")
def setup():
    whole = _engine(max_prefill_length=64)
    weights = host_params(whole)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in LENGTHS]
    wp = place(whole, weights)
    want = [r.token_ids for r in generate_many(whole, wp, prompts, max_tokens=6,
                                               ignore_eos=True)]
    scores = whole.prompt_logprobs(wp, prompts[0]).token_logprobs
    return weights, prompts, want, scores


@pytest.fixture(scope="module")
def chunked(setup):
    """One engine (and its compiled programs) for every path: each builds its own state."""
    eng = _engine()
    return eng, place(eng, setup[0])


def _submit_all(orch, prompts):
    return [orch.submit(Request(prompt_ids=p, max_tokens=6, ignore_eos=True)) for p in prompts]


def test_offline_chunks_long_prompts(setup, chunked):
    _, prompts, want, _ = setup
    eng, params = chunked
    got = generate_many(eng, params, prompts, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in got] == want
    with pytest.raises(ValueError, match=r"max_seq_len - 1 = 63.*--max-seq-len"):
        generate_many(eng, None, [[1] * 64], max_tokens=1)


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_orchestrator_chunks_and_scores_long_prompts(setup, chunked, mode):
    weights, prompts, want, scores = setup
    gen, params = chunked
    pre, pre_params = gen, params
    if mode == "disaggregated":
        pre = _engine(device=1)
        pre_params = place(pre, weights)
    orch = Orchestrator(prefill_engines=[pre], generate_engines=[gen],
                        prefill_params=[pre_params], generate_params=[params])
    assert orch.max_prompt_length == 63
    with orch:
        handles = _submit_all(orch, prompts)
        with pytest.raises(ValueError, match=r"64 tokens.*max_seq_len - 1 = 63.*--max-seq-len"):
            orch.submit(Request(prompt_ids=[1] * 64, max_tokens=1))
        scored = orch.submit(Request(prompt_ids=prompts[0], max_tokens=0,
                                     prompt_logprobs=True))
        got = [h.result(timeout=300) for h in handles]
        lps = scored.result(timeout=300).prompt_logprobs
    assert [c.token_ids for c in got] == want  # the refusal disturbed nothing admitted
    assert all(c.finish_reason == "length" for c in got)
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], scores[1:], rtol=1e-5, atol=1e-5)


def test_lock_step_chunks_long_prompts(setup, chunked):
    _, prompts, want, _ = setup
    eng, params = chunked
    orch = LockStepOrchestrator(eng, params, primary=True, broadcast=lambda x: x,
                                idle_wait_s=0.01)
    with orch:
        got = [h.result(timeout=300).token_ids for h in _submit_all(orch, prompts)]
    assert got == want
