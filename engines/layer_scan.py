"""The decoder's layers as one body under a scan, and the stacked state it carries.

With `ModelConfig.scan_layers` the decoder runs `engines.model.ScanBlock` under
`nn.scan`: the program holds one layer body whatever L is, so compile time stops growing
with the layer count (docs/BENCHMARKS.md, "One compiled layer body"). Parameters gain a
leading layer axis, named by the logical axis `layers` (unsplit by every preset);
checkpoints keep per-layer names and are stacked at load (engines/param_loading.py,
`stack_layers`), random weights too, so a seed gives the loop's weights. Prefixes keep
their per-layer tuples; only the decode cache is stacked. The stacks enter the body
whole, with the layer's index (`Layer`, `LayerWeight`): the CPU kernels read a layer of
the weights and of the cache where it lies; what XLA's ops read instead (norms, biases,
quantized and expert weights, an int8 cache) is sliced out inside the step.

A KV store takes part in the scan through three methods (`run` calls them):

  scan_init() -> (carry, xs): what the loop carries (the decode cache, stacked [L, ...],
      so each layer's writes land in place in the donated buffer: no second copy of the
      cache per step) and what it slices per layer (an existing prefix's k, v).
  scan_layer(carry, xs_i, i) -> a KVStore for layer i, whose scan_carry() / scan_ys()
      give the updated carry and the layer's outputs once the block has run.
  scan_finish(carry, ys): the store's results as the unrolled loop leaves them.

A stacked decode cache is kept in the decode state (DecodeState, or PagedDecodeState's
page pools) as a one-element tuple holding the [L, ...] array (`stack_cache`), so code
that rebuilds the state with `tuple(kv.k)` works on both layouts. The decode-step stores
of both KV layouts carry it the same way (`StackedStore`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sharding import axes

CACHE_FIELDS = ("k", "v", "k_scale", "v_scale")
# nn.scan makes a new dataclass each call, and flax's dataclass processing reads the base
# class's fields while another thread's may be changing them: two threads tracing scanned
# models at once (lock-step drivers in one process, disaggregated prefill and generate
# threads warming up) failed with "dictionary changed size during iteration".
_SCAN_CLASS_LOCK = threading.Lock()


def run(body, cfg, dtype, backend, x, positions, inv_freq, kv, initializing: bool,
        lora=None):
    """x through the cfg.num_layers layers of `body` (a ScanBlock class) over store kv;
    called inside the decoder's compact method, so the layers' parameters sit under its
    scope as "layers", each [L, ...]. `lora` (engines/lora.py LoraBatch, or None) enters
    whole too: its pool is stacked by layer already, and each layer reads its slice.

    The parameters enter the loop whole (broadcast, never sliced by the scan): the body
    declares each one stacked and reads its layer through `Layer`, so the matmul kernels
    take the stack and the index and read the layer in place (`LayerWeight`), where the
    scan's own slicing made XLA copy every layer's weights out on the CPU. Flax checks
    that a broadcast parameter does not depend on the loop only while `initializing`
    (the extra trace creates them); applying skips it."""
    with _SCAN_CLASS_LOCK:  # flax builds a class here, which two threads must not do at once
        scanned = nn.scan(body, variable_broadcast="params", split_rngs={"params": False},
                          in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                          length=cfg.num_layers, check_constancy_invariants=initializing)
    carry, xs = kv.scan_init()
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, carry), ys = scanned(cfg, dtype, 0, backend, name="layers")(
        (x, carry), (layers, xs), positions, inv_freq, kv, lora)
    kv.scan_finish(carry, ys)
    return x


@dataclasses.dataclass(frozen=True)
class Layer:
    """The layer a scanned block runs: `index` (i32[]) of `count`. Its parameters are
    declared for all layers, [count, ...] on the logical axis `layers`, and read here."""

    index: jax.Array
    count: int

    def take(self, stack: jax.Array) -> jax.Array:
        """This layer's slice of stack [L, ...]."""
        return jax.lax.dynamic_index_in_dim(stack, self.index, keepdims=False)


