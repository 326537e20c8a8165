"""gpt-oss (gpt_oss) against Hugging Face transformers on the same files, float32, random
weights (tests/parity/hf_models.py MOE_CONFIGS["gpt_oss"]: 3 layers, sliding window 8
and full attention in turn, 4 experts top 2, a SwiGLU limit low enough to clamp, sinks
large enough to matter). The MoE families' shared checks (tokens and log-probs on the
contiguous and paged layouts with 16-token prefill chunks, experts over 4 devices) run
on the same config in tests/parity/test_moe_families.py; here what gpt-oss adds:

- the attention sinks on every path a step can take: blockwise prefill over several
  tiles, decode past the CPU decode kernel (which has no sinks), ragged mixed steps;
- the experts' biases with the experts and F split over 8 devices (the down bias added
  once, not per F shard);
- `jetserve generate --model DIR`, and on its `jetserve convert` Orbax copy;
- a checkpoint in the published MXFP4 layout (`*_blocks` / `*_scales` experts), decoded
  as transformers decodes it, kept 4-bit on the devices (one and eight, ep_tp), giving
  transformers' tokens and log-probs; shard-report's bytes per parameter of it;
- the config fields and paths it cannot take refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch

from engines import create_engine, load_hf_config, mxfp4
from engines.backend import Backend
from engines.hf_config import from_hf_config
from engines.paged_kv import resolve_attention
from jetserve import cli
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    assert_logprobs_close,
    assert_mixed_steps_keep_the_tokens,
    cli_generate,
    hf_greedy,
    make_hf_model,
    parity_config,
    parity_prompts,
    written_case,
)

STEPS = 12


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(model dir, torch model, transformers' greedy tokens of each prompt)."""
    _, d, model, want = written_case("gpt_oss", tmp_path_factory, parity_prompts(), STEPS)
    return d, model, want


def test_config_reads_the_family(case):
    d, model, _ = case
    cfg = load_hf_config(d)
    assert (cfg.attn_sinks, cfg.qkv_bias, cfg.o_bias, cfg.expert_bias) == (True,) * 4
    assert cfg.moe_router == "topk_softmax" and cfg.activation == "clamped_swiglu"
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (0.5, 1.5)
    assert cfg.layer_types == tuple(model.config.layer_types)
    assert [cfg.layer_window(i) for i in range(3)] == [8, None, 8]
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate
    assert cfg.param_count() == sum(p.numel() for p in model.parameters())


def test_blockwise_prefill_and_decode_past_the_cpu_kernel(case):
    """Tiles of 8 make every 16-token chunk's prefill run the blockwise path (with the
    sinks in its online softmax); decode steps on one CPU device would take the CPU
    attention kernel, which has no sinks, and take XLA's path instead."""
    d, model, want = case
    engine = create_engine(load_hf_config(d), weights=d, config=parity_config(),
                           devices=jax.devices()[:1], backend=Backend(block_q=8, block_k=8))
    results = generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_mixed_steps_keep_the_tokens(case):
    """Ragged mixed steps on the paged layout: chunks of 5 beside decode rows."""
    d, _, want = case
    assert_mixed_steps_keep_the_tokens(d, want, STEPS)


def test_experts_and_their_ffn_over_eight_devices(case):
    """ep_tp on 8 devices: {expert: 4, model: 2}, each device one expert and half its F
    (gate and up biases split with it, the down bias added by one F shard)."""
    d, _, want = case
    engine = create_engine(load_hf_config(d), weights=d, config=parity_config(),
                           devices=jax.devices()[:8], sharding=load_preset("ep_tp"))
    assert dict(engine.mesh.shape) == {"expert": 4, "model": 2}
    results = generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want


def test_cli_generate_and_convert_round_trip(case, tmp_path, capsys):
    """`jetserve generate` on the HF directory and on its `jetserve convert` Orbax copy
    (whose config keeps the family's options)."""
    d, _, want = case
    orbax = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", d, "--to", orbax]) == 0
    for source in (d, orbax):
        assert cli_generate(source, parity_prompts(), STEPS, 16, capsys) == want, source


