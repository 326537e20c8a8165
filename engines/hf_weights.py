"""Which Hugging Face tensor fills which decoder parameter, per family, and how it is
reshaped on the way (engines/checkpoint.py reads the files with these tables).

Linear kernels keep HF's [out, in] order, with heads split out of the flattened axis
([N*H, D] -> [N, H, D]); the MoE experts' kernels and the router are transposed to
[in, out] (engines.model). Fused tensors (Phi-3's qkv_proj and gate_up_proj, gpt-oss's
and Llama 4's gate_up_proj) are split by rows or columns. Llama 4 rotates interleaved
pairs of each head's dims (2i, 2i+1) where the decoder rotates halves (i, i + H/2): its
q and k rows are reordered per head as they load (evens, then odds), which changes no
q.k product.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engines.config import ModelConfig

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _t(x, c):  # HF linear [out, in] -> [in, out]
    return x.T


def _q(x, c):  # [N*H, D] -> [N, H, D]
    return x.reshape(c.num_heads, c.head_dim, c.hidden_size)


def _kv(x, c):  # [K*H, D] -> [K, H, D]
    return x.reshape(c.num_kv_heads, c.head_dim, c.hidden_size)


def _o(x, c):  # [D, N*H] -> [D, N, H]
    return x.reshape(c.hidden_size, c.num_heads, c.head_dim)


def _heads(x, c):  # [N*h, in] -> [N, h, in]
    return x.reshape(c.num_heads, -1, x.shape[-1])


def _qb(x, c):
    return x.reshape(c.num_heads, c.head_dim)


def _kvb(x, c):
    return x.reshape(c.num_kv_heads, c.head_dim)


def _same(x, c):
    return x


def _rows(part: str, transform: Transform) -> Transform:
    """One part of a fused [q; k; v] or [gate; up] kernel (Phi-3), then `transform`."""
    def take(x, c):
        N, K, H, F = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        start, size = {"q": (0, N * H), "k": (N * H, K * H), "v": (N * H + K * H, K * H),
                       "gate": (0, F), "up": (F, F)}[part]
        whole = {"gate": 2 * F, "up": 2 * F}.get(part, (N + 2 * K) * H)
        if x.shape[0] != whole:
            raise ValueError(f"fused kernel has {x.shape[0]} rows, expected {whole}")
        return transform(x[start:start + size], c)
    return take


def _even(x, c):  # gpt-oss's gate_up_proj [..., 2F]: gate columns 0, 2, 4, ...
    return x[..., 0::2]


def _odd(x, c):  # ... and up columns 1, 3, 5, ...
    return x[..., 1::2]


def _first_half(x, c):  # Llama 4's gate_up_proj [E, D, 2F]: gate columns [0, F)
    return x[..., :x.shape[-1] // 2]


def _second_half(x, c):  # ... and up columns [F, 2F)
    return x[..., x.shape[-1] // 2:]


def rope_pairs_to_halves(x: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows [n*H, ...] of q or k heads reordered, per head, from interleaved RoPE pairs to
    halves: rows 0, 2, 4, ..., then 1, 3, 5, ... of each head (Llama 4's kernels, and a
    LoRA adapter's B of them)."""
    h = x.reshape(-1, head_dim, *x.shape[1:])
    return np.concatenate([h[:, 0::2], h[:, 1::2]], axis=1).reshape(x.shape)


def _pairs_to_halves(heads: Callable[[np.ndarray, ModelConfig], np.ndarray]) -> Transform:
    """`heads` ([n*H, D] -> [n, H, D]) of rows reordered by `rope_pairs_to_halves`."""
    def reorder(x, c):
        return heads(rope_pairs_to_halves(x, c.head_dim), c)
    return reorder


def _norm(name: str, ours: str | None = None) -> tuple[str, str, Transform]:
    return (f"model.layers.{{i}}.{name}.weight", f"layers_{{i}}/{ours or name}", _same)


# (HF name, our path, transform); `{i}` is the layer index. Our paths are '/'-joined keys.
# Block norms by layout (engines.model.Block): HF's names, which the params keep.
_PRE_NORMS = [_norm("input_layernorm"), _norm("post_attention_layernorm")]
_SANDWICH_NORMS = _PRE_NORMS + [_norm("pre_feedforward_layernorm"),
                                _norm("post_feedforward_layernorm")]
_POST_NORMS = [_norm("post_attention_layernorm"), _norm("post_feedforward_layernorm")]
_HEAD_QK_NORMS = [_norm("self_attn.q_norm", "self_attn/q_norm"),
                  _norm("self_attn.k_norm", "self_attn/k_norm")]
