"""Which transformer engine a config asks for: the one place that knows both classes.

It sits above the contiguous engine (engines/transformer_engine.py) and the paged one
(engines/paged_engine.py, its subclass), so neither imports the other to choose.
"""

from __future__ import annotations

from engines.lora_engine import LoraTransformerEngine
from engines.paged_engine import PagedTransformerEngine
from engines.transformer_engine import TransformerEngine

# EngineConfig.kv_layout -> the engine that keeps its KV that way.
ENGINES: dict[str, type[TransformerEngine]] = {
    TransformerEngine.KV_LAYOUT: TransformerEngine,
    PagedTransformerEngine.KV_LAYOUT: PagedTransformerEngine,
}


def create_engine(model_config, **kwargs) -> TransformerEngine:
    """The transformer engine for `kwargs["config"].kv_layout` (contiguous without a
    config); takes TransformerEngine's arguments, and `lora_config` (engines.lora.LoraConfig)
    for one that serves LoRA adapters (contiguous only, for now)."""
    config = kwargs.get("config")
    layout = config.kv_layout if config is not None else TransformerEngine.KV_LAYOUT
    if kwargs.get("lora_config") is not None:
        if layout != TransformerEngine.KV_LAYOUT:
            raise ValueError(f"LoRA adapters are served with kv_layout "
                             f"{TransformerEngine.KV_LAYOUT!r}, not {layout!r}")
        return LoraTransformerEngine(model_config, **kwargs)
    kwargs.pop("lora_config", None)
    return ENGINES[layout](model_config, **kwargs)
