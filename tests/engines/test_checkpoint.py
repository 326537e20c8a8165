"""Loading weights: HF safetensors (single file and sharded index), Orbax round trip via
`jetserve convert`, and errors that name the file and the tensor."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from engines import EngineConfig, create_engine, load_hf_config
from engines.checkpoint import _V1_TO_V2
from jetserve import cli
from jetserve.offline import generate_many
from tests.parity.hf_models import make_hf_model

ECFG = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=32)
PROMPTS = [[5, 9, 11, 3], [7, 7, 8]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "llama")
    make_hf_model("llama", d)
    return d


def _tokens(model_dir):
    eng = create_engine(load_hf_config(model_dir) if "config.json" in os.listdir(model_dir)
                        and not os.path.exists(os.path.join(model_dir, "jetserve_model.json"))
                        else _orbax_cfg(model_dir), weights=model_dir, config=ECFG)
    return [r.token_ids for r in generate_many(eng, eng.load_params(), PROMPTS, max_tokens=8,
                                               ignore_eos=True)]


def _orbax_cfg(d):
    from engines.checkpoint import read_orbax_config
    return read_orbax_config(d)


def test_orbax_round_trip_gives_identical_tokens(hf_dir, tmp_path):
    src, out = tmp_path / "hf", str(tmp_path / "orbax")
    shutil.copytree(hf_dir, src)
    # What transformers 5 writes beside the weights travels with them.
    (src / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (src / "generation_config.json").write_text('{"temperature": 0.5}')
    assert cli.main(["convert", "--from-hf", str(src), "--to", out]) == 0
    assert os.path.isdir(os.path.join(out, "params"))
    for name in ("chat_template.jinja", "generation_config.json"):
        assert (src / name).read_text() == open(os.path.join(out, name)).read()
    assert _tokens(out) == _tokens(hf_dir)


def test_sharded_safetensors_with_index(hf_dir, tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), d)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _tokens(str(d)) == _tokens(hf_dir)


def _copy_with(hf_dir, tmp_path, edit):
    d = tmp_path / "edited"
    d.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), d)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return str(d)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    d = _copy_with(hf_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    eng = create_engine(load_hf_config(d), weights=d, config=ECFG)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        eng.load_params()


def test_mismatched_shape_is_named(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    d = _copy_with(hf_dir, tmp_path, edit)
    eng = create_engine(load_hf_config(d), weights=d, config=ECFG)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*shape"):
        eng.load_params()


def test_corrupt_safetensors_file_is_named(hf_dir, tmp_path):
    d = tmp_path / "corrupt"
    d.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    eng = create_engine(load_hf_config(str(d)), weights=str(d), config=ECFG)
    with pytest.raises(ValueError, match="model.safetensors"):
        eng.load_params()


def _rewrite_as_v1(out: str) -> None:
    """Rewrites a checkpoint written by this jetserve the way format v1 stored it: every
    dense kernel input-major ([D, N, H] q, [N, H, D] o, [D, F] gate, ...), quantized
    kernels' qvalues and int4 scales alike; int8 scales (output axes only) as they are."""
    params_dir = os.path.join(out, "params")
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(params_dir)

    def back(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        name = keys[-1] if keys[-1] in _V1_TO_V2 else keys[-2] if len(keys) > 1 else None
        order = _V1_TO_V2.get(name)
        if order is None or np.ndim(x) != len(order):
            return np.asarray(x)
        return np.ascontiguousarray(np.transpose(np.asarray(x), np.argsort(order)))

    tree = jax.tree_util.tree_map_with_path(back, tree)
    shutil.rmtree(params_dir)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(params_dir, tree)
    meta_path = os.path.join(out, "jetserve_model.json")
    meta = json.load(open(meta_path))
    assert meta["format"] == "jetserve-orbax-v2"
    meta["format"] = "jetserve-orbax-v1"
    json.dump(meta, open(meta_path, "w"))


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_v1_checkpoint_loads_transposed(hf_dir, tmp_path, quantize):
    """Checkpoints from before kernels were stored output-major still load, to the same
    arrays and the same tokens."""
    out = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", hf_dir, "--to", out, "--quantize", quantize]) == 0
    eng = create_engine(_orbax_cfg(out), weights=out, config=ECFG)
    v2 = eng.load_params()
    before = _tokens(out)
    _rewrite_as_v1(out)
    v1 = eng.load_params()
    flat2, tree2 = jax.tree_util.tree_flatten_with_path(v2)
    flat1, tree1 = jax.tree_util.tree_flatten_with_path(v1)
    assert tree1 == tree2
    moved = 0
    for (p, a), (_, b) in zip(flat2, flat1, strict=True):
        assert a.shape == b.shape and a.sharding == b.sharding, p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
        moved += a.ndim > 1 and "embed" not in str(p)
    assert moved >= 8  # the kernels were there to transpose
    assert _tokens(out) == before


def test_corrupt_or_mismatched_orbax_checkpoint(hf_dir, tmp_path):
    out = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", hf_dir, "--to", out]) == 0
    # A config that disagrees with the stored arrays.
    meta_path = os.path.join(out, "jetserve_model.json")
    meta = json.load(open(meta_path))
    meta["model"]["intermediate_size"] = 96
    json.dump(meta, open(meta_path, "w"))
    eng = create_engine(_orbax_cfg(out), weights=out, config=ECFG)
    with pytest.raises(ValueError, match="cannot restore Orbax checkpoint"):
        eng.load_params()
    # Array data removed.
    shutil.rmtree(os.path.join(out, "params"))
    with pytest.raises(FileNotFoundError, match="params"):
        eng.load_params()


def test_unknown_family_and_missing_config(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="bert"):
        load_hf_config(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_hf_config(str(d))
