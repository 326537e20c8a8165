"""Meshes, logical axis names, rules and YAML presets. Imports nothing of jetserve's."""

from sharding import axes
from sharding.config import MODEL_DIMS, PRESETS, ShardingConfig, load_preset
from sharding.layout import constrain, layout, traced_under

__all__ = ["MODEL_DIMS", "PRESETS", "ShardingConfig", "axes", "constrain", "layout",
           "load_preset", "traced_under"]
