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
    config); takes TransformerEngine's arguments. `config.max_loras` > 0: the contiguous
    engine that also serves LoRA adapters."""
    config = kwargs.get("config")
    layout = config.kv_layout if config is not None else TransformerEngine.KV_LAYOUT
    if config is not None and config.max_loras:  # EngineConfig refuses it with paged KV
        return LoraTransformerEngine(model_config, **kwargs)
    return ENGINES[layout](model_config, **kwargs)
