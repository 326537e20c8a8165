"""Random-weight Hugging Face checkpoints of jetserve's `random:NAME` shapes.

`jetserve bench compare-hf` needs the same weights in both engines: this writes a
transformers LlamaForCausalLM with the shapes of `jetserve.model_loading.RANDOM_MODELS`
via save_pretrained (safetensors, no tokenizer: token ids only), which jetserve then loads
like any HF directory. Needs torch and transformers (the `test` extra).
"""

from __future__ import annotations

import os

from engines.config import ModelConfig
from jetserve.model_loading import RANDOM_MODELS


def hf_llama_config(cfg: ModelConfig, init_std: float):
    import transformers as tf

    if cfg.family != "llama" or cfg.rope_scaling is not None or cfg.num_experts:
        raise ValueError(f"only plain llama shapes are supported, got family {cfg.family!r}")
    return tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
        initializer_range=init_std,
    )


def make_hf_model(preset: str, out_dir: str, *, seed: int = 0, init_std: float = 0.02) -> str:
    """Writes a random LlamaForCausalLM shaped like RANDOM_MODELS[preset] to out_dir."""
    import torch
    import transformers as tf

    if preset not in RANDOM_MODELS:
        raise ValueError(f"--preset {preset!r} is unknown; expected one of {list(RANDOM_MODELS)}")
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(hf_llama_config(RANDOM_MODELS[preset], init_std)).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
