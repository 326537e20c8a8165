"""Every family with its layers under one scanned body (EngineConfig.layers "scan",
engines/layer_scan.py) against Hugging Face transformers on the same files: the HF
weights are stacked at load, and logits, greedy tokens and log-probs match as the
unrolled decoder's do (tests/parity/test_transformers_parity.py); with paged KV too, its
page pools stacked and carried through the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from engines.kv_cache import PrefillKV
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import PagePlanner
from tests.parity.hf_models import FAMILIES, hf_greedy
from tests.parity.test_transformers_parity import _prompts, _rel_err

STEPS = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_dirs):
    d, model = hf_dirs[request.param]
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=48, max_seq_len=96,
                       top_logprobs=4, layers="scan")
    eng = create_engine(load_hf_config(d), weights=d, config=cfg)
    return request.param, model, eng, eng.load_params()


def test_stacked_prefill_logits_match(family):
    name, model, eng, params = family
    assert eng.model_config.scan_layers
    L = eng.model_config.num_layers
    assert all(x.shape[0] == L for x in jax.tree.leaves(params["layers"]))
    prompt = _prompts()[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    pos = jnp.arange(len(prompt))[None]
    ours = eng.model.apply({"params": params}, jnp.asarray([prompt]), pos, PrefillKV(pos, None))
    assert _rel_err(np.asarray(ours[0]), ref) < 1e-4, name


def test_scanned_greedy_tokens_and_logprobs_match(family):
    name, model, eng, params = family
    prompts = _prompts()
    results = generate_many(eng, params, prompts, max_tokens=STEPS, ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, STEPS), name
    p, r = prompts[2], results[2]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0], -1)
    want = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(r.token_ids)]
    np.testing.assert_allclose(r.logprobs, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_scanned_greedy_tokens_match(hf_dirs, name):
    """Five prompts on four slots of pages of 8 (the 40-token prompt prefilled in three
    chunks of 16, the last prompt joining when a slot and its pages free up)."""
    d, model = hf_dirs[name]
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=64,
                       kv_layout="paged", page_size=8, layers="scan")
    eng = PagePlanner(create_engine(load_hf_config(d), weights=d, config=cfg))
    assert eng.model_config.scan_layers and len(eng.init_decode_state().k) == 1
    prompts = _prompts()
    results = generate_many(eng, eng.load_params(), prompts, max_tokens=STEPS, ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, STEPS), name
    assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages
