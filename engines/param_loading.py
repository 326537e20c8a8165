"""A decoder's parameters: their shapes, where they live, and how they are loaded.

One `load_params` for every source: random weights (from the engine's seed), a Hugging
Face safetensors directory or a jetserve Orbax checkpoint, each placed straight onto the
engine's parameter shardings. Quantize-on-load is the same path over the float model:
when the engine's parameters are quantized but the stored ones are float
(`needs_quantizing`), HF tensors are quantized one by one on the host (the float model
never sits on the devices), random and Orbax weights by one jitted function whose float
input is dropped as soon as it returns. MXFP4 experts (ModelConfig.expert_quant) come
from the checkpoint as stored, bytes only (engines/checkpoint.py); random ones are drawn
float and quantized the same way. Kv-head replication (engines/kv_heads.py) is the
same path again: the weights are read as stored, with K kv heads, and each kv head is
repeated `kv_repeat` times on the way to the engine's K' heads.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engines import checkpoint, exported_programs, kv_heads, layer_scan
from engines.config import ModelConfig
from engines.model import Decoder
from engines.quantization import (
    EXPERT_KERNELS,
    KERNEL_INPUT_AXES,
    QVALUE,
    SCALE,
    quantize,
    quantize_params,
    quantizes,
)
from sharding import ShardingConfig


class ShapeOnlyKV:
    """KV store for tracing shapes at init: attend over the new tokens only."""

    def __init__(self, k_pos):
        self.k_pos = k_pos

    def update(self, layer, k, v):
        return k, v, self.k_pos

    # Under a scan over layers (engines/layer_scan.py): nothing carried, nothing kept.
    def scan_init(self):
        return None, None

    def scan_layer(self, carry, xs, i):
        return self

    def scan_carry(self):
        return None

    def scan_ys(self):
        return None

    def scan_finish(self, carry, ys):
        pass


def _path(p) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in p)


def _init(model: Decoder, key) -> dict:
    """The model's boxed parameters (logical axis names attached) from `key`."""
    one = jnp.zeros((1, 1), jnp.int32)
    return model.init(key, one, one, ShapeOnlyKV(one))["params"]


def trace_params(model: Decoder) -> tuple[dict, dict]:
    """(abstract parameters, their logical axis names as PartitionSpecs), without
    computing any parameter; a warm start reads them from the exported-program cache
    (tracing the model's init costs a few tenths of a second)."""

    def compute():
        boxed = jax.eval_shape(lambda: _init(model, jax.random.key(0)))
        return nn.meta.unbox(boxed), nn.get_partition_spec(boxed)

    return exported_programs.cached_json("params", repr(model), compute, _encode_trace,
                                         _decode_trace)


def _encode_trace(trace: tuple[dict, dict]) -> list:
    def one(a, spec):
        if isinstance(a, dict):
            return {k: one(a[k], spec[k]) for k in a}
        return {"shape": list(a.shape), "dtype": str(a.dtype),
                "spec": [list(x) if isinstance(x, tuple) else x for x in spec]}

    return one(*trace)


def _decode_trace(tree) -> tuple[dict, dict]:
    def split(t):
        if "dtype" in t and isinstance(t["dtype"], str):
            return (jax.ShapeDtypeStruct(tuple(t["shape"]), jnp.dtype(t["dtype"])),
                    PartitionSpec(*(tuple(x) if isinstance(x, list) else x
                                    for x in t["spec"])))
        pairs = {k: split(v) for k, v in t.items()}
        return {k: a for k, (a, _) in pairs.items()}, {k: p for k, (_, p) in pairs.items()}

    return split(tree)


def param_shardings(sharding: ShardingConfig, mesh: Mesh, logical: dict,
                    abstract: dict, *, whole_kv: bool = False) -> dict:
    """Where each parameter lives on `mesh`, by its logical axis names. whole_kv: kv
    heads unsplit (stored heads that are repeated after loading)."""

    def one(path, spec, a):
        name = _path(path)
        if whole_kv:
            spec = kv_heads.whole_kv_heads(spec)
        # Quantization scales are 1/group the size of their kernel: where their groups
        # do not divide over the channel's mesh axis they stay whole on every device.
        return sharding.named(mesh, tuple(spec), a.shape, f"parameter {name}",
                              strict=not name.endswith(f"/{SCALE}"))

    return jax.tree_util.tree_map_with_path(
        one, logical, abstract, is_leaf=lambda x: isinstance(x, PartitionSpec))


def needs_quantizing(cfg: ModelConfig, weights: str | None) -> bool:
    """True when the engine's params are quantized but its weights are stored float."""
    if cfg.weight_quant == "none":
        return False
    if weights is not None and checkpoint.is_orbax_dir(weights):
        return checkpoint.read_orbax_config(weights).weight_quant == "none"
    if weights is not None and cfg.weight_quant == "fp8_block":  # kept as the files hold it
        return checkpoint.fp8_block_size(weights, cfg.family) != (cfg.quant_group_size,) * 2
    return True


