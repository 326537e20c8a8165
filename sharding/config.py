"""Sharding presets: a mesh shape plus rules from logical axis names to mesh axes.

A preset is data (`sharding/presets/*.yaml`), so researchers swap layouts without touching
model code. Written as `W[D_X, F_Y]`: dimension D of W is split over mesh axis X.

Mesh sizes are an integer, -1 (all devices left over), or the name of a model dimension
(`num_kv_heads`, `num_heads`, `num_experts`): that axis gets as many devices as the model
has of that thing, limited to a divisor of the devices left. `tp_kv_batch` uses this to put
the KV cache by kv heads first and give the remaining devices to the batch.

`replicate_kv_heads: true` (as in `tp`) lets the kv_heads axis take more devices than the
model has kv heads: M devices for K heads, M a multiple of K dividing num_heads, each head
held by M / K devices (`kv_head_replicas`; the engine repeats the heads, engines/kv_heads.py).

`kv_layouts` lists the engine KV layouts a preset can place (default both); `dp_ep` splits
the cache by slot, which the paged layout's pool has no axis for, so it names `contiguous`
alone and an engine with paged KV refuses it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding import axes

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
# Explicit registry of bundled presets: short name -> file.
PRESETS = {
    "replicated": "replicated.yaml",
    "tp": "tp.yaml",
    "tp_kv_batch": "tp_kv_batch.yaml",
    "seq_tp": "seq_tp.yaml",
    "ep_tp": "ep_tp.yaml",
    "dp_ep": "dp_ep.yaml",
}
# The engine's KV layouts (EngineConfig.kv_layout) a preset may be limited to.
KV_LAYOUTS = ("contiguous", "paged")
# Model dimensions a mesh axis may take its size from (ModelConfig field names).
MODEL_DIMS = ("num_heads", "num_kv_heads", "num_experts")


def _size_ok(n: Any) -> bool:
    if isinstance(n, bool):
        return False
    if isinstance(n, int):
        return n >= 1 or n == -1
    return n in MODEL_DIMS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """A mesh and the rules that place logical axes on it.

    mesh: ordered (mesh axis, size); size >= 1, -1 (the remaining devices), or a name
      from MODEL_DIMS (as many devices as the model has of it, where they divide).
    rules: (logical axis, mesh axis); a logical axis without a rule is not split.
    replicate_kv_heads: where the kv_heads mesh axis has more devices than the model has
      kv heads, hold each kv head (projections and cache) on several devices rather than
      refuse the mesh (`kv_head_replicas`).
    kv_layouts: the KV layouts (EngineConfig.kv_layout) this layout can place.
    """

    name: str = "replicated"
    mesh: tuple[tuple[str, int | str], ...] = (("data", 1), ("model", -1))
    rules: tuple[tuple[str, str], ...] = ()
    replicate_kv_heads: bool = False
    kv_layouts: tuple[str, ...] = KV_LAYOUTS

    def __post_init__(self):
        if (not isinstance(self.kv_layouts, tuple) or not self.kv_layouts
                or any(k not in KV_LAYOUTS for k in self.kv_layouts)):
            raise ValueError(f"sharding {self.name!r}: kv_layouts must be a non-empty list "
                             f"of {KV_LAYOUTS}, got {self.kv_layouts!r}")
        if not isinstance(self.replicate_kv_heads, bool):
            raise ValueError(f"sharding {self.name!r}: replicate_kv_heads must be true or "
                             f"false, got {self.replicate_kv_heads!r}")
        mesh_axes = [a for a, _ in self.mesh]
        if not mesh_axes:
            raise ValueError(f"sharding {self.name!r}: mesh must name at least one axis")
        if len(set(mesh_axes)) != len(mesh_axes):
            raise ValueError(f"sharding {self.name!r}: mesh axes repeat: {mesh_axes}")
        if sum(1 for _, n in self.mesh if n == -1) > 1:
            raise ValueError(f"sharding {self.name!r}: only one mesh axis may be -1")
        for a, n in self.mesh:
            if not isinstance(a, str) or not a:
                raise ValueError(f"sharding {self.name!r}: mesh axis names must be strings, got {a!r}")
            if not _size_ok(n):
                raise ValueError(
                    f"sharding {self.name!r}: mesh axis {a!r} size must be an integer >= 1, "
                    f"-1, or one of {MODEL_DIMS}; got {n!r}"
                )
        seen = set()
        for logical, mesh_axis in self.rules:
            if logical not in axes.ALL:
                raise ValueError(
                    f"sharding {self.name!r}: unknown logical axis {logical!r} in rules; "
                    f"expected one of {axes.ALL}"
                )
            if logical in seen:
                raise ValueError(f"sharding {self.name!r}: logical axis {logical!r} has two rules")
            seen.add(logical)
            if mesh_axis not in mesh_axes:
                raise ValueError(
                    f"sharding {self.name!r}: rule {logical}: {mesh_axis!r} names a mesh axis "
                    f"that is not in the mesh {mesh_axes}"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str) -> ShardingConfig:
        unknown = set(d) - {"mesh", "rules", "replicate_kv_heads", "kv_layouts"}
        if unknown:
            raise ValueError(f"sharding {name!r}: unknown keys {sorted(unknown)}; expected "
                             f"mesh, rules, replicate_kv_heads, kv_layouts")
        mesh = d.get("mesh") or {"data": 1, "model": -1}
        rules = d.get("rules") or {}
        for key, value in (("mesh", mesh), ("rules", rules)):
            if not isinstance(value, Mapping):
                raise ValueError(f"sharding {name!r}: {key} must be a mapping, got {value!r}")
        for logical, mesh_axis in rules.items():
            if not isinstance(mesh_axis, str):
                raise ValueError(
                    f"sharding {name!r}: rule {logical}: expected one mesh axis name, "
                    f"got {mesh_axis!r}"
                )
        return cls(name=name, mesh=tuple((str(k), v) for k, v in mesh.items()),
                   rules=tuple((str(k), v) for k, v in rules.items()),
                   replicate_kv_heads=d.get("replicate_kv_heads", False),
                   kv_layouts=_layouts(d.get("kv_layouts", KV_LAYOUTS), name))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mesh": dict(self.mesh), "rules": dict(self.rules)}
        if self.replicate_kv_heads:
            d["replicate_kv_heads"] = True
        if self.kv_layouts != KV_LAYOUTS:
            d["kv_layouts"] = list(self.kv_layouts)
        return d

    # ---- meshes ------------------------------------------------------------------------

    def mesh_shape(self, num_devices: int, dims: Mapping[str, int] | None = None) -> dict[str, int]:
        """Resolves sizes for num_devices: integers, then model dimensions, then -1."""
        fixed = math.prod(n for _, n in self.mesh if isinstance(n, int) and n != -1)
        if fixed > num_devices or num_devices % fixed:
            raise ValueError(
                f"sharding {self.name!r}: mesh {dict(self.mesh)} needs a multiple of {fixed} "
                f"devices, got {num_devices}"
            )
        left = num_devices // fixed
        shape: dict[str, int] = {}
        for a, n in self.mesh:
            if isinstance(n, str):
                if dims is None or n not in dims:
                    raise ValueError(
                        f"sharding {self.name!r}: mesh axis {a!r} takes its size from {n}, "
                        f"which was not given (pass the model's dimensions)"
                    )
                shape[a] = math.gcd(max(int(dims[n]), 1), left)
                left //= shape[a]
        for a, n in self.mesh:
            if isinstance(n, int) and n != -1:
                shape[a] = n
            elif n == -1:
                shape[a] = left
                left = 1
        if left != 1:
            used = num_devices // left
            raise ValueError(
                f"sharding {self.name!r}: mesh {dict(self.mesh)} resolves to "
                f"{ {a: shape[a] for a, _ in self.mesh} }, which uses {used} of the "
                f"{num_devices} devices; give {used} devices or add a -1 axis"
            )
        return {a: shape[a] for a, _ in self.mesh}

    def split_count(self, logical: str, num_devices: int,
                    dims: Mapping[str, int] | None = None) -> int:
        """How many ways a dimension named `logical` is split on `num_devices` (the size
        of the mesh axis its rule names; 1 where it has none): a size it must divide."""
        axis = dict(self.rules).get(logical)
        return self.mesh_shape(num_devices, dims).get(axis, 1) if axis is not None else 1

    def make_mesh(self, devices: Sequence[jax.Device],
                  dims: Mapping[str, int] | None = None) -> Mesh:
        """The mesh over `devices`, in order (the last mesh axis varies fastest)."""
        if not devices:
            raise ValueError(f"sharding {self.name!r}: no devices given")
        shape = self.mesh_shape(len(devices), dims)
        arr = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
        return Mesh(arr, tuple(shape.keys()))

    def kv_head_replicas(self, mesh: Mesh, num_kv_heads: int, num_heads: int,
                         tensor: str = "kv heads") -> int:
        """How many devices hold each kv head on `mesh`: 1, or M / K where the kv_heads
        mesh axis has M devices for K kv heads (with replicate_kv_heads, M a multiple of K
        that divides num_heads). A mesh that can do neither is refused, naming `tensor`,
        the sizes and the preset; without replicate_kv_heads `spec` refuses it later."""
        axis = dict(self.rules).get(axes.KV_HEADS)
        K, N = num_kv_heads, num_heads
        if axis is None or not self.replicate_kv_heads or K % mesh.shape[axis] == 0:
            return 1
        M = mesh.shape[axis]
        if M % K == 0 and N % M == 0:
            return M // K
        fits = [m for m in range(1, N + 1) if N % m == 0 and (K % m == 0 or m % K == 0)]
        raise ValueError(
            f"{tensor}: dimension 0 (kv_heads) of size {K} does not divide over mesh axis "
            f"{axis!r} of size {M} in sharding {self.name!r}, nor can each kv head be "
            f"replicated over it: that needs a size that is a multiple of num_kv_heads ({K}) "
            f"and divides num_heads ({N}); sizes that work: {fits}")

    # ---- specs -------------------------------------------------------------------------

    def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh: Mesh | None = None, tensor: str = "tensor", *,
             strict: bool = True) -> PartitionSpec:
        """Maps one logical name per dimension to a PartitionSpec.

        A mesh axis of size 1 is dropped. Errors name the tensor, the dimension and the
        mesh axis: an unknown logical name, a mesh axis used by two dimensions, and (with
        `strict`, as for parameters and caches) a dimension that does not divide; without
        `strict` (activation hints) such a dimension is left unsplit.
        """
        if shape is not None and len(shape) != len(names):
            raise ValueError(
                f"{tensor}: {len(names)} logical names {tuple(names)} for a tensor of "
                f"rank {len(shape)} (shape {tuple(shape)})"
            )
        rules = dict(self.rules)
        out: list[str | None] = []
        used: dict[str, tuple[int, str]] = {}
        for i, name in enumerate(names):
            if name is not None and name not in axes.ALL:
                raise ValueError(
                    f"{tensor}: dimension {i} has unknown logical axis {name!r}; expected one "
                    f"of {axes.ALL} or None"
                )
            mesh_axis = rules.get(name) if name is not None else None
            if mesh_axis is not None and mesh is not None and mesh.shape[mesh_axis] == 1:
                mesh_axis = None
            if mesh_axis is not None and shape is not None and mesh is not None:
                size = mesh.shape[mesh_axis]
                if shape[i] % size:
                    if not strict:
                        mesh_axis = None
                    else:
                        raise ValueError(
                            f"{tensor}: dimension {i} ({name}) of size {shape[i]} does not "
                            f"divide over mesh axis {mesh_axis!r} of size {size} in sharding "
                            f"{self.name!r}; use fewer devices (--devices) or a preset that "
                            f"does not split {name}"
                        )
            if mesh_axis is not None:
                if mesh_axis in used:
                    j, other = used[mesh_axis]
                    raise ValueError(
                        f"{tensor}: mesh axis {mesh_axis!r} is used by dimension {j} ({other}) "
                        f"and dimension {i} ({name}) in sharding {self.name!r}; a mesh axis "
                        f"may split only one dimension of a tensor"
                    )
                used[mesh_axis] = (i, name)
            out.append(mesh_axis)
        return PartitionSpec(*out)

    def named(self, mesh: Mesh, names: Sequence[str | None], shape: Sequence[int] | None = None,
              tensor: str = "tensor", *, strict: bool = True) -> NamedSharding:
        return NamedSharding(mesh, self.spec(names, shape, mesh, tensor, strict=strict))


def _layouts(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"sharding {name!r}: kv_layouts must be a list of {KV_LAYOUTS}, "
                         f"got {value!r}")
    return tuple(value)


def load_preset(name_or_path: str | ShardingConfig) -> ShardingConfig:
    """A short preset name (`tp`), a path to any YAML file, or a ShardingConfig as is."""
    if isinstance(name_or_path, ShardingConfig):
        return name_or_path
    if name_or_path in PRESETS:
        path = os.path.join(PRESET_DIR, PRESETS[name_or_path])
        name = name_or_path
    elif os.path.isfile(name_or_path):
        path = name_or_path
        name = os.path.splitext(os.path.basename(path))[0]
    else:
        raise ValueError(
            f"unknown sharding {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
            f"nor an existing YAML file"
        )
    with open(path) as f:
        try:
            d = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"sharding file {path} is not valid YAML: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"sharding file {path} must hold a mapping with mesh and rules")
    return ShardingConfig.from_dict(d, name)
