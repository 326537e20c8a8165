"""The reasoning splitter and the block tool-call formats, fed whole and a character at a
time: both ways must give the same reasoning, content and calls."""

import json

import pytest

from jetserve.server import reasoning, tool_output
from jetserve.server.call_blocks import DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP
from jetserve.server.tool_calls import plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                     "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _streamed(plan, think, text):
    r = tool_output.ChoiceReader(plan, think)
    deltas = [r.delta(c, None)[0] for c in text] + [r.delta("", "stop")[0]]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for e in d.get("tool_calls", ()):
            if "id" in e:
                calls[e["index"]] = [e["function"]["name"], ""]
            calls[e["index"]][1] += e["function"]["arguments"]
    join = lambda k: "".join(d.get(k, "") for d in deltas) or None  # noqa: E731
    return join("reasoning_content"), join("content"), [tuple(c) for c in calls.values()]


def _whole(plan, think, text):
    m, _ = tool_output.message(plan, text, "stop", think)
    return (m.get("reasoning_content"), m["content"] or None,
            [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls",
                                                                                ())])


@pytest.mark.parametrize("name, text, want", [
    ("deepseek_r1", "plan</think>\n\nanswer", ("plan", "answer")),
    ("deepseek_r1", "<think>plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", "cut inside the thinking", ("cut inside the thinking", "")),
    ("qwen3", "\n<think>a</think>b", ("a", "b")),
    ("qwen3", "no thinking <think>x</think>", ("", "no thinking <think>x</think>")),
    ("glm45", "<think>cut", ("cut", "")),
])
def test_thinking_split_whole_and_streamed(name, text, want):
    fmt = reasoning.PARSERS[name]
    assert reasoning.split(fmt, text) == want
    s = reasoning.ThinkSplitter(fmt)
    parts = [s.feed(c) for c in text] + [s.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want


def test_thinking_off_by_template_kwargs():
    assert not reasoning.thinking_on({"enable_thinking": False})
    assert reasoning.thinking_on({"enable_thinking": True}) and reasoning.thinking_on(None)


ARGS = {"city": "Paris", "zip": "75001", "days": 3}
PY_ARGS = {**ARGS, "city": "Pa,r)is"}  # a comma and a paren inside the string
CASES = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
                   "\n<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                   "</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>days</arg_key>\n"
             "<arg_value>3</arg_value>\n</tool_call>",
    "deepseek_v3": f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                   f"{json.dumps(ARGS)}\n```{DS_CALL_END}{DS_CALLS_END}",
    "pythonic": "[get_weather(city='Pa,r)is', zip='75001', days=(3))]",
}


@pytest.mark.parametrize("parser", list(CASES))
def test_block_formats_whole_and_streamed(parser):
    plan = plan_tools([WEATHER, TIME], None, None, parser)
    lead = "" if parser == "pythonic" else "Let me see. "
    text = lead + CASES[parser]
    for got in (_whole(plan, None, text), _streamed(plan, None, text)):
        assert got[1] == (lead.strip() or None)
        [(name, args)] = got[2]
        want = PY_ARGS if parser == "pythonic" else ARGS
        assert name == "get_weather" and json.loads(args) == want  # "75001" stays text
    # Two calls; parallel_tool_calls false keeps the first.
    two = text.replace("get_weather", "get_time", 1) if parser != "pythonic" else \
        "[get_time(), get_weather(city='Paris', zip='75001', days=3)]"
    if parser in ("qwen3_coder", "glm45"):
        two = lead + CASES[parser].replace("get_weather", "get_time") + CASES[parser]
    elif parser == "deepseek_v3":
        call = CASES[parser][len(DS_CALLS):-len(DS_CALLS_END)]
        two = lead + DS_CALLS + call.replace("get_weather", "get_time") + call + DS_CALLS_END
    both = plan_tools([WEATHER, TIME], None, None, parser)
    assert [n for n, _ in _whole(both, None, two)[2]] == ["get_time", "get_weather"]
    one = plan_tools([WEATHER, TIME], None, False, parser)
    assert [n for n, _ in _whole(one, None, two)[2]] == ["get_time"]
    assert [n for n, _ in _streamed(one, None, two)[2]] == ["get_time"]


@pytest.mark.parametrize("parser, text", [
    ("pythonic", "[get_weather(city=open('/etc/passwd').read())]"),  # not a literal
    ("pythonic", "[1, 2] are numbers"),
    ("qwen3_coder", "a <tool_call><function=launch>\n</function></tool_call> b"),  # unlisted
    ("glm45", "<tool_call>not a call at all"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}launch\n```json\n{{}}\n```"
                    f"{DS_CALL_END}{DS_CALLS_END}"),  # unlisted
])
def test_what_is_no_call_stays_content(parser, text):
    plan = plan_tools([WEATHER, TIME], None, None, parser)
    assert _whole(plan, None, text) == (None, text, [])
    assert _streamed(plan, None, text) == (None, text, [])


def test_thinking_is_never_read_for_calls():
    plan = plan_tools([WEATHER], None, None, "hermes")
    think = reasoning.PARSERS["qwen3"]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = f"<think>{call}</think>Done."
    assert _whole(plan, think, text) == (call, "Done.", [])
    assert _streamed(plan, think, text) == (call, "Done.", [])