_PROJ_QK_NORMS = [
    ("model.layers.{i}.self_attn.q_norm.weight", "layers_{i}/self_attn/q_norm", _qb),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers_{i}/self_attn/k_norm", _kvb),
]
_PROJ = [
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj", _q),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj", _kv),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj", _kv),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj", _o),
]
_ATTN = _PRE_NORMS + _PROJ
_FUSED = "model.layers.{i}.self_attn.qkv_proj.weight"
_FUSED_MLP = "model.layers.{i}.mlp.gate_up_proj.weight"
_PHI3 = _PRE_NORMS + [
    (_FUSED, "layers_{i}/self_attn/q_proj", _rows("q", _q)),
    (_FUSED, "layers_{i}/self_attn/k_proj", _rows("k", _kv)),
    (_FUSED, "layers_{i}/self_attn/v_proj", _rows("v", _kv)),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj", _o),
    (_FUSED_MLP, "layers_{i}/mlp/gate_proj", _rows("gate", _same)),
    (_FUSED_MLP, "layers_{i}/mlp/up_proj", _rows("up", _same)),
    ("model.layers.{i}.mlp.down_proj.weight", "layers_{i}/mlp/down_proj", _same),
]
_BIAS = [
    ("model.layers.{i}.self_attn.q_proj.bias", "layers_{i}/self_attn/q_bias", _qb),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers_{i}/self_attn/k_bias", _kvb),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers_{i}/self_attn/v_bias", _kvb),
]
_DENSE_MLP = [(f"model.layers.{{i}}.mlp.{p}.weight", f"layers_{{i}}/mlp/{p}", _same)
              for p in ("gate_proj", "up_proj", "down_proj")]
# Experts are stacked: `{e}` runs over experts and the results stack on a new axis 0.
_MOE_MLP = [
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers_{i}/moe/router", _t),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "layers_{i}/moe/w1", _t),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", "layers_{i}/moe/w3", _t),
    ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", "layers_{i}/moe/w2", _t),
]
_QWEN3_MOE_MLP = [
    ("model.layers.{i}.mlp.gate.weight", "layers_{i}/moe/router", _t),
    ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "layers_{i}/moe/w1", _t),
    ("model.layers.{i}.mlp.experts.{e}.up_proj.weight", "layers_{i}/moe/w3", _t),
    ("model.layers.{i}.mlp.experts.{e}.down_proj.weight", "layers_{i}/moe/w2", _t),
]
# GLM-4.5 and DeepSeek-V3: Qwen3-MoE's, with the router's score-correction bias and the
# shared experts.
_GLM4_MOE_MLP = _QWEN3_MOE_MLP + [
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers_{i}/moe/router_bias", _same),
] + [(f"model.layers.{{i}}.mlp.shared_experts.{p}.weight", f"layers_{{i}}/shared_experts/{p}",
      _same) for p in ("gate_proj", "up_proj", "down_proj")]
_O_BIAS = [("model.layers.{i}.self_attn.o_proj.bias", "layers_{i}/self_attn/o_bias", _same)]
_GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"
# gpt-oss: sinks; a router with a bias; experts stacked in one tensor each ([E, D, 2F],
# gate and up columns interleaved; [E, F, D]), with biases.
_GPT_OSS = [
    ("model.layers.{i}.self_attn.sinks", "layers_{i}/self_attn/sinks", _same),
    ("model.layers.{i}.mlp.router.weight", "layers_{i}/moe/router", _t),
    ("model.layers.{i}.mlp.router.bias", "layers_{i}/moe/router_bias", _same),
    (_GATE_UP, "layers_{i}/moe/w1", _even),
    (_GATE_UP, "layers_{i}/moe/w3", _odd),
    ("model.layers.{i}.mlp.experts.down_proj", "layers_{i}/moe/w2", _same),
    (_GATE_UP + "_bias", "layers_{i}/moe/b1", _even),
    (_GATE_UP + "_bias", "layers_{i}/moe/b3", _odd),
    ("model.layers.{i}.mlp.experts.down_proj_bias", "layers_{i}/moe/b2", _same),
]
_FF = "model.layers.{i}.feed_forward"
# Llama 4: q and k in interleaved-pair RoPE order; experts stacked in one tensor each
# ([E, D, 2F] gate then up; [E, F, D]), a shared expert beside them.
_LLAMA4_ATTN = _PRE_NORMS + [
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj",
     _pairs_to_halves(_q)),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj",
     _pairs_to_halves(_kv)),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj", _kv),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj", _o),
]
_LLAMA4_DENSE = [(f"{_FF}.{p}.weight", f"layers_{{i}}/mlp/{p}", _same)
                 for p in ("gate_proj", "up_proj", "down_proj")]
