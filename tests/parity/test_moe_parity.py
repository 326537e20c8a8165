"""Routed experts against Hugging Face transformers: a Mixtral of 8 experts, top 2 (float32).

Prefill logits match to 1e-4 relative, and greedy tokens through prefill -> insert ->
generate equal `transformers` generate, on one device and under `ep_tp` on 8 devices (one
expert per device, each running only its own expert's rows).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from engines.kv_cache import PrefillKV
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import hf_greedy, make_hf_model
from tests.parity.test_transformers_parity import _rel_err

EXPERTS, TOP_K, STEPS = 8, 2, 24
PROMPT_LENGTHS = (45, 9, 30)


@pytest.fixture(scope="module")
def mixtral8(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe") / "mixtral8")
    model = make_hf_model("mixtral", d, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]
    return d, model, prompts


def _engine(d, devices, preset="replicated"):
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=48, max_seq_len=96)
    return create_engine(load_hf_config(d), weights=d, config=cfg, devices=devices,
                         sharding=load_preset(preset))


def test_prefill_logits_match(mixtral8):
    d, model, prompts = mixtral8
    eng = _engine(d, jax.devices()[:1])
    assert eng.model_config.num_experts == EXPERTS
    prompt = prompts[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    pos = jnp.arange(len(prompt))[None]
    ours = eng.model.apply({"params": eng.load_params()}, jnp.asarray([prompt], jnp.int32),
                           pos, PrefillKV(pos, None))[0]
    assert _rel_err(np.asarray(ours), ref) < 1e-4


@pytest.mark.parametrize("preset,n", [("replicated", 1), ("ep_tp", 8)])
def test_greedy_tokens_match_transformers(mixtral8, preset, n):
    d, model, prompts = mixtral8
    eng = _engine(d, jax.devices()[:n], preset)
    results = generate_many(eng, eng.load_params(), prompts, max_tokens=STEPS,
                            ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, STEPS)
