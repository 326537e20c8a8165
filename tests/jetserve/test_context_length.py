"""The default max_seq_len: the model's context when its KV cache fits, else the longest
length that does, and an error naming the flags when nothing does."""

import argparse

import jax
import pytest

from engines import ModelConfig
from jetserve import context_length as cl
from jetserve.commands.common import add_model_arguments, engine_config
from jetserve.plan import ModelSpec, Precision, kv_tokens_that_fit

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
F32 = Precision(weight_bits=32, act_bits=32, kv_bits=32)
KV_TOKEN = 2 * 2 * 2 * 16 * 4  # 2 L K H values of 4 bytes
WEIGHTS = MODEL.param_count() * 4


def _mem(b):
    return cl.Memory(bytes=b, where="test memory")


def test_model_context_when_it_fits():
    S, why = cl.default_max_seq_len(MODEL, slots=8, precision=F32,
                                     memory=_mem(WEIGHTS + 8 * 4096 * KV_TOKEN))
    assert S == 4096
    assert "max_position_embeddings" in why and "8 slots x 4096 tokens" in why


def test_capped_by_memory_to_whole_pages():
    room = 8 * 1000 * KV_TOKEN  # 1,000 tokens per slot: 992 in whole pages of 16
    S, why = cl.default_max_seq_len(MODEL, slots=8, precision=F32, memory=_mem(WEIGHTS + room))
    assert S == 992
    assert "below the model's max_position_embeddings=4096" in why and "--max-seq-len" in why
    # The same arithmetic as `jetserve plan`: 8 slots of S tokens fit, of S + 16 do not.
    spec = ModelSpec.from_config(MODEL)
    assert 8 * S <= kv_tokens_that_fit(spec, F32, WEIGHTS + room) < 8 * (S + 16)


def test_no_room_names_the_flags():
    with pytest.raises(ValueError, match="--max-seq-len.*--max-concurrent-decodes"):
        cl.default_max_seq_len(MODEL, slots=8, precision=F32, memory=_mem(WEIGHTS + KV_TOKEN))


def test_precision_follows_dtype_quantization_and_kv_dtype():
    assert cl.precision_of("auto", "none", "auto", "cpu").weight_bits == 32
    assert cl.precision_of("auto", "none", "auto", "gpu").kv_bits == 16
    p = cl.precision_of("bfloat16", "int4", "int8", "tpu")
    assert (p.weight_bits, p.kv_bits) == (4, 8)


def test_cpu_memory_is_the_hosts_share(monkeypatch):
    assert cl.host_available_bytes() > 0
    # A fixed reading: the host's available memory moves between two reads of it.
    host = 16 * cl.GIB
    monkeypatch.setattr(cl, "host_available_bytes", lambda: host)
    devices = jax.devices()[:2]
    m = cl.usable_memory(devices, "replicated")
    assert m.bytes == pytest.approx(host * cl.HOST_FRACTION / 2)
    assert "shared by 2 CPU devices" in m.where
    assert cl.usable_memory(devices, "tp").bytes == pytest.approx(2 * m.bytes)


def test_engine_config_defaults_to_the_model_context(capsys):
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    cfg = engine_config(p.parse_args(["--model", "random:tiny"]), jax.devices()[:1])
    assert cfg.max_seq_len == 4096  # random:tiny's max_position_embeddings: it fits
    assert cfg.max_prefill_length == 512
    assert "max_seq_len=4096" in capsys.readouterr().err
    given = engine_config(p.parse_args(["--model", "random:tiny", "--max-seq-len", "96"]))
    assert (given.max_seq_len, given.max_prefill_length) == (96, 96)


def test_generate_names_the_limit_and_its_flag(capsys):
    from jetserve import cli

    argv = ["generate", "--model", "random:tiny", "--max-seq-len", "64",
            "--max-concurrent-decodes", "2", "--devices", "1",
            "--prompt-ids", ",".join(["7"] * 64)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "64 tokens" in err and "max_seq_len - 1 = 63" in err and "--max-seq-len" in err


def test_generate_takes_one_slot_per_prompt_unless_given():
    """A long default context costs slots x max_seq_len of KV: generate's default is one
    slot per prompt, at most DEFAULT_SLOTS; a given --max-concurrent-decodes stands.
    (On one device; tests/sharding/test_preset_prompt_counts.py rounds up for presets
    that split the slots.)"""
    from jetserve import cli
    from jetserve.commands.common import DEFAULT_SLOTS, decode_slots
    from jetserve.commands.generate import slots_for

    parser = cli.build_parser()
    two = parser.parse_args(["generate", "--prompt", "a", "--prompt-ids", "1,2"])
    assert slots_for(two, 1) == 2
    many = parser.parse_args(["generate", *["--prompt-ids", "3"] * (DEFAULT_SLOTS + 3)])
    assert slots_for(many, 1) == DEFAULT_SLOTS
    given = parser.parse_args(["generate", "--prompt", "a", "--max-concurrent-decodes", "5"])
    assert slots_for(given, 1) == 5
    # serve leaves the flag unset so that --max-num-seqs can size the slots alone.
    served = parser.parse_args(["serve"])
    assert decode_slots(served) == DEFAULT_SLOTS
    assert decode_slots(parser.parse_args(["serve", "--max-num-seqs", "3"])) == 3
