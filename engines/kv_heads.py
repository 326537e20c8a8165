"""Kv-head replication: tensor parallelism over more devices than the model has kv heads.

With K kv heads and a kv_heads mesh axis of M devices (M a multiple of K that divides the
N query heads; `ShardingConfig.kv_head_replicas`), the engine runs the decoder with
K' = M kv heads, each stored head repeated r = M / K times consecutively. Query head n
attends kv head n // G' (G' = N / K'), which holds stored head (n // G') // r = n // G
(G = N / K): the head it attends with K heads, so the attention math is unchanged and
every other weight still splits M ways. Each device then holds one copy of one kv head's
projections and cache, as in MaxText and vLLM.

Here: repeating the stored tensors along their kv-head axis as they load (any tensor whose
logical names include kv_heads: projections, biases, quantized values and scales),
selecting one copy of each head back (checkpoints keep K heads), and regrouping a
prefix's heads when it moves between engines that repeat them differently (disaggregated
prefill and generate slices on different presets or device counts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from engines.config import ModelConfig
from engines.kv_cache import Prefix
from sharding import axes


def kv_axis(spec: PartitionSpec | tuple | None) -> int | None:
    """The dimension a tensor's logical names give to kv heads, or None."""
    if spec is None or axes.KV_HEADS not in tuple(spec):
        return None
    return tuple(spec).index(axes.KV_HEADS)


def repeat_leaf(x: Any, spec: PartitionSpec | tuple | None, r: int, xp: Any = jnp) -> Any:
    """x with each kv head repeated r times in place (heads a, a, b, b for r = 2)."""
    a = kv_axis(spec)
    return x if a is None or r == 1 else xp.repeat(x, r, axis=a)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def repeat_heads(params: dict, logical: dict, r: int, xp: Any = jnp) -> dict:
    """Every kv-head tensor of `params` repeated r times along its kv-head axis.
    logical: the tree of logical-name PartitionSpecs of `params`."""
    if r == 1:
        return params
    return jax.tree.map(lambda s, x: repeat_leaf(x, s, r, xp), logical, params,
                        is_leaf=_is_spec)


def select_heads(params: dict, logical: dict, r: int) -> dict:
    """The inverse of repeat_heads: the first of each r copies of every kv head."""
    if r == 1:
        return params

    def one(s, x):
        a = kv_axis(s)
        return x if a is None else jax.lax.slice_in_dim(x, 0, x.shape[a], r, axis=a)

    return jax.tree.map(one, logical, params, is_leaf=_is_spec)


def kv_head_paths(logical: dict) -> list[str]:
    """The parameters ('/'-joined paths) whose logical names hold one slice per kv head:
    those a layout with kv_repeat > 1 repeats."""
    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=_is_spec)[0]
    return ["/".join(str(getattr(k, "key", k)) for k in p) for p, spec in flat
            if kv_axis(spec) is not None]


def whole_kv_heads(spec: PartitionSpec) -> PartitionSpec:
    """A logical spec with its kv-head dimension unsplit: where a tensor of the stored K
    heads lives before it is repeated (K does not divide over the axis)."""
    return PartitionSpec(*(None if n == axes.KV_HEADS else n for n in spec))


def stored_config(cfg: ModelConfig, r: int) -> ModelConfig:
    """The config of the weights as stored: the engine's config with K'/r kv heads."""
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads // r)


def head_map(stored: int, have: int, want: int) -> np.ndarray:
    """For each of `want` heads, the index among `have` heads that holds the same stored
    head (both repeat `stored` heads consecutively)."""
    return (np.arange(want) // (want // stored)) * (have // stored)


@jax.jit
def _take_heads(prefix: Prefix, index: jax.Array) -> Prefix:
    def take(x):  # [1, T, K, H]
        return jnp.take(x, index, axis=2)

    return dataclasses.replace(prefix, k=tuple(map(take, prefix.k)),
                               v=tuple(map(take, prefix.v)))


def regroup_prefix(prefix: Prefix, stored: int, want: int) -> Prefix:
    """A prefix whose k / v [1, T, K1, H] repeat `stored` kv heads, with `want` heads
    instead (K1 and want multiples of stored); runs where the prefix is."""
    have = prefix.k[0].shape[2]
    if have == want:
        return prefix
    if have % stored or want % stored:
        raise ValueError(f"a prefix with {have} kv heads cannot become one with {want}: "
                         f"both must repeat the model's {stored} kv heads")
    return _take_heads(prefix, jnp.asarray(head_map(stored, have, want), jnp.int32))
