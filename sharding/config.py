"""Sharding presets: a mesh shape plus rules from logical axis names to mesh axes.

A preset is data (`sharding/presets/*.yaml`), so researchers swap layouts without touching
model code. Written as `W[D_X, F_Y]`: dimension D of W is split over mesh axis X.
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
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """mesh: ordered mesh axis -> size (-1: all remaining devices); rules: logical -> mesh."""

    name: str = "replicated"
    mesh: tuple[tuple[str, int], ...] = (("data", 1), ("model", -1))
    rules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        mesh_axes = [a for a, _ in self.mesh]
        if len(set(mesh_axes)) != len(mesh_axes):
            raise ValueError(f"sharding {self.name!r}: mesh axes repeat: {mesh_axes}")
        if sum(1 for _, n in self.mesh if n == -1) > 1:
            raise ValueError(f"sharding {self.name!r}: only one mesh axis may be -1")
        for a, n in self.mesh:
            if not isinstance(n, int) or (n < 1 and n != -1):
                raise ValueError(f"sharding {self.name!r}: mesh axis {a!r} size must be >= 1 or -1, got {n!r}")
        for logical, mesh_axis in self.rules:
            if logical not in axes.ALL:
                raise ValueError(
                    f"sharding {self.name!r}: unknown logical axis {logical!r} in rules; "
                    f"expected one of {axes.ALL}"
                )
            if mesh_axis not in mesh_axes:
                raise ValueError(
                    f"sharding {self.name!r}: rule {logical}: {mesh_axis} names a mesh axis "
                    f"that is not in the mesh {mesh_axes}"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str) -> ShardingConfig:
        unknown = set(d) - {"mesh", "rules"}
        if unknown:
            raise ValueError(f"sharding {name!r}: unknown keys {sorted(unknown)}; expected mesh, rules")
        mesh = d.get("mesh") or {"data": 1, "model": -1}
        rules = d.get("rules") or {}
        return cls(name=name, mesh=tuple((str(k), v) for k, v in mesh.items()),
                   rules=tuple((str(k), str(v)) for k, v in rules.items()))

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        fixed = math.prod(n for _, n in self.mesh if n != -1)
        if num_devices % fixed:
            raise ValueError(
                f"sharding {self.name!r}: mesh {dict(self.mesh)} needs a multiple of {fixed} "
                f"devices, got {num_devices}"
            )
        return {a: (num_devices // fixed if n == -1 else n) for a, n in self.mesh}

    def make_mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        shape = self.mesh_shape(len(devices))
        if math.prod(shape.values()) != len(devices):
            raise ValueError(
                f"sharding {self.name!r}: mesh {shape} uses {math.prod(shape.values())} devices, "
                f"but {len(devices)} were given"
            )
        arr = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
        return Mesh(arr, tuple(shape.keys()))

    def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh: Mesh | None = None, tensor: str = "tensor") -> PartitionSpec:
        """Maps logical names to a PartitionSpec, checking reuse and divisibility.

        A mesh axis of size 1 is dropped; a mesh axis already used by an earlier dim of
        the same tensor is an error (rules must not map two dims of one tensor to it).
        """
        rules = dict(self.rules)
        out: list[str | None] = []
        used: dict[str, str] = {}
        for i, name in enumerate(names):
            if name is not None and name not in axes.ALL:
                raise ValueError(f"{tensor}: unknown logical axis {name!r}")
            mesh_axis = rules.get(name) if name is not None else None
            if mesh_axis is not None and mesh is not None and mesh.shape[mesh_axis] == 1:
                mesh_axis = None
            if mesh_axis is not None:
                if mesh_axis in used:
                    raise ValueError(
                        f"{tensor}: mesh axis {mesh_axis!r} used twice (by {used[mesh_axis]!r} "
                        f"and {name!r}) in sharding {self.name!r}"
                    )
                used[mesh_axis] = name
                if shape is not None and mesh is not None and shape[i] % mesh.shape[mesh_axis]:
                    raise ValueError(
                        f"{tensor}: dimension {i} ({name}) of size {shape[i]} does not divide "
                        f"over mesh axis {mesh_axis!r} of size {mesh.shape[mesh_axis]} "
                        f"in sharding {self.name!r}"
                    )
            out.append(mesh_axis)
        return PartitionSpec(*out)

    def named(self, mesh: Mesh, names: Sequence[str | None], shape: Sequence[int] | None = None,
              tensor: str = "tensor") -> NamedSharding:
        return NamedSharding(mesh, self.spec(names, shape, mesh, tensor))


def load_preset(name_or_path: str) -> ShardingConfig:
    """A short preset name (`tp`) or a path to any YAML file."""
    if name_or_path in PRESETS:
        path = os.path.join(PRESET_DIR, PRESETS[name_or_path])
        name = name_or_path
    elif os.path.exists(name_or_path):
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
