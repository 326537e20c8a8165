"""A small Orbax checkpoint read without orbax (engines/ocdbt_reader.py): the same
arrays on the same shardings as orbax's restore, and orbax whenever the case is not the
plain one."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from engines import EngineConfig, create_engine, ocdbt_reader
from engines.checkpoint import read_orbax_config
from jetserve import cli
from sharding import load_preset
from tests.engines.test_checkpoint import _rewrite_as_v1
from tests.parity.hf_models import make_hf_model

ECFG = EngineConfig(max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ocdbt") / "llama")
    make_hf_model("llama", d)
    return d


def _convert(hf_dir, out, quantize="none") -> str:
    assert cli.main(["convert", "--from-hf", hf_dir, "--to", out, "--quantize", quantize]) == 0
    return out


def _engine(out, devices=2):
    return create_engine(read_orbax_config(out), weights=out, config=ECFG,
                         devices=jax.devices()[:devices], sharding=load_preset("tp"))


def _assert_same(a_tree, b_tree):
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a_tree)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b_tree)
    assert tree_a == tree_b
    for (p, a), (_, b) in zip(flat_a, flat_b, strict=True):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding), p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))


@pytest.mark.parametrize("quantize,v1", [("none", False), ("int4", False), ("int8", True)])
def test_reads_what_orbax_restores(hf_dir, tmp_path, monkeypatch, quantize, v1):
    out = _convert(hf_dir, str(tmp_path / "orbax"), quantize)
    if v1:  # stored input-major: transposed on the host instead of in a program
        _rewrite_as_v1(out)
    eng = _engine(out)
    with monkeypatch.context() as m:  # orbax must not be asked
        m.setattr(ocp, "StandardCheckpointer", None)
        direct = eng.load_params()
    monkeypatch.setattr(ocdbt_reader, "MAX_BYTES", 0)  # too big: orbax restores
    _assert_same(direct, eng.load_params())
    down = direct["layers_0"]["mlp"]["down_proj"]
    down = down if quantize == "none" else down["qvalue"]
    assert down.sharding.shard_shape(down.shape)[1] == down.shape[1] // 2  # tp over F


def test_anything_but_the_plain_case_is_left_to_orbax(hf_dir, tmp_path, monkeypatch):
    out = _convert(hf_dir, str(tmp_path / "orbax"))
    params_dir = os.path.join(out, "params")
    target = _engine(out, devices=1).checkpoint_abstract()  # per layer, as stored
    assert ocdbt_reader.read_small(params_dir, target) is not None
    # A leaf the checkpoint lacks, and one it has that the target does not.
    extra = {**target, "not_stored": target["embed_tokens"]}
    assert ocdbt_reader.read_small(params_dir, extra) is None
    fewer = {k: v for k, v in target.items() if k != "embed_tokens"}
    assert ocdbt_reader.read_small(params_dir, fewer) is None
    # A shape or dtype the stored array does not have.
    emb = target["embed_tokens"]
    for wrong in (jax.ShapeDtypeStruct((emb.shape[0] + 1, emb.shape[1]), emb.dtype),
                  jax.ShapeDtypeStruct(emb.shape, np.int8)):
        assert ocdbt_reader.read_small(params_dir, {**target, "embed_tokens": wrong}) is None
    # Larger than the cap.
    monkeypatch.setattr(ocdbt_reader, "MAX_BYTES", 1024)
    assert ocdbt_reader.read_small(params_dir, target) is None
    monkeypatch.undo()
    # Not one OCDBT database (an older orbax layout).
    os.remove(os.path.join(params_dir, "manifest.ocdbt"))
    assert ocdbt_reader.read_small(params_dir, target) is None
