"""`tp` past the kv-head count: each kv head (projections, biases, cache) held by several
devices, weights loaded as stored and repeated, the same greedy tokens as one device.

Random weights, HF safetensors (float, int8, int4), Orbax checkpoints written by
`jetserve convert`, the paged layout, a draft model, and meshes that cannot work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, load_hf_config
from engines.checkpoint import read_orbax_config
from jetserve import cli
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from sharding import ShardingConfig, load_preset
from tests.parity.hf_models import make_hf_model

# 8 query heads, 2 kv heads: tp on 8 devices holds each kv head on 4 of them.
CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=16)
ECFG = dict(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48)
PROMPTS = ([5, 17, 33, 2, 9], [100, 3, 3, 64, 12, 7, 90, 1, 45, 11, 8], [77, 6, 120])


def _tokens(engine, params=None, n=10):
    params = engine.load_params() if params is None else params
    out = generate_many(engine, params, PROMPTS, max_tokens=n, ignore_eos=True)
    return [r.token_ids for r in out]


def _engine(cfg, n, preset="tp", weights=None, **kw):
    return create_engine(cfg, weights=weights, devices=jax.devices()[:n],
                         sharding=load_preset(preset), config=EngineConfig(**ECFG, **kw))


@pytest.fixture(scope="module")
def one_device_tokens():
    tokens = _tokens(_engine(CFG, 1, "replicated"))
    assert all(len(set(t)) > 2 for t in tokens)  # random weights, yet no fixed point
    return tokens


def test_random_weights_on_8_devices_match_one_device(one_device_tokens):
    engine = _engine(CFG, 8)
    assert engine.kv_repeat == 4 and engine.model_config.num_kv_heads == 8
    assert engine.source_config.num_kv_heads == 2
    params = engine.load_params()
    k = params["layers_0"]["self_attn"]["k_proj"]  # [K' = 8, H, D] over model 8
    assert k.shape == (8, 16, 64) and k.sharding.shard_shape(k.shape) == (1, 16, 64)
    # Heads repeated consecutively: device i holds stored head i // 4.
    host = np.asarray(k)
    assert all(np.array_equal(host[i], host[4 * (i // 4)]) for i in range(8))
    assert not np.array_equal(host[0], host[4])
    up = params["layers_0"]["mlp"]["up_proj"]  # every other weight split 8 ways
    assert up.sharding.shard_shape(up.shape)[0] == up.shape[0] // 8
    state = engine.init_decode_state()
    assert state.k[0].shape[1] == 8 and state.k[0].sharding.shard_shape(state.k[0].shape)[1] == 1
    assert _tokens(engine, params) == one_device_tokens
    # The stored view is the one-device model's.
    one = _engine(CFG, 1, "replicated")
    stored = engine.checkpoint_params(params)
    one_stored = one.checkpoint_params(one.load_params())  # per layer, whatever its layers
    assert jax.tree.map(np.shape, stored) == jax.tree.map(np.shape, one_stored)
    np.testing.assert_array_equal(np.asarray(stored["layers_1"]["self_attn"]["v_proj"]),
                                  np.asarray(one_stored["layers_1"]["self_attn"]["v_proj"]))


def test_paged_layout_on_8_devices_matches_one_device(one_device_tokens):
    engine = _engine(CFG, 8, kv_layout="paged", page_size=8)
    pool = engine.init_decode_state().k[0]  # [K', P+1, ps, H]
    assert pool.shape[0] == 8 and pool.sharding.shard_shape(pool.shape)[0] == 1
    assert _tokens(engine) == one_device_tokens


def test_draft_model_with_replicated_target(one_device_tokens):
    """Greedy speculative decoding with a draft model (replicated, its own 1 kv head)
    gives the target's greedy tokens."""
    draft = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    engine = create_engine(CFG, devices=jax.devices()[:8], sharding=load_preset("tp"),
                           config=EngineConfig(**ECFG, speculative="draft:random:x:3"),
                           draft_config=draft)
    assert engine.kv_repeat == 4
    assert _tokens(engine) == one_device_tokens


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """An HF qwen2 model (q/k/v biases): 4 heads, 2 kv heads."""
    d = str(tmp_path_factory.mktemp("kvrep") / "qwen2")
    make_hf_model("qwen2", d)
    return d


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_hf_weights_on_4_devices_match_one_device(qwen2_dir, quantize):
    cfg = load_hf_config(qwen2_dir)
    tp = _engine(cfg, 4, weights=qwen2_dir, quantize=quantize)
    assert tp.kv_repeat == 2
    params = tp.load_params()
    bias = np.asarray(params["layers_0"]["self_attn"]["k_bias"])  # [K' = 4, H]
    assert bias.shape[0] == 4 and np.array_equal(bias[0], bias[1])
    assert not np.array_equal(bias[0], bias[2])
    if quantize != "none":
        q = params["layers_0"]["self_attn"]["v_proj"]["qvalue"]
        assert q.shape[0] == 4 and q.sharding.shard_shape(q.shape)[0] == 1
    one = _engine(cfg, 1, "replicated", weights=qwen2_dir, quantize=quantize)
    assert _tokens(tp, params) == _tokens(one)


