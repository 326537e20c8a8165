"""`jetserve bench ray-batch`: its flags are checked before a cluster or an engine starts.
(The benchmark itself runs as docs/BENCHMARKS.md shows; the behaviour it times is tested
in tests/jetserve/batch/test_ray.py.)"""

import pytest

from jetserve.bench import ray_batch


def test_defaults():
    a = ray_batch.parse([])
    assert (a.pools, a.rows, a.block_rows, a.num_cpus) == ([1, 2], 2000, 64, 2)
    assert ray_batch.parse(["--actors", "2,1"]).pools == [2, 1]


@pytest.mark.parametrize("argv, message", [
    (["--actors", "0"], "--actors: pool sizes >= 1"),
    (["--actors", "one"], "--actors: pool sizes >= 1"),
    (["--rows", "0"], "--rows must be >= 1"),
    (["--block-rows", "0"], "--block-rows must be >= 1"),
])
def test_bad_flags_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        ray_batch.parse(argv)
