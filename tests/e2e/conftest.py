"""Shared serving fixtures: one disaggregated random:tiny orchestrator for the session
(prefill on fake CPU devices 0-3, generate on 4-7), and servers over it on 127.0.0.1."""

import pytest

from engines import EngineConfig
from jetserve.server.config import ServerConfig
from jetserve.server.runner import BackgroundServers

TINY_MODEL = "random:tiny"
# Small shapes: compiles fast; max_seq_len is what the "prompt too long" cases hit (longer
# prompts than max_prefill_length are prefilled in chunks).
TINY_ENGINE = EngineConfig(max_concurrent_decodes=8, max_prefill_length=64, max_seq_len=256)


def local_config(**kw) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "grpc_port": 0, "http_port": 0,
                           "model_name": TINY_MODEL, "drain_timeout_s": 30.0, **kw})


@pytest.fixture(scope="session")
def tiny_orch():
    from jetserve import orchestrator

    orch = orchestrator.build(TINY_MODEL, interleaved=False, prefill_devices=4,
                              generate_devices=4, engine_config=TINY_ENGINE)
    orch.start()
    yield orch
    orch.stop(drain=False, timeout=30)


@pytest.fixture(scope="session")
def tiny_servers(tiny_orch):
    """Both servers, no API key, over the session orchestrator."""
    with BackgroundServers(tiny_orch, local_config()) as s:
        yield s


@pytest.fixture(scope="session")
def bundled_servers():
    """Both servers over the bundled model (real sentencepiece tokenizer, real text),
    interleaved on one fake device."""
    yield from interleaved_servers(None, "bundled", EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=256, max_seq_len=512))


def interleaved_servers(model: str | None, name: str, engine_config: EngineConfig):
    """Both servers over `model` (a --model value) interleaved on one fake device, as a
    generator for a fixture: it yields the servers and stops everything after."""
    import jax

    from jetserve import orchestrator

    orch = orchestrator.build(model, interleaved=True, devices=jax.devices()[:1],
                              engine_config=engine_config)
    orch.start()
    try:
        with BackgroundServers(orch, local_config(model_name=name)) as s:
            yield s
    finally:
        orch.stop(drain=False, timeout=30)


def random_llama_orch(d, vocab_size: int, seq_len: int, **config):
    """A started interleaved orchestrator (one device) over a random-weight tiny Llama
    written into `d` beside its tokenizer (`config`: more of its LlamaConfig)."""
    import jax
    import torch
    import transformers as tf

    from jetserve import orchestrator
    from tests.parity.hf_models import TINY

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "vocab_size": vocab_size,
                                          **config})).save_pretrained(d)
    orch = orchestrator.build(str(d), interleaved=True, devices=jax.devices()[:1],
                              engine_config=EngineConfig(max_concurrent_decodes=4,
                                                         max_prefill_length=seq_len // 2,
                                                         max_seq_len=seq_len))
    orch.start()
    return orch
