"""Which transformer engine a config asks for: the one place that knows both classes.

It sits above the contiguous engine (engines/transformer_engine.py) and the paged one
(engines/paged_engine.py, its subclass), so neither imports the other to choose.
"""

from __future__ import annotations

from engines.paged_engine import PagedTransformerEngine
from engines.transformer_engine import TransformerEngine

# EngineConfig.kv_layout -> the engine that keeps its KV that way.
ENGINES: dict[str, type[TransformerEngine]] = {
    TransformerEngine.KV_LAYOUT: TransformerEngine,
    PagedTransformerEngine.KV_LAYOUT: PagedTransformerEngine,
}


def create_engine(model_config, **kwargs) -> TransformerEngine:
    """The transformer engine for `kwargs["config"].kv_layout` (contiguous without a
    config); takes TransformerEngine's arguments."""
    config = kwargs.get("config")
    layout = config.kv_layout if config is not None else TransformerEngine.KV_LAYOUT
    return ENGINES[layout](model_config, **kwargs)
