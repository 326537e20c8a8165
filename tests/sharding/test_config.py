"""Presets, mesh sizes, validation messages and activation constraints (no engine compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jetserve import distributed
from jetserve.model_loading import build_engine
from sharding import PRESETS, ShardingConfig, axes, constrain, layout, load_preset, traced_under


def test_every_bundled_preset_loads():
    for name in PRESETS:
        cfg = load_preset(name)
        assert cfg.name == name and cfg.rules is not None
    assert load_preset(load_preset("tp")) == load_preset("tp")


@pytest.mark.parametrize("kv_heads,n,want", [
    (4, 8, {"data": 2, "model": 4}),   # more devices than kv heads: the rest split slots
    (8, 8, {"data": 1, "model": 8}),
    (2, 8, {"data": 4, "model": 2}),
    (1, 4, {"data": 4, "model": 1}),   # MQA: pure batch split
    (4, 6, {"data": 3, "model": 2}),   # model takes a divisor of the devices
])
def test_tp_kv_batch_sizes_model_by_kv_heads(kv_heads, n, want):
    dims = {"num_kv_heads": kv_heads, "num_heads": 8, "num_experts": 0}
    assert load_preset("tp_kv_batch").mesh_shape(n, dims) == want


def test_ep_tp_and_seq_tp_sizes():
    assert load_preset("ep_tp").mesh_shape(8, {"num_experts": 4, "num_heads": 8,
                                               "num_kv_heads": 4}) == {"expert": 4, "model": 2}
    assert load_preset("ep_tp").mesh_shape(8, {"num_experts": 0, "num_heads": 8,
                                               "num_kv_heads": 8}) == {"expert": 1, "model": 8}
    assert load_preset("seq_tp").mesh_shape(8, {"num_kv_heads": 2, "num_heads": 8,
                                                "num_experts": 0}) == {"seq": 4, "model": 2}


def test_dp_ep_splits_slots_and_experts_over_every_device():
    cfg = load_preset("dp_ep")
    assert cfg.mesh_shape(8) == {"data": 8}
    assert {a: cfg.split_count(a, 8) for a in (axes.CACHE_BATCH, axes.BATCH, axes.EXPERT,
                                               axes.HEADS, axes.KV_HEADS, axes.MLP)} == {
        "cache_batch": 8, "batch": 8, "expert": 8, "heads": 1, "kv_heads": 1, "mlp": 1}
    assert cfg.kv_layouts == ("contiguous",) and load_preset("tp").kv_layouts == (
        "contiguous", "paged")
    assert load_preset(cfg) == cfg and ShardingConfig.from_dict(cfg.to_dict(), "dp_ep") == cfg


@pytest.mark.parametrize("yaml_text,message", [
    ("mesh: {model: -1}\nrules: {hedas: model}\n", "unknown logical axis 'hedas' in rules"),
    ("mesh: {model: -1}\nrules: {heads: modle}\n", "rule heads: 'modle' names a mesh axis that is not in the mesh"),
    ("mesh: {a: -1, b: -1}\n", "only one mesh axis may be -1"),
    ("mesh: {model: 0}\n", "mesh axis 'model' size must be an integer >= 1, -1, or one of"),
    ("mesh: {model: kv}\n", "mesh axis 'model' size must be"),
    ("mesh: {model: -1}\nrules: {heads: [model, data]}\n", "rule heads: expected one mesh axis name"),
    ("mesh: {model: -1}\nlayout: {}\n", "unknown keys ['layout']"),
    ("mesh: {model: -1}\nkv_layouts: paged\n", "kv_layouts must be a list of ('contiguous', 'paged')"),
    ("mesh: {model: -1}\nkv_layouts: [pagd]\n", "kv_layouts must be a non-empty list of"),
    ("mesh: {model: -1}\nkv_layouts: []\n", "kv_layouts must be a non-empty list of"),
    ("- just\n- a list\n", "must hold a mapping with mesh and rules"),
    ("mesh: {model: -1\n", "is not valid YAML"),
])
def test_bad_yaml_is_rejected_with_the_reason(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError) as e:
        load_preset(str(path))
    assert message in str(e.value)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown sharding 'tq': not a preset \(replicated, tp"):
        load_preset("tq")


def _mesh(shape: dict[str, int]):
    return jax.make_mesh(tuple(shape.values()), tuple(shape.keys()),
                         devices=jax.devices()[: int(np.prod(list(shape.values())))])


def test_spec_errors_name_tensor_dimension_and_axis():
    cfg = ShardingConfig(name="bad", mesh=(("model", 4),),
                         rules=(("embed", "model"), ("mlp", "model"), ("vocab", "model")))
    mesh = _mesh({"model": 4})
    with pytest.raises(ValueError) as e:
        cfg.spec((axes.EMBED, axes.MLP), (64, 128), mesh, "parameter layers_0/mlp/up_proj")
    assert str(e.value).startswith(
        "parameter layers_0/mlp/up_proj: mesh axis 'model' is used by dimension 0 (embed) and "
        "dimension 1 (mlp) in sharding 'bad'")
    with pytest.raises(ValueError) as e:
        cfg.spec((axes.VOCAB, None), (30, 64), mesh, "parameter embed_tokens")
    assert str(e.value).startswith(
        "parameter embed_tokens: dimension 0 (vocab) of size 30 does not divide over mesh axis "
        "'model' of size 4 in sharding 'bad'")
    with pytest.raises(ValueError, match=r"kv cache: dimension 1 has unknown logical axis 'sequence'"):
        cfg.spec((None, "sequence"), (2, 8), mesh, "kv cache")
    with pytest.raises(ValueError, match=r"x: 1 logical names \('vocab',\) for a tensor of rank 2"):
        cfg.spec((axes.VOCAB,), (8, 8), mesh, "x")
    # Activation hints leave a dimension whole instead of failing.
    assert cfg.spec((axes.VOCAB, None), (30, 64), mesh, "logits", strict=False) == P(None, None)
    # A mesh axis of size 1 splits nothing.
    one = _mesh({"model": 1})
    assert cfg.spec((axes.VOCAB, None), (30, 64), one) == P(None, None)


def test_mesh_needs_the_devices_it_names():
    cfg = ShardingConfig(name="fixed", mesh=(("expert", 2), ("model", 4)))
    with pytest.raises(ValueError, match=r"needs a multiple of 8 devices, got 4"):
        cfg.make_mesh(jax.devices()[:4])
    cfg = ShardingConfig(name="derived", mesh=(("model", "num_kv_heads"),))
    with pytest.raises(ValueError, match=r"uses 2 of the 8 devices; give 2 devices or add a -1"):
        cfg.make_mesh(jax.devices(), {"num_kv_heads": 2})
    with pytest.raises(ValueError, match=r"takes its size from num_kv_heads, which was not given"):
        cfg.make_mesh(jax.devices())


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match=r"--devices 9: only 8 cpu devices exist"):
        distributed.select_devices(9)
    assert len(distributed.select_devices(3)) == 3
    with pytest.raises(ValueError, match=r"--process-id, --num-processes need --coordinator|"
                                         r"--num-processes, --process-id need --coordinator"):
        distributed.initialize(None, 2, 0)
    with pytest.raises(ValueError, match=r"--coordinator needs --num-processes and --process-id"):
        distributed.initialize("127.0.0.1:1234", None, None)
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 2\), got 2"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


def test_constrain_is_a_no_op_outside_a_layout():
    x = jnp.ones((2, 8, 16))
    assert constrain(x, (axes.BATCH, axes.SEQ, axes.VOCAB)) is x


def test_constrain_pins_activations_under_a_layout():
    cfg = load_preset("tp")
    mesh = cfg.make_mesh(jax.devices()[:4])

    def f(x):  # elementwise: nothing else decides the output's layout
        return constrain(x * 2.0, (axes.BATCH, axes.SEQ, axes.VOCAB), "logits")

    x = jnp.ones((1, 4, 32))
    out = jax.jit(traced_under(cfg, mesh, f))(x)
    assert out.sharding.spec == P(None, None, "model")
    assert len({s.device for s in out.addressable_shards}) == 4
    # The layout ends with the traced call; outside it constrain is a no-op again.
    plain = jax.jit(f)(x)
    assert plain.sharding.is_fully_replicated
    with layout(cfg, mesh):
        odd = jax.jit(f)(jnp.ones((1, 4, 30)))  # 30 over 4: left whole, no error
    assert odd.sharding.is_fully_replicated


def test_build_engine_takes_names_paths_and_configs(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("mesh: {model: -1}\nrules: {heads: model, kv_heads: model, mlp: model}\n")
    devices = jax.devices()[:2]
    by_name = build_engine("random:tiny", sharding="tp", devices=devices)
    by_path = build_engine("random:tiny", sharding=str(path), devices=devices)
    by_cfg = build_engine("random:tiny", sharding=load_preset("tp"), devices=devices)
    assert by_name.sharding == by_cfg.sharding
    assert by_path.sharding.name == "mine" and dict(by_path.mesh.shape) == {"model": 2}
