"""The device pool of LoRA adapters and the per-row delta the decoder adds with it.

The pool holds, per target projection, A [L, M+1, R, in] and B [L, M+1, out, R] (M =
`max_loras` adapters resident at once, R = `max_rank`; row 0 is "no adapter" and stays
zero; a smaller rank is zero-padded, which adds nothing) and each row's scale f32[M+1].
The leading layer axis L keeps per-layer slices one index away (`LoraBatch.at_layer`),
as a scan over layers wants them.

Sharding follows the base weight each pair modifies: B's output axis is split as the
column-parallel projection's output (q/k/v heads, gate/up mlp), A's input axis as the
row-parallel projection's input (o heads, down mlp); the rank axis stays whole, so the
only extra collective is the all-reduce of o/down's [B, T, R] partial products.

`LoraBatch` is the hook the decoder calls (engines/model.py): for each row b of the
batch it adds scale[i_b] * (x_b A[i_b]^T) B[i_b]^T, with i_b the row's adapter (or, with
`tokens`, for each token t of the mixed step's one row of T tokens, its own i_t: the
tokens are taken as the rows). Two forms
of the same sum, picked by shape at trace time: with fewer pool rows than batch rows every
row's product with every adapter, masked to its own (reads the pool once); otherwise the
rows' own A and B gathered (reads B x R x (in + out) values). Rows without an adapter
read row 0 (zeros) and add exactly nothing. There is no branch on the device to skip the
delta when no row has an adapter: on XLA's CPU backend a `lax.cond` per projection cost
more than the delta itself; the engine instead runs its plain step when no slot holds an
adapter (engines/lora_engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engines.config import ModelConfig
from engines.lora_loading import AdapterWeights, module_dims, target_modules
from sharding import ShardingConfig, axes

# Logical name of the base projection's output (B's axis 2) or input (A's axis 3) that
# the model axis splits; None: that side is whole on every device.
_OUT_AXIS = {"q_proj": axes.HEADS, "k_proj": axes.KV_HEADS, "v_proj": axes.KV_HEADS,
             "gate_proj": axes.MLP, "up_proj": axes.MLP}
_IN_AXIS = {"o_proj": axes.HEADS, "down_proj": axes.MLP}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """How many adapters the device holds at once and their largest rank."""

    max_loras: int = 4
    max_rank: int = 16

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=("a", "b", "scale"),
                   meta_fields=("modules",))
@dataclasses.dataclass
class LoraPool:
    """Adapters resident on the device; `modules` names the projection of a[i] and b[i]."""

    a: tuple[jax.Array, ...]  # per module [L, M+1, R, in]
    b: tuple[jax.Array, ...]  # per module [L, M+1, out, R]
    scale: jax.Array  # f32[M+1], 0 for row 0
    modules: tuple[str, ...]


def pool_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[tuple, tuple]]:
    """module -> (A shape, B shape) for the running model (its kv heads, repeated or not)."""
    L, M, R = cfg.num_layers, lora.max_loras + 1, lora.max_rank
    out = {}
    for m in target_modules(cfg):
        n_in, n_out = module_dims(cfg, m)
        out[m] = ((L, M, R, n_in), (L, M, n_out, R))
    return out


def pool_shardings(cfg: ModelConfig, lora: LoraConfig, sharding: ShardingConfig,
                   mesh: Mesh) -> LoraPool:
    """Where each pool array lives: split as the base projection it modifies."""
    shapes = pool_shapes(cfg, lora)
    a, b = [], []
    for m, (sa, sb) in shapes.items():
        a.append(sharding.named(mesh, (None, None, None, _IN_AXIS.get(m)), sa, f"lora {m} A"))
        b.append(sharding.named(mesh, (None, None, _OUT_AXIS.get(m), None), sb, f"lora {m} B"))
    return LoraPool(a=tuple(a), b=tuple(b), scale=sharding.named(mesh, (None,)),
                    modules=tuple(shapes))


def empty_pool(cfg: ModelConfig, lora: LoraConfig, dtype) -> LoraPool:
    """A pool holding no adapter (all zeros); jit it with `pool_shardings` as out."""
    shapes = pool_shapes(cfg, lora)
    return LoraPool(a=tuple(jnp.zeros(sa, dtype) for sa, _ in shapes.values()),
                    b=tuple(jnp.zeros(sb, dtype) for _, sb in shapes.values()),
                    scale=jnp.zeros((lora.max_loras + 1,), jnp.float32), modules=tuple(shapes))


def adapter_rows(w: AdapterWeights, cfg: ModelConfig, lora: LoraConfig, kv_repeat: int,
                 dtype) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """One adapter as one pool row per module: A [L, R, in], B [L, out, R], zero-padded to
    the pool's rank, with k/v outputs repeated per kv head as the engine runs them."""
    shapes = pool_shapes(cfg, lora)
    a_rows, b_rows = [], []
    for m, (sa, sb) in shapes.items():
        a = np.zeros((sa[0], *sa[2:]), dtype)
        b = np.zeros((sb[0], *sb[2:]), dtype)
        if m in w.a:
            a[:, : w.rank] = w.a[m]
            wb = w.b[m]
            if m in ("k_proj", "v_proj") and kv_repeat > 1:  # [L, K*H, r] -> [L, K'*H, r]
                L, _, r = wb.shape
                wb = np.repeat(wb.reshape(L, -1, cfg.head_dim, r), kv_repeat, axis=1)
                wb = wb.reshape(L, -1, r)
            b[:, :, : w.rank] = wb
        a_rows.append(a)
        b_rows.append(b)
    return tuple(a_rows), tuple(b_rows)


