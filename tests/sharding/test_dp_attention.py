"""The dp_ep preset: attention data parallel (the decode batch and the KV cache split by slot
over every device) with the routed experts split over the same devices.

On random-weight directories written by transformers, DeepSeek-V3 (latent attention: one
kv head, which no head split can shard) and Qwen3-MoE (dense layers among the expert
ones): greedy tokens are transformers' (which one device gives: tests/parity) on 4 and 8
fake devices; each device holds 1/n of every KV cache array's bytes (read from its
addressable shards) and E/n experts; the decode step moves no cache between devices;
paged KV and slot counts that do not divide are refused by name.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from engines import create_engine, load_hf_config
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import parity_config, parity_prompts, written_case

STEPS = 12
SLOTS = 8  # divides 4 and 8 devices
CASES = [pytest.param("deepseek_v3", 4, id="deepseek_v3-4"),
         pytest.param("deepseek_v3", 8, id="deepseek_v3-8"),
         pytest.param("qwen3_moe", 4, id="qwen3_moe-4"),
         pytest.param("qwen3_moe", 8, id="qwen3_moe-8", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (model dir, transformers' greedy tokens of each prompt), written once."""
    cache = {}

    def get(family):
        if family not in cache:
            _, d, _, want = written_case(family, tmp_path_factory, parity_prompts(), STEPS)
            cache[family] = d, want
        return cache[family]

    return get


def _engine(d, n, **kw):
    return create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:n],
                         sharding=load_preset("dp_ep"),
                         config=parity_config(max_concurrent_decodes=SLOTS, **kw))


def _assert_split_n_ways(a: jax.Array, n: int, axis: int, what: str) -> None:
    """a lies on n devices, each holding a different 1/n of `axis` (so 1/n of its bytes)."""
    shards = a.addressable_shards
    assert len(shards) == n, what
    assert all(s.data.nbytes * n == a.nbytes for s in shards), (what, a.sharding)
    starts = sorted(s.index[axis].start or 0 for s in shards)
    assert starts == [i * a.shape[axis] // n for i in range(n)], (what, a.sharding)


@pytest.mark.parametrize("family,n", CASES)
def test_tokens_and_shares_per_device(written, family, n):
    d, want = written(family)
    engine = _engine(d, n)
    assert dict(engine.mesh.shape) == {"data": n}
    params = engine.load_params()
    state = engine.init_decode_state()
    caches = jax.tree.leaves((state.k, state.v))
    assert caches
    for a in caches:  # keys [B, K, H, S], values [B, K, S, H] (or [L, B, ...] stacked)
        _assert_split_n_ways(a, n, a.ndim - 4, "kv cache")
    experts = [(jax.tree_util.keystr(p), a) for p, a in
               jax.tree_util.tree_leaves_with_path(params)
               if re.search(r"\['w[123]'\]", jax.tree_util.keystr(p))]
    assert experts
    for name, a in experts:  # [E, ...] or [L, E, ...]: E / n experts on each device
        _assert_split_n_ways(a, n, a.ndim - 3, name)
    # Attention is data parallel: its weights are whole on every device.
    attn = [a for p, a in jax.tree_util.tree_leaves_with_path(params)
            if "attn" in jax.tree_util.keystr(p)]
    assert attn and all(a.sharding.is_fully_replicated for a in attn)
    results = generate_many(engine, params, parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want


def test_decode_step_moves_no_cache(written):
    """The compiled generate step has no collective over an array the size of a layer's
    cache or of a device's share of it: each device attends over its own slots' cache."""
    d, _ = written("deepseek_v3")
    engine = _engine(d, 4)
    state = engine.init_decode_state()
    hlo = engine._generate_jit.lower(engine.load_params(), state, None).compile().as_text()
    collectives = re.findall(
        r"= \w+\[([\d,]*)\]\{[^}]*\} (all-gather|all-reduce|all-to-all|reduce-scatter|"
        r"collective-permute)\(", hlo)
    assert collectives  # the experts' partial outputs are summed over `data`
    cache = jax.tree.leaves(state.k)[0]
    share = cache.addressable_shards[0].data.shape
    for dims, op in collectives:
        size = int(np.prod([int(x) for x in dims.split(",") if x]))
        assert size < int(np.prod(share)), (op, dims, cache.shape)


def test_refusals(written):
    d, _ = written("deepseek_v3")
    with pytest.raises(ValueError, match=r"sharding 'dp_ep' places the KV cache for "
                                         r"kv_layout 'contiguous' only, not 'paged': .*no "
                                         r"slot axis"):
        _engine(d, 4, kv_layout="paged")
    with pytest.raises(ValueError) as e:
        create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:4],
                      sharding=load_preset("dp_ep"),
                      config=parity_config(max_concurrent_decodes=6))
    assert re.search(r"dimension 0 \(cache_batch\) of size 6 does not divide over mesh "
                     r"axis 'data' of size 4 in sharding 'dp_ep'", str(e.value)), str(e.value)
