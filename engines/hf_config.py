"""Reading a Hugging Face config.json into a ModelConfig, by `model_type`: each family's
fields mapped to the decoder's options, and every field whose value the decoder does not
implement refused by name."""

from __future__ import annotations

import json
import os
from typing import Any

from engines import fp8_block
from engines.config import (
    CHUNKED,
    FAMILIES,
    FULL,
    GEMMA_FAMILIES,
    QWEN3_FAMILIES,
    SLIDING,
    ModelConfig,
    RopeScaling,
    yarn_mscale,
)


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


# Config fields whose other values change the math in ways the decoder does not
# implement: field -> the values it accepts (anything else is refused by name).
_UNIMPLEMENTED = {
    "attention_bias": (False, None), "mlp_bias": (False, None),
    "use_bidirectional_attention": (False, None), "clip_qkv": (None,),
    "final_logit_softcapping": (None,), "attn_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
}
# Per family, the fields of _UNIMPLEMENTED it does implement.
_IMPLEMENTS = {
    "qwen2": ("attention_bias",),
    "glm4_moe": ("attention_bias",),
    "gpt_oss": ("attention_bias",),
    "gemma2": ("final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar"),
    "gemma3_text": ("final_logit_softcapping", "attn_logit_softcapping",
                    "query_pre_attn_scalar"),
}
# Keys of a rope_parameters / rope_scaling dict each kind reads (others are refused).
_ROPE_KEYS = {
    "default": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "truncate", "mscale", "mscale_all_dim"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
}


