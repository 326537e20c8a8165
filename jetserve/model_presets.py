"""Published model shapes by name, for planning without the weights (`--model-preset`).

Shapes as in each model's released config.json; only the counts matter to a plan, so
tokenizer ids are left out.
"""

from __future__ import annotations

from engines.config import ModelConfig

MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128),
    "llama2-13b": ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                              num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128),
    "llama2-70b": ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                              rope_theta=500000.0, max_position_embeddings=8192),
    "mistral-7b": ModelConfig(family="mistral", vocab_size=32000, hidden_size=4096,
                              intermediate_size=14336, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128, sliding_window=4096),
    "mixtral-8x7b": ModelConfig(family="mixtral", vocab_size=32000, hidden_size=4096,
                                intermediate_size=14336, num_layers=32, num_heads=32,
                                num_kv_heads=8, head_dim=128, num_experts=8,
                                num_experts_per_tok=2, rope_theta=1e6,
                                max_position_embeddings=32768),
    "qwen2-7b": ModelConfig(family="qwen2", vocab_size=152064, hidden_size=3584,
                            intermediate_size=18944, num_layers=28, num_heads=28,
                            num_kv_heads=4, head_dim=128, qkv_bias=True, rope_theta=1e6),
    "gemma-7b": ModelConfig(family="gemma", vocab_size=256000, hidden_size=3072,
                            intermediate_size=24576, num_layers=28, num_heads=16,
                            num_kv_heads=16, head_dim=256, tie_word_embeddings=True,
                            activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True),
}