def _write_mxfp4(src: str, dst: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A copy of the float directory `src` with every expert kernel replaced by random
    MXFP4 blocks and scales in the published layout ([E, out, in / 32, 16] codes,
    [E, out, in / 32] exponents around 2^-4), config.json naming the quantization as the
    published one does; returns the written tensors."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    out = {}
    for name, value in load_file(os.path.join(src, "model.safetensors")).items():
        if not name.endswith(("gate_up_proj", "down_proj")):
            out[name] = value
            continue
        E, n_in, n_out = value.shape  # the float form is [E, in, out]
        out[name + "_blocks"] = rng.integers(0, 256, (E, n_out, n_in // 32, 16), np.uint8)
        out[name + "_scales"] = rng.integers(121, 125, (E, n_out, n_in // 32), np.uint8)
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory):
    """(MXFP4 model dir with F = 64: whole blocks of 32, the tensors written, transformers'
    model of it dequantized, its greedy tokens of each prompt)."""
    import transformers as tf

    tmp = tmp_path_factory.mktemp("mxfp4")
    src, dst = str(tmp / "float"), str(tmp / "mxfp4")
    make_hf_model("gpt_oss", src, intermediate_size=64)
    written = _write_mxfp4(src, dst)
    model = tf.GptOssForCausalLM.from_pretrained(
        dst, quantization_config=tf.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    return dst, written, model, [hf_greedy(model, p, STEPS) for p in parity_prompts()]


def _experts(params) -> dict[str, jax.Array]:
    """path -> leaf, for every leaf under an expert kernel (w1, w3, w2)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = {"/".join(str(getattr(k, "key", k)) for k in p): a for p, a in flat}
    return {p: a for p, a in paths.items() if {"w1", "w3", "w2"} & set(p.split("/"))}


def test_mxfp4_checkpoint_matches_transformers(mxfp4_case, monkeypatch):
    """Experts as published (MXFP4) decode exactly as transformers decodes them, stay
    4-bit on the device (their bytes as published, moved to [E, in, out]; no float copy,
    <= 0.3 of their bfloat16 bytes), and give the tokens and log-probs transformers gives
    on its dequantized model."""
    dst, written, model, want = mxfp4_case
    experts = model.model.layers[1].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{proj}"
        ours = mxfp4.dequantize_transposed(written[key + "_blocks"], written[key + "_scales"])
        np.testing.assert_array_equal(ours, getattr(experts, proj).detach().numpy())
    cfg = load_hf_config(dst)
    assert cfg.expert_quant == "mxfp4"
    engine = create_engine(cfg, weights=dst, config=parity_config(), devices=jax.devices()[:1])
    with monkeypatch.context() as m:  # loading decodes nothing: no float experts, ever
        m.setattr(mxfp4, "dequantize", lambda *a, **k: pytest.fail("experts decoded"))
        params = engine.load_params()
    resident = _experts(params)
    assert {p.rsplit("/", 1)[-1] for p in resident} == {"qvalue", "scale"}
    assert all(a.dtype == np.uint8 for a in resident.values()), "a float expert array"
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.expert_size
    assert len(resident) == L * 3 * 2
    assert sum(a.nbytes for a in resident.values()) <= 0.3 * L * E * D * F * 3 * 2
    # The down projection's codes are the published bytes, input axis first.
    blocks = written["model.layers.1.mlp.experts.down_proj_blocks"]  # [E, D, F / 32, 16]
    np.testing.assert_array_equal(np.asarray(resident["layers_1/moe/w2/qvalue"]),
                                  blocks.reshape(E, D, F // 2).transpose(0, 2, 1))
    assert params["layers_1"]["self_attn"]["q_proj"].dtype == np.float32  # the rest as before
    results = generate_many(engine, params, parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_mxfp4_experts_over_eight_devices(mxfp4_case):
    """ep_tp on 8 devices places the 4-bit experts as the float ones (experts over
    `expert`, F over `model`: the down projection's packed F axis split in two) and keeps
    transformers' tokens."""
    dst, _, _, want = mxfp4_case
    engine = create_engine(load_hf_config(dst), weights=dst, config=parity_config(),
                           devices=jax.devices()[:8], sharding=load_preset("ep_tp"))
    params = engine.load_params()
    w1, w2 = params["layers_0"]["moe"]["w1"], params["layers_0"]["moe"]["w2"]
    assert tuple(w1["qvalue"].sharding.spec) == ("expert", None, "model")  # [E, D / 2, F]
    assert tuple(w2["qvalue"].sharding.spec) == ("expert", "model", None)  # [E, F / 2, D]
    assert w2["qvalue"].addressable_shards[0].data.shape == (1, 16, 64)  # D = 64
    results = generate_many(engine, params, parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want


def test_quantize_int8_leaves_the_mxfp4_experts(mxfp4_case):
    """`--quantize int8` on an MXFP4 checkpoint quantizes the other kernels and keeps the
    experts' published bytes."""
    dst = mxfp4_case[0]
    engine = create_engine(load_hf_config(dst), weights=dst, devices=jax.devices()[:1],
                           config=parity_config(quantize="int8"))
    layer = engine.load_params()["layers_1"]
    assert layer["self_attn"]["q_proj"]["qvalue"].dtype == np.int8
    assert all(layer["moe"][w][k].dtype == np.uint8 for w in ("w1", "w3", "w2")
               for k in ("qvalue", "scale"))


def test_shard_report_gives_mxfp4_bytes_per_parameter(mxfp4_case, capsys):
    """`jetserve shard-report` counts the experts' parameters (two per byte) and their
    bytes (codes and one exponent per 32): 0.53125 bytes per parameter."""
    dst = mxfp4_case[0]
    cfg = load_hf_config(dst)
    assert cli.main(["shard-report", "--model", dst, "--no-measure", "--hardware", "tpu-v5e",
                     "--max-seq-len", "64", "--json"]) == 0
    rows = {r["storage"]: r for r in json.loads(capsys.readouterr().out)["param_storage"]}
    assert rows["mxfp4"]["params"] == cfg.num_layers * cfg.num_experts * cfg.hidden_size \
        * cfg.expert_size * 3
    assert rows["mxfp4"]["bytes_per_param"] == 0.5 + 1 / 32
    assert rows["float32"]["bytes_per_param"] == 4
    assert sum(r["params"] for r in rows.values()) == cfg.param_count()


def test_mxfp4_decodes_each_code_and_scale():
    """Byte 0x2F holds code 0xF (-6.0) first and 0x2 (1.0) second, byte 0x97 code 0x7
    (6.0) and 0x9 (-0.5); a scale of 130 is 2^3, of 125 is 2^-2."""
    blocks = np.zeros((2, 1, 16), np.uint8)
    blocks[0, 0, 0], blocks[1, 0, 15] = 0x2F, 0x97
    got = mxfp4.dequantize(blocks, np.array([[130], [125]], np.uint8))
    assert got.shape == (2, 32)
    assert (got[0, :2] == [-48.0, 8.0]).all() and not got[0, 2:].any()
    assert (got[1, 30:] == [1.5, -0.125]).all() and not got[1, :30].any()
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(blocks.astype(np.int8), np.zeros((2, 1), np.uint8))


def test_unimplemented_paths_and_fields_are_refused(case):
    d, _, _ = case
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="quantization_config"):
        from_hf_config({**hf, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="quantization_config"):
        from_hf_config({**hf, "model_type": "llama",
                        "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="sinks=True"):
        resolve_attention("pallas_tpu", "tpu", None, 1, sinks=True)
    assert resolve_attention("auto", "tpu", None, 1, sinks=True) == "xla"
    no_bias = from_hf_config({**hf, "attention_bias": False})
    assert not (no_bias.qkv_bias or no_bias.o_bias) and no_bias.attn_sinks


def test_published_config_reads_as_the_plan_preset():
    """gpt-oss-20b's config.json as released (top-level rope_theta and rope_scaling, an
    MXFP4 quantization_config, fields for training only) reads as `plan`'s preset."""
    from jetserve.model_presets import MODEL_PRESETS

    hf = {"architectures": ["GptOssForCausalLM"], "attention_bias": True,
          "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
          "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
          "initial_context_length": 4096, "initializer_range": 0.02,
          "intermediate_size": 2880,
          "layer_types": ["sliding_attention", "full_attention"] * 12,
          "max_position_embeddings": 131072, "model_type": "gpt_oss",
          "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
          "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
          "pad_token_id": 199999, "quantization_config": {
              "modules_to_not_convert": ["model.layers.*.self_attn",
                                         "model.layers.*.mlp.router", "model.embed_tokens",
                                         "lm_head"], "quant_method": "mxfp4"},
          "rms_norm_eps": 1e-05, "rope_scaling": {
              "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
              "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
          "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
          "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
          "vocab_size": 201088}
    cfg = from_hf_config(hf)
    preset = MODEL_PRESETS["gpt-oss-20b"]
    assert cfg == dataclasses.replace(preset, eos_token_ids=(200002,))
