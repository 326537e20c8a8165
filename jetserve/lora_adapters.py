"""LoRA adapters as the commands and servers see them: the `--lora-modules`,
`--max-loras` and `--max-lora-rank` flags, and the adapters of an orchestrator's engines
by name (list, check, load and unload at run time).

The engines keep the adapters (engines/lora_engine.py); this module only finds the
engines that serve them and forwards. Every LoRA engine of a server holds the same set.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax

from engines.lora_registry import UnknownAdapter

__all__ = ["Adapters", "UnknownAdapter", "add_arguments", "load_modules", "parse_modules"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve, each under NAME; a "
                        "request names one (OpenAI model, gRPC lora_adapter_id)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters on the device at once; more are kept on the host and "
                        "swapped in least recently used (default 4 with --lora-modules; "
                        "give it alone to load adapters at run time only)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank r accepted (default 16)")


def engine_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the LoRA flags set ({} without LoRA)."""
    n = args.max_loras if args.max_loras is not None else (4 if args.lora_modules else 0)
    if n < 0 or (args.lora_modules and n == 0):
        raise ValueError(f"--max-loras must be >= 1 to serve LoRA adapters, got {n}")
    return {"max_loras": n, "max_lora_rank": args.max_lora_rank} if n else {}


def parse_modules(items: Sequence[str]) -> list[tuple[str, str]]:
    """['NAME=PATH', ...] -> [(NAME, PATH), ...]; a ValueError names a malformed one."""
    out, seen = [], set()
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        if name in seen:
            raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
        seen.add(name)
        out.append((name, path))
    return out


class Adapters:
    """The LoRA adapters of a set of engines (those that serve them), by name."""

    def __init__(self, engines: Sequence[Any], base_model: str = ""):
        unique = {id(e): e for e in engines if hasattr(e, "load_adapter")}
        self.engines = list(unique.values())
        self.base_model = base_model

    @classmethod
    def of(cls, orch: Any, base_model: str = "") -> Adapters:
        engines = [*getattr(orch, "prefill_engines", ()), *getattr(orch, "generate_engines", ())]
        return cls(engines, base_model)

    @property
    def enabled(self) -> bool:
        return bool(self.engines)

    def names(self) -> list[str]:
        return self.engines[0].adapters.names() if self.engines else []

    def check(self, name: str, field: str = "model") -> None:
        """Raises UnknownAdapter (its message names `field` and what is loaded) unless
        `name` is a loaded adapter."""
        if not self.engines or name not in self.engines[0].adapters:
            raise UnknownAdapter(f"{field} {name!r}: no such LoRA adapter (loaded: "
                                 f"{self.names()})")

    def load(self, name: str, path: str) -> None:
        """Reads the adapter at `path` into every engine (ValueError when malformed, or
        when this server has no LoRA pool)."""
        if not self.engines:
            raise ValueError("this server holds no LoRA adapters: start it with --max-loras "
                             "N (or --lora-modules) to load some")
        for e in self.engines:
            e.load_adapter(name, path)

    def load_at_run_time(self, name: str, path: str) -> None:
        """`load` for a client's request (POST /v1/load_lora_adapter): refused when
        several processes serve the model, whose others would not hold the adapter."""
        _one_process("loaded")
        self.load(name, path)

    def unload(self, name: str) -> None:
        """Forgets `name` in every engine (a client's request; refused as
        `load_at_run_time` is)."""
        _one_process("unloaded")
        self.check(name)
        for e in self.engines:
            e.unload_adapter(name)


def _one_process(what: str) -> None:
    """ValueError when several processes serve the model: only this one would change."""
    if jax.process_count() > 1:
        raise ValueError(f"LoRA adapters are not {what} at run time when several processes "
                         "serve one model: give every process the same --lora-modules")


def load_modules(engines: Sequence[Any], items: Sequence[str]) -> Adapters:
    """Loads every --lora-modules NAME=PATH into the engines that serve LoRA."""
    adapters = Adapters(engines)
    for name, path in parse_modules(items):
        adapters.load(name, path)
    return adapters
