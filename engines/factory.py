"""Which transformer engine a config asks for: the one place that knows both classes.

It sits above the contiguous engine (engines/transformer_engine.py) and the paged one
(engines/paged_engine.py, its subclass), so neither imports the other to choose.
"""

from __future__ import annotations

from engines.lora_engine import LoraTransformerEngine, PagedLoraEngine
from engines.paged_engine import PagedTransformerEngine
from engines.transformer_engine import TransformerEngine

# EngineConfig.kv_layout -> the engine that keeps its KV that way.
ENGINES: dict[str, type[TransformerEngine]] = {
    TransformerEngine.KV_LAYOUT: TransformerEngine,
    PagedTransformerEngine.KV_LAYOUT: PagedTransformerEngine,
}
# The same, serving LoRA adapters (config.max_loras > 0).
LORA_ENGINES: dict[str, type[TransformerEngine]] = {
    TransformerEngine.KV_LAYOUT: LoraTransformerEngine,
    PagedTransformerEngine.KV_LAYOUT: PagedLoraEngine,
}


def create_engine(model_config, **kwargs) -> TransformerEngine:
    """The transformer engine for `kwargs["config"].kv_layout` (contiguous without a
    config); takes TransformerEngine's arguments. `config.max_loras` > 0: that layout's
    engine that also serves LoRA adapters."""
    config = kwargs.get("config")
    layout = config.kv_layout if config is not None else TransformerEngine.KV_LAYOUT
    if config is not None and config.max_loras:
        return LORA_ENGINES[layout](model_config, **kwargs)
    return ENGINES[layout](model_config, **kwargs)