def param(mod: nn.Module, name: str, init, shape: tuple[int, ...], names: tuple, dtype,
          at: Layer | None = None, whole: bool = False):
    """Parameter `name` of `mod` with logical axis names; in a scanned layer (`at`),
    declared stacked [L, *shape] and read at the layer's index: its slice, or with
    `whole` a LayerWeight (the stack, read in place by the kernels that take an index)."""
    if at is None:
        return mod.param(name, nn.with_logical_partitioning(init, names), shape, dtype)
    stack = param(mod, name, init, (at.count, *shape), (axes.LAYERS, *names), dtype)
    return LayerWeight(stack, at.index) if whole else at.take(stack)


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """One layer of a stacked matmul kernel, kept as the whole stack [L, ...] and the
    layer's index i32[]: engines.backend.Backend.linear hands both to the CPU matmul
    kernel, which reads the layer in place; `value()` is the slice, for XLA's dot."""

    stack: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def reshape(self, *shape: int) -> LayerWeight:
        """The same layer of the stack with each layer reshaped (free: no data moves)."""
        return LayerWeight(self.stack.reshape(self.stack.shape[0], *shape), self.index)

    def value(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, keepdims=False)


def use_scan(config, platform: str, cpu_kernels: bool, mixed_layers: bool = False) -> bool:
    """Whether an engine with EngineConfig `config` on `platform` scans its layers.

    "auto" scans on accelerators, and on the CPU where the CPU kernels run (one device,
    float32 weights: `cpu_kernels`, engines/cpu_kernels.py max_rows), since they read
    each layer of the stacked weights and cache in place and the scan decodes at the
    loop's speed while its compile stops growing with the layer count (docs/BENCHMARKS.md,
    "The scan at loop speed on the CPU" and "Issue 21: the scan as the CPU default"). It
    keeps the loop on a CPU without them (several devices, quantized or bfloat16
    weights), where XLA would copy every layer's weights out of the stack on each step,
    and with LoRA adapters ("scan" serves them too; "auto" keeps the loop there, where
    the scanned adapter step has not been measured). Either KV layout scans (the paged
    pools are stacked and carried as the contiguous cache is). Engines of one model may
    so hold their parameters in different layouts: each converts another's at its door
    (engines/param_layout.py). A model whose layers differ in attention (sliding and
    global layers: their windows and RoPE are fixed per layer at trace time) or in MLP
    (dense layers among routed ones), `mixed_layers`, runs the loop; layers "scan" is
    refused for it."""
    if mixed_layers and config.layers == "scan":
        raise ValueError("layers 'scan' runs one layer body, but this model mixes sliding "
                         "and global attention layers (layer_types) or dense and expert "
                         "MLP layers: use layers 'loop' or 'auto'")
    if config.layers == "auto":
        return (platform != "cpu" or cpu_kernels) and not config.max_loras and not mixed_layers
    return config.layers == "scan"


class StackedStore:
    """The scan methods of a decode-step KV store (engines.kv_cache.DecodeKV,
    engines.paged_kv.PagedDecodeKV, engines.mixed_step.RaggedPagedKV) over a decode
    state whose cache fields (those of CACHE_FIELDS it has; each layer's array of rank 4)
    are stacked [L, ...]. The stacks are the loop's carry: the store opened for layer i
    (`at` = i) writes its entries into each stack at layer i, so every write lands in
    place in the donated buffer and no layer is rebuilt or copied out. The store keeps
    `state` and, per cache field, the list of arrays it wrote (one stack under a scan)."""

    # Under a scan over layers: i32[] the layer this store serves; None in the loop.
    at: jax.Array | None = None

    def _fields(self) -> tuple[str, ...]:
        return tuple(f for f in CACHE_FIELDS if getattr(self.state, f, ()))

    def scan_init(self):
        if not is_stacked(self.state.k, 4):
            raise ValueError("a scanned model needs its decode cache stacked [L, ...] "
                             "(engines.layer_scan.stack_cache)")
        return {f: getattr(self.state, f)[0] for f in self._fields()}, None

    def scan_layer(self, carry, xs, i):
        del xs
        one = copy.copy(self)
        one.state = dataclasses.replace(self.state, **{f: (c,) for f, c in carry.items()})
        for f in self._fields():
            setattr(one, f, [])
        one.at = i
        return one

    def scan_carry(self):
        return {f: getattr(self, f)[0] for f in self._fields()}

    def scan_ys(self):
        return None

    def scan_finish(self, carry, ys):
        del ys
        for f, c in carry.items():
            setattr(self, f, [c])

    def layer_of(self, written: list[jax.Array], layer) -> jax.Array:
        """This layer's array of a field the store wrote: its slice of the stack under a
        scan (a copy of one layer, for readers that take no layer index)."""
        if self.at is None:
            return written[layer]
        return jax.lax.dynamic_index_in_dim(written[0], self.at, keepdims=False)