def load_params(model: Decoder, weights: str | None, *, seed: int, sharding: ShardingConfig,
                mesh: Mesh, shardings: dict, abstract: dict, kv_repeat: int = 1) -> dict:
    """The parameters of `model` from `weights` (None: random from `seed`), placed with
    `shardings` (the tree of NamedShardings of `abstract`, the model's parameters).
    kv_repeat: the model has this many copies of each stored kv head (engines/kv_heads.py);
    random weights are drawn for the stored heads, so they equal a one-device run's."""
    cfg = model.cfg
    if cfg.scan_layers:  # read per layer, as checkpoints name them, then stacked
        loop = Decoder(dataclasses.replace(cfg, scan_layers=False), dtype=model.dtype)
        loop_abstract, loop_logical = trace_params(loop)
        per_layer = load_params(
            loop, weights, seed=seed, sharding=sharding, mesh=mesh, abstract=loop_abstract,
            shardings=param_shardings(sharding, mesh, loop_logical, loop_abstract),
            kv_repeat=kv_repeat)
        return layer_scan.stack_layers(per_layer, cfg.num_layers, shardings)
    quantizing = needs_quantizing(cfg, weights)
    scheme, group = cfg.weight_quant, cfg.quant_group_size
    source_cfg = kv_heads.stored_config(cfg, kv_repeat)
    if quantizing:
        source_cfg = dataclasses.replace(source_cfg, weight_quant="none")
    float_experts = weights is None and cfg.expert_quant != "none"  # drawn, then quantized
    if float_experts:
        source_cfg = dataclasses.replace(source_cfg, expert_quant="none")
    source = Decoder(source_cfg, dtype=model.dtype)
    if source_cfg == cfg:
        stored, stored_sh, logical = abstract, shardings, None
    else:
        stored, logical = trace_params(source)
        stored_sh = param_shardings(sharding, mesh, logical, stored, whole_kv=kv_repeat > 1)

    def convert(p):  # stored params -> the model's: heads repeated, then quantized
        p = kv_heads.repeat_heads(p, logical, kv_repeat, jnp)
        if float_experts:
            p = quantize_params(p, cfg.expert_quant, 0, jnp, EXPERT_KERNELS)
        return quantize_params(p, scheme, group, jnp) if quantizing else p

    if weights is None:
        return _init_random(source, convert, abstract, shardings, seed)
    if checkpoint.is_orbax_dir(weights):
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              stored, stored_sh)
        params = checkpoint.read_orbax_params(weights, target)
        if stored is abstract:
            return params
        return jax.jit(convert, out_shardings=shardings)(params)
    return _load_hf(weights, source_cfg, stored, logical, shardings,
                    quantizing=quantizing, kv_repeat=kv_repeat, scheme=scheme, group=group)


# Random weights are drawn in jitted calls of about this many bytes each: one call over
# a whole model keeps its RNG temporaries alive together, ~2.5x the model's size on top
# of the weights (llama-156m: 2.0 GB peak for 0.62 GB of weights).
INIT_GROUP_BYTES = 192 << 20


def init_groups(abstract: dict) -> list[list[str]]:
    """The model's top-level modules in order, grouped to about INIT_GROUP_BYTES each
    (a small model: one group, one compile)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, sub in abstract.items():
        if size >= INIT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(sub))
    return groups


def _init_random(source: Decoder, convert, abstract: dict, shardings: dict,
                 seed: int) -> dict:
    """Random parameters from `seed`, one group of modules per call. Each call traces
    the whole init and keeps its group's outputs (XLA drops the rest), so every value is
    the one a single call over the model would give: seeds stay reproducible."""
    params = {}
    for names in init_groups(abstract):
        def group(key, names=tuple(names)):
            full = convert(nn.meta.unbox(_init(source, key)))
            return {n: full[n] for n in names}
        # Waited on before the next group, so no two groups' temporaries are alive at once.
        params.update(jax.block_until_ready(jax.jit(
            group, out_shardings={n: shardings[n] for n in names})(jax.random.key(seed))))
    return params


def _load_hf(weights: str, source_cfg: ModelConfig, stored: dict, logical: dict | None,
             shardings: dict, *, quantizing: bool, kv_repeat: int, scheme: str,
             group: int) -> dict:
    """HF safetensors, one tensor at a time: read as stored, kv heads repeated and
    quantized on the host, then put on the devices."""
    flat_sh: dict[str, NamedSharding] = {
        _path(p): s for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    flat_logical: dict[str, PartitionSpec] = {} if logical is None else {
        _path(p): s for p, s in jax.tree_util.tree_flatten_with_path(
            logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}

    def place(path: str, arr: np.ndarray | dict):
        if isinstance(arr, dict):  # kept as stored (MXFP4 experts)
            return {k: jax.device_put(v, flat_sh[f"{path}/{k}"]) for k, v in arr.items()}
        arr = kv_heads.repeat_leaf(arr, flat_logical.get(path), kv_repeat, np)
        leaf = path.rsplit("/", 1)[-1]
        if not quantizing or not quantizes(scheme, leaf):
            return jax.device_put(arr, flat_sh[path])
        q, s = quantize(arr, KERNEL_INPUT_AXES[leaf], scheme, group, np)
        return {QVALUE: jax.device_put(q, flat_sh[f"{path}/{QVALUE}"]),
                SCALE: jax.device_put(s, flat_sh[f"{path}/{SCALE}"])}

    return checkpoint.read_hf_params(weights, source_cfg, stored, place)
