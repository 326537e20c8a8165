"""The orchestrator: prefill, transfer, generate and detokenize threads over engines.

See driver.py for the threading model. `build()` makes one from a `--model` argument,
interleaved on one slice or disaggregated over two disjoint slices of jax.devices().
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from engines import Engine, EngineConfig
from jetserve.orchestrator.config import MIXED, OrchestratorConfig
from jetserve.orchestrator.driver import Orchestrator
from jetserve.orchestrator.handle import Completion, RequestHandle
from jetserve.orchestrator.prefix_cache import model_cache_key
from jetserve.orchestrator.timing import (
    Event,
    PrefillDone,
    RequestFinished,
    RequestTiming,
    StepDone,
)
from jetserve.request import Delta, Overloaded, Request

__all__ = [
    "Completion", "Delta", "Event", "Orchestrator", "OrchestratorConfig", "Overloaded",
    "PrefillDone", "Request", "RequestFinished", "RequestHandle", "RequestTiming", "StepDone",
    "build", "keyed", "split_devices",
]

Devices = int | Sequence[jax.Device] | None


def split_devices(interleaved: bool, prefill_devices: Devices = None,
                  generate_devices: Devices = None,
                  devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
    """(prefill slice, generate slice) of `devices` (default jax.devices()).

    A count takes devices in order: the prefill slice first, the generate slice from what
    is left, so disaggregated slices are disjoint (default: half each). Interleaved: one
    slice (generate_devices, default all) serves both.
    """
    devs = list(devices if devices is not None else jax.devices())
    if interleaved:
        g = _take(devs, generate_devices, len(devs), "generate_devices")
        return g, g
    p = _take(devs, prefill_devices, max(1, len(devs) // 2), "prefill_devices")
    rest = [d for d in devs if d not in p]
    g = _take(rest, generate_devices, len(rest), "generate_devices")
    if set(p) & set(g):
        raise ValueError("prefill_devices and generate_devices overlap; give disjoint slices "
                         "or use interleaved mode")
    return p, g


def keyed(config: OrchestratorConfig | None, model: str | None,
          engine: Engine) -> OrchestratorConfig | None:
    """`config` with its prefix cache keyed by the served model, when it has a cache and
    no key yet."""
    if config is None or config.prefix_cache_key or not (
            config.prefix_cache_hbm_bytes or config.prefix_cache_host_bytes):
        return config
    key = model_cache_key(model, getattr(engine, "model_config", type(engine).__name__))
    return dataclasses.replace(config, prefix_cache_key=key)


def _take(pool: list, spec: Devices, default: int, name: str) -> list:
    n = default if spec is None else spec
    if isinstance(n, int) and not isinstance(n, bool):
        if not 1 <= n <= len(pool):
            raise ValueError(f"{name}={n}: expected between 1 and {len(pool)} devices "
                             f"(the devices not taken yet)")
        return pool[:n]
    out = list(n)
    if not out:
        raise ValueError(f"{name} is empty")
    return out


def build(model: str | None = None, *, interleaved: bool = True,
          devices: Sequence[jax.Device] | None = None,
          prefill_devices: Devices = None, generate_devices: Devices = None,
          prefill_sharding: str = "replicated", generate_sharding: str = "replicated",
          engine_config: EngineConfig | None = None,
          config: OrchestratorConfig | None = None, seed: int = 0) -> Orchestrator:
    """An orchestrator for `--model` (see jetserve.model_loading) on `devices` (default
    jax.devices()), not started yet. A prefix cache in `config` is keyed by this model
    (prefix_cache.model_cache_key)."""
    from jetserve.model_loading import build_engine

    p_devs, g_devs = split_devices(interleaved, prefill_devices, generate_devices, devices)
    if config is not None and config.scheduling == MIXED:
        return _mixed(model, interleaved, g_devs, generate_sharding, engine_config, config, seed)
    if interleaved:
        engine = build_engine(model, devices=g_devs, sharding=generate_sharding,
                              engine_config=engine_config, seed=seed)
        return Orchestrator.from_engines(engine, config=keyed(config, model, engine))
    pe = build_engine(model, devices=p_devs, sharding=prefill_sharding,
                      engine_config=engine_config, seed=seed)
    ge = build_engine(model, devices=g_devs, sharding=generate_sharding,
                      engine_config=engine_config, seed=seed)
    config = keyed(config, model, pe)
    return Orchestrator(prefill_engines=[pe], generate_engines=[ge],
                        prefill_params=[pe.load_params()], generate_params=[ge.load_params()],
                        config=config)


def _mixed(model, interleaved: bool, devices, sharding: str,
           engine_config: EngineConfig | None, config: OrchestratorConfig, seed: int):
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator.mixed import MixedOrchestrator

    if not interleaved:
        raise ValueError("--scheduling mixed runs prompts and decoding in one step on one "
                         "slice: leave out --prefill-devices / --generate-devices (or add "
                         "--interleaved)")
    if engine_config is None or engine_config.kv_layout != "paged":
        raise ValueError("--scheduling mixed runs its steps on the paged KV cache: add "
                         "--kv-layout paged")
    engine = build_engine(model, devices=devices, sharding=sharding,
                          engine_config=engine_config, seed=seed)
    return MixedOrchestrator.from_engines(engine, config=keyed(config, model, engine))
