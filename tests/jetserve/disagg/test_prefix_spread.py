"""Spreading a prefix from one device over a generate engine's layout (prefix_spread.py),
in one process: the blocks each process needs, the global prefix generating what a local
prefill does, and the agreement that drops a prefix some process lacks. (Over two
processes: tests/e2e/test_split_decode_processes.py.)"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jetserve.disagg.prefix_spread import PrefixSpreader, SpreadFailed, blocks_of
from jetserve.model_loading import build_engine
from tests.jetserve.disagg.prefix_sender import ENGINE
from tests.jetserve.disagg.test_kv_transfer import _greedy


def test_blocks_of_lists_each_distinct_block_once_with_its_devices():
    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
    split = NamedSharding(mesh, PartitionSpec(None, "b"))
    # Axis "a" replicates: each column block is held by two devices.
    assert blocks_of(split, (4, 6), 0) == [
        (((0, 4), (0, 3)), [devices[0], devices[2]]),
        (((0, 4), (3, 6)), [devices[1], devices[3]])]
    assert blocks_of(split, (4, 6), 1) == []  # no device of process 1 in this mesh
    whole = NamedSharding(mesh, PartitionSpec())
    assert blocks_of(whole, (3,), 0) == [(((0, 3),), devices)]


@pytest.fixture(scope="module")
def engine():
    return build_engine("random:tiny", devices=jax.devices()[:4], sharding="tp_kv_batch",
                        engine_config=ENGINE)


def _local_prefix(engine, params, spreader, prompt):
    ids = np.asarray(prompt, np.int32)
    prefix, _ = engine.prefill(params, ids, len(ids))
    return jax.device_put(prefix, spreader.local_sharding())


def test_spread_prefix_is_laid_out_as_the_engine_takes_it_and_generates_alike(engine):
    params = engine.load_params()
    spreader = PrefixSpreader(engine)
    prompt = [5, 17, 42, 9, 88, 3]
    local = _local_prefix(engine, params, spreader, prompt)
    assert {d for x in jax.tree.leaves(local) for d in x.sharding.device_set} == {
        spreader.device}
    turn, held = spreader.offer(local)
    assert turn["offered"] and held == []  # one process: nothing to register
    spread = spreader.take(turn, local)
    for got, want in zip(jax.tree.leaves(spread),
                         jax.tree.leaves(engine.prefix_destination_sharding()), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    for got, mine in zip(jax.tree.leaves(spread), jax.tree.leaves(local), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(mine))
    ids = np.asarray(prompt, np.int32)
    own, _ = engine.prefill(params, ids, len(ids))
    assert _greedy(engine, params, spread, 6) == _greedy(engine, params, own, 6)
    assert (spreader.spread, spreader.failed) == (1, 0)


def test_a_prefix_some_process_lacks_is_dropped_by_all(engine):
    params = engine.load_params()
    votes = []
    spreader = PrefixSpreader(engine, agree=lambda ok, name, timeout_s: votes.append(ok) or False)
    local = _local_prefix(engine, params, spreader, [7] * 9)
    turn, _ = spreader.offer(local)
    with pytest.raises(SpreadFailed, match="did not receive its part"):
        spreader.take(turn, local)
    assert votes == [True]  # this process had its part; another said no
    # An offer that failed on process 0 is voted down without placing anything.
    with pytest.raises(SpreadFailed):
        spreader.take({**turn, "offered": False}, local)
    assert votes == [True, False]
    assert spreader.failed == 2
