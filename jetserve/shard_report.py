"""Where an engine's tensors live: PartitionSpecs, bytes per device, the decode step floor.

Predicted bytes come from shapes and shardings alone (`NamedSharding.shard_shape`);
measured bytes from the live arrays' addressable shards. They agree when the layout is what
the preset says; a gap means XLA or the loader placed something other than we asked.
The floor of one decode step is the bytes the busiest device reads, parameters plus a
full KV cache (every slot at max_seq_len), over its memory bandwidth.

Bytes per parameter are given per storage: a float dtype, or a quantized kernel's scheme
(engines/quantization.py), whose parameters are its kernel's elements (two per packed
byte for int4 and mxfp4) and whose bytes are its values' plus its scales'.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from engines import TransformerEngine
from engines.quantization import QVALUE, SCALE, kernel_scheme


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """One tensor: its global shape, its spec, and the bytes each mesh device holds."""

    name: str
    kind: str  # "param" | "kv_cache" | "decode_state"
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[Any, ...]  # PartitionSpec entries: None, a mesh axis, or a tuple of them
    bytes: int  # the whole tensor
    bytes_per_device: int  # one shard

    @property
    def sharded(self) -> bool:
        return any(s is not None for s in self.spec)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["spec"] = spec_json(self.spec)
        return d


def spec_json(spec: PartitionSpec | tuple) -> list:
    """A PartitionSpec as JSON: one entry per dimension (trailing Nones dropped by JAX)."""
    return [list(s) if isinstance(s, tuple) else s for s in spec]


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def _layouts(kind: str, abstract, shardings) -> list[TensorLayout]:
    out = []
    flat_a = jax.tree_util.tree_flatten_with_path(abstract)[0]
    flat_s = jax.tree_util.tree_leaves(shardings,
                                       is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, a), s in zip(flat_a, flat_s, strict=True):
        itemsize = a.dtype.itemsize
        total = math.prod(a.shape) * itemsize
        out.append(TensorLayout(
            name=_path_name(path), kind=kind, shape=tuple(a.shape), dtype=str(a.dtype),
            spec=tuple(s.spec), bytes=total,
            bytes_per_device=math.prod(s.shard_shape(a.shape)) * itemsize,
        ))
    return out


def param_layouts(engine: TransformerEngine) -> list[TensorLayout]:
    return _layouts("param", engine.abstract_params, engine.param_shardings)


def decode_state_layouts(engine: TransformerEngine) -> list[TensorLayout]:
    """The KV cache (`k/i`, `v/i`) and the rest of the decode state, from shapes only."""
    abstract = jax.eval_shape(engine.init_decode_state)
    out = []
    for t in _layouts("decode_state", abstract, engine.decode_state_shardings()):
        kind = ("kv_cache" if t.name.split("/")[0] in ("k", "v", "k_scale", "v_scale")
                else "decode_state")
        out.append(dataclasses.replace(t, kind=kind))
    return out


def predicted_bytes(layouts: Iterable[TensorLayout], devices: Iterable[jax.Device]) -> dict[int, int]:
    """device id -> bytes: every device of the mesh holds one shard of every tensor."""
    per = sum(t.bytes_per_device for t in layouts)
    return {d.id: per for d in devices}


def measured_bytes(tree) -> dict[int, int]:
    """device id -> bytes of the live arrays' shards on this process's devices."""
    out: dict[int, int] = defaultdict(int)
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] += shard.data.nbytes
    return dict(out)


def sharded_fraction(layouts: Iterable[TensorLayout]) -> float:
    """Share of bytes in tensors split over at least one mesh axis."""
    layouts = list(layouts)
    total = sum(t.bytes for t in layouts)
    return sum(t.bytes for t in layouts if t.sharded) / total if total else 0.0


def storage(engine: TransformerEngine, p_lay: list[TensorLayout]) -> list[dict[str, Any]]:
    """Parameters and bytes per storage (a float dtype or a quantization scheme)."""
    rows: dict[str, dict[str, Any]] = {}
    for t in p_lay:
        parts = t.name.split("/")
        kind, count = t.dtype, math.prod(t.shape)
        if len(parts) > 1 and parts[-1] in (QVALUE, SCALE):
            kind = kernel_scheme(engine.model_config, parts[-2])[0]
            packed = 2 if kind in ("int4", "mxfp4") else 1
            count = count * packed if parts[-1] == QVALUE else 0
        row = rows.setdefault(kind, {"storage": kind, "params": 0, "bytes": 0})
        row["params"] += count
        row["bytes"] += t.bytes
    for row in rows.values():
        row["bytes_per_param"] = row["bytes"] / row["params"]
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def build_report(engine: TransformerEngine, *, params=None, decode_state=None,
                 bandwidth: float | None = None) -> dict[str, Any]:
    """The report as JSON-ready data; measured columns only for the live trees given."""
    devices = list(engine.mesh.devices.flat)
    p_lay = param_layouts(engine)
    s_lay = decode_state_layouts(engine)
    kv_lay = [t for t in s_lay if t.kind == "kv_cache"]
    pred_p = predicted_bytes(p_lay, devices)
    pred_kv = predicted_bytes(kv_lay, devices)
    meas_p = measured_bytes(params) if params is not None else {}
    kv_fields = ("k", "v", "k_scale", "v_scale")  # a paged state has no scales
    meas_kv = (measured_bytes([getattr(decode_state, f, ()) for f in kv_fields])
               if decode_state is not None else {})
    per_device = []
    for d in devices:
        row = {"device": d.id, "process": d.process_index,
               "param_bytes": pred_p[d.id], "kv_cache_bytes": pred_kv[d.id],
               "measured_param_bytes": meas_p.get(d.id),
               "measured_kv_cache_bytes": meas_kv.get(d.id)}
        per_device.append(row)
    busiest = max(pred_p[d.id] + pred_kv[d.id] for d in devices)
    report: dict[str, Any] = {
        "sharding": engine.sharding.name,
        "preset": engine.sharding.to_dict(),
        "mesh": {k: int(v) for k, v in engine.mesh.shape.items()},
        "devices": len(devices),
        "platform": devices[0].platform,
        "dtype": str(jax.numpy.dtype(engine.dtype)),
        "max_concurrent_decodes": engine.max_concurrent_decodes,
        "max_seq_len": engine.max_seq_len,
        "param_bytes_total": sum(t.bytes for t in p_lay),
        "kv_cache_bytes_total": sum(t.bytes for t in kv_lay),
        "sharded_param_fraction": sharded_fraction(p_lay),
        "param_storage": storage(engine, p_lay),
        "tensors": [t.to_json() for t in p_lay + s_lay],
        "per_device": per_device,
        "step_bytes_per_device": busiest,
    }
    report["kv_head_replication"] = kv_head_replication(engine, p_lay, kv_lay)
    if bandwidth is not None:
        report["bandwidth_bytes_per_s"] = bandwidth
        report["decode_step_floor_s"] = busiest / bandwidth
        report["decode_step_floor_params_only_s"] = max(pred_p.values()) / bandwidth
    return report


def kv_head_replication(engine: TransformerEngine, p_lay: list[TensorLayout],
                        kv_lay: list[TensorLayout]) -> dict[str, Any]:
    """How many devices hold each kv head (engines/kv_heads.py), the tensors that carry
    the copies, and their bytes per device: with `copies` devices per head, all but
    1/copies of those bytes on a device repeat what another device of the axis holds."""
    r = engine.kv_repeat
    names = set(engine.kv_head_tensors())
    params = [t for t in p_lay if t.name in names] if r > 1 else []
    cache = kv_lay if r > 1 else []
    per_device = sum(t.bytes_per_device for t in params + cache)
    return {
        "copies": r,
        "stored_kv_heads": engine.source_config.num_kv_heads,
        "kv_heads": engine.model_config.num_kv_heads,
        "params": [t.name for t in params],
        "kv_cache": [t.name for t in cache],
        "bytes_per_device": per_device,
        "copy_bytes_per_device": per_device * (r - 1) // r,
    }