def is_stacked(cache: tuple, layer_ndim: int) -> bool:
    """Whether a cache field (L per-layer arrays of rank layer_ndim) holds instead one
    stacked [L, ...] array, as a scanned model's decode state does."""
    return len(cache) == 1 and cache[0].ndim == layer_ndim + 1


def cache_layers(cache: tuple, layer_ndim: int) -> tuple:
    """A cache field as L per-layer arrays whichever layout holds it (a scanned model's
    one stacked [L, ...] array split into its layers)."""
    return tuple(cache[0]) if is_stacked(cache, layer_ndim) else tuple(cache)


def stack_cache(state, scan: bool):
    """`state` (a DecodeState or PagedDecodeState of arrays or of NamedShardings, its
    cache fields L-tuples) with each cache field as one stacked [L, ...] entry when
    `scan`; as is otherwise."""
    if not scan:
        return state

    def stack(field):
        parts = getattr(state, field)
        if not parts:
            return ()
        if isinstance(parts[0], NamedSharding):
            s = parts[0]
            return (NamedSharding(s.mesh, PartitionSpec(None, *s.spec)),)
        return (jnp.stack(parts),)

    fields = [f.name for f in dataclasses.fields(state) if f.name in CACHE_FIELDS]
    return dataclasses.replace(state, **{f: stack(f) for f in fields})


def stack_layers(per_layer: dict, num_layers: int, shardings: dict, *,
                 keep: bool = False) -> dict:
    """Parameters with per-layer names ("layers_0" .. "layers_{L-1}", as checkpoints
    store them; numpy or jax arrays) -> the scanned decoder's, each layer leaf stacked on
    a leading axis under "layers" and placed with `shardings` (the scanned model's). Leaf
    by leaf, each per-layer copy dropped once stacked, so the load holds about one leaf
    twice; `keep` leaves the given arrays alone (they are the caller's)."""
    out, treedef, columns = _layer_columns(per_layer, num_layers)
    stacked = []
    for column, sh in zip(columns, jax.tree.leaves(shardings["layers"]), strict=True):
        stacked.append(_stack(column, sh))
        for x in column:
            if not keep and isinstance(x, jax.Array):
                x.delete()
    out["layers"] = jax.tree.unflatten(treedef, stacked)
    return out


def stack_layers_as(per_layer: dict, num_layers: int, xp=jnp) -> dict:
    """stack_layers unplaced: each layer leaf stacked by `xp` (np on the host, jnp for
    device arrays or under a trace), the given arrays kept."""
    out, treedef, columns = _layer_columns(per_layer, num_layers)
    out["layers"] = jax.tree.unflatten(treedef, [xp.stack(c) for c in columns])
    return out


def _layer_columns(per_layer: dict, num_layers: int) -> tuple[dict, object, list[tuple]]:
    """(the entries that are no layer, the tree of one layer, each of its leaves' L
    per-layer arrays)."""
    names = [f"layers_{i}" for i in range(num_layers)]
    rest = {k: v for k, v in per_layer.items() if k not in names}
    parts = [per_layer[n] for n in names]
    columns = list(zip(*(jax.tree.leaves(p) for p in parts), strict=True))
    return rest, jax.tree.structure(parts[0]), columns


def _stack(column: tuple, sharding) -> jax.Array:
    """One leaf's per-layer arrays stacked on a new leading axis, placed with `sharding`.
    Where every array is on the host (numpy) or on this process's CPU devices the host
    memory is the device's, so the stack is made there and placed: no program to compile
    (a jitted stack costs one compile per leaf shape at every cold start). Elsewhere one
    jitted stack per shape."""
    if all(isinstance(x, np.ndarray) or (
            x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()))
           for x in column):
        return jax.device_put(np.stack([np.asarray(x) for x in column]), sharding)
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*column)


def unstack_layers(params: dict) -> dict:
    """The inverse of stack_layers (per-layer names, as a checkpoint stores them); a
    tree without "layers" is returned as is."""
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(jax.tree.leaves(params["layers"])[0].shape[0]):
        out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
    return out
