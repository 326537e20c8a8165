"""DeepSeek-V3 (deepseek_v3) against Hugging Face transformers on the same files, float32,
random weights (tests/parity/hf_models.py DEEPSEEK_CONFIGS: 4 layers, multi-head latent
attention at odd ranks, with a q bottleneck, interleaved-pair RoPE and YaRN's mscale on
the scores, or a plain q_proj and half-split RoPE; two dense layers, then 8 experts top-2
of the best 1 of 2 groups with a shared expert). The prompts (40, 7 and 23 tokens) take
several 16-token prefill chunks. Checked:

- greedy tokens equal transformers' `generate` and log-probs within 1e-4 of its forward,
  on the contiguous and the paged KV layouts (the latent attention in its absorbed form:
  one kv head of kv_lora_rank + qk_rope_head_dim per token, keys only, not per-head keys
  and values), and the caches' bytes on the device are that latent once;
- blockwise prefill over tiles of 8; ragged mixed steps on the paged layout;
- the key-only cache through prefix-cache blocks (of a prefill and of pages), a prefix
  transfer's check and move, int8 KV and speculative verification;
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
from jetserve.scheduling.page_planner import PagePlanner
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
INT8_TOL = 0.05  # int8 keys' log-probs against transformers' float forward
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


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kv_bytes_per_token_are_the_latent_once(case, layout, kv_dtype):
    """The cache holds per token per layer one kv head of kv_lora_rank + qk_rope_head_dim,
    keys only (the values are read from them), not N heads of keys and values nor the
    latent twice: measured as the device arrays' bytes of an engine's decode state
    (contiguous: slots x max length tokens; paged: the pool's pages, its scratch page
    with them, x page size). float32: 4 bytes a value; int8: 1, and one f32 scale per
    token and layer for the keys (none for values)."""
    _, d, _, _ = case
    cfg = load_hf_config(d)
    assert cfg.kv_bytes_per_token(4) == (19 + 8) * 4 * 4
    engine = create_engine(cfg, weights=d, devices=jax.devices()[:1],
                           config=parity_config(kv_layout=layout, kv_dtype=kv_dtype))
    state = engine.init_decode_state()
    g = engine.page_geometry
    tokens = 4 * 64 if g is None else (g.num_pages + 1) * g.page_size
    cache = jax.tree.leaves((state.k, state.v, getattr(state, "k_scale", ()),
                             getattr(state, "v_scale", ())))
    per_entry = (19 + 8) * 4 if kv_dtype == "auto" else 19 + 8 + 4
    assert sum(x.nbytes for x in cache) == per_entry * 4 * tokens
    assert all(x.shape[-1] == 0 for x in state.v)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tokens_and_logprobs(case, layout):
    _, d, model, want = case
    results = _generate(d, config=parity_config(kv_layout=layout))
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_key_only_prefix_cache_blocks_and_transfer(case):
    """The paged key-only cache through the prefix cache and a transfer between roles: a
    prefill's first 16 positions cut into blocks of a page (keys alone: [L, 1, ps, K, C]),
    equal to the blocks its inserted pages give, joined back and continued; that prefix
    pulled by a decode engine on another device (jax's transfer server, as the split
    roles do: its empty value arrays are made there, not sent) decodes transformers'
    tokens."""
    from jetserve.disagg.kv_transfer import KVReceiver, KVSender

    _, d, _, want = case

    def paged(devices):
        return PagePlanner(create_engine(load_hf_config(d), weights=d, devices=devices,
                                         config=parity_config(kv_layout="paged", page_size=8)))

    engine, decoder = paged(jax.devices()[:1]), paged(jax.devices()[1:2])
    params = engine.load_params()
    prompt = parity_prompts()[0]  # 40 tokens
    donor, _ = engine.prefill(params, prompt[:16], 16)
    blocks = engine.stack_blocks(engine.cache_blocks(donor, 0, 2, 8))
    assert blocks.shape == (2, 4, 1, 8, 1, 19 + 8)
    state = engine.insert(donor, engine.init_decode_state(), 0)
    pages = engine.kv_pages.pages_of(0)[:2]
    np.testing.assert_array_equal(np.asarray(engine.page_blocks(state, pages)), blocks)
    engine.free_slot(0)
    prefix = engine.prefix_from_blocks(blocks, prompt[:16])
    for start in (16, 32):
        piece = prompt[start:start + 16]
        prefix, first = engine.prefill(params, piece, len(piece), existing_prefix=prefix)
    sender = KVSender(engine.engine, hold_s=30.0)
    uuid, meta = sender.register(prefix, receiver_devices=1)
    prefix = KVReceiver(decoder.engine, timeout_s=30.0).pull(sender.address, uuid, meta,
                                                             "a prefill worker")
    assert sender.ack(uuid)
    assert all(x.shape[-1] == 0 for x in prefix.v)
    state = decoder.insert(prefix, decoder.init_decode_state(), 1)
    tokens = [first.to_host().token(0)]
    params = decoder.load_params()
    while len(tokens) < STEPS:
        state, res = decoder.generate(params, state)
        tokens.append(res.to_host().token(1))
    decoder.free_slot(1)
    assert tokens == want[0]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_key_only_cache_under_speculative_decoding(case, layout):
    """Prompt-lookup drafts verified several tokens a step over the key-only cache keep
    transformers' greedy tokens."""
    _, d, _, want = case
    results = _generate(d, config=parity_config(kv_layout=layout, speculative="ngram:3"))
    assert [r.token_ids for r in results] == want


def test_key_only_cache_in_int8(case):
    """int8 keys alone (no values, no value scales; pages of C + 4 byte entries): the
    paged and contiguous int8 caches decode alike, and each token's log-prob stays near
    transformers' forward over the same tokens."""
    _, d, model, _ = case
    runs = {layout: _generate(d, config=parity_config(kv_layout=layout, kv_dtype="int8"))
            for layout in ("contiguous", "paged")}
    for a, b in zip(runs["contiguous"], runs["paged"], strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert_logprobs_close(model, parity_prompts(), runs["paged"], tol=INT8_TOL)


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
