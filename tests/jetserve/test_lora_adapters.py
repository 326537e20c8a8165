"""The LoRA flags and names on the host side (jetserve/lora_adapters.py, batch rows'
`model`, Request.lora_adapter), without a model."""

import argparse

import pytest

from engines.mock_engine import ByteTokenizer
from jetserve import lora_adapters
from jetserve.batch.rows import RowError, build_job
from jetserve.request import Request
from jetserve.server.validation import ModelLimits

LIMITS = ModelLimits(vocab_size=256, max_prefill_length=32, max_seq_len=48, bos_id=None,
                     eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)))


def _args(*argv):
    p = argparse.ArgumentParser()
    lora_adapters.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_set_the_engine_fields():
    assert lora_adapters.engine_fields(_args()) == {}
    assert lora_adapters.engine_fields(_args("--lora-modules", "a=/x", "b=/y")) == {
        "max_loras": 4, "max_lora_rank": 16}
    assert lora_adapters.engine_fields(_args("--max-loras", "2", "--max-lora-rank", "8")) == {
        "max_loras": 2, "max_lora_rank": 8}
    with pytest.raises(ValueError, match="--max-loras must be >= 1"):
        lora_adapters.engine_fields(_args("--lora-modules", "a=/x", "--max-loras", "0"))


@pytest.mark.parametrize("items, message", [
    (["a"], "expected NAME=PATH"), (["=/x"], "expected NAME=PATH"),
    (["a=/x", "a=/y"], "given twice"),
])
def test_malformed_lora_modules_are_named(items, message):
    with pytest.raises(ValueError, match=message):
        lora_adapters.parse_modules(items)
    assert lora_adapters.parse_modules(["a=/x=y", "b=/z"]) == [("a", "/x=y"), ("b", "/z")]


def test_an_engine_less_server_has_no_adapters():
    adapters = lora_adapters.Adapters([object()])
    assert not adapters.enabled and adapters.names() == []
    with pytest.raises(lora_adapters.UnknownAdapter, match="lora_adapter_id 'x'"):
        adapters.check("x", "lora_adapter_id")
    with pytest.raises(ValueError, match="--max-loras"):
        adapters.load("x", "/nowhere")


def test_batch_rows_name_an_adapter_by_model():
    row = {"id": 1, "prompt": "hi", "model": "alpha"}
    job = build_job(row, LIMITS, default_max_tokens=4, adapters=("alpha",))
    assert job.request.lora_adapter == "alpha"
    assert build_job({"id": 2, "prompt": "hi"}, LIMITS, default_max_tokens=4,
                     adapters=("alpha",)).request.lora_adapter is None
    with pytest.raises(RowError, match="model 'beta': no such LoRA adapter"):
        build_job({**row, "model": "beta"}, LIMITS, default_max_tokens=4, adapters=("alpha",))


def test_requests_key_the_prefix_cache_by_adapter():
    base, tuned = Request(prompt_ids=[1, 2]), Request(prompt_ids=[1, 2], lora_adapter="a")
    assert base.cache_key("m") == "m" and tuned.cache_key("m") != "m"
    assert tuned.prefill_kwargs() == {"adapter": "a"} and base.prefill_kwargs() == {}
    with pytest.raises(ValueError, match="lora_adapter"):
        Request(prompt_ids=[1], lora_adapter="")
    scored = Request(prompt_ids=[1], lora_adapter="a", prompt_logprobs=True, max_tokens=0)
    assert scored.prefill_kwargs() == {"adapter": "a"}  # scored through the adapter


def test_serve_loads_lora_modules_into_every_engine(monkeypatch):
    from jetserve import orchestrator
    from jetserve.cli import build_parser
    from jetserve.commands import serve

    class Engine:
        def __init__(self):
            self.loaded = []

        def load_adapter(self, name, path):
            self.loaded.append((name, path))

    class Orch:
        prefill_engines, generate_engines = [Engine()], [Engine()]

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw) or Orch())
    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--lora-modules",
                                      "a=/x", "b=/y", "--max-lora-rank", "8"])
    orch = serve.build_orchestrator(args)
    assert seen["engine_config"].max_loras == 4 and seen["engine_config"].max_lora_rank == 8
    for e in orch.prefill_engines + orch.generate_engines:
        assert e.loaded == [("a", "/x"), ("b", "/y")]