def write_row(pool: LoraPool, index, a_rows, b_rows, scale) -> LoraPool:
    """The pool with row `index` (i32[], traced: one compile for every row) replaced."""
    put = lambda p, r: jax.lax.dynamic_update_index_in_dim(p, r.astype(p.dtype), index, 1)
    return LoraPool(a=tuple(map(put, pool.a, a_rows)), b=tuple(map(put, pool.b, b_rows)),
                    scale=pool.scale.at[index].set(scale), modules=pool.modules)


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One layer's slice of the pool and the rows' adapters: the decoder's hook."""

    a: Mapping[str, jax.Array]  # module -> [M+1, R, in]
    b: Mapping[str, jax.Array]  # module -> [M+1, out, R]
    scale: jax.Array  # f32[M+1]
    index: jax.Array  # i32[B] each row's adapter (0: none); `tokens`: i32[T] each token's
    tokens: bool = False  # x is one row [1, T, in] whose tokens each have an adapter

    def __call__(self, module: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """y (the projection of x [B, T, in], [B, T, out]) plus each row's LoRA delta."""
        if module not in self.a:
            return y
        if self.tokens:  # [1, T, in] -> T rows of one token each, and back
            d = _delta(jnp.swapaxes(x, 0, 1), self.a[module], self.b[module], self.scale,
                       self.index)
            return y + jnp.swapaxes(d, 0, 1).astype(y.dtype)
        return y + _delta(x, self.a[module], self.b[module], self.scale,
                          self.index).astype(y.dtype)


def _delta(x, a, b, scale, index):
    """sum over rows b: scale[i_b] (x_b A[i_b]^T) B[i_b]^T, x [B, T, in] -> [B, T, out]."""
    Bn, M = x.shape[0], a.shape[0]
    if M <= Bn:  # every adapter on every row, masked: reads the pool once
        xa = jnp.einsum("bti,mri->btmr", x, a)  # (B, T, M+1, R)
        w = jax.nn.one_hot(index, M, dtype=xa.dtype) * scale.astype(xa.dtype)  # (B, M+1)
        return jnp.einsum("btmr,mor->bto", xa * w[:, None, :, None], b)
    xa = jnp.einsum("bti,bri->btr", x, a[index])  # (B, T, R): the rows' own A
    xa = xa * scale[index].astype(xa.dtype)[:, None, None]
    return jnp.einsum("btr,bor->bto", xa, b[index])


@dataclasses.dataclass(frozen=True)
class LoraBatch:
    """The pool and each batch row's adapter, as the decoder receives them."""

    pool: LoraPool
    index: jax.Array  # i32[B]; `tokens`: i32[T], each token's (LoraLayer)
    tokens: bool = False

    def at_layer(self, layer) -> LoraLayer:
        """Layer `layer`'s hook (an int, or a traced index under a scan)."""
        at = lambda p: p[layer]
        return LoraLayer(a=dict(zip(self.pool.modules, map(at, self.pool.a), strict=True)),
                         b=dict(zip(self.pool.modules, map(at, self.pool.b), strict=True)),
                         scale=self.pool.scale, index=self.index, tokens=self.tokens)

