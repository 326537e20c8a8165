"""The Engine contract and what implements it: device math only."""

from engines.config import ModelConfig
from engines.engine_api import Engine, HostResults, ResultTokens, prefill_buckets
from engines.engine_config import EngineConfig
from engines.factory import create_engine
from engines.hf_config import from_hf_config, load_hf_config
from engines.kv_cache import DecodeState, Prefix
from engines.mock_engine import MockEngine
from engines.sampling import SamplingParams
from engines.transformer_engine import TransformerEngine

__all__ = [
    "DecodeState", "Engine", "EngineConfig", "HostResults", "MockEngine", "ModelConfig",
    "Prefix", "ResultTokens", "SamplingParams", "TransformerEngine", "create_engine",
    "from_hf_config", "load_hf_config", "prefill_buckets",
]
