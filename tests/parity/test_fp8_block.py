"""FP8 block-quantized checkpoints (engines/fp8_block.py) against Hugging Face transformers
loading the same directory (`FineGrainedFP8Config(dequantize=True)`, float32).

The checkpoint is a random-weight deepseek_v3 model (tests/parity/hf_models.py
DEEPSEEK_CONFIGS, with the shapes below) saved by transformers, then written in the
published layout (by fp8_block.quantize; transformers is the reader that checks it): every
attention, MLP, expert and shared-expert linear as float8_e4m3fn with a float32
`weight_scale_inv` per 16 x 16 block; the embeddings, LM head, norms and router as they
were. Blocks of 16 give a tiny model several blocks per matrix. transformers 5.25 derives
the block from the scale grid: it refuses a grid that does not divide the matrix (as
DeepSeek-V3's own kv_a_proj_with_mqa has, 576 rows in blocks of 128) and would misread
one that does with a partial block (24 rows in blocks of 16 read as two blocks of 12), so
every dimension here is a multiple of 16 or a single partial block under 16; partial last
blocks of several are checked against the definition instead. Checked: greedy tokens and
log-probs (1e-4) on the contiguous and paged layouts, and over 4 devices (ep_tp); the MLP
kernels held 8-bit as stored, and so through `jetserve convert` to Orbax; Qwen3 and
Qwen3-MoE in the same layout; refusals by name.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from engines import create_engine, fp8_block, load_hf_config, quantization
from engines.hf_config import from_hf_config
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    assert_logprobs_close,
    hf_greedy,
    make_hf_model,
    parity_config,
    parity_prompts,
)

STEPS = 12
BLOCK = (16, 16)
# q_b_proj 80 x 12, kv_a_proj_with_mqa 15 x 64, kv_b_proj 128 x 7, o_proj 64 x 80, the
# dense MLP 128 x 64, experts and the shared expert 12 x 64 (D = 64).
SHAPES = dict(q_lora_rank=12, kv_lora_rank=7, v_head_dim=20, moe_intermediate_size=12)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}


def _unquantized(name: str) -> bool:
    """The tensors published checkpoints keep at full precision."""
    return (not name.endswith(".weight") or "embed_tokens" in name or "lm_head" in name
            or "norm" in name or name.endswith("mlp.gate.weight"))


def write_fp8_checkpoint(src: str, dst: str, block: tuple[int, int]) -> None:
    """A float safetensors directory rewritten in the published FP8 block layout."""
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    out = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            for name, t in load_file(os.path.join(src, f)).items():
                if _unquantized(name) or t.dim() != 2:
                    out[name] = t
                    continue
                q, s = fp8_block.quantize(t.float().numpy(), block)
                out[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
                out[name + fp8_block.SCALE_SUFFIX] = torch.from_numpy(s)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**FP8_CONFIG, "weight_block_size": list(block)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _written(variant: str, tmp_path_factory, **overrides):
    """(FP8 directory, transformers' model loaded from it, its greedy tokens, the float
    model the checkpoint was written from)."""
    import torch
    import transformers as tf

    src = str(tmp_path_factory.mktemp("float"))
    dst = str(tmp_path_factory.mktemp("fp8"))
    original = make_hf_model(variant, src, **overrides)
    write_fp8_checkpoint(src, dst, BLOCK)
    model = tf.AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=tf.FineGrainedFP8Config(dequantize=True,
                                                         weight_block_size=BLOCK),
        dtype=torch.float32).eval()
    return dst, model, [hf_greedy(model, p, STEPS) for p in parity_prompts()], original


def _generate(d: str, devices: int = 1, sharding=None, **config):
    engine = create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:devices],
                           config=parity_config(**config),
                           **({} if sharding is None else {"sharding": sharding}))
    return generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                         ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return _written("deepseek_v3", tmp_path_factory, **SHAPES)


def test_the_checkpoint_is_quantized_as_published(case):
    """Each attention / MLP / expert linear is fp8 with its block grid of scales; the
    transformers model built from it holds those weights, not the float ones."""
    d, model, _, original = case
    from safetensors import safe_open

    with safe_open(os.path.join(d, "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv" in names
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in names
    assert "model.layers.2.mlp.gate.weight_scale_inv" not in names
    assert "lm_head.weight_scale_inv" not in names
    a = model.model.layers[0].self_attn.kv_b_proj.weight.detach().numpy()
    b = original.model.layers[0].self_attn.kv_b_proj.weight.detach().numpy()
    assert a.shape == b.shape == (128, 7) and not np.array_equal(a, b)
    np.testing.assert_allclose(a, b, atol=0.02)


def test_mlp_kernels_stay_8bit(case):
    """The experts', shared experts' and dense MLP's kernels are held as the file holds
    them (fp8 values, one f32 scale per 16 x 16 block; experts as [E, in, out]); the
    latent attention's, folded into the query and output, are dequantized."""
    import torch
    from safetensors import safe_open

    d = case[0]
    cfg = load_hf_config(d)
    assert (cfg.weight_quant, cfg.quant_group_size) == ("fp8_block", 16)
    engine = create_engine(cfg, weights=d, devices=jax.devices()[:1], config=parity_config())
    flat = {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_leaves_with_path(engine.load_params())}
    kinds = {k: str(v.dtype) for k, v in flat.items() if "layers" in k}
    for name in ("'moe']['w1", "'moe']['w2", "'shared_experts']['up_proj", "'mlp']['down_proj"):
        got = {v for k, v in kinds.items() if f"{name}']['qvalue']" in k}
        assert got == {"float8_e4m3fn"}, (name, got)
    assert {v for k, v in kinds.items() if "kv_b_proj" in k} == {"float32"}
    w1 = np.asarray(flat["['layers_2']['moe']['w1']['qvalue']"])  # [E, D, F]
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        expert = f.get_tensor("model.layers.2.mlp.experts.5.gate_proj.weight")  # [F, D]
    stored = expert.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    assert w1[5].view(np.uint8).tolist() == stored.T.view(np.uint8).tolist()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tokens_and_logprobs(case, layout):
    d, model, want, _ = case
    results = _generate(d, kv_layout=layout)
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


