"""Model configuration: one frozen dataclass for every decoder family, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# Families the decoder implements, keyed by HF `model_type`.
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "mixtral", "qwen3", "gemma2", "gemma3_text",
            "olmo2", "phi3", "qwen3_moe", "glm4_moe")
QWEN3_FAMILIES = ("qwen3", "qwen3_moe")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
ROPE_KINDS = ("llama3", "linear", "yarn", "longrope")
# Kinds of attention layer (HF `layer_types`): every key so far, or the last sliding_window.
FULL, SLIDING = "full_attention", "sliding_attention"
QK_NORMS = ("none", "head", "projection")
NORM_LAYOUTS = ("pre", "post", "sandwich")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`), by `kind`:
    "llama3" (Llama 3.1: factor, low/high_freq_factor, original_max_position_embeddings),
    "linear" (every frequency / factor), "yarn" (factor, original_max_position_embeddings,
    beta_fast, beta_slow, truncate, attention_factor) or "longrope" (short_factor and
    long_factor per frequency, original_max_position_embeddings, attention_factor)."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    kind: str = "llama3"
    attention_factor: float | None = None  # None: the kind's own default
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling kind must be one of {ROPE_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "short_factor", tuple(map(float, self.short_factor)))
        object.__setattr__(self, "long_factor", tuple(map(float, self.long_factor)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and per-family options of the decoder. Letters: D, F, L, N, K, H, V, E."""

    family: str = "llama"
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    qkv_bias: bool = False
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_plus_one: bool = False  # Gemma: x * (1 + w)
    scale_embeddings: bool = False  # Gemma: embeddings * sqrt(D)
    num_experts: int = 0  # E; 0 means a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's F; 0: intermediate_size
    # Layers of an MoE model whose MLP is dense (of intermediate_size: Qwen3-MoE's
    # mlp_only_layers / decoder_sparse_step); the others route over the experts.
    dense_layers: tuple[int, ...] = ()
    # The router (engines/moe.py Routing): "softmax" or "sigmoid" (a learned bias for the
    # choice, group-limited top-k); the top-k weights renormalised to sum to one, scaled.
    moe_router: str = "softmax"
    moe_renormalize: bool = True
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_scale: float = 1.0
    shared_experts: int = 0  # an always-on MLP of shared_experts * expert_size beside them
    max_position_embeddings: int = 4096
    # Per layer: FULL or SLIDING (sliding_window keys); None: every layer alike (all
    # sliding when sliding_window is set).
    layer_types: tuple[str, ...] | None = None
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: per "head" (Qwen3, Gemma 3)
    # or over the whole "projection" (OLMo 2)
    # Where the block's norms sit: "pre" (Llama: before attention and MLP), "post" (OLMo 2:
    # on their outputs), "sandwich" (Gemma 2/3: before and after each).
    norm_layout: str = "pre"
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # score scale 1/sqrt(this), not 1/sqrt(H)
    partial_rotary_factor: float = 1.0  # RoPE on the first H * this dims of each head
    local_rope_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # How the matmul kernels are stored (engines/quantization.py): "none", "int8" (per
    # output channel) or "int4" (groups of quant_group_size along the input axis).
    weight_quant: str = "none"
    quant_group_size: int = 32
    # One layer body run L times under a scan, parameters and decode cache stacked on a
    # leading layer axis (engines/layer_scan.py), instead of L unrolled copies: a compile
    # that does not grow with L. Set by the engine (where it runs decides), so it is never
    # written to a checkpoint's config.
    scan_layers: bool = False

    def __post_init__(self):
        if self.weight_quant not in ("none", "int8", "int4"):
            raise ValueError(
                f"weight_quant must be 'none', 'int8' or 'int4', got {self.weight_quant!r}")
        g = self.quant_group_size
        if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
            raise ValueError(f"quant_group_size must be an even integer >= 2, got {g!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {self.scan_layers!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
            if len(self.layer_types) != self.num_layers or bad:
                raise ValueError(
                    f"layer_types must name {self.num_layers} layers, each {FULL!r} or "
                    f"{SLIDING!r}, got {list(self.layer_types)}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")
        for name, allowed in (("qk_norm", QK_NORMS), ("norm_layout", NORM_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in "
                             f"(0, 1] and give an even number of rotary dims of {self.head_dim}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if any(not 0 <= i < self.num_layers for i in self.dense_layers) or (
                self.dense_layers and not self.num_experts):
            raise ValueError(f"dense_layers must be layers of an MoE model, in [0, "
                             f"{self.num_layers}), got {list(self.dense_layers)}")
        if self.moe_router not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router must be 'softmax' or 'sigmoid', got "
                             f"{self.moe_router!r}")
        if self.num_experts and (self.moe_groups < 1 or self.num_experts % self.moe_groups
                                 or not 1 <= self.moe_topk_groups <= self.moe_groups):
            raise ValueError(f"moe_groups {self.moe_groups} must divide the {self.num_experts} "
                             f"experts and moe_topk_groups {self.moe_topk_groups} be in "
                             f"[1, moe_groups]")
        if self.moe_intermediate_size < 0:
            raise ValueError(f"moe_intermediate_size must be >= 0, got "
                             f"{self.moe_intermediate_size}")

    @property
    def num_groups(self) -> int:  # G = N / K
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (all but with partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, layer: int) -> str:
        """FULL or SLIDING: whether layer `layer` attends over a window."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window else FULL

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it sees every earlier key)."""
        return self.sliding_window if self.layer_kind(layer) == SLIDING else None

    @property
    def mixed_layers(self) -> bool:
        """Whether layers differ in attention (window, RoPE) or MLP (dense beside routed
        experts): they cannot share one scanned layer body (engines/layer_scan.py)."""
        return (len({self.layer_kind(i) for i in range(self.num_layers)}) > 1
                or bool(self.dense_layers))

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP routes over the experts."""
        return bool(self.num_experts) and layer not in self.dense_layers

    @property
    def expert_size(self) -> int:
        """F of each expert."""
        return self.moe_intermediate_size or self.intermediate_size

    def param_count(self) -> int:
        D, F, L, N, K, H, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim,
                               self.vocab_size)
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.qkv_bias:
            attn += N * H + 2 * K * H
        moe = (3 * D * self.expert_size * (self.num_experts + self.shared_experts)
               + D * self.num_experts + (self.num_experts if self.moe_router == "sigmoid" else 0))
        mlp = sum(moe if self.moe_layer(i) else 3 * D * F for i in range(L))
        norms = {"pre": 2, "post": 2, "sandwich": 4}[self.norm_layout] * D
        norms += {"none": 0, "head": 2 * H, "projection": (N + K) * H}[self.qk_norm]
        head = 0 if self.tie_word_embeddings else V * D
        return V * D + L * (attn + norms) + mlp + D + head

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["scan_layers"]
        d["eos_token_ids"] = list(self.eos_token_ids)
        if d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])
        d["dense_layers"] = list(d["dense_layers"])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


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
    if types is None and family == "gemma2":
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
    elif family in ("gemma2", "gemma3_text", "phi3") and hf.get("sliding_window"):
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
    if family in ("qwen3_moe", "glm4_moe"):
        try:  # the families' own fields
            common.update((_qwen3_moe if family == "qwen3_moe" else _glm4_moe)(hf, L))
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    return ModelConfig(**common)


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
