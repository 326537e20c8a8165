"""Activation sharding constraints that model code writes with logical names.

The model calls `constrain(x, (BATCH, SEQ, EMBED))` where XLA's propagation needs a hint
(the residual stream, attention heads, logits). Outside a layout it returns x unchanged, so
the model runs the same on one device and needs no mesh of its own. The engine wraps each
function it jits with `traced_under(config, mesh, fn)`, which makes the preset and mesh the
current layout while jit traces fn.

Concurrency: the current layout is a `contextvars.ContextVar`, so a prefill thread and a
generate thread tracing engines on two slices at once each see their own layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import jax
from jax.sharding import Mesh, NamedSharding

from sharding.config import ShardingConfig

_CURRENT: contextvars.ContextVar[tuple[ShardingConfig, Mesh] | None] = contextvars.ContextVar(
    "jetserve_sharding_layout", default=None
)

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def layout(config: ShardingConfig, mesh: Mesh) -> Iterator[None]:
    """Makes (config, mesh) the layout that `constrain` uses inside the block."""
    token = _CURRENT.set((config, mesh))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> tuple[ShardingConfig, Mesh] | None:
    return _CURRENT.get()


def traced_under(config: ShardingConfig, mesh: Mesh, fn: F) -> F:
    """fn, run (hence traced, when jitted) under the layout (config, mesh)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with layout(config, mesh):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def constrain(x: jax.Array, names: Sequence[str | None], what: str = "activation") -> jax.Array:
    """Pins x to the layout's sharding for these logical names; a no-op with no layout.

    Dimensions that do not divide over their mesh axis stay whole (an activation's batch of
    one under a `data` axis, a decode step's sequence of one under `seq`): a hint, unlike a
    parameter's sharding, must never fail.
    """
    cur = _CURRENT.get()
    if cur is None:
        return x
    config, mesh = cur
    spec = config.spec(names, x.shape, mesh, what, strict=False)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
