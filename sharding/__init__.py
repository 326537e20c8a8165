"""Meshes, logical axis names, rules and YAML presets. Imports nothing of jetserve's."""

from sharding import axes
from sharding.config import PRESETS, ShardingConfig, load_preset

__all__ = ["PRESETS", "ShardingConfig", "axes", "load_preset"]
