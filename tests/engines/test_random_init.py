"""Random weights drawn group by group equal the values of one init call over the
whole model (so seeds stay reproducible across the change that split the init)."""

import flax.linen as nn
import jax
import numpy as np

from engines import param_loading
from jetserve.model_loading import build_engine


def _one_call(engine, seed):
    init = jax.jit(lambda key: nn.meta.unbox(param_loading._init(engine.model, key)))
    return init(jax.random.key(seed))


def test_grouped_random_init_equals_one_call(monkeypatch):
    monkeypatch.setattr(param_loading, "INIT_GROUP_BYTES", 1)  # every module its own call
    engine = build_engine("random:tiny", seed=3)
    assert engine.kv_repeat == 1
    assert len(param_loading.init_groups(engine.abstract_params)) == len(engine.abstract_params) > 2
    grouped = engine.load_params()
    whole = _one_call(engine, 3)
    assert jax.tree.structure(grouped) == jax.tree.structure(whole)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grouped)[0],
                            jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    assert next(iter(jax.tree.leaves(grouped))).sharding == next(
        iter(jax.tree.leaves(engine.param_shardings)))


def test_small_model_is_one_group():
    engine = build_engine("random:tiny")
    assert len(param_loading.init_groups(engine.abstract_params)) == 1
