"""PEFT-format LoRA adapters written by hand (no torch), for any ModelConfig, and the
reference they are checked against: the base parameters with each delta merged."""

from __future__ import annotations

import json

import jax
import numpy as np
from safetensors.numpy import save_file

from engines.lora_loading import module_dims

PREFIX = "base_model.model.model.layers"
SECTION = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path, cfg, targets, rank=4, alpha=8, seed=0, config=None, tensors=None,
                  std=0.3):
    """A PEFT adapter of `cfg` in directory `path` (a pathlib.Path): random A and B for
    `targets` in every layer, `tensors` added or replacing; -> (path, tensors)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            n_in, n_out = module_dims(cfg, m)
            key = f"{PREFIX}.{layer}.{SECTION[m]}.{m}"
            out[f"{key}.lora_A.weight"] = rng.normal(0, std, (rank, n_in)).astype(np.float32)
            out[f"{key}.lora_B.weight"] = rng.normal(0, std, (n_out, rank)).astype(np.float32)
    out.update(tensors or {})
    save_file(out, str(path / "adapter_model.safetensors"))
    conf = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets),
            "use_rslora": False, "peft_type": "LORA", **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return str(path), out


def merged_params(params, tensors, scale, cfg, shardings):
    """`params` with every adapter delta scale * B @ A added to its kernel."""
    host = jax.tree.map(np.array, jax.device_get(params))
    for layer in range(cfg.num_layers):
        for m, section in SECTION.items():
            key = f"{PREFIX}.{layer}.{section}.{m}"
            if f"{key}.lora_A.weight" not in tensors:
                continue
            d = scale * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
            # A scanned engine's layers are one stack (engines/layer_scan.py); a looped
            # one's are named per layer.
            stack = host["layers"][section] if "layers" in host else None
            w = stack[m][layer] if stack is not None else host[f"layers_{layer}"][section][m]
            flat = w.reshape(d.shape) if m != "o_proj" else w.reshape(cfg.hidden_size, -1)
            if stack is not None:
                stack[m][layer] = (flat + d).reshape(w.shape)
            else:
                host[f"layers_{layer}"][section][m] = (flat + d).reshape(w.shape)
    return jax.device_put(host, shardings)
