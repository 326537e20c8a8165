"""Weight quantization: int8 per channel and int4 group-wise, their error bounds and
packing, quantizing HF weights at load time, `jetserve convert --quantize` (Orbax round
trip), and a tensor-parallel quantized engine."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, load_hf_config, mxfp4
from engines import quantization as qz
from engines.checkpoint import read_orbax_config
from jetserve import cli
from jetserve.offline import generate_many
from jetserve.scheduling.page_planner import with_pages
from sharding import load_preset
from tests.parity.hf_models import make_hf_model

ECFG = dict(max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=48)
PROMPTS = [[5, 9, 11, 3], [7, 7, 8]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("quant") / "llama")
    make_hf_model("llama", d)
    return d


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _tokens(eng, params, n=10):
    return [r.token_ids for r in generate_many(eng, params, PROMPTS, max_tokens=n,
                                               ignore_eos=True)]


@pytest.mark.parametrize("shape,in_axes", [((64, 4, 16), (0,)), ((4, 16, 64), (0, 1)),
                                           ((3, 32, 48), (1,))])
def test_int8_per_channel_error_bound(shape, in_axes):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    w[..., 0] = 0.0  # an all-zero output channel must not divide by zero
    q, s = qz.quantize(w, in_axes, "int8", 0)
    assert q.dtype == np.int8 and q.shape == w.shape
    amax = np.max(np.abs(w), axis=in_axes)
    np.testing.assert_allclose(s, amax / 127, rtol=1e-6)
    dq = np.asarray(qz.dequantize(q, s, in_axes, "int8", 0, np.float32))
    bound = np.expand_dims(s, in_axes) / 2 + 1e-7
    assert np.all(np.abs(dq - w) <= bound)
    assert np.all(dq[..., 0] == 0)


@pytest.mark.parametrize("shape,in_axes,group,g", [((64, 4, 16), (0,), 32, 32),
                                                   ((4, 16, 64), (0, 1), 32, 16),
                                                   ((2, 48, 8), (1,), 32, 16)])
def test_int4_group_error_bound_and_packing(shape, in_axes, group, g):
    w = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    q, s = qz.quantize(w, in_axes, "int4", group)
    a = in_axes[-1]
    assert q.dtype == np.int8 and q.shape[a] == shape[a] // 2  # two values per byte
    assert s.shape[a] == shape[a] // g
    # The host (numpy) and device (jax) quantizers agree (XLA may divide by 7 through a
    # reciprocal: scales within an ulp, values equal unless one sits on a rounding edge).
    qj, sj = qz.quantize(jax.numpy.asarray(w), in_axes, "int4", group, jax.numpy)
    np.testing.assert_allclose(np.asarray(sj), s, rtol=2e-7)
    assert np.mean(np.asarray(qj) != q) < 1e-3
    values = np.asarray(qz.unpack_int4(q, a))
    assert values.min() >= -8 and values.max() <= 7
    dq = np.asarray(qz.dequantize(q, s, in_axes, "int4", group, np.float32))
    scale_full = np.repeat(s, g, axis=a)
    assert np.all(np.abs(dq - w) <= scale_full / 2 + 1e-6)
    # Every value of a group is within its scale's range; the largest hits +-7 or -8.
    wg = np.abs(w).reshape(shape[:a] + (shape[a] // g, g) + shape[a + 1:]).max(axis=a + 1)
    np.testing.assert_allclose(s, wg / 7, rtol=1e-6)


@pytest.mark.parametrize("xp", [np, jax.numpy], ids=["numpy", "jax"])
def test_mxfp4_quantizes_its_own_values_exactly_and_dequantizes_in_jit(xp):
    """Weights that are MXFP4 values already (random codes times 2^(e - 127), decoded by
    the host reader engines/mxfp4.py) come back unchanged through quantize and the jitted
    dequantize, in float32 and bfloat16; other weights land within a unit of their
    block's scale (two where OCP's exponent rule clips the block's largest to 6)."""
    rng = np.random.default_rng(2)
    E, D, F = 2, 64, 6
    blocks = rng.integers(0, 256, (E, F, D // 32, 16), np.uint8)
    scales = rng.integers(118, 131, (E, F, D // 32), np.uint8)
    w = mxfp4.dequantize_transposed(blocks, scales)  # [E, D, F]
    q, s = qz.quantize(xp.asarray(w), (1,), "mxfp4", 0, xp)
    assert q.dtype == np.uint8 and q.shape == (E, D // 2, F)
    assert s.dtype == np.uint8 and s.shape == (E, D // 32, F)
    for dtype in (np.float32, jax.numpy.bfloat16):
        dq = jax.jit(qz.dequantize, static_argnums=(2, 3, 4, 5))(q, s, (1,), "mxfp4", 0, dtype)
        assert dq.dtype == dtype
        np.testing.assert_array_equal(np.asarray(dq, np.float32), w)
    # The checkpoint's own bytes, moved to [E, in, out], decode to the same weights.
    codes, exps = mxfp4.transpose_packed(blocks, scales)
    np.testing.assert_array_equal(
        np.asarray(qz.dequantize(codes, exps, (1,), "mxfp4", 0, np.float32)), w)
    v = rng.normal(size=(E, D, F)).astype(np.float32)
    q, s = qz.quantize(xp.asarray(v), (1,), "mxfp4", 0, xp)
    dv = np.asarray(qz.dequantize(q, s, (1,), "mxfp4", 0, np.float32))
    unit = np.repeat(2.0 ** (np.asarray(s, np.float32) - 127), 32, axis=1)
    # Codes 4 and 6 are 2 units apart, and values up to 8 units clip to 6 (OCP's rule).
    assert np.all(np.abs(dv - v) <= 2 * unit + 1e-7)
    assert np.mean(np.abs(dv - v) <= unit + 1e-7) > 0.95
    with pytest.raises(ValueError, match="multiple of 32"):
        qz.layout((2, 48, 4), (None,) * 3, (1,), "mxfp4", 0, "w1")


def test_random_mxfp4_experts_are_the_float_ones_quantized():
    """Random weights of a model whose experts are stored MXFP4 are the float model's of
    the same seed, its experts quantized and every other weight as it is."""
    cfg = ModelConfig(family="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2)
    ec = EngineConfig(**ECFG)
    plain = create_engine(cfg, config=ec, devices=jax.devices()[:1])
    eng = create_engine(dataclasses.replace(cfg, expert_quant="mxfp4"), config=ec,
                        devices=jax.devices()[:1])
    params = eng.load_params()
    got = _np(eng.checkpoint_params(params))  # per layer, as checkpoints hold them
    assert got["layers_0"]["moe"]["w2"]["qvalue"].shape == (4, 16, 64)  # [E, F / 2, D]
    want = qz.quantize_params(_np(plain.checkpoint_params(plain.load_params())), "mxfp4",
                              0, np, qz.EXPERT_KERNELS)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert _tokens(eng, params, 4)  # the step runs on them


def test_bad_quantize_settings_are_named():
    with pytest.raises(ValueError, match="quantize must be one of"):
        EngineConfig(quantize="int3")
    with pytest.raises(ValueError, match="group size must be an even integer"):
        EngineConfig(quantize="int4", quant_group_size=7)
    # An odd input dimension (down_proj's F = 25) cannot pack two int4 values per byte.
    # (An odd head_dim is refused before, by the config: RoPE rotates pairs of dims.)
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=25, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="down_proj.*must be even"):
        create_engine(cfg, config=EngineConfig(quantize="int4", **ECFG),
                      devices=jax.devices()[:1])


def test_hf_weights_quantized_at_load_time(hf_dir):
    cfg = load_hf_config(hf_dir)
    plain = create_engine(cfg, weights=hf_dir, config=EngineConfig(**ECFG),
                          devices=jax.devices()[:1])
    # Compared as a checkpoint stores them (per layer), whichever layer layout each
    # engine runs (the float one may scan, engines/layer_scan.py use_scan).
    float_params = plain.checkpoint_params(plain.load_params())
    for scheme in ("int8", "int4"):
        eng = create_engine(cfg, weights=hf_dir, devices=jax.devices()[:1],
                            config=EngineConfig(quantize=scheme, **ECFG))
        params = _np(eng.checkpoint_params(eng.load_params()))
        want = _np(qz.quantize_params(_np(float_params), scheme, qz.DEFAULT_GROUP, np))
        assert jax.tree.structure(params) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        q_proj = params["layers_0"]["self_attn"]["q_proj"]
        assert q_proj[qz.QVALUE].dtype == np.int8  # no float copy is kept
        # Kernel bytes: int8 a quarter of f32 plus one scale per channel; int4 an eighth
        # plus one scale per 32 weights (the embedding and norms stay f32).
        layer, float_layer = params["layers_0"], _np(float_params)["layers_0"]
        ratio = qz.param_bytes(layer) / qz.param_bytes(float_layer)
        assert (0.25 < ratio < 0.27) if scheme == "int8" else (0.125 < ratio < 0.17), ratio


def test_convert_quantized_orbax_round_trip(hf_dir, tmp_path, capsys):
    cfg = load_hf_config(hf_dir)
    on_load = create_engine(cfg, weights=hf_dir, devices=jax.devices()[:1],
                            config=EngineConfig(quantize="int4", quant_group_size=16,
                                                **ECFG))
    want_params = on_load.load_params()
    out = str(tmp_path / "int4")
    assert cli.main(["convert", "--from-hf", hf_dir, "--to", out, "--quantize", "int4",
                     "--quant-group-size", "16"]) == 0
    meta = json.load(open(os.path.join(out, "jetserve_model.json")))["model"]
    assert (meta["weight_quant"], meta["quant_group_size"]) == ("int4", 16)
    stored = read_orbax_config(out)
    eng = create_engine(stored, weights=out, config=EngineConfig(**ECFG),
                        devices=jax.devices()[:1])
    params = eng.load_params()
    got, want = jax.tree.leaves(_np(params)), jax.tree.leaves(_np(want_params))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    want_tokens = _tokens(eng, params)
    assert want_tokens == _tokens(on_load, want_params)
    # The CLI loads the checkpoint quantized with no flag, through the orchestrator.
    capsys.readouterr()
    assert cli.main(["generate", "--model", out, "--prompt-ids", "5,9,11,3", "--max-tokens",
                     "10", "--ignore-eos", "--json", "--max-concurrent-decodes", "2",
                     "--max-prefill-length", "16", "--max-seq-len", "48"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["token_ids"] == want_tokens[0]
    with pytest.raises(ValueError, match="holds int4 weights .* cannot load them as int8"):
        create_engine(stored, weights=out, config=EngineConfig(quantize="int8", **ECFG))


@pytest.mark.slow
def test_tp_quantized_engine_matches_one_device(hf_dir):
    cfg = load_hf_config(hf_dir)  # 4 heads, 2 kv heads, F 128
    for scheme in ("int8", "int4"):
        ec = EngineConfig(quantize=scheme, **ECFG)
        one = create_engine(cfg, weights=hf_dir, config=ec, devices=jax.devices()[:1])
        tp = create_engine(cfg, weights=hf_dir, config=ec, devices=jax.devices()[:2],
                           sharding=load_preset("tp"))
        tp_params = tp.load_params()
        down = tp_params["layers_0"]["mlp"]["down_proj"][qz.QVALUE]
        assert down.sharding.shard_shape(down.shape)[1] == down.shape[1] // 2  # split over F
        assert _tokens(tp, tp_params) == _tokens(one, one.load_params())


@pytest.mark.parametrize("family", ["mixtral", "gemma", "qwen2"])
def test_every_family_quantizes_its_kernels(family, tmp_path):
    """MoE experts, Gemma's tied head (the embedding stays float) and Qwen2's biases."""
    d = str(tmp_path / family)
    make_hf_model(family, d)
    cfg = load_hf_config(d)
    plain = create_engine(cfg, weights=d, config=EngineConfig(**ECFG),
                          devices=jax.devices()[:1])
    eng = create_engine(cfg, weights=d, config=EngineConfig(quantize="int4", **ECFG),
                        devices=jax.devices()[:1])
    params = _np(eng.checkpoint_params(eng.load_params()))  # per layer, either layout
    want = _np(qz.quantize_params(_np(plain.checkpoint_params(plain.load_params())), "int4",
                                  qz.DEFAULT_GROUP, np))
    assert jax.tree.structure(params) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    quantized = {str(path[-2].key) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
                 if path[-1].key == qz.QVALUE}
    expect = {"mixtral": {"w1", "w2", "w3", "q_proj", "lm_head"},
              "gemma": {"q_proj", "o_proj", "down_proj"},
              "qwen2": {"q_proj", "k_proj", "v_proj", "gate_proj"}}[family]
    assert expect <= quantized
    assert params["embed_tokens"].dtype == np.float32
    assert ("lm_head" in quantized) == (not cfg.tie_word_embeddings)


def test_paged_engine_with_quantized_weights(hf_dir):
    cfg = load_hf_config(hf_dir)
    want = create_engine(cfg, weights=hf_dir, devices=jax.devices()[:1],
                         config=EngineConfig(quantize="int8", **ECFG))
    paged = with_pages(create_engine(cfg, weights=hf_dir, devices=jax.devices()[:1],
                                     config=EngineConfig(quantize="int8", kv_layout="paged",
                                                         page_size=8, **ECFG)))
    assert paged.kv_pages is not None  # the paged engine, not the contiguous one
    params = paged.load_params()
    assert params["layers_1"]["mlp"]["up_proj"][qz.QVALUE].dtype == np.int8
    assert _tokens(paged, params) == _tokens(want, want.load_params())