def test_convert_keeps_stored_heads_and_orbax_loads_replicated(qwen2_dir, tmp_path):
    out = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", qwen2_dir, "--to", out, "--quantize", "int8"]) == 0
    stored = read_orbax_config(out)
    assert stored.num_kv_heads == 2
    with open(os.path.join(out, "jetserve_model.json")) as f:
        assert json.load(f)["model"]["num_kv_heads"] == 2
    tp = _engine(stored, 4, weights=out, quantize="int8")
    params = tp.load_params()
    scale = params["layers_1"]["self_attn"]["k_proj"]["scale"]  # int8: [K', H]
    assert scale.shape[0] == 4
    one = _engine(stored, 1, "replicated", weights=out, quantize="int8")
    assert _tokens(tp, params) == _tokens(one)


def test_prefix_cache_and_transfer_between_differently_replicated_slices():
    """Prefill with tp on 4 devices (each kv head on 2) and a prefix cache of its own
    blocks; decode paged with tp_kv_batch on 4 others (the 2 heads split, no copies): the
    transfer regroups every prefix, cached or not, and the tokens are one device's."""
    shapes = dict(max_concurrent_decodes=2, max_prefill_length=32, max_seq_len=48)
    devices = jax.devices()
    prefill = create_engine(CFG, devices=devices[:4], sharding=load_preset("tp"),
                            config=EngineConfig(**shapes))
    gen = create_engine(CFG, devices=devices[4:8], sharding=load_preset("tp_kv_batch"),
                        config=EngineConfig(**shapes, kv_layout="paged", page_size=8))
    assert (prefill.kv_repeat, gen.kv_repeat) == (2, 1)
    system = list(range(40, 56))  # two cached blocks of 8
    prompts = [system + [i, 7, 9] for i in (3, 4, 5)]
    one = create_engine(CFG, devices=devices[:1], config=EngineConfig(**shapes))
    want = [r.token_ids for r in generate_many(one, one.load_params(), prompts,
                                               max_tokens=6, ignore_eos=True)]
    config = OrchestratorConfig(prefix_cache_hbm_bytes=1 << 20, prefix_cache_block=8,
                                prefix_cache_key="kvrep")
    with Orchestrator(prefill_engines=[prefill], generate_engines=[gen],
                      prefill_params=[prefill.load_params()],
                      generate_params=[gen.load_params()], config=config) as orch:
        got = [orch.submit(Request(prompt_ids=p, max_tokens=6, ignore_eos=True)).result(
            timeout=300).token_ids for p in prompts]
        s = orch.stats()["prefix_cache"][0]
    assert got == want
    assert s["hits"] == 2 and s["hit_tokens"] == 2 * 16


