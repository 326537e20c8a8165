"""Model configuration: one frozen dataclass for every decoder family (read from HF
config.json by engines/hf_config.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Families the decoder implements, keyed by HF `model_type`.
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "mixtral", "qwen3", "gemma2", "gemma3_text",
            "olmo2", "phi3", "qwen3_moe", "glm4_moe", "gpt_oss", "llama4_text",
            "deepseek_v3")
QWEN3_FAMILIES = ("qwen3", "qwen3_moe")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
ROPE_KINDS = ("llama3", "linear", "yarn", "longrope")
# Kinds of attention layer (HF `layer_types`): every key so far, the last sliding_window,
# or those of the query's own chunk of attention_chunk_size positions (Llama 4).
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
QK_NORMS = ("none", "head", "projection", "l2")
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
MOE_ROUTERS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
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
    o_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    # A learned logit per query head in every softmax's sum, with no value (gpt-oss).
    attn_sinks: bool = False
    # The gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "clamped_swiglu"
    # (gpt-oss: gate clamped above and up on both sides at swiglu_limit, then
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    norm_plus_one: bool = False  # Gemma: x * (1 + w)
    scale_embeddings: bool = False  # Gemma: embeddings * sqrt(D)
    num_experts: int = 0  # E; 0 means a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's F; 0: intermediate_size
    # Layers of an MoE model whose MLP is dense (of intermediate_size: Qwen3-MoE's
    # mlp_only_layers / decoder_sparse_step); the others route over the experts.
    dense_layers: tuple[int, ...] = ()
    # The router (engines/moe.py Routing): "softmax", "sigmoid" (a learned bias for the
    # choice, group-limited top-k) or "topk_softmax" (gpt-oss: a biased linear router, the
    # softmax over the top-k logits) or "topk_sigmoid" (Llama 4: the sigmoid of each of the
    # top-k logits scales that expert's input, not its output); the top-k weights
    # renormalised to sum to one, scaled.
    moe_router: str = "softmax"
    moe_renormalize: bool = True
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_scale: float = 1.0
    shared_experts: int = 0  # an always-on MLP of shared_experts * expert_size beside them
    expert_bias: bool = False  # biases on each expert's projections (gpt-oss)
    max_position_embeddings: int = 4096
    # Multi-head latent attention (DeepSeek-V3; engines/model.py MlaAttention), on where
    # kv_lora_rank > 0: queries from x (q_proj) or through a rank-q_lora_rank bottleneck
    # (q_a_proj, q_a_layernorm, q_b_proj), qk_nope_head_dim + qk_rope_head_dim dims each;
    # keys and values from one shared latent of kv_lora_rank (kv_a_layernorm) and one
    # shared RoPE'd key of qk_rope_head_dim (kv_a_proj_with_mqa), expanded per head by
    # kv_b_proj (qk_nope_head_dim of key, v_head_dim of value). The caches and attention
    # paths see it in its absorbed form: one kv head (num_kv_heads 1) of head_dim
    # kv_lora_rank + qk_rope_head_dim, its keys [latent | RoPE'd key]; the caches hold the
    # keys only (`value_dim` 0) and attention reads its values from them (only the latent
    # part of the output is used). rope_interleave: RoPE on pairs (2i, 2i+1).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Per layer: FULL or SLIDING (sliding_window keys); None: every layer alike (all
    # sliding when sliding_window is set).
    layer_types: tuple[str, ...] | None = None
    qk_norm: str = "none"  # RMSNorm of q and k before RoPE: per "head" (Qwen3, Gemma 3)
    # or over the whole "projection" (OLMo 2); or "l2" (Llama 4): per head without a
    # weight, after RoPE, on the RoPE layers only
    # Llama 4: layers whose attention has no RoPE (NoPE); on them, with
    # attn_temperature_tuning, each query is scaled by
    # 1 + attn_scale * log1p(floor((position + 1) / floor_scale)).
    nope_layers: tuple[int, ...] = ()
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    attention_chunk_size: int | None = None  # CHUNKED layers' chunk of positions
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
    # output channel), "int4" (groups of quant_group_size along the input axis) or
    # "fp8_block" (an FP8 checkpoint's MLP kernels, blocks of quant_group_size squared).
    weight_quant: str = "none"
    quant_group_size: int = 32
    # How the MoE experts' kernels (w1, w3, w2) are stored, apart from weight_quant:
    # "mxfp4" keeps them as gpt-oss publishes them (4-bit codes, one power-of-two scale
    # per 32 inputs), dequantized inside the step like weight_quant's schemes.
    expert_quant: str = "none"
    # One layer body run L times under a scan, parameters and decode cache stacked on a
    # leading layer axis (engines/layer_scan.py), instead of L unrolled copies: a compile
    # that does not grow with L. Set by the engine (where it runs decides), so it is never
    # written to a checkpoint's config.
    scan_layers: bool = False

    def __post_init__(self):
        if self.weight_quant not in ("none", "int8", "int4", "fp8_block"):
            raise ValueError(f"weight_quant must be 'none', 'int8', 'int4' or 'fp8_block', "
                             f"got {self.weight_quant!r}")
        if self.expert_quant not in ("none", "mxfp4"):
            raise ValueError(
                f"expert_quant must be 'none' or 'mxfp4', got {self.expert_quant!r}")
        if self.expert_quant != "none" and not self.num_experts:
            raise ValueError(f"expert_quant {self.expert_quant!r} needs MoE experts "
                             f"(num_experts is 0)")
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
            bad = [t for t in self.layer_types if t not in (FULL, SLIDING, CHUNKED)]
            if len(self.layer_types) != self.num_layers or bad:
                raise ValueError(
                    f"layer_types must name {self.num_layers} layers, each {FULL!r}, "
                    f"{SLIDING!r} or {CHUNKED!r}, got {list(self.layer_types)}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")
            if CHUNKED in self.layer_types and not self.attention_chunk_size:
                raise ValueError("layer_types has chunked layers but attention_chunk_size is "
                                 "not set")
        c = self.attention_chunk_size
        if c is not None and (not isinstance(c, int) or c < 1):
            raise ValueError(f"attention_chunk_size must be a positive integer, got {c!r}")
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers must be layers in [0, {self.num_layers}), got "
                             f"{list(self.nope_layers)}")
        if self.attn_temperature_tuning and not self.floor_scale > 0:
            raise ValueError(f"floor_scale must be > 0, got {self.floor_scale!r}")
        for name, allowed in (("qk_norm", QK_NORMS), ("norm_layout", NORM_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in "
                             f"(0, 1] and give an even number of rotary dims of {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "clamped_swiglu" and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit!r}")
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
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"moe_router must be one of {MOE_ROUTERS}, got {self.moe_router!r}")
        if self.num_experts and (self.moe_groups < 1 or self.num_experts % self.moe_groups
                                 or not 1 <= self.moe_topk_groups <= self.moe_groups):
            raise ValueError(f"moe_groups {self.moe_groups} must divide the {self.num_experts} "
                             f"experts and moe_topk_groups {self.moe_topk_groups} be in "
                             f"[1, moe_groups]")
        if self.mla:
            self._check_mla()
        if self.moe_intermediate_size < 0:
            raise ValueError(f"moe_intermediate_size must be >= 0, got "
                             f"{self.moe_intermediate_size}")

    def _check_mla(self):
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer with kv_lora_rank, "
                                 f"got {v!r}")
        if self.qk_rope_head_dim % 2 or self.q_lora_rank < 0:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and "
                             f"q_lora_rank ({self.q_lora_rank}) >= 0")
        want = self.kv_lora_rank + self.qk_rope_head_dim
        if self.num_kv_heads != 1 or self.head_dim != want:
            raise ValueError(f"multi-head latent attention is one kv head of kv_lora_rank + "
                             f"qk_rope_head_dim = {want} dims: num_kv_heads must be 1 and "
                             f"head_dim {want}, got {self.num_kv_heads} and {self.head_dim}")
        if self.qk_norm != "none" or self.qkv_bias or self.o_bias or self.attn_sinks:
            raise ValueError("multi-head latent attention takes no qk_norm, qkv_bias, "
                             "o_bias or attn_sinks")

    @property
    def mla(self) -> bool:
        """Whether the attention is multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def num_groups(self) -> int:  # G = N / K
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (all but with partial rotary;
        MLA: its qk_rope_head_dim)."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_kind(self, layer: int) -> str:
        """FULL or SLIDING: whether layer `layer` attends over a window."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window else FULL

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it sees every earlier key)."""
        return self.sliding_window if self.layer_kind(layer) == SLIDING else None

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of layer `layer` (None: not chunked)."""
        return self.attention_chunk_size if self.layer_kind(layer) == CHUNKED else None

    def layer_reach(self, layer: int) -> int | None:
        """How far back layer `layer`'s queries see (None: to position 0): its window or
        its attention chunk (engines.attention.reach)."""
        return reach(self.layer_window(layer), self.layer_chunk(layer))

    def layer_rope(self, layer: int) -> bool:
        """Whether layer `layer`'s attention applies RoPE (not a Llama 4 NoPE layer)."""
        return layer not in self.nope_layers

    @property
    def mixed_layers(self) -> bool:
        """Whether layers differ in attention (window, chunk, RoPE) or MLP (dense beside
        routed experts): they cannot share one scanned layer body (engines/layer_scan.py)."""
        return (len({self.layer_kind(i) for i in range(self.num_layers)}) > 1
                or bool(self.dense_layers)
                or 0 < len(set(self.nope_layers)) < self.num_layers)

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
        E, Fe = self.num_experts, self.expert_size
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.mla:
            attn = self.mla_params()
        attn += (N * H + 2 * K * H) * self.qkv_bias + D * self.o_bias + N * self.attn_sinks
        moe = (3 * D * Fe * (E + self.shared_experts) + D * E
               + (E if self.moe_router in ("sigmoid", "topk_softmax") else 0)
               + (E * (2 * Fe + D) if self.expert_bias else 0))
        mlp = sum(moe if self.moe_layer(i) else 3 * D * F for i in range(L))
        norms = {"pre": 2, "post": 2, "sandwich": 4}[self.norm_layout] * D
        norms += {"none": 0, "head": 2 * H, "projection": (N + K) * H, "l2": 0}[self.qk_norm]
        head = 0 if self.tie_word_embeddings else V * D
        return V * D + L * (attn + norms) + mlp + D + head

    def mla_params(self) -> int:
        """The parameters of one layer's latent attention (its projections and norms)."""
        D, N, Rq, Rkv = self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank
        Hq = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = D * Rq + Rq + Rq * N * Hq if Rq else D * N * Hq
        kv = D * (Rkv + self.qk_rope_head_dim) + Rkv + Rkv * N * (self.qk_nope_head_dim
                                                                  + self.v_head_dim)
        return q + kv + N * self.v_head_dim * D

    @property
    def value_dim(self) -> int:
        """The width of each cached value entry: head_dim, or 0 where the caches hold keys
        only and attention reads the values from them (multi-head latent attention, whose
        values are the latent part of its keys: engines.attention.key_only)."""
        return 0 if self.mla else self.head_dim

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        K, H = self.num_kv_heads, self.head_dim
        return self.num_layers * K * (H + self.value_dim) * bytes_per_value

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["scan_layers"]
        d["eos_token_ids"] = list(self.eos_token_ids)
        if d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])
        d["dense_layers"] = list(d["dense_layers"])
        d["nope_layers"] = list(d["nope_layers"])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def reach(sliding_window: int | None, chunk: int | None) -> int | None:
    """How far back any query sees (None: to position 0): the window, or the chunk's
    length, whichever is shorter; what the block-skipping paths bound their spans by."""
    if chunk is None:
        return sliding_window
    return chunk if sliding_window is None else min(chunk, sliding_window)


def ring_pages(reach: int, span: int, page_size: int) -> int:
    """Pages per slot of a paged layer that sees `reach` positions back, when one step
    writes at most `span` positions of a slot (engines/paged_kv.py WindowRing): the keys
    a step's queries read and those it writes fit without a page holding two of them."""
    return -(-(reach + span - 1) // page_size) + 1
