"""Parameters travel between the two layer layouts (engines/param_layout.py): an engine
handed another layout's parameters (per layer from the loop, stacked from the scan)
converts them once and gives its own tokens; `adopt_params` does it by name and refuses a
tree of neither layout, naming what it expected; the checkpoint view is per layer
whatever the engine runs."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, param_layout
from jetserve.offline import generate_many

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PROMPTS = [list(range(1, 22)), [5, 6, 7], [9, 2, 6, 11, 40, 3]]


def _engine(layers):
    config = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48,
                          layers=layers)
    return create_engine(CFG, config=config, devices=jax.devices()[:1], seed=3)


@pytest.fixture(scope="module")
def engines():
    """(loop engine, its params, scan engine, its params): one seed, the same weights."""
    loop, scan = _engine("loop"), _engine("scan")
    assert scan.model_config.scan_layers and not loop.model_config.scan_layers
    return loop, loop.load_params(), scan, scan.load_params()


def _tokens(eng, params):
    res = generate_many(eng, params, PROMPTS, max_tokens=6, ignore_eos=True)
    return [r.token_ids for r in res], np.array([r.logprobs for r in res])


def _assert_same(a: dict, b: dict):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_each_engine_runs_the_other_layouts_params(engines):
    loop, lp, scan, sp = engines
    want, want_lp = _tokens(loop, lp)
    for eng, params in ((scan, lp), (loop, sp), (scan, sp)):
        got, got_lp = _tokens(eng, params)
        assert got == want
        np.testing.assert_allclose(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    # The handed trees are the caller's: converting read them and left them whole.
    _assert_same(scan.checkpoint_params(sp), lp)


def test_adopt_params_converts_between_layouts(engines):
    loop, lp, scan, sp = engines
    stacked = scan.adopt_params(lp)
    _assert_same(stacked, sp)
    placed = jax.tree.map(lambda x: x.sharding, stacked)
    assert placed == scan.param_shardings
    _assert_same(loop.adopt_params(sp), lp)
    assert scan.adopt_params(sp) is sp and loop.adopt_params(lp) is lp
    # Host (numpy) trees convert too.
    _assert_same(scan.adopt_params(jax.tree.map(np.asarray, lp)), sp)


def test_params_of_neither_layout_are_refused(engines):
    loop, lp, scan, sp = engines
    missing = {k: v for k, v in lp.items() if k != "layers_2"}
    with pytest.raises(ValueError, match=r"'layers_0' \.\. 'layers_2' \(per layer\) or "
                                         r"'layers' with a leading axis of 3.*'layers_2/"):
        scan.adopt_params(missing)
    short = {**sp, "layers": jax.tree.map(lambda x: x[:2], sp["layers"])}
    with pytest.raises(ValueError, match=r"neither layer layout.*'layers/[a-z_/]+' is "
                                         r"\(2, [0-9, ]+\), expected \(3, "):
        loop.adopt_params(short)
    with pytest.raises(ValueError, match="neither layer layout"):
        loop.prefill(short, [1, 2, 3], 3)  # the entry points check as they convert


def test_a_tree_handed_again_is_converted_once(engines, monkeypatch):
    loop, lp, scan, sp = engines
    calls = []

    def counting(*args):
        calls.append(args[0])
        return adopt(*args)

    adopt = param_layout.adopt
    monkeypatch.setattr(param_layout, "adopt", counting)
    fresh = dict(lp)  # a tree the engine has not seen (the same arrays)
    _tokens(scan, fresh)  # a prefill per prompt, a generate per step: one conversion
    assert len(calls) == 1 and calls[0] is fresh
    _tokens(scan, sp)  # its own layout: none
    assert len(calls) == 1


def test_the_checkpoint_view_is_per_layer_in_either_layout(engines):
    loop, lp, scan, sp = engines
    abstract = scan.checkpoint_abstract()
    assert "layers" not in abstract and "layers_2" in abstract
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
        lambda a: (a.shape, a.dtype), loop.checkpoint_abstract())
    host = jax.tree.map(np.asarray, lp)  # as a checkpoint stores it
    stacked = scan.params_from_checkpoint(host)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(stacked))
    _assert_same(stacked, sp)
    _assert_same(loop.params_from_checkpoint(host), lp)