def _rope_scaling(rs: dict[str, Any], hf: dict[str, Any]) -> RopeScaling | None:
    """One rope dict (transformers 5 `rope_parameters`, or an older `rope_scaling`) as a
    RopeScaling; None for plain RoPE."""
    kind = rs.get("rope_type", rs.get("type")) or "default"
    if kind not in _ROPE_KEYS:
        raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; expected "
                         f"one of {tuple(_ROPE_KEYS)}")
    extra = sorted(set(rs) - set(_ROPE_KEYS[kind])
                   - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    extra = [k for k in extra if rs[k] is not None]
    if extra:
        raise ValueError(f"config.json rope parameters {extra} are not implemented for rope "
                         f"type {kind!r}")
    if kind == "default":
        return None
    orig = int(rs.get("original_max_position_embeddings")
               or hf.get("original_max_position_embeddings") or 0)
    if kind in ("yarn", "longrope") and not orig:
        raise ValueError(f"config.json rope type {kind!r} needs "
                         f"original_max_position_embeddings")
    factor = rs.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = hf.get("max_position_embeddings", orig) / orig
    if factor is None:
        raise ValueError(f"config.json rope type {kind!r} needs a factor")
    if kind == "llama3":
        return RopeScaling(kind=kind, factor=float(factor),
                           low_freq_factor=float(rs["low_freq_factor"]),
                           high_freq_factor=float(rs["high_freq_factor"]),
                           original_max_position_embeddings=orig)
    if kind == "linear":
        return RopeScaling(kind=kind, factor=float(factor))
    att = rs.get("attention_factor")
    if kind == "yarn":
        if att is None and rs.get("mscale") and rs.get("mscale_all_dim"):
            att = yarn_mscale(factor, rs["mscale"]) / yarn_mscale(factor, rs["mscale_all_dim"])
        return RopeScaling(kind=kind, factor=float(factor),
                           original_max_position_embeddings=orig,
                           attention_factor=None if att is None else float(att),
                           beta_fast=float(rs.get("beta_fast") or 32),
                           beta_slow=float(rs.get("beta_slow") or 1),
                           truncate=bool(rs.get("truncate", True)))
    return RopeScaling(kind=kind, factor=float(factor), original_max_position_embeddings=orig,
                       attention_factor=None if att is None else float(att),
                       short_factor=tuple(rs["short_factor"]),
                       long_factor=tuple(rs["long_factor"]))


def _rope_of(hf: dict[str, Any], family: str) -> tuple[dict, dict | None]:
    """(the rope dict of full-attention layers, that of sliding layers where they have
    their own: Gemma 3), whichever way the config writes them."""
    rope = hf.get("rope_parameters") or {}
    if family == "gemma3_text":
        if FULL in rope or SLIDING in rope:
            return dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
        glob = dict(hf.get("rope_scaling") or {})
        glob["rope_theta"] = hf.get("rope_theta", 1_000_000.0)
        return glob, {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    rope = dict(rope)
    if hf.get("rope_scaling"):
        rope.update(hf["rope_scaling"])
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope, None


def _layer_types(hf: dict[str, Any], family: str, window: int | None,
                 L: int) -> tuple[str, ...] | None:
    """Each layer's attention kind, from `layer_types` or the family's older fields; None
    where all layers are alike."""
    if window is None:
        return None
    types = hf.get("layer_types")
    if types is None and family in ("gemma2", "gpt_oss"):
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(L)]
    elif types is None and family == "gemma3_text":
        n = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % n else FULL for i in range(L)]
    elif types is None and family in QWEN3_FAMILIES:
        first = int(hf.get("max_window_layers", 0))
        types = [SLIDING if i >= first else FULL for i in range(L)]
    if types is None or len(set(types)) == 1 and types[0] == SLIDING:
        return None
    return tuple(types)


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Maps a Hugging Face config.json dict to a ModelConfig, by `model_type`."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"config.json model_type {family!r} is not supported; expected one of {FAMILIES}"
        )
    stored_quant = _quantization(hf, family)
    for field, ok in _UNIMPLEMENTED.items():
        if field not in _IMPLEMENTS.get(family, ()) and hf.get(field) not in ok:
            raise ValueError(f"config.json {field}={hf[field]!r} is not implemented for "
                             f"{family} (expected {' or '.join(map(repr, ok))})")
    # transformers >= 5 nests RoPE settings under `rope_parameters`; older files use
    # top-level `rope_theta` and `rope_scaling`.
    rope, local_rope = _rope_of(hf, family)
    gemma = family in GEMMA_FAMILIES
    try:
        D = hf["hidden_size"]
        N = hf["num_attention_heads"]
        L = hf["num_hidden_layers"]
        common: dict[str, Any] = dict(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=D,
            intermediate_size=hf["intermediate_size"],
            num_layers=L,
            num_heads=N,
            num_kv_heads=hf.get("num_key_value_heads") or N,
            head_dim=hf.get("head_dim") or D // N,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(rope, hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
            partial_rotary_factor=float(rope.get("partial_rotary_factor")
                                        or hf.get("partial_rotary_factor") or 1.0),
        )
    except KeyError as e:
        raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    if local_rope is not None:
        if _rope_scaling(local_rope, hf) is not None:
            raise ValueError("config.json: scaled RoPE on sliding layers is not implemented")
        common["local_rope_theta"] = float(local_rope.get("rope_theta", 10000.0))
    window = None
    if family in ("mistral", "mixtral", "qwen2", *QWEN3_FAMILIES):
        use_sw = hf.get("use_sliding_window", family not in ("qwen2", *QWEN3_FAMILIES))
        if use_sw and hf.get("sliding_window"):
            window = int(hf["sliding_window"])
    elif family in ("gemma2", "gemma3_text", "phi3", "gpt_oss") and hf.get("sliding_window"):
        window = int(hf["sliding_window"])
    if window is not None:
        common["sliding_window"] = window
        if family != "qwen2":
            common["layer_types"] = _layer_types(hf, family, window, L)
            if common["layer_types"] is not None and SLIDING not in common["layer_types"]:
                common["layer_types"] = common["sliding_window"] = None
    if family == "qwen2":
        common["qkv_bias"] = True
    if family in (*QWEN3_FAMILIES, "gemma3_text"):
        common["qk_norm"] = "head"
    if family == "olmo2":
        common.update(qk_norm="projection", norm_layout="post")
    if gemma:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"config.json {family} activation {act!r} is not supported")
        common.update(activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True)
    elif hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf.get('hidden_act')!r} is not supported")
    if family in ("gemma2", "gemma3_text"):
        common.update(norm_layout="sandwich",
                      attn_logit_softcap=hf.get("attn_logit_softcapping"),
                      final_logit_softcap=hf.get("final_logit_softcapping"),
                      query_pre_attn_scalar=hf.get("query_pre_attn_scalar"))
    if family == "mixtral":
        common["num_experts"] = int(hf["num_local_experts"])
        common["num_experts_per_tok"] = int(hf["num_experts_per_tok"])
    if family in ("qwen3_moe", "glm4_moe", "gpt_oss", "llama4_text", "deepseek_v3"):
        own = {"qwen3_moe": _qwen3_moe, "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss,
               "llama4_text": _llama4_text, "deepseek_v3": _deepseek_v3}[family]
        try:  # the families' own fields
            common.update(own(hf, L))
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    return ModelConfig(**common, **stored_quant)


