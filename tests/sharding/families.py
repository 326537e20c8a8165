"""Tiny one-layer models of every family, shaped to exercise each preset on 4 and 8 devices.

Each family keeps its own options (tied embeddings, qkv bias, sliding window, Gemma norms,
experts) from tests/parity/hf_models.py, with 8 query heads (gemma 4) and a kv head count
chosen so that, across families, every preset both fits and fails to divide somewhere:
llama MHA (K=8), llama3 / qwen2 / mixtral K=4, mistral K=2, gemma MQA (K=1). tp and ep_tp
replicate kv heads over a model axis that divides the query heads, so only gemma's 4
query heads on 8 devices make them fail. dp_ep splits mixtral's 4 experts on 4 devices,
not on 8.
Weights are drawn on the host (larger than the init's, so greedy tokens vary and are not
near ties) and placed with the engine's shardings: no init program to compile.
"""

from __future__ import annotations

import jax
import numpy as np

from engines import EngineConfig, ModelConfig, TransformerEngine, create_engine, from_hf_config
from sharding import PRESETS, load_preset
from tests.parity.hf_models import FAMILIES, FAMILY_CONFIGS, TINY

KV_HEADS = {"llama": 8, "llama3": 4, "mistral": 2, "qwen2": 4, "gemma": 1, "mixtral": 4}
HEADS = {"gemma": 4}  # 8 for the others
PRESET_NAMES = tuple(PRESETS)
DEVICE_COUNTS = (4, 8)
ENGINE_CONFIG = EngineConfig(max_concurrent_decodes=8, max_prefill_length=16, max_seq_len=32)
PROMPTS = ([5, 17, 33, 2, 9], [100, 3, 3, 64, 12, 7, 90, 1, 45, 11, 8], [77, 6, 120])
MAX_TOKENS = 8


def model_config(family: str) -> ModelConfig:
    kind = {"llama3": "llama"}.get(family, family)
    hf = {**TINY, **FAMILY_CONFIGS[family], "model_type": kind, "num_hidden_layers": 1,
          "num_attention_heads": HEADS.get(family, 8), "num_key_value_heads": KV_HEADS[family]}
    if "head_dim" not in hf:
        hf["head_dim"] = 8
    return from_hf_config(hf)


def make_engine(family: str, preset: str, devices) -> TransformerEngine:
    return create_engine(model_config(family), devices=list(devices),
                         sharding=load_preset(preset), config=ENGINE_CONFIG)


def host_params(engine: TransformerEngine, seed: int = 0) -> dict:
    """numpy weights as stored (one copy of each kv head); the same for every layout of
    one family."""
    rng = np.random.default_rng(seed)
    gemma = engine.model_config.norm_plus_one

    def draw(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            centre = 0.0 if gemma else 1.0
            return (centre + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        # Small embeddings, large layers: with tied embeddings a one-layer model would
        # otherwise just repeat its input token.
        std = 0.05 if "embed" in name else 0.2 if len(a.shape) >= 2 else 0.1
        return (std * rng.standard_normal(a.shape)).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(draw, engine.checkpoint_abstract())


def place(engine: TransformerEngine, host: dict) -> dict:
    """host_params on the engine's devices, kv heads repeated where it replicates them."""
    return jax.device_put(engine.params_from_checkpoint(host), engine.param_shardings)


def greedy_tokens(engine: TransformerEngine, params) -> list[list[int]]:
    from jetserve.offline import generate_many

    out = generate_many(engine, params, PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in out]


def expected_error(family: str, preset: str, n: int) -> str | None:
    """The dimension a preset cannot split for this family on n devices, or None."""
    cfg = model_config(family)
    if preset == "dp_ep":  # attention whole on every device; experts split n ways
        return "expert" if cfg.num_experts and cfg.num_experts % n else None
    model = {
        "replicated": 1,
        "tp": n,
        "tp_kv_batch": np.gcd(cfg.num_kv_heads, n),
        "seq_tp": np.gcd(cfg.num_kv_heads, n),
        "ep_tp": n // np.gcd(max(cfg.num_experts, 1), n),
    }[preset]
    K = cfg.num_kv_heads
    # tp and ep_tp replicate kv heads over a model axis that is a multiple of them (and
    # divides the query heads): every device holds one copy of one kv head.
    replicated = (preset in ("tp", "ep_tp") and model % K == 0
                  and cfg.num_heads % model == 0)
    if K % model and not replicated:
        return "kv_heads"
    return None


__all__ = ["DEVICE_COUNTS", "FAMILIES", "PRESET_NAMES", "PROMPTS", "expected_error",
           "greedy_tokens", "host_params", "make_engine", "model_config", "place"]
