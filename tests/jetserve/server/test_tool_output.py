"""Tool calls read out of generated text: forced call objects and `<tool_call>` blocks,
whole and streamed in pieces of every size (the two agree), and the streamed deltas as
the openai SDK's own stream state assembles them."""

import json

import pytest

from jetserve.server.tool_calls import ToolPlan
from jetserve.server.tool_output import CallScanner, ChoiceReader, message

TOOLS = ({"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "get_time"}})
# One forced call object (parallel tool calls off; with them, required is a list: below).
FORCED = ToolPlan(tools=TOOLS, mode="required", parallel=False)
AUTO = ToolPlan(tools=TOOLS, mode="auto")
# Braces, brackets, quotes and escapes inside strings must not end the arguments early.
ARGS = '{"city": "Pa\\"ris} ]", "days": [1, {"x": "\\\\"}], "n": null}'
CALL = '{"name": "get_weather", "arguments": ' + ARGS + '}'


def _stream(plan, text: str, step: int, finish: str = "stop"):
    """The deltas a stream sends for `text` arriving `step` characters at a time."""
    reader = ChoiceReader(plan)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    out = [reader.delta(p, None) for p in pieces[:-1]]
    out.append(reader.delta(pieces[-1], finish))
    return out


def _assemble(deltas):
    """(content, [(id, name, arguments)], final finish_reason) as a client joins them."""
    content, calls = "", {}
    for delta, _ in deltas:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                assert entry["type"] == "function" and entry["index"] not in calls
                calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
            calls[entry["index"]][2] += entry["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)], deltas[-1][1]


def _whole(plan, text, finish="stop"):
    msg, reason = message(plan, text, finish)
    calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
             for c in msg.get("tool_calls", ())]
    return msg["content"], calls, reason


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_forced_call_streams_name_first_then_arguments(step):
    deltas = _stream(FORCED, CALL, step)
    content, calls, finish = _assemble(deltas)
    assert content == "" and finish == "tool_calls"
    [(call_id, name, args)] = calls
    assert call_id.startswith("call_") and name == "get_weather" and args == ARGS
    entries = [e for d, _ in deltas for e in d.get("tool_calls", ())]
    assert "id" in entries[0] and all("id" not in e and "name" not in e["function"]
                                      for e in entries[1:])
    if step < len(CALL):
        assert len(entries) > 1  # arguments in fragments, as they were generated
    whole_content, whole_calls, whole_finish = _whole(FORCED, CALL)
    assert whole_content is None and whole_finish == "tool_calls"
    assert [c[1:] for c in whole_calls] == [c[1:] for c in calls]


def test_forced_call_with_arguments_first_or_none():
    content, calls, _ = _whole(FORCED, '{"arguments": {"a": 1}, "name": "get_time"}')
    assert content is None and [c[1:] for c in calls] == [("get_time", '{"a": 1}')]
    _, calls, _ = _whole(FORCED, '{"name": "get_time"}')
    assert [c[1:] for c in calls] == [("get_time", "{}")]


def test_forced_output_that_is_no_call_is_content():
    assert _whole(FORCED, "I will not call.", "length") == ("I will not call.", [], "length")
    assert _assemble(_stream(FORCED, "I will not call.", 2, "length")) == (
        "I will not call.", [], "length")
    # Cut by max_tokens inside the arguments: the call so far, finish_reason length.
    content, calls, finish = _whole(FORCED, CALL[:-12], "length")
    assert finish == "length" and calls[0][1:] == ("get_weather", ARGS[:-11])


def test_scanner_flags_what_is_not_a_call_object():
    for text in ('["get_time"]', '{"name": 3, "arguments": {}}', '{"arguments": {}}',
                 '{"name": "f"} trailing'):
        s = CallScanner()
        s.feed(text)
        assert s.bad, text


AUTO_TEXT = ("Let me look.\n<tool_call>" + CALL + "</tool_call>\n"
             '<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n</tool_call>\n')


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_auto_calls_parsed_out_of_text_streamed_as_whole(step):
    whole = _whole(AUTO, AUTO_TEXT)
    content, calls, finish = whole
    assert content == "Let me look." and finish == "tool_calls"
    assert [c[1:] for c in calls] == [("get_weather", json.dumps(json.loads(ARGS))),
                                      ("get_time", '{"tz": "UTC"}')]
    assert len({c[0] for c in calls}) == 2
    streamed = _assemble(_stream(AUTO, AUTO_TEXT, step))
    assert streamed[0] == content and streamed[2] == finish
    assert [c[1:] for c in streamed[1]] == [c[1:] for c in calls]


@pytest.mark.parametrize("text", [
    "plain answer, trailing space and newline \n",
    "a < b and <tool_ is not a tag <tool_call",
    'bad json <tool_call>{"name": "get_time", </tool_call> kept',
    'unknown <tool_call>{"name": "launch", "arguments": {}}</tool_call> kept',
    "",
])
def test_auto_text_without_a_call_is_content_verbatim(text):
    assert _whole(AUTO, text) == (text, [], "stop")
    for step in (1, 3):
        assert _assemble(_stream(AUTO, text, step)) == (text, [], "stop")


def test_auto_unclosed_call_at_the_end_is_a_call():
    content, calls, finish = _whole(AUTO, '<tool_call>{"name": "get_time", "arguments": {}}')
    assert content is None and [c[1:] for c in calls] == [("get_time", "{}")]
    assert finish == "tool_calls"


def test_no_plan_passes_text_through():
    assert message(None, "hi ", "length") == ({"role": "assistant", "content": "hi "}, "length")
    reader = ChoiceReader(None)
    assert reader.delta("", None) == ({"content": ""}, None)
    assert reader.delta("", "stop") == ({}, "stop")


@pytest.mark.parametrize("plan, text", [(FORCED, CALL), (AUTO, AUTO_TEXT)])
def test_openai_sdk_stream_state_assembles_the_deltas(plan, text):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    first = ChoiceReader(plan).opening()
    state.handle_chunk(ChatCompletionChunk.model_validate(
        {**head, "choices": [{"index": 0, "delta": first, "finish_reason": None}]}))
    for delta, finish in _stream(plan, text, 3):
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    want_content, want_calls, _ = _whole(plan, text)
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == [c[1:] for c in want_calls]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    assert choice.message.content == want_content
