"""Input rows -> jobs (or errors naming the problem), and the rows written for them."""

import math

import pytest

from engines.mock_engine import ByteTokenizer
from jetserve.batch.results import error_row, generate_row, score_row
from jetserve.batch.rows import GenerateJob, RowError, ScoreJob, build_job, parse_line, row_id
from jetserve.server.validation import ModelLimits

LIMITS = ModelLimits(vocab_size=256, max_prefill_length=32, max_seq_len=48, bos_id=None,
                     eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)))


def job(row, limits=LIMITS):
    return build_job(row, limits, default_max_tokens=7)


def test_generation_rows_from_text_ids_and_messages():
    j = job({"id": "a", "prompt": "hi", "temperature": 0.5, "seed": 3, "stop": "x",
             "logprobs": 2, "metadata": {"k": [1]}})
    assert isinstance(j, GenerateJob)
    assert j.request.prompt_ids == (104, 105)
    assert j.request.max_tokens == 7  # the default
    assert j.request.sampling.temperature == 0.5 and j.request.sampling.seed == 3
    assert j.request.stop_strings == ("x",) and j.request.logprobs == 2
    assert j.metadata == {"k": [1]}
    assert job({"id": 1, "prompt_ids": [5, 6, 7], "max_tokens": 3,
                "logprobs": True}).request.logprobs == 0
    chat = job({"id": 2, "messages": [{"role": "user", "content": "yo"}]})
    assert len(chat.request.prompt_ids) > 2


@pytest.mark.parametrize("row, words", [
    ({"id": "a"}, ["exactly one of", "prompt", "got none"]),
    ({"id": "a", "prompt": "x", "prompt_ids": [1]}, ["exactly one of", "'prompt_ids'"]),
    ({"id": "a", "prompt": "x", "temprature": 1}, ["unknown field", "temprature"]),
    ({"id": "a", "prompt": "x", "max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"id": "a", "prompt": "x", "max_tokens": 100}, ["max_tokens = 100", "too large"]),
    ({"id": "a", "prompt": "x" * 40}, ["prompt has 40 tokens", "longest prompt is 32", "--max-prefill-length"]),
    ({"id": "a", "prompt_ids": [1, 300]}, ["prompt_ids[1] = 300", "vocabulary"]),
    ({"id": "a", "prompt": "x", "temperature": "hot"}, ["temperature"]),
    ({"id": "a", "prompt": "x", "logit_bias": {"256": 1}}, ["logit_bias", "'256'", "0..255"]),
    ({"id": "a", "prompt": "x", "logit_bias": {"5": -101}}, ["logit_bias[5]", "[-100, 100]"]),
    ({"id": "a", "prompt": "x", "ignore_eos": 1}, ["ignore_eos", "true or false"]),
    ({"id": "a", "prompt": "x", "logprobs": 9}, ["logprobs = 9", "4"]),
    ({"id": "a", "context": "x"}, ["continuation", "got none"]),
    ({"id": "a", "context": "x", "continuation": "y", "max_tokens": 2},
     ["unknown field", "max_tokens", "scoring"]),
    ({"id": "a", "context": "x" * 30, "continuation": "y" * 30},
     ["60 tokens", "30 + 30", "longest prompt is 32"]),
    ({"id": "a", "context": 5, "continuation": "y"}, ["context must be a string"]),
    ({"id": "a", "context": "x", "continuation": "y", "add_bos": "yes"},
     ["add_bos", "true or false", "'yes'"]),
    ({"id": "a", "context_ids": [1], "continuation": "y", "add_bos": True},
     ["add_bos", "with context_ids"]),
])
def test_bad_rows_name_the_problem(row, words):
    with pytest.raises(RowError) as e:
        job(row)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("line, words", [
    ("[1, 2]", ["JSON object", "list"]),
    ('{"prompt": "x"}', ['no "id"']),
    ('{"id": true, "prompt": "x"}', ['"id"', "True"]),
    ('{"id": "", "prompt": "x"}', ['"id"', "non-empty"]),
    ('{"id": 1.5, "prompt": "x"}', ['"id"', "1.5"]),
])
def test_bad_ids(line, words):
    with pytest.raises(RowError) as e:
        row_id(parse_line(line))
    for w in words:
        assert w in str(e.value)


def test_not_json_names_the_column():
    with pytest.raises(RowError, match="not valid JSON.*column 8"):
        parse_line('{"id": x}')


def test_scoring_rows_move_the_context_whitespace_to_the_continuation():
    j = job({"id": "s", "context": "ab ", "continuation": "c"})
    assert isinstance(j, ScoreJob)
    assert j.request.prompt_ids == (97, 98, 32, 99)
    assert j.context_len == 2  # " c" is scored, as evaluation harnesses do
    assert j.request.max_tokens == 0 and j.request.prompt_logprobs
    assert j.request.logprobs == 1  # the top alternative says whether a token is greedy
    ids = job({"id": "t", "context_ids": [4, 5], "continuation_ids": [6]})
    assert ids.request.prompt_ids == (4, 5, 6) and ids.context_len == 2


def test_score_row_sums_the_continuation_and_checks_greediness():
    j = job({"id": "s", "context_ids": [4, 5], "continuation_ids": [6, 7]})
    lps = [math.nan, -1.0, -0.5, -0.25]
    row = score_row(j, lps, [None, 5, 6, 7], [None, -1.0, -0.5, -0.25], latency=0.1234567)
    assert row == {"id": "s", "logprob": -0.75, "is_greedy": True, "num_tokens": 2,
                   "latency": 0.123457}
    # Position 3 prefers token 9: not greedy.
    assert score_row(j, lps, [None, 5, 6, 9], [None, -1.0, -0.5, -0.2], None)[
        "is_greedy"] is False
    # A tie with the top token still counts as greedy.
    assert score_row(j, lps, [None, 5, 6, 9], [None, -1.0, -0.5, -0.25], None)[
        "is_greedy"] is True
    # No alternatives from the engine: unknown.
    assert score_row(j, lps, [None, 5, None, None], [None] * 4, None)["is_greedy"] is None


def test_generate_and_error_rows():
    j = job({"id": 9, "prompt_ids": [1, 2], "logprobs": 1, "metadata": "m"})
    row = generate_row(j, token_ids=[3, 4], text="xy", finish_reason="stop", stop_reason=4,
                       logprobs=[-1.0, -2.0], top_logprobs=[[(3, -1.0)], [(5, -1.5)]],
                       ttft=0.5, latency=1.0)
    assert row == {"id": 9, "text": "xy", "token_ids": [3, 4], "finish_reason": "stop",
                   "stop_reason": 4, "prompt_tokens": 2, "completion_tokens": 2,
                   "logprobs": [-1.0, -2.0], "top_logprobs": [[[3, -1.0]], [[5, -1.5]]],
                   "ttft": 0.5, "latency": 1.0, "metadata": "m"}
    assert error_row(j, "boom") == {"id": 9, "error": "boom", "metadata": "m"}


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ROOMY = ModelLimits(vocab_size=256, max_prefill_length=2048, max_seq_len=2048, bos_id=None,
                    eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)))
