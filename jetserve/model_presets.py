"""Published model shapes by name, for planning without the weights (`--model-preset`).

Shapes as in each model's released config.json; only the counts matter to a plan, so
tokenizer ids are left out.
"""

from __future__ import annotations

from engines.config import CHUNKED, FULL, SLIDING, ModelConfig, RopeScaling


def _gemma3(layers: int, **shape) -> ModelConfig:
    """A Gemma 3 text model: five sliding layers of 1024 keys to one global."""
    return ModelConfig(family="gemma3_text", vocab_size=262208, num_layers=layers,
                       sliding_window=1024, layer_types=tuple(
                           SLIDING if (i + 1) % 6 else FULL for i in range(layers)),
                       qk_norm="head", norm_layout="sandwich", tie_word_embeddings=True,
                       activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True,
                       rope_theta=1e6, local_rope_theta=1e4, **shape)


def _qwen3_moe(**shape) -> ModelConfig:
    """A Qwen3-MoE model: 128 experts, top 8 renormalised, every layer routed."""
    return ModelConfig(family="qwen3_moe", vocab_size=151936, head_dim=128, qk_norm="head",
                       rope_theta=1e6, num_experts=128, num_experts_per_tok=8, **shape)


def _glm4_moe(**shape) -> ModelConfig:
    """A GLM-4.5 model: top 8 of the routed experts by a sigmoid router, one shared."""
    return ModelConfig(family="glm4_moe", vocab_size=151552, head_dim=128, qkv_bias=True,
                       partial_rotary_factor=0.5, num_experts_per_tok=8, moe_router="sigmoid",
                       shared_experts=1, rope_theta=1e6, **shape)


def _gpt_oss(layers: int, experts: int) -> ModelConfig:
    """A gpt-oss model: sliding (128 keys) and full attention layers in turn, attention
    sinks and q/k/v/o biases, top 4 of the experts by a biased router, biased experts
    with the clamped SwiGLU, kept MXFP4 as published; YaRN from 4,096 to 131,072
    positions."""
    return ModelConfig(family="gpt_oss", vocab_size=201088, hidden_size=2880,
                       intermediate_size=2880, moe_intermediate_size=2880, num_layers=layers,
                       num_heads=64, num_kv_heads=8, head_dim=64, sliding_window=128,
                       layer_types=tuple(SLIDING if i % 2 == 0 else FULL
                                         for i in range(layers)),
                       qkv_bias=True, o_bias=True, attn_sinks=True, num_experts=experts,
                       num_experts_per_tok=4, moe_router="topk_softmax", expert_bias=True,
                       activation="clamped_swiglu", expert_quant="mxfp4", rms_norm_eps=1e-5,
                       rope_theta=150000.0,
                       rope_scaling=RopeScaling(kind="yarn", factor=32.0, truncate=False,
                                                original_max_position_embeddings=4096),
                       max_position_embeddings=131072)


def _llama4(layers: int, experts: int) -> ModelConfig:
    """A Llama 4 text decoder: every 4th layer NoPE with full attention (queries
    temperature-tuned), the others RoPE with chunked attention over 8192 positions and
    weightless q/k norms; every layer top 1 of the experts (the sigmoid scaling its
    input) beside a shared expert. (RoPE scaling left out: a plan counts shapes.)"""
    nope = tuple(i for i in range(layers) if (i + 1) % 4 == 0)
    return ModelConfig(family="llama4_text", vocab_size=202048, hidden_size=5120,
                       intermediate_size=16384, moe_intermediate_size=8192,
                       num_layers=layers, num_heads=40, num_kv_heads=8, head_dim=128,
                       num_experts=experts, num_experts_per_tok=1, moe_router="topk_sigmoid",
                       shared_experts=1, qk_norm="l2", nope_layers=nope,
                       attn_temperature_tuning=True, attention_chunk_size=8192,
                       layer_types=tuple(FULL if i in nope else CHUNKED
                                         for i in range(layers)),
                       rms_norm_eps=1e-5, rope_theta=500000.0)