def _gpt_oss(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """gpt-oss: attention sinks, biases on q, k, v and o (`attention_bias`, on unless
    set false); every layer routes top-k over `num_local_experts` by a biased linear
    router (softmax over the top-k logits), experts with biases and the clamped SwiGLU
    (`swiglu_limit`, `swiglu_alpha`) of `intermediate_size` each."""
    del L
    bias = bool(hf.get("attention_bias", True))
    return dict(num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]), moe_router="topk_softmax",
                expert_bias=True, activation="clamped_swiglu",
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                attn_sinks=True, qkv_bias=bias, o_bias=bias)


def _llama4_text(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """Llama 4's text decoder: NoPE layers (`no_rope_layers`: 1 = RoPE, 0 = none; else
    every `no_rope_layer_interval`-th), their queries temperature-tuned
    (`attn_temperature_tuning`, `floor_scale`, `attn_scale`); weightless q/k norms on the
    RoPE layers (`use_qk_norm`); chunked attention (`attention_chunk_size`) on the
    layers `layer_types` names so (by default the RoPE ones); experts (`num_local_experts`
    of `intermediate_size`) on `moe_layers` (else every `interleave_moe_layer_step`-th),
    each beside a shared expert, routed top-k by the sigmoid of their logits, which
    scales their input; the other layers dense, of `intermediate_size_mlp`."""
    rope_flags = hf.get("no_rope_layers") or [
        int((i + 1) % int(hf.get("no_rope_layer_interval", 4)) != 0) for i in range(L)]
    if len(rope_flags) < L or any(f not in (0, 1) for f in rope_flags[:L]):
        raise ValueError(f"config.json no_rope_layers must give 0 or 1 for each of the {L} "
                         f"layers, got {rope_flags}")
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or [
        CHUNKED if r and chunk is not None else FULL for r in rope_flags[:L]]
    if any(t not in (FULL, CHUNKED) for t in types):
        raise ValueError(f"config.json llama4_text layer_types must each be {FULL!r} or "
                         f"{CHUNKED!r}, got {types}")
    step = int(hf.get("interleave_moe_layer_step", 1))
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        if step < 1:
            raise ValueError(f"config.json interleave_moe_layer_step must be >= 1, got {step}")
        moe_layers = range(step - 1, L, step)
    moe_layers = {int(i) for i in moe_layers}
    return dict(intermediate_size=int(hf["intermediate_size_mlp"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
                num_experts=int(hf["num_local_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                dense_layers=tuple(i for i in range(L) if i not in moe_layers),
                moe_router="topk_sigmoid", shared_experts=1,
                qk_norm="l2" if hf.get("use_qk_norm", True) else "none",
                nope_layers=tuple(i for i in range(L) if not rope_flags[i]),
                attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                floor_scale=float(hf.get("floor_scale", 8192)),
                attn_scale=float(hf.get("attn_scale", 0.1)),
                attention_chunk_size=None if chunk is None else int(chunk),
                layer_types=None if set(types) == {FULL} else tuple(types))


def _quantization(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Refuses a `quantization_config` the checkpoint reader does not read: gpt-oss's MXFP4
    experts (`*_blocks` / `*_scales`, kept 4-bit: expert_quant "mxfp4") and the FP8 blocks
    of DeepSeek-V3 and Qwen3 (`*.weight_scale_inv`, engines/fp8_block.py) are read. Returns
    the ModelConfig fields saying how the weights stay stored: square even FP8 blocks keep
    the MLP and expert kernels 8-bit (weight_quant "fp8_block"); other kernels and blocks
    are dequantized on load."""
    q = hf.get("quantization_config")
    if q is None:
        return {}
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method == "fp8" and isinstance(q, dict):
        bm, bn = fp8_block.block_size(q, family)
        if bm != bn or bm % 2:
            return {}
        return dict(weight_quant="fp8_block", quant_group_size=bm)
    if family != "gpt_oss" or method != "mxfp4":
        raise ValueError(f"config.json quantization_config with quant_method {method!r} is "
                         f"not implemented for {family} (read: gpt_oss's 'mxfp4'; 'fp8' "
                         f"blocks for {', '.join(fp8_block.FAMILIES)})")
    return dict(expert_quant="mxfp4")


def _glm4_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """GLM-4.5's attention options and MoE: q/k norms per head where `use_qk_norm`, qkv
    bias where `attention_bias`; the first `first_k_dense_replace` layers dense, the others
    a sigmoid router with a score-correction bias and group-limited top-k
    (`n_group`, `topk_group`), `routed_scaling_factor`, and `n_shared_experts` always on."""
    E = int(hf["num_local_experts"] if "num_local_experts" in hf else hf["n_routed_experts"])
    out = dict(num_experts=E, num_experts_per_tok=int(hf["num_experts_per_tok"]),
               moe_intermediate_size=int(hf["moe_intermediate_size"]),
               dense_layers=tuple(range(min(int(hf.get("first_k_dense_replace", 0)), L))),
               moe_router="sigmoid", moe_renormalize=bool(hf.get("norm_topk_prob", True)),
               moe_groups=int(hf.get("n_group") or 1),
               moe_topk_groups=int(hf.get("topk_group") or 1),
               moe_scale=float(hf.get("routed_scaling_factor", 1.0)),
               shared_experts=int(hf.get("n_shared_experts") or 0))
    if hf.get("use_qk_norm"):
        out["qk_norm"] = "head"
    out["qkv_bias"] = bool(hf.get("attention_bias", False))
    return out


def _deepseek_v3(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """DeepSeek-V3: multi-head latent attention (`q_lora_rank`, null for a plain q_proj;
    `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
    `rope_interleave`), its scores scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
    times YaRN's mscale(factor, `mscale_all_dim`) squared where the RoPE is scaled; and
    GLM-4.5's MoE (`_glm4_moe`: sigmoid router, groups, shared experts, dense first
    layers)."""
    Rkv, P = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"])
    Hn = int(hf["qk_nope_head_dim"])
    rope = _rope_of(hf, "deepseek_v3")[0]
    mscale = 1.0
    if (rope.get("rope_type", rope.get("type")) or "default") != "default" and rope.get(
            "mscale_all_dim"):
        mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
    out = _glm4_moe(hf, L)
    out.update(q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=Rkv,
               qk_nope_head_dim=Hn, qk_rope_head_dim=P, v_head_dim=int(hf["v_head_dim"]),
               rope_interleave=bool(hf.get("rope_interleave", True)),
               num_kv_heads=1, head_dim=Rkv + P, partial_rotary_factor=1.0,
               query_pre_attn_scalar=(Hn + P) / mscale ** 4)
    return out


def _qwen3_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    """Qwen3-MoE's MLP fields: a layer routes over the experts unless it is one of
    `mlp_only_layers` or falls between `decoder_sparse_step`s (as transformers picks)."""
    # Published configs say num_experts; transformers 5 writes num_local_experts.
    E = int(hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"])
    k = int(hf["num_experts_per_tok"])
    step = int(hf.get("decoder_sparse_step", 1))
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    F = int(hf["moe_intermediate_size"])
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step must be >= 1, got {step}")
    if not E:  # no experts: a dense model
        return {}
    dense = tuple(i for i in range(L) if i in only or (i + 1) % step)
    return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=F,
                dense_layers=dense, moe_renormalize=bool(hf.get("norm_topk_prob", False)))


def load_hf_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return from_hf_config(hf)