def test_meshes_that_cannot_work_are_refused():
    # 6 devices: not a multiple of 2 kv heads (nor a divisor of them).
    with pytest.raises(ValueError) as e:
        _engine(CFG, 6)
    msg = str(e.value)
    assert re.search(r"parameter layers_0/self_attn/k_proj: dimension 0 \(kv_heads\) of "
                     r"size 2 does not divide over mesh axis 'model' of size 6 in sharding "
                     r"'tp'", msg), msg
    assert "multiple of num_kv_heads (2) and divides num_heads (8)" in msg
    assert "sizes that work: [1, 2, 4, 8]" in msg
    # 8 devices for 4 query heads: a multiple of the kv heads, but the query heads do
    # not split 8 ways.
    narrow = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"size 8 in sharding 'tp'.* divides num_heads "
                                         r"\(4\); sizes that work: \[1, 2, 4\]"):
        _engine(narrow, 8)
    # A preset that does not ask for replication keeps refusing as before.
    plain = ShardingConfig.from_dict(
        {"mesh": {"model": -1}, "rules": {"heads": "model", "kv_heads": "model"}}, "plain")
    with pytest.raises(ValueError, match=r"use fewer devices \(--devices\) or a preset that "
                                         r"does not split kv_heads"):
        create_engine(CFG, devices=jax.devices()[:4], sharding=plain,
                      config=EngineConfig(**ECFG))


def test_preset_key_is_validated_and_kept():
    cfg = load_preset("tp")
    assert cfg.replicate_kv_heads and cfg.to_dict()["replicate_kv_heads"] is True
    assert "replicate_kv_heads" not in load_preset("tp_kv_batch").to_dict()
    with pytest.raises(ValueError, match="replicate_kv_heads must be true or false, got 'yes'"):
        ShardingConfig.from_dict({"replicate_kv_heads": "yes"}, "bad")


def test_slices_of_two_models_are_refused_naming_both():
    other = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=4, head_dim=16)
    pe, ge = _engine(CFG, 4), _engine(other, 4, "tp_kv_batch")
    with pytest.raises(ValueError, match=r"prefill engine 0 \(sharding 'tp', 4 devices\) "
                                         r"holds 2 kv heads .* generate engine 0 \(sharding "
                                         r"'tp_kv_batch', 4 devices\) holds 4"):
        Orchestrator(prefill_engines=[pe], generate_engines=[ge], prefill_params=[None],
                     generate_params=[None])


def test_generate_cli_on_8_devices_matches_one(capsys, tmp_path):
    """`jetserve generate` of an HF Llama with 8 heads and 2 kv heads, tp on 8 devices."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(tmp_path), safe_serialization=True)

    def run(*extra):
        args = ["generate", "--model", str(tmp_path), "--prompt-ids", "5,17,33,2",
                "--max-tokens", "8", "--ignore-eos", "--json", "--max-seq-len", "64", *extra]
        assert cli.main(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]

    tokens = run("--sharding", "tp", "--devices", "8")
    assert tokens == run("--devices", "1")
    assert len(tokens) == 8 and len(set(tokens)) > 2  # not a degenerate repetition


def test_ep_tp_replicates_kv_heads_of_a_moe_model():
    """ep_tp on 8 devices for 2 experts and 2 kv heads: mesh {expert: 2, model: 4}, each
    kv head held by 2 devices, expert weights split over `expert`; one device's tokens."""
    moe = dataclasses.replace(CFG, num_experts=2, num_experts_per_tok=1)
    want = _tokens(_engine(moe, 1, "replicated"))
    engine = _engine(moe, 8, "ep_tp")
    assert dict(engine.mesh.shape) == {"expert": 2, "model": 4}
    assert engine.kv_repeat == 2 and engine.source_config.num_kv_heads == 2
    params = engine.load_params()
    k = params["layers_0"]["self_attn"]["k_proj"]  # [K' = 4, H, D] over model 4
    assert k.shape == (4, 16, 64) and k.sharding.shard_shape(k.shape) == (1, 16, 64)
    w1 = params["layers_0"]["moe"]["w1"]  # [E, D, F]: one expert per `expert` device
    assert w1.sharding.shard_shape(w1.shape)[0] == 1
    assert _tokens(engine, params) == want