def _deepseek_v3(*, experts: int, heads: int, dense: int, groups: int, topk_groups: int,
                 vocab: int) -> ModelConfig:
    """A DeepSeek-V3 shape: 61 layers of multi-head latent attention (a q bottleneck of
    1536, a kv latent of 512 beside 64 RoPE dims: one kv head of 576 per token, absorbed),
    the first `dense` layers dense, the others top 8 of the routed experts by a sigmoid
    router within the best `topk_groups` of `groups` groups, one shared expert. (YaRN
    left out: a plan counts shapes.)"""
    return ModelConfig(family="deepseek_v3", vocab_size=vocab, hidden_size=7168,
                       intermediate_size=18432, moe_intermediate_size=2048, num_layers=61,
                       num_heads=heads, num_kv_heads=1, head_dim=512 + 64, q_lora_rank=1536,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                       v_head_dim=128, rope_interleave=True, query_pre_attn_scalar=192,
                       num_experts=experts, num_experts_per_tok=8, moe_router="sigmoid",
                       moe_groups=groups, moe_topk_groups=topk_groups, moe_scale=2.5,
                       shared_experts=1, dense_layers=tuple(range(dense)))


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
    "qwen3-8b": ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096,
                            intermediate_size=12288, num_layers=36, num_heads=32,
                            num_kv_heads=8, head_dim=128, qk_norm="head", rope_theta=1e6),
    "qwen3-32b": ModelConfig(family="qwen3", vocab_size=151936, hidden_size=5120,
                             intermediate_size=25600, num_layers=64, num_heads=64,
                             num_kv_heads=8, head_dim=128, qk_norm="head", rope_theta=1e6),
    "gemma3-12b": _gemma3(48, hidden_size=3840, intermediate_size=15360, num_heads=16,
                          num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-27b": _gemma3(62, hidden_size=5376, intermediate_size=21504, num_heads=32,
                          num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168),
    "phi4-mini": ModelConfig(family="phi3", vocab_size=200064, hidden_size=3072,
                             intermediate_size=8192, num_layers=32, num_heads=24,
                             num_kv_heads=8, head_dim=128, partial_rotary_factor=0.75,
                             tie_word_embeddings=True),
    "olmo2-13b": ModelConfig(family="olmo2", vocab_size=100352, hidden_size=5120,
                             intermediate_size=13824, num_layers=40, num_heads=40,
                             num_kv_heads=40, head_dim=128, qk_norm="projection",
                             norm_layout="post", rope_theta=500000.0),
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, intermediate_size=6144, num_layers=48,
                                num_heads=32, num_kv_heads=4, moe_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3_moe(hidden_size=4096, intermediate_size=12288, num_layers=94,
                                  num_heads=64, num_kv_heads=4, moe_intermediate_size=1536),
    "glm-4.5-air": _glm4_moe(hidden_size=4096, intermediate_size=10944, num_layers=46,
                             num_heads=96, num_kv_heads=8, num_experts=128,
                             moe_intermediate_size=1408, dense_layers=(0,)),
    "glm-4.5": _glm4_moe(hidden_size=5120, intermediate_size=12288, num_layers=92, num_heads=96,
                         num_kv_heads=8, num_experts=160, moe_intermediate_size=1536,
                         dense_layers=(0, 1, 2), qk_norm="head", moe_scale=2.5),
    "gpt-oss-20b": _gpt_oss(24, experts=32),
    "gpt-oss-120b": _gpt_oss(36, experts=128),
    "llama-4-scout": _llama4(48, experts=16),
    "deepseek-v3": _deepseek_v3(experts=256, heads=128, dense=3, groups=8, topk_groups=4,
                                vocab=129280),
    "kimi-k2": _deepseek_v3(experts=384, heads=64, dense=1, groups=1, topk_groups=1,
                            vocab=163840),
}