@pytest.mark.slow
def test_experts_over_four_devices(case):
    """ep_tp on 4 devices: the fp8 experts and their block scales split 2 of 8 per device,
    the dense MLP's over the model axis (16-row blocks of 128 rows: whole blocks apiece)."""
    d, _, want, _ = case
    results = _generate(d, devices=4, sharding=load_preset("ep_tp"))
    assert [r.token_ids for r in results] == want


def test_orbax_convert_keeps_fp8(case, tmp_path):
    """`jetserve convert` stores the 8-bit kernels as they are; the Orbax checkpoint loads
    as fp8_block with no flag and gives transformers' tokens."""
    from engines import checkpoint
    from jetserve import cli

    d, _, want, _ = case
    out = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", d, "--to", out]) == 0
    assert checkpoint.read_orbax_config(out).weight_quant == "fp8_block"
    assert [r.token_ids for r in _generate(out)] == want


@pytest.mark.parametrize("variant,layers", [("qwen3_yarn", "scan"), ("qwen3_moe", "auto")])
def test_qwen3_families(variant, layers, tmp_path_factory):
    """Qwen3's and Qwen3-MoE's FP8 releases use the same layout: their q/k/v/o
    (dequantized, heads split as they load), MLPs and experts (kept 8-bit; Qwen3's
    stacked for a scan over its layers)."""
    d, model, want, _ = _written(variant, tmp_path_factory)
    assert load_hf_config(d).weight_quant == "fp8_block"
    results = _generate(d, kv_layout="paged", layers=layers)
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_partial_blocks_follow_the_definition():
    """Several blocks with a partial last one each way (as 576 rows in blocks of 128):
    W[i, j] = fp8[i, j] * scale[i // bm, j // bn]."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(40, 21)).astype(np.float32)
    q, s = fp8_block.quantize(w, (16, 8))
    assert s.shape == (3, 3)
    got = fp8_block.dequantize(q, s, (16, 8))
    want = np.array([[float(q[i, j]) * s[i // 16, j // 8] for j in range(21)]
                     for i in range(40)], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, w, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
    # The same blocks stacked as experts and dequantized in jit, as the decoder does.
    stacked = jax.jit(lambda q, s: quantization.dequantize(q, s, (1,), "fp8_block", 16,
                                                           np.float32))
    q2, s2 = quantization.quantize(np.stack([w, -w]), (1,), "fp8_block", 16)
    np.testing.assert_array_equal(np.asarray(stacked(q2, s2))[1], -fp8_block.dequantize(
        *fp8_block.quantize(w, (16, 16)), (16, 16)))
    # ue8m0 scales stored as their biased exponents: 2^(e - 127).
    e = rng.integers(115, 135, size=s.shape).astype(np.uint8)
    np.testing.assert_array_equal(fp8_block.dequantize(q, fp8_block.scales_f32(e), (16, 8)),
                                  fp8_block.dequantize(q, np.exp2(e - 127.0), (16, 8)))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(3, 2\).*\(3, 3\)"):
        fp8_block.dequantize(q, s[:, :2], (16, 8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block.dequantize(w, s, (16, 8))


def test_unimplemented_settings_are_refused(case):
    d = case[0]
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    for field, value in (("activation_scheme", "static"), ("fmt", "e5m2"),
                         ("scale_fmt", "e5m2"), ("group_size", 4), ("weight_block_size", [128]),
                         ("weight_block_size", None)):
        with pytest.raises(ValueError, match=field):
            from_hf_config({**hf, "quantization_config": {**FP8_CONFIG, field: value}})
    with pytest.raises(ValueError, match="not implemented for glm4_moe"):
        fp8_block.block_size(FP8_CONFIG, "glm4_moe")
