"""From a `--model` argument to a ready engine: config, tokenizer, weights, devices.

`--model` is a Hugging Face directory, an Orbax directory written by `jetserve convert`,
`random:NAME` (random weights, byte tokenizer; for tests and benchmarks), or nothing (the
bundled model, or `random:tiny` until one is bundled).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax

from engines import EngineConfig, ModelConfig, TransformerEngine, create_engine, load_hf_config
from engines.checkpoint import is_orbax_dir, read_orbax_config
from engines.mock_engine import ByteTokenizer
from jetserve.scheduling.page_planner import with_pages
from jetserve.tokenizer import load_tokenizer
from sharding import ShardingConfig, load_preset

BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "bundled_model")

# Random-weight models by name (`--model random:NAME`), byte-level vocabulary of 256.
RANDOM_MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(0,)),
    "small": ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=8, num_kv_heads=4, head_dim=32, eos_token_ids=(0,)),
    # A tiny model with the bundled model's vocabulary of 4096 (a random draft model for
    # it: `--speculative draft:random:tiny-v4096:K`); token ids only.
    "tiny-v4096": ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                              num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                              eos_token_ids=(2,), bos_token_id=1),
    # The 156M-parameter f32 Llama of the performance issue (untied, vocab 32000): F = 2816
    # (8/3 D rounded up to 256) gives its 156M parameters and 492 MB read per step.
    "llama-156m": ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                              num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                              eos_token_ids=(2,), bos_token_id=1),
    # Qwen3-MoE of llama-156m's attention and active MLP: 64 experts of F 352, top 8 (8 x
    # 352 = 2816 per token, llama-156m's F), every layer routed: what routing costs beside
    # the dense model (`jetserve bench prefill`).
    "qwen3-moe-156m-active": ModelConfig(
        family="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
        num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64, qk_norm="head",
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=352,
        eos_token_ids=(2,), bos_token_id=1),
}


def default_model() -> str:
    if os.path.exists(os.path.join(BUNDLED_DIR, "config.json")):
        return BUNDLED_DIR
    return "random:tiny"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a `--model` argument names."""

    path: str | None  # directory, or None for random weights
    config: ModelConfig
    tokenizer: object | None

    @property
    def name(self) -> str:
        return self.path or "random"


def resolve_model(model: str | None) -> ModelSource:
    model = model or default_model()
    if model.startswith("random:"):
        name = model.split(":", 1)[1]
        if name not in RANDOM_MODELS:
            raise ValueError(f"unknown random model {name!r}; expected one of {list(RANDOM_MODELS)}")
        cfg = RANDOM_MODELS[name]
        tok = ByteTokenizer(eos_ids=cfg.eos_token_ids) if cfg.vocab_size == 256 else None
        return ModelSource(path=None, config=cfg, tokenizer=tok)
    return ModelSource(path=model, config=model_config(model), tokenizer=load_tokenizer(model))


def model_config(model: str | None) -> ModelConfig:
    """The ModelConfig of a `--model` argument alone (no tokenizer, no weights)."""
    model = model or default_model()
    if model.startswith("random:"):
        return resolve_model(model).config
    if not os.path.isdir(model):
        raise FileNotFoundError(f"--model {model!r}: no such directory")
    return read_orbax_config(model) if is_orbax_dir(model) else load_hf_config(model)


def build_engine(
    model: str | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    sharding: str | ShardingConfig | None = None,
    engine_config: EngineConfig | None = None,
    seed: int = 0,
) -> TransformerEngine:
    """The engine of `model` (a paged one wrapped in its PagePlanner, which plans the
    page table of every call); with speculative "draft:PATH:K" the draft model PATH (a
    directory or random:NAME) is resolved here too."""
    src = resolve_model(model)
    if isinstance(sharding, str):
        sharding = load_preset(sharding)
    spec = engine_config.spec if engine_config is not None else None
    draft = resolve_model(spec.path) if spec is not None and spec.kind == "draft" else None
    engine = create_engine(src.config, weights=src.path, devices=devices, sharding=sharding,
                           config=engine_config, tokenizer=src.tokenizer, seed=seed,
                           draft_config=draft.config if draft else None,
                           draft_weights=draft.path if draft else None)
    return with_pages(engine)
