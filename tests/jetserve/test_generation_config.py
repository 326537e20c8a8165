"""generation_config.json as the default sampling of requests (jetserve.generation_config),
and the one rule each request path applies: the request's value, else the model's, else
the path's own."""

import json

import pytest

from jetserve import generation_config as gc
from jetserve.batch.rows import build_job
from jetserve.request import ModelLimits
from jetserve.server.openai_format import prepare_chat, prepare_completion
from jetserve.server.openai_schema import ChatRequest, CompletionRequest


def _dir(tmp_path, **fields):
    (tmp_path / gc.FILE).write_text(json.dumps(fields))
    return str(tmp_path)


def test_read_takes_the_sampling_fields_and_max_new_tokens(tmp_path):
    d = _dir(tmp_path, do_sample=True, temperature=0.6, top_k=20, top_p=0.95, min_p=0,
             repetition_penalty=1.1, max_new_tokens=64, eos_token_id=[1, 2],
             transformers_version="5.25.0", pad_token_id=None)
    got = gc.read(d)
    assert got.given() == dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                               repetition_penalty=1.1, max_tokens=64)
    assert got.source == str(tmp_path / gc.FILE)
    assert got.describe() == ("temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, "
                              "repetition_penalty=1.1, max_new_tokens=64")
    assert gc.read(d, "vllm").given() == {}  # --generation-config vllm: the file unread
    assert gc.read(str(tmp_path / "none")).given() == {}
    assert gc.read("random:tiny").given() == {}
    assert gc.read(_dir(tmp_path, eos_token_id=2, temperature=None)).given() == {}
    with pytest.raises(ValueError, match="--generation-config must be one of"):
        gc.read(d, "hf")


@pytest.mark.parametrize("field, value, expected", [
    ("temperature", "0.7", "temperature must be a number in [0.0, 100.0], got '0.7'"),
    ("temperature", -1, "temperature must be a number"),
    ("top_p", 0, "top_p must be a number in (0.0, 1.0], got 0"),
    ("top_k", 2.5, "top_k must be an integer in [-1, "),
    ("top_k", True, "top_k must be an integer"),
    ("min_p", 1.5, "min_p must be a number in [0.0, 1.0]"),
    ("repetition_penalty", 0, "repetition_penalty must be a number in [0.001, 100.0]"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer in [1, "),
])
def test_a_bad_field_names_the_file_and_the_field(tmp_path, field, value, expected):
    d = _dir(tmp_path, **{field: value})
    with pytest.raises(ValueError) as e:
        gc.read(d)
    assert str(e.value).startswith(f"{tmp_path / gc.FILE}: ")
    assert expected in str(e.value)
    assert "--generation-config vllm" in str(e.value)


def test_a_file_that_is_not_an_object_is_an_error(tmp_path):
    (tmp_path / gc.FILE).write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        gc.read(str(tmp_path))
    (tmp_path / gc.FILE).write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        gc.read(str(tmp_path))


def test_resolve_request_then_model_then_engine():
    model = gc.GenerationDefaults(temperature=0.6, top_k=20, max_tokens=100)
    engine = dict(temperature=1.0, top_k=0, top_p=1.0, max_tokens=16)
    assert gc.resolve({}, model, engine) == dict(temperature=0.6, top_k=20, top_p=1.0,
                                                 max_tokens=100)
    # A request's value wins, 0 included; None is "unset".
    assert gc.resolve(dict(temperature=0.0, top_k=None, top_p=0.5, max_tokens=3), model,
                      engine) == dict(temperature=0.0, top_k=20, top_p=0.5, max_tokens=3)
    assert gc.resolve({}, gc.GenerationDefaults(), engine) == engine
    # The model's max_new_tokens is cut to the room a prompt leaves; a request's is not.
    assert gc.resolve({}, model, engine, room=40)["max_tokens"] == 40
    assert gc.resolve({"max_tokens": 90}, model, engine, room=40)["max_tokens"] == 90
    assert gc.resolve({}, gc.GenerationDefaults(), engine, room=4)["max_tokens"] == 16


def _limits(**defaults):
    return ModelLimits(vocab_size=256, max_prefill_length=64, max_seq_len=128, bos_id=None,
                       eos_ids=(0,), top_logprobs=4, tokenizer=None,
                       generation=gc.GenerationDefaults(**defaults))


def test_every_path_applies_the_model_defaults():
    limits = _limits(temperature=0.5, top_k=1, min_p=0.1, max_tokens=9)
    r = prepare_completion(limits, CompletionRequest(prompt=[1, 2, 3]), "m").requests[0]
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.min_p) == (0.5, 1, 0.1)
    assert r.max_tokens == 9
    r = prepare_completion(limits, CompletionRequest(prompt=[1], temperature=0.0, top_k=-1,
                                                     max_tokens=4), "m").requests[0]
    assert (r.sampling.temperature, r.sampling.top_k, r.max_tokens) == (0.0, 0, 4)
    job = build_job({"id": 1, "prompt_ids": [1, 2]}, limits)
    assert (job.request.sampling.temperature, job.request.max_tokens) == (0.5, 9)
    job = build_job({"id": 1, "prompt_ids": [1, 2], "temperature": 0.0}, limits,
                    default_max_tokens=3)
    assert (job.request.sampling.temperature, job.request.max_tokens) == (0.0, 3)
    # Without model defaults each path keeps its own: OpenAI's 1.0 and 16, batch's greedy.
    plain = _limits()
    r = prepare_completion(plain, CompletionRequest(prompt=[1]), "m").requests[0]
    assert (r.sampling.temperature, r.max_tokens) == (1.0, 16)
    job = build_job({"id": 1, "prompt_ids": [1, 2]}, plain)
    assert (job.request.sampling.temperature, job.request.max_tokens) == (0.0, 16)


def test_chat_max_tokens_default_is_cut_to_the_room_left():
    from engines.mock_engine import ByteTokenizer

    limits = ModelLimits(vocab_size=256, max_prefill_length=64, max_seq_len=128, bos_id=None,
                         eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)),
                         generation=gc.GenerationDefaults(max_tokens=1000, top_p=0.9))
    p = prepare_chat(limits, ChatRequest(messages=[{"role": "user", "content": "hi"}]), "m")
    r = p.requests[0]
    assert r.max_tokens == 128 - len(r.prompt_ids) and r.sampling.top_p == 0.9