_LLAMA4_MOE = [
    (f"{_FF}.router.weight", "layers_{i}/moe/router", _t),
    (f"{_FF}.experts.gate_up_proj", "layers_{i}/moe/w1", _first_half),
    (f"{_FF}.experts.gate_up_proj", "layers_{i}/moe/w3", _second_half),
    (f"{_FF}.experts.down_proj", "layers_{i}/moe/w2", _same),
] + [(f"{_FF}.shared_expert.{p}.weight", f"layers_{{i}}/shared_experts/{p}", _same)
     for p in ("gate_proj", "up_proj", "down_proj")]
# DeepSeek-V3's latent attention (engines.model.MlaAttention): per-head kernels split.
_MLA = {p: (f"model.layers.{{i}}.self_attn.{p}.weight", f"layers_{{i}}/self_attn/{p}", t)
        for p, t in (("q_proj", _heads), ("q_a_proj", _same), ("q_a_layernorm", _same),
                     ("q_b_proj", _heads), ("kv_a_proj_with_mqa", _same),
                     ("kv_a_layernorm", _same), ("kv_b_proj", _heads),
                     ("o_proj", lambda x, c: x.reshape(x.shape[0], c.num_heads, -1)))}
TOP = [
    ("model.embed_tokens.weight", "embed_tokens", _same),
    ("model.norm.weight", "norm", _same),
]
HEAD = [("lm_head.weight", "lm_head", _same)]

FAMILY_WEIGHTS: dict[str, list[tuple[str, str, Transform]]] = {
    "llama": _ATTN + _DENSE_MLP,
    "mistral": _ATTN + _DENSE_MLP,
    "gemma": _ATTN + _DENSE_MLP,
    "qwen2": _ATTN + _BIAS + _DENSE_MLP,
    "mixtral": _ATTN + _MOE_MLP,
    "qwen3": _ATTN + _HEAD_QK_NORMS + _DENSE_MLP,
    "gemma2": _SANDWICH_NORMS + _PROJ + _DENSE_MLP,
    "gemma3_text": _SANDWICH_NORMS + _PROJ + _HEAD_QK_NORMS + _DENSE_MLP,
    "olmo2": _POST_NORMS + _PROJ + _PROJ_QK_NORMS + _DENSE_MLP,
    "phi3": _PHI3,
    # These families' tables go on in layer_weights: each layer's MLP (dense, or experts)
    # and, for GLM-4.5, the attention's optional parts.
    "qwen3_moe": _ATTN + _HEAD_QK_NORMS,
    "glm4_moe": _ATTN,
    "gpt_oss": _ATTN + _GPT_OSS,
    "llama4_text": _LLAMA4_ATTN,
    "deepseek_v3": _PRE_NORMS,
}
# Families whose layers differ in MLP: (the dense layers' tensors, the expert layers').
LAYER_MLP_WEIGHTS: dict[str, tuple[list, list]] = {
    "qwen3_moe": (_DENSE_MLP, _QWEN3_MOE_MLP),
    "glm4_moe": (_DENSE_MLP, _GLM4_MOE_MLP),
    "deepseek_v3": (_DENSE_MLP, _GLM4_MOE_MLP),
    "llama4_text": (_LLAMA4_DENSE, _LLAMA4_MOE),
}
# Tensors a family's checkpoints carry that the decoder does not run: GLM-4.5's and
# DeepSeek-V3's multi-token-prediction layers, stored after the last decoder layer.
_UNUSED_LAYERS = ("glm4_moe", "deepseek_v3")


def layer_weights(cfg: ModelConfig, layer: int) -> list[tuple[str, str, Transform]]:
    """Layer `layer`'s rows of the family's table (with its MLP's, where layers differ)."""
    rows = FAMILY_WEIGHTS[cfg.family]
    if cfg.family == "glm4_moe":
        rows = (rows + (_BIAS if cfg.qkv_bias else [])
                + (_HEAD_QK_NORMS if cfg.qk_norm == "head" else []))
    if cfg.family == "gpt_oss":
        rows = rows + (_BIAS if cfg.qkv_bias else []) + (_O_BIAS if cfg.o_bias else [])
    if cfg.mla:
        q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
        rows = rows + [_MLA[p] for p in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm",
                                         "kv_b_proj", "o_proj")]
    if cfg.family in LAYER_MLP_WEIGHTS:
        dense, experts = LAYER_MLP_WEIGHTS[cfg.family]
        rows = rows + (experts if cfg.moe_layer(layer) else dense)
    return rows


def beyond_last_layer(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a layer past the decoder's last (GLM-4.5's next-token predictors)."""
    parts = name.split(".")
    return (cfg.family in _UNUSED_LAYERS and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= cfg.num_layers)
