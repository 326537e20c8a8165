"""Reading a PEFT LoRA adapter directory into host arrays, checked against the base model.

A PEFT adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are
named `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r], as the linear layers they modify store theirs. Nothing here touches a device:
engines/lora.py writes what this returns into the device pool.

Every refusal names the file, the tensor or field, the value and what was expected, since
an adapter trained for another model is the usual mistake.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from engines.config import ModelConfig
from engines.hf_weights import rope_pairs_to_halves

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def target_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The projections an adapter may modify: the dense MLP's too, except for a mixture
    of experts (whose experts are not nn.Linear projections PEFT names this way)."""
    return ATTENTION_MODULES if cfg.num_experts else ATTENTION_MODULES + MLP_MODULES


def module_dims(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of one projection of the stored model (its own kv heads)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (D, NH), "k_proj": (D, KH), "v_proj": (D, KH), "o_proj": (NH, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}[module]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterWeights:
    """One adapter on the host: per module, A [L, r, in] and B [L, out, r] (zeros for a
    layer it leaves alone), and the scale its delta is multiplied by."""

    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if set(self.a) != set(self.b):
            raise ValueError(f"a and b must name the same modules, got {sorted(self.a)} "
                             f"and {sorted(self.b)}")


def read_adapter(path: str, cfg: ModelConfig, max_rank: int) -> AdapterWeights:
    """The adapter in directory `path`, checked against the base model `cfg` (as stored)."""
    conf = _read_config(path, cfg, max_rank)
    rank = conf["r"]
    scale = conf["lora_alpha"] / (math.sqrt(rank) if conf.get("use_rslora") else rank)
    a, b = _read_tensors(path, cfg, rank)
    return AdapterWeights(path=path, rank=rank, scale=float(scale), a=a, b=b)


def _read_config(path: str, cfg: ModelConfig, max_rank: int) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (a PEFT adapter directory "
                         f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(file) as f:
        conf = json.load(f)
    rank = conf.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"{file}: r={rank!r} must be an integer in [1, {max_rank}] "
                         f"(--max-lora-rank {max_rank})")
    if not isinstance(conf.get("lora_alpha"), (int, float)):
        raise ValueError(f"{file}: lora_alpha={conf.get('lora_alpha')!r} must be a number")
    # Options that change the math beyond x A B: refused rather than served wrongly.
    for field, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                         ("rank_pattern", {}), ("alpha_pattern", {}),
                         ("modules_to_save", None)):
        if conf.get(field, plain) not in (plain, None, [], {}):
            raise ValueError(f"{file}: {field}={conf[field]!r} is not supported "
                             f"(only {plain!r})")
    allowed = target_modules(cfg)
    names = conf.get("target_modules") or []
    names = [names] if isinstance(names, str) else names
    unknown = [m for m in names if m not in allowed]
    if unknown:
        raise ValueError(f"{file}: target_modules {unknown} are not among the projections "
                         f"an adapter may modify here: {list(allowed)}")
    return conf


def _read_tensors(path: str, cfg: ModelConfig, rank: int):
    from safetensors.numpy import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}")
    L = cfg.num_layers
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    for name, x in load_file(file).items():
        m = _TENSOR.search(name)
        if m is None or m.group(3) not in target_modules(cfg) or int(m.group(1)) >= L:
            raise ValueError(f"{file}: tensor {name!r} is not a LoRA A/B weight of a "
                             f"projection among {list(target_modules(cfg))} in layers "
                             f"0..{L - 1}")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        n_in, n_out = module_dims(cfg, module)
        want = (rank, n_in) if which == "A" else (n_out, rank)
        if x.shape != want:
            raise ValueError(f"{file}: tensor {name!r} has shape {tuple(x.shape)}, the base "
                             f"model's {module} with r={rank} needs {want}")
        if which == "B" and module in ("q_proj", "k_proj") and cfg.family == "llama4_text":
            x = rope_pairs_to_halves(x, cfg.head_dim)  # as the base kernels were read
        store = a if which == "A" else b
        if module not in store:
            store[module] = np.zeros((L, *want), np.float32)
        store[module][layer] = x.astype(np.float32)
    for module in set(a) ^ set(b):
        raise ValueError(f"{file}: {module} has lora_{'A' if module in a else 'B'} weights "
                         f"but no lora_{'B' if module in a else 'A'}")
    return a, b
