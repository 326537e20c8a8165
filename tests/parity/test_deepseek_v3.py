"""DeepSeek-V3 (deepseek_v3) against Hugging Face transformers on the same files, float32,
random weights (tests/parity/hf_models.py DEEPSEEK_CONFIGS: 4 layers, multi-head latent
attention at odd ranks, with a q bottleneck, interleaved-pair RoPE and YaRN's mscale on
the scores, or a plain q_proj and half-split RoPE; two dense layers, then 8 experts top-2
of the best 1 of 2 groups with a shared expert). The prompts (40, 7 and 23 tokens) take
several 16-token prefill chunks. Checked:

- greedy tokens equal transformers' `generate` and log-probs within 1e-4 of its forward,
  on the contiguous and the paged KV layouts (the latent attention in its absorbed form:
  one kv head of kv_lora_rank + qk_rope_head_dim per token, not per-head keys and values);
- blockwise prefill over tiles of 8; ragged mixed steps on the paged layout;
- the experts over 4 devices (ep_tp) give one device's tokens;
- `jetserve generate --model DIR`;
- the config fields and paths it cannot take refused by name: int4 weights on odd latent
  ranks, tp repeating the latent kv head.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from engines import create_engine, load_hf_config
from engines.backend import Backend
from engines.hf_config import from_hf_config
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    assert_logprobs_close,
    assert_mixed_steps_keep_the_tokens,
    cli_generate,
    parity_config,
    parity_prompts,
    written_case,
)

STEPS = 12
VARIANTS = ("deepseek_v3", "deepseek_v3_q_proj")


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory):
    """(variant, model dir, torch model, transformers' greedy tokens of each prompt)."""
    return written_case(request.param, tmp_path_factory, parity_prompts(), STEPS)


def _generate(d, devices=None, **kw):
    engine = create_engine(load_hf_config(d), weights=d, devices=devices or jax.devices()[:1],
                           **kw)
    return generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                         ignore_eos=True)


def test_config_reads_the_family(case):
    variant, d, model, _ = case
    cfg = load_hf_config(d)
    hf = model.config
    assert cfg.mla and (cfg.num_kv_heads, cfg.head_dim) == (1, 19 + 8)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (hf.q_lora_rank or 0, 19)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (12, 8, 10)
    assert cfg.rope_interleave == hf.rope_interleave and cfg.rotary_dim == 8
    assert [cfg.moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert (cfg.moe_router, cfg.moe_groups, cfg.moe_topk_groups) == ("sigmoid", 2, 1)
    assert (cfg.moe_scale, cfg.shared_experts, cfg.expert_size) == (2.5, 1, 24)
    # The scores' scale as transformers' attention has it.
    scale = model.model.layers[0].self_attn.scaling
    np.testing.assert_allclose(cfg.query_pre_attn_scalar ** -0.5, scale, rtol=1e-6)
    if variant == "deepseek_v3":
        assert not np.isclose(scale, 20 ** -0.5)  # mscale_all_dim at work
    bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
    assert cfg.param_count() == sum(p.numel() for p in model.parameters()) + bias


def test_kv_bytes_per_token_are_the_latent_heads(case):
    """The cache holds per token per layer one kv head of kv_lora_rank + qk_rope_head_dim
    (keys; values the same shape), not N heads of keys and values."""
    _, d, _, _ = case
    cfg = load_hf_config(d)
    assert cfg.kv_bytes_per_token(4) == 2 * 4 * (19 + 8) * 4


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tokens_and_logprobs(case, layout):
    _, d, model, want = case
    results = _generate(d, config=parity_config(kv_layout=layout))
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_blockwise_prefill(case):
    """Tiles of 8 make every 16-token chunk's prefill run the blockwise path."""
    _, d, model, want = case
    results = _generate(d, config=parity_config(), backend=Backend(block_q=8, block_k=8))
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_mixed_steps_keep_the_tokens(case):
    """Ragged mixed steps on the paged layout: prompt chunks of 5 beside decode rows."""
    _, d, _, want = case
    assert_mixed_steps_keep_the_tokens(d, want, STEPS)


def test_experts_over_four_devices(case):
    """ep_tp on 4 devices: 2 of the 8 experts each, the heads split as tp does, the one
    latent kv head on every device; the tokens are transformers'."""
    _, d, _, want = case
    results = _generate(d, config=parity_config(), devices=jax.devices()[:4],
                        sharding=load_preset("ep_tp"))
    assert [r.token_ids for r in results] == want


def test_cli_generate(case, capsys):
    _, d, _, want = case
    assert cli_generate(d, parity_prompts(), STEPS, 16, capsys) == want


def test_unimplemented_fields_are_refused(case):
    variant, d, _, _ = case
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf_config({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        from_hf_config({k: v for k, v in hf.items() if k != "kv_lora_rank"})
    with pytest.raises(ValueError, match="quantization_config"):
        from_hf_config({**hf, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        dataclasses.replace(load_hf_config(d), num_kv_heads=2)
    # int4 packs pairs along each kernel's input axis: the odd latent ranks cannot
    # (int8 and int4 with even ranks: tests/parity/test_moe_paths.py).
    odd = "q_b_proj" if variant == "deepseek_v3" else "kv_b_proj"
    with pytest.raises(ValueError, match=f"{odd}: int4 packs two values per byte"):
        create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:1],
                      config=parity_config(quantize="int4"))
    # tp would repeat the one latent kv head over its 4 devices.
    with pytest.raises(ValueError, match="one latent kv head, which is not repeated"):
        create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:4],
                      config=parity_config(), sharding=load_preset("tp"))
