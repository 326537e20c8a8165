"""The edge checks in jetserve.server.validation, shared by both servers and batch jobs:
text a tokenizer accepts, JSON nesting, integer ranges, and error messages that stay
short whatever the value."""

import json

import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.server import chat_template
from jetserve.server import validation as v
from jetserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def sp_limits():
    """The bundled model's sentencepiece tokenizer: the one that failed deep inside."""
    tok = load_tokenizer(BUNDLED_DIR)
    return v.ModelLimits(vocab_size=tok.vocab_size, max_prefill_length=64, max_seq_len=128,
                         bos_id=tok.bos_id, eos_ids=tok.eos_ids, top_logprobs=0, tokenizer=tok)


@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "ok \ud83d\ude00"],
                         ids=["high", "low", "a pair left unjoined"])
def test_sentencepiece_never_sees_a_lone_surrogate(sp_limits, text):
    with pytest.raises(v.InvalidArgument) as e:
        v.encode_text(sp_limits, text, "prompt[2]", add_bos=None)
    assert e.value.field == "prompt[2]" and "surrogate" in str(e.value)
    # What JSON gives for a proper pair is one character, and it tokenizes.
    assert v.encode_text(sp_limits, json.loads('"ok \\ud83d\\ude00"'), "prompt", add_bos=None)


def test_chat_content_with_a_lone_surrogate_names_the_message(sp_limits):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\ud800"}]
    with pytest.raises(v.InvalidArgument) as e:
        chat_template.chat_prompt_ids(sp_limits, msgs)
    assert e.value.field == "messages[1].content"


@pytest.mark.parametrize("raw", [
    b'{"prompt": "' + b"[" * 1000 + b'"}',  # brackets inside a string do not nest
    b'{"prompt": "\\"' + b"[" * 1000 + b'"}',  # nor after an escaped quote
    b"[" * 64 + b"]" * 64,
    b"]" * 1000,
    b'"' + b"[" * 1000,  # an unterminated string: left to the JSON parser
], ids=["in a string", "after an escaped quote", "at the limit", "closers", "unterminated"])
def test_json_depth_allows(raw):
    v.check_json_depth(raw)


@pytest.mark.parametrize("raw", [
    b"[" * 65,
    b'{"a":' * 65 + b"1" + b"}" * 65,
    b'["\\\\"' + b", [" * 70,  # an escaped backslash does not escape the closing quote
    "[\ud800" + "[" * 70,  # a str with a lone surrogate is scanned as well
], ids=["lists", "objects", "after an escaped backslash", "str"])
def test_json_depth_refuses(raw):
    with pytest.raises(v.InvalidArgument) as e:
        v.check_json_depth(raw, "line")
    assert e.value.field == "line" and "64" in str(e.value)


@pytest.mark.parametrize("value, lo, hi", [(2**31, 0, 2**31 - 1), (-2, -1, 5), (True, 0, 1),
                                           (1.0, 0, 5), ("3", 0, 5)])
def test_check_int_refuses(value, lo, hi):
    with pytest.raises(v.InvalidArgument) as e:
        v.check_int(value, "top_k", lo, hi)
    assert e.value.field == "top_k"


def test_sampling_params_range_checks_integers():
    assert v.sampling_params(top_k=v.MAX_TOP_K).top_k == v.MAX_TOP_K
    assert v.sampling_params(top_k=-1).top_k == 0
    for top_k in (v.MAX_TOP_K + 1, 2**64, -2):
        with pytest.raises(v.InvalidArgument, match=r"top_k .*\[-1, 2147483647\]"):
            v.sampling_params(top_k=top_k)
    with pytest.raises(v.InvalidArgument, match="seed"):
        v.sampling_params(seed=v.MAX_SEED + 1)


def test_stop_strings_are_capped_and_checked():
    assert v.check_stop(["x" * v.MAX_STOP_LENGTH]) == ("x" * v.MAX_STOP_LENGTH,)
    for stop, field in [(["ok", "x" * (v.MAX_STOP_LENGTH + 1)], "stop[1]"),
                        ("y\udc00", "stop"), (["", "z"], "stop[0]")]:
        with pytest.raises(v.InvalidArgument) as e:
            v.check_stop(stop)
        assert e.value.field == field and len(str(e.value)) < 400


def test_show_is_short_for_any_value():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in ["x" * 5_000_000, 10**4000, list(range(10**6)), {str(i): i for i in range(10**5)},
                  deep, b"\xff" * 10**6]:
        assert len(v.show(value)) < 300
    assert v.show("a\ud800").encode("utf-8")  # escaped: encodable
    assert "5,000,000 characters" in v.show("x" * 5_000_000)
