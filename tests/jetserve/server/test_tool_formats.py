"""Tool calls in each --tool-call-parser format, forced lists of calls and
parallel_tool_calls false: read whole and streamed in pieces of every size (the two
agree), a call's arguments streamed in fragments as they arrive."""

import json
import random

import pytest

from jetserve.server.tool_calls import ToolPlan
from jetserve.server.tool_formats import PARSERS, CallFormat, check_parser
from jetserve.server.tool_output import ChoiceReader
from tests.jetserve.server.test_tool_output import TOOLS, _assemble, _stream, _whole

W_ARGS, T_ARGS = '{"city": "Oslo", "unit": "celsius"}', '{"tz": "UTC"}'


def plan(parser="hermes", mode="auto", parallel=True):
    return ToolPlan(tools=TOOLS, mode=mode, parser=parser, parallel=parallel)


# (parser, text, content, [(name, arguments)]) read the same whole and streamed.
CASES = [
    ("hermes", f'Sure.\n<tool_call>{{"name": "get_weather", "arguments": {W_ARGS}}}'
               f'</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {T_ARGS}}}'
               "</tool_call>", "Sure.", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W_ARGS}}}; '
                    f'{{"name": "get_time", "parameters": {T_ARGS}}}',
     None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_time", "parameters": {T_ARGS}}}',
     None, [("get_time", T_ARGS)]),
    ("llama3_json", f'I would call {{"name": "get_time", "parameters": {T_ARGS}}}',
     f'I would call {{"name": "get_time", "parameters": {T_ARGS}}}', []),
    ("llama3_json", '{"weather": "fine"}', '{"weather": "fine"}', []),
    ("mistral", f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": '
                f'{W_ARGS}}}, {{"name": "get_time", "arguments": {T_ARGS}}}]',
     "Let me check.", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    # The marker is a special token, which decoding drops: a list at the start is calls.
    ("mistral", f'[{{"name": "get_time", "arguments": {T_ARGS}}}]', None,
     [("get_time", T_ARGS)]),
    ("mistral", "[1] is a citation, [TOOL_CALLS] is not a call",
     "[1] is a citation, [TOOL_CALLS] is not a call", []),
    # Arguments written as a JSON string are sent as the string's text.
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}'
               "</tool_call>", None, [("get_time", T_ARGS)]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_each_parser_reads_its_format_streamed_as_whole(parser, text, content, calls, step):
    p = plan(parser)
    whole = _whole(p, text)
    assert whole[0] == content and [c[1:] for c in whole[1]] == calls
    assert whole[2] == ("tool_calls" if calls else "stop")
    streamed = _assemble(_stream(p, text, step))
    assert (streamed[0] or None) == content and streamed[2] == whole[2]
    assert [c[1:] for c in streamed[1]] == calls


def test_auto_streams_content_then_the_name_then_argument_fragments():
    text = f'Checking.\n<tool_call>{{"name": "get_weather", "arguments": {W_ARGS}}}</tool_call>'
    deltas = _stream(plan(), text, 3)
    entries = [(k, e) for k, (d, _) in enumerate(deltas) for e in d.get("tool_calls", ())]
    first_content = next(k for k, (d, _) in enumerate(deltas) if d.get("content"))
    k0, head = entries[0]
    assert first_content < k0  # the text before the call went out before it
    assert head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    assert head["type"] == "function" and head["index"] == 0
    rest = [e for _, e in entries[1:]]
    assert len(rest) > 5  # the arguments in fragments, not one delta at the end
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
               for e in rest)
    assert head["function"]["arguments"] + "".join(e["function"]["arguments"]
                                                   for e in rest) == W_ARGS


