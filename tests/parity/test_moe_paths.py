"""The MoE families (Qwen3-MoE, GLM-4.5, gpt-oss, Llama 4 text, DeepSeek-V3) through the
paths the dense families take, on the random-weight directories of
tests/parity/hf_models.py (float32; the prompts of 40, 7 and 23 tokens, 16-token prefill
chunks, one device):

- n-gram speculative decoding through the orchestrator: greedy tokens equal
  transformers' `generate`; the model as its own draft model (on DeepSeek-V3 and
  gpt-oss): the same, every draft kept;
- an int8 KV cache: each token transformers' greedy pick after the same tokens, but
  where transformers' top two are within 0.05 (int8 keys and values may flip such a
  near tie: Qwen3-MoE's first prompt does at its last token), log-probs within 0.05;
- int8 and int4 weights (`--quantize`, quantized as they load: experts, attention
  projections, the latent attention's included): the tokens and log-probs (1e-4) of the
  float engine run on those weights dequantized (the quantized engine dequantizes inside
  its step).

DeepSeek-V3 runs with even latent ranks here (a q bottleneck of 24, a kv latent of 16) so
int4 can pack its projections two values a byte; the odd ranks of its own file are
refused for int4 by name (tests/parity/test_deepseek_v3.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from engines import create_engine, load_hf_config
from engines import quantization as qz
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, Request
from tests.parity.hf_models import (
    hf_greedy,
    make_hf_model,
    parity_config,
    parity_prompts,
)

STEPS = 12
TOL = 0.05  # int8 KV: how far its log-probs may move
VARIANTS = ("qwen3_moe", "glm4_moe", "gpt_oss", "llama4", "deepseek_v3")
# int4 packs pairs along each kernel's input axis: DeepSeek-V3's latent ranks made even.
OVERRIDES = {"deepseek_v3": dict(q_lora_rank=24, kv_lora_rank=16)}


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory):
    """(variant, model dir, torch model, transformers' greedy tokens of each prompt)."""
    d = str(tmp_path_factory.mktemp(request.param))
    model = make_hf_model(request.param, d, **OVERRIDES.get(request.param, {}))
    return request.param, d, model, [hf_greedy(model, p, STEPS) for p in parity_prompts()]


def _engine(d, **kw):
    spec = {k: kw.pop(k) for k in ("draft_config", "draft_weights") if k in kw}
    return create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:1],
                         config=parity_config(**kw), **spec)


def _run(engine, params):
    return generate_many(engine, params, parity_prompts(), max_tokens=STEPS, ignore_eos=True)


def _served(engine, params=None):
    """Each prompt's greedy tokens through the orchestrator, and its generate stats."""
    with Orchestrator.from_engines(engine, params=params) as orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=STEPS, ignore_eos=True))
                   for p in parity_prompts()]
        got = [h.result(600).token_ids for h in handles]
        return got, orch.stats()["generate"][0]


@pytest.fixture(scope="module")
def ngram(case):
    """The float engine with n-gram drafts on one device: checked against transformers
    below, then the reference for the quantized weights (greedy drafts keep the tokens)."""
    return _engine(case[1], speculative="ngram:3")


def test_ngram_speculative_decoding_keeps_transformers_tokens(case, ngram):
    """Drafts (mostly rejected on random weights: the rows roll back) verified several
    tokens a step over the family's cache, through the orchestrator's batching."""
    name, _, _, want = case
    got, stats = _served(ngram)
    assert got == want, name
    assert 0 <= stats["accepted"] <= stats["drafted"] > 0, stats


# The target as its own draft model on the families whose caches differ most from the
# dense ones' (the latent kv head; sinks beside sliding windows).
DRAFT_VARIANTS = ("deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("case", DRAFT_VARIANTS, indirect=True)
def test_draft_model_keeps_transformers_tokens(case):
    """The model as its own draft: every draft kept (the accepted rows' KV stays), the
    tokens transformers'."""
    name, d, _, want = case
    got, stats = _served(_engine(d, speculative="draft:itself:3",
                                 draft_config=load_hf_config(d), draft_weights=d))
    assert got == want, name
    assert stats["accepted"] >= 0.97 * stats["drafted"] > 0, stats


def test_int8_kv_cache_keeps_transformers_tokens(case):
    """Each token is transformers' greedy pick after the same tokens, unless int8 keys and
    values can flip it (transformers' top two within TOL), so up to such a near tie the
    tokens are transformers' `generate`'s; log-probs within TOL of transformers'."""
    name, d, model, _ = case
    engine = _engine(d, kv_dtype="int8")
    assert engine.init_decode_state().k[0].dtype == np.int8
    results = _run(engine, engine.load_params())
    for p, r in zip(parity_prompts(), results, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0], -1)
        steps = logp[len(p) - 1:-1]  # (STEPS, V): the distribution each token was drawn from
        top = steps.max(-1).values
        picked = steps[torch.arange(STEPS), torch.tensor(r.token_ids)]
        assert bool((picked >= top - TOL).all()), (name, r.token_ids, (top - picked).tolist())
        np.testing.assert_allclose(r.logprobs, picked.numpy(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_give_the_dequantized_tokens(case, ngram, scheme):
    name, d, _, _ = case
    engine = _engine(d, quantize=scheme)
    params = engine.load_params()
    host = jax.tree.map(np.asarray, engine.checkpoint_params(params))
    quantized = {str(path[-2].key) for path, _ in jax.tree_util.tree_flatten_with_path(host)[0]
                 if path[-1].key == qz.QVALUE}
    # The experts, and every projection of the attention (the latent one's for DeepSeek).
    attn = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} \
        if name == "deepseek_v3" else {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert {"w1", "w2", "w3", "lm_head"} | attn <= quantized, quantized
    dequantized = jax.device_put(
        ngram.params_from_checkpoint(qz.dequantize_params(host, scheme, np.float32)),
        ngram.param_shardings)
    want = _run(ngram, dequantized)
    got = _run(engine, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want], name
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
