"""logit_bias (engines/sampling.py) against Hugging Face transformers with the same bias as
a logits processor: +100 on one token makes the greedy answer that token, -100 on the
greedy tokens removes them, and both equal transformers' greedy tokens, in every engine
variant that samples (contiguous and paged KV, speculative decoding, the LoRA engine, the
mixed step). Biased and unbiased requests share each batch, so a bias stays in its slot."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams, create_engine, load_hf_config
from jetserve.orchestrator import Orchestrator, Request
from jetserve.scheduling.page_planner import with_pages
from tests.engines.mixed_driver import run_mixed
from tests.parity.hf_models import hf_greedy

FAMILY = "llama"
STEPS = 8
UP = 77  # the token +100 forces


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 128, n).tolist() for n in (6, 11)]


@pytest.fixture(scope="module")
def cases(hf_dirs):
    """[(prompt, bias, transformers' greedy tokens under it)]: no bias, +100 on UP, -100
    on every token of the unbiased answer."""
    _, model = hf_dirs[FAMILY]
    out = []
    for p in _prompts():
        plain = hf_greedy(model, p, STEPS)
        down = {t: -100.0 for t in plain}
        for bias in ({}, {UP: 100.0}, down):
            out.append((p, bias, hf_greedy(model, p, STEPS, logit_bias=bias)))
    return out


def test_references_show_the_bias(cases):
    for _, bias, ref in cases:
        if bias.get(UP) == 100.0:
            assert ref == [UP] * STEPS
        elif bias:
            assert not set(ref) & set(bias)


def _engine(hf_dirs, **cfg):
    d, _ = hf_dirs[FAMILY]
    config = EngineConfig(max_concurrent_decodes=6, max_prefill_length=16, max_seq_len=48,
                          **cfg)
    return create_engine(load_hf_config(d), weights=d, config=config,
                         devices=jax.devices()[:1])


@pytest.mark.parametrize("variant", [
    dict(),
    dict(kv_layout="paged", page_size=8, num_pages=40),
    pytest.param(dict(speculative="ngram:3"), marks=pytest.mark.slow),
    pytest.param(dict(max_loras=1, max_lora_rank=4), marks=pytest.mark.slow),
])
def test_logit_bias_equals_transformers(hf_dirs, cases, variant):
    eng = with_pages(_engine(hf_dirs, **variant))
    with Orchestrator.from_engines(eng) as orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=STEPS, ignore_eos=True,
                                       sampling=SamplingParams(logit_bias=bias)))
                   for p, bias, _ in cases]
        got = [h.result(600).token_ids for h in handles]
    assert got == [ref for _, _, ref in cases]


@pytest.mark.slow
def test_logit_bias_in_the_mixed_step_equals_transformers(hf_dirs, cases):
    eng = _engine(hf_dirs, kv_layout="paged", page_size=8)
    params = eng.load_params()
    prompts = _prompts()
    for p, bias, ref in cases:
        run = run_mixed(eng, params, prompts, max_tokens=STEPS, chunk=6, budget=9,
                        sampling=SamplingParams(logit_bias=bias))
        assert run.outputs[prompts.index(p)] == ref, bias