CHAT = [{"role": "user", "content": "time?"}]


def test_rows_take_logit_bias_as_the_api_does():
    j = job({"id": 1, "prompt": "x", "logit_bias": {"7": 100, "3": -5.5}})
    assert j.request.sampling.logit_bias == ((3, -5.5), (7, 100.0))


def test_chat_rows_take_tools_as_the_chat_api_does():
    plain = job({"id": 1, "messages": CHAT}, ROOMY)
    auto = job({"id": 1, "messages": CHAT, "tools": [TOOL]}, ROOMY)
    assert plain.tools is None and auto.tools.mode == "auto" and auto.tools.parallel
    assert auto.request.constraint is None
    assert b"get_time" in bytes(auto.request.prompt_ids)  # listed in the prompt
    forced = job({"id": 1, "messages": CHAT, "tools": [TOOL], "tool_choice": "required",
                  "parallel_tool_calls": False}, ROOMY)
    assert forced.request.constraint == forced.tools.constraint()
    assert forced.request.constraint.value["properties"]["name"] == {"const": "get_time"}
    llama = build_job({"id": 1, "messages": CHAT, "tools": [TOOL]}, ROOMY,
                      default_max_tokens=7, tool_parser="llama3_json")
    assert llama.tools.parser == "llama3_json"


@pytest.mark.parametrize("row, words", [
    ({"id": 1, "prompt": "x", "tools": [TOOL]}, ["tools needs a chat row", "prompt"]),
    ({"id": 1, "prompt_ids": [1], "tool_choice": "auto"}, ["tool_choice", "prompt_ids"]),
    ({"id": 1, "messages": CHAT, "tool_choice": "required"}, ["tool_choice", "needs tools"]),
    ({"id": 1, "messages": CHAT, "tools": [TOOL], "parallel_tool_calls": 1},
     ["parallel_tool_calls must be true or false"]),
    ({"id": 1, "messages": CHAT, "tools": [TOOL], "tool_choice": "required",
      "guided_regex": "a+"}, ["tool_choice", "guided_regex", "give one of them"]),
])
def test_bad_tool_rows_name_the_field(row, words):
    with pytest.raises(RowError) as e:
        job(row, ROOMY)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_rows_with_tools_carry_the_calls_as_the_chat_api_does():
    j = job({"id": 1, "messages": CHAT, "tools": [TOOL]}, ROOMY)
    text = 'Sure.\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    row = generate_row(j, token_ids=[1, 2], text=text, finish_reason="stop",
                       stop_reason=None, logprobs=None, top_logprobs=None, ttft=0.1,
                       latency=0.2)
    assert row["text"] == text and row["finish_reason"] == "tool_calls"
    assert row["content"] == "Sure."
    [call] = row["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    no_call = generate_row(j, token_ids=[1], text="It is noon.", finish_reason="length",
                           stop_reason=None, logprobs=None, top_logprobs=None, ttft=0.1,
                           latency=0.2)
    assert (no_call["content"], no_call["finish_reason"]) == ("It is noon.", "length")
    assert "tool_calls" not in no_call