def test_auto_call_goes_out_before_its_block_closes():
    """The name and arguments stream while the model is still writing the call."""
    reader = ChoiceReader(plan())
    delta, _ = reader.delta('<tool_call>{"name": "get_time", "arguments": {"tz": "U', None)
    [entry] = delta["tool_calls"]
    assert entry["function"] == {"name": "get_time", "arguments": '{"tz": "U'}
    delta, _ = reader.delta('TC"}}', None)
    assert delta["tool_calls"] == [{"index": 0, "function": {"arguments": 'TC"}'}}]


@pytest.mark.parametrize("parser, text", [(c[0], c[1]) for c in CASES if len(c[3]) == 2])
def test_parallel_off_keeps_the_first_call_only(parser, text):
    p = plan(parser, parallel=False)
    content, calls, finish = _whole(p, text)
    assert [c[1] for c in calls] == ["get_weather"] and finish == "tool_calls"
    for step in (1, 4):
        streamed = _assemble(_stream(p, text, step))
        assert [c[1:] for c in streamed[1]] == [c[1:] for c in calls]
        assert (streamed[0] or None) == content


LIST = (f'[{{"name": "get_weather", "arguments": {W_ARGS}}}, '
        '{"name": "get_time", "arguments": {}}]')


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_required_with_parallel_calls_reads_a_list(step):
    p = plan(mode="required")
    content, calls, finish = _whole(p, LIST)
    assert content is None and finish == "tool_calls"
    assert [c[1:] for c in calls] == [("get_weather", W_ARGS), ("get_time", "{}")]
    streamed = _assemble(_stream(p, LIST, step))
    assert [c[1:] for c in streamed[1]] == [c[1:] for c in calls]
    # Cut by max_tokens inside the second call: the first whole, the second so far.
    _, calls, finish = _whole(p, LIST[:-3], "length")
    assert finish == "length" and [c[1:] for c in calls] == [("get_weather", W_ARGS),
                                                            ("get_time", "{")]
    # Forced output is calls by construction: a call goes out with its name.
    _, calls, _ = _whole(p, LIST[:-8], "length")
    assert [c[1:] for c in calls] == [("get_weather", W_ARGS), ("get_time", "")]


def test_formats_and_parser_names_are_checked():
    assert set(PARSERS) >= {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, "
                                         "llama3_json, mistral, qwen3_coder, pythonic, "
                                         "deepseek_v3, glm45, openai, got 'granite'"):
        check_parser("granite")
    with pytest.raises(ValueError, match="parser must be one of"):
        plan("qwen")
    with pytest.raises(ValueError, match="marker"):
        CallFormat()
    with pytest.raises(ValueError, match="opener"):
        CallFormat(at_start=True, opener="[")


def test_call_format_whitespace_and_a_cut_close_are_not_content():
    p = plan()
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_'
    assert _whole(p, text)[0] is None
    assert json.loads(_whole(p, text)[1][0][2]) == {}


PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "[", "]", ",",
          ";", " ", "\n", "hello", "{", "}", '"', '{"name": "get_time", "arguments": {}}',
          '{"name": "get_weather", "parameters": {"a": [1, "}"]}}', '"name": ', '"x"',
          '{"name": "nope", "arguments": {}}', '"arguments": ', '{"a": "\\"b"}']


@pytest.mark.parametrize("parser", list(PARSERS) + ["required"])
def test_any_text_streamed_in_any_pieces_reads_as_whole(parser):
    """Random mixes of markers, JSON and prose, cut at random: the stream assembles to
    the whole message, and no text is lost when no call is read."""


    rng = random.Random(parser)
    p = plan(mode="required") if parser == "required" else plan(parser)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        whole = _whole(p, text, "length")
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 6))))
        reader, deltas = ChoiceReader(p), []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas.append(reader.delta(text[a:b], None))
        deltas.append(reader.delta("", "length"))
        content, calls, finish = _assemble(deltas)
        assert ((content or None) if whole[0] is None else content) == whole[0], text
        assert [c[1:] for c in calls] == [c[1:] for c in whole[1]], text
        if not whole[1]:
            assert content == text, text
