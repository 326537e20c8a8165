"""Golden PartitionSpecs of parameters, decode state and prefixes per family x preset.

A layout change shows up here as a diff of tests/sharding/golden/<family>__<preset>.json.
After an intended change, regenerate and review the diff:

    JETSERVE_UPDATE_GOLDEN=1 pytest tests/sharding/test_golden_specs.py

Building an engine compiles nothing, so the whole matrix is cheap.
"""

from __future__ import annotations

import json
import os

import jax
import pytest
from jax.sharding import NamedSharding

from jetserve.shard_report import decode_state_layouts, param_layouts, sharded_fraction, spec_json
from tests.sharding import families

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
UPDATE = os.environ.get("JETSERVE_UPDATE_GOLDEN") == "1"


def _spec(spec) -> str:
    """One line per tensor in the golden files: "('data', None, 'model', None)"."""
    return repr(tuple(spec))


def _prefix_specs(engine) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(
        engine.prefix_destination_sharding(), is_leaf=lambda x: isinstance(x, NamedSharding))[0]
    return {jax.tree_util.keystr(p): _spec(s.spec) for p, s in flat}


def snapshot(family: str, preset: str, n: int) -> dict:
    try:
        engine = families.make_engine(family, preset, jax.devices()[:n])
    except ValueError as e:
        return {"error": str(e)}
    out = {
        "mesh": dict(engine.mesh.shape),
        "params": {t.name: _spec(t.spec) for t in param_layouts(engine)},
        "decode_state": {t.name: _spec(t.spec) for t in decode_state_layouts(engine)},
        "prefix": _prefix_specs(engine),
    }
    if engine.kv_repeat > 1:
        out["kv_head_replication"] = _replicated_shapes(engine)
    return out


def _replicated_shapes(engine) -> dict:
    """Where tp holds each kv head on several devices: how many copies, and the global and
    per-device shapes of the tensors that carry them."""
    kv = [t for t in param_layouts(engine) + decode_state_layouts(engine)
          if t.kind == "kv_cache" or t.name.endswith(("k_proj", "v_proj", "k_bias", "v_bias"))]
    sh = {**{t.name: s for t, s in zip(param_layouts(engine), jax.tree.leaves(
        engine.param_shardings), strict=True)},
          **{t.name: s for t, s in zip(decode_state_layouts(engine), jax.tree.leaves(
              engine.decode_state_shardings()), strict=True)}}
    return {"copies_of_each_kv_head": engine.kv_repeat,
            "stored_kv_heads": engine.source_config.num_kv_heads,
            "shapes": {t.name: f"{t.shape}, per device {sh[t.name].shard_shape(t.shape)}"
                       for t in kv}}


@pytest.mark.parametrize("preset", families.PRESET_NAMES)
@pytest.mark.parametrize("family", families.FAMILIES)
def test_golden_specs(family, preset):
    got = {str(n): snapshot(family, preset, n) for n in families.DEVICE_COUNTS}
    path = os.path.join(GOLDEN_DIR, f"{family}__{preset}.json")
    if UPDATE:
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
    assert os.path.exists(path), f"{path} missing: run with JETSERVE_UPDATE_GOLDEN=1"
    with open(path) as f:
        want = json.load(f)
    assert got == want


def _tp_devices(family: str) -> int | None:
    return next((n for n in (8, 4, 2) if families.expected_error(family, "tp", n) is None), None)


# gemma here has one kv head (MQA): tp cannot split it on any number of devices.
@pytest.mark.parametrize("family", [f for f in families.FAMILIES if _tp_devices(f)])
def test_tp_shards_most_parameter_bytes(family):
    """Under tp at least 90% of parameter bytes are split, wherever tp fits the model."""
    n = _tp_devices(family)
    engine = families.make_engine(family, "tp", jax.devices()[:n])
    layouts = param_layouts(engine)
    assert sharded_fraction(layouts) >= 0.9, {t.name: t.spec for t in layouts}
    # The unsplit ones are the small vectors (norms), never a matrix.
    assert all(t.sharded for t in layouts if len(t.shape) >= 2 and "router" not in t.name)


def test_tp_kv_batch_splits_cache_by_kv_heads_then_batch():
    """8 devices, 4 kv heads: keys[B_data, K_model, H, S], values[B_data, K_model, S, H]
    with data 2, model 4."""
    engine = families.make_engine("llama3", "tp_kv_batch", jax.devices()[:8])
    assert dict(engine.mesh.shape) == {"data": 2, "model": 4}
    kv = [t for t in decode_state_layouts(engine) if t.kind == "kv_cache"]
    assert {tuple(spec_json(t.spec)) for t in kv} == {("data", "model", None, None)}
    # Every device holds 1/8 of the cache.
    assert all(t.bytes_per_device * 8 == t.bytes for t in kv)
