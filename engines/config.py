"""Model configuration: one frozen dataclass for every decoder family, read from HF config.json."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# Families the decoder implements, keyed by HF `model_type`.
FAMILIES = ("llama", "mistral", "qwen2", "gemma", "mixtral")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    max_position_embeddings: int = 4096
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
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )

    @property
    def num_groups(self) -> int:  # G = N / K
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        D, F, L, N, K, H, V = (self.hidden_size, self.intermediate_size, self.num_layers,
                               self.num_heads, self.num_kv_heads, self.head_dim,
                               self.vocab_size)
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.qkv_bias:
            attn += N * H + 2 * K * H
        mlp = 3 * D * F * max(self.num_experts, 1) + D * self.num_experts
        per_layer = attn + mlp + 2 * D
        head = 0 if self.tie_word_embeddings else V * D
        return V * D + L * per_layer + D + head

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["scan_layers"]
        d["eos_token_ids"] = list(self.eos_token_ids)
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


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """Maps a Hugging Face config.json dict to a ModelConfig, by `model_type`."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"config.json model_type {family!r} is not supported; expected one of {FAMILIES}"
        )
    # transformers >= 5 nests RoPE settings under `rope_parameters`; older files use
    # top-level `rope_theta` and `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rs = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    try:
        D = hf["hidden_size"]
        N = hf["num_attention_heads"]
        common: dict[str, Any] = dict(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=D,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=N,
            num_kv_heads=hf.get("num_key_value_heads") or N,
            head_dim=hf.get("head_dim") or D // N,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma")),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf),
        )
    except KeyError as e:
        raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            common["rope_scaling"] = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        elif kind != "default":
            raise ValueError(f"config.json rope_scaling type {kind!r} is not supported")
    if family in ("mistral", "mixtral", "qwen2"):
        use_sw = hf.get("use_sliding_window", family != "qwen2")
        if use_sw and hf.get("sliding_window"):
            common["sliding_window"] = int(hf["sliding_window"])
    if family == "qwen2":
        common["qkv_bias"] = True
    if family == "gemma":
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"config.json gemma activation {act!r} is not supported")
        common.update(activation="gelu_tanh", norm_plus_one=True, scale_embeddings=True)
    elif hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf.get('hidden_act')!r} is not supported")
    if family == "mixtral":
        common["num_experts"] = int(hf["num_local_experts"])
        common["num_experts_per_tok"] = int(hf["num_experts_per_tok"])
    return ModelConfig(**common)


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


def llama3_inv_freq(cfg: ModelConfig) -> list[float]:
    """RoPE inverse frequencies, with Llama 3 scaling when configured (host math)."""
    H = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / H)) for i in range(0, H, 2)]
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
