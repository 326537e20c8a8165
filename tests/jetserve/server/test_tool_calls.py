"""Chat `tools` / `tool_choice`: checks that name the field, the constraint a forced call
is generated under (compiled by llguidance, run over the bundled tokenizer), and the tool
fields of the conversation's messages."""

import json

import pytest

from jetserve.server import tool_calls
from jetserve.server.tool_calls import ToolPlan, plan_tools
from jetserve.server.validation import InvalidArgument

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
# A pydantic-style schema: a local $ref into its own $defs.
ORDER = {"type": "function", "function": {"name": "order", "parameters": {
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
    "required": ["item"], "additionalProperties": False,
    "$defs": {"Item": {"type": "object", "properties": {"qty": {"type": "integer"}},
                       "required": ["qty"], "additionalProperties": False}}}}}


@pytest.fixture(scope="module")
def matcher_for():
    """A function making an llguidance matcher of a constraint over the bundled tokenizer,
    and the tokenizer."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from jetserve.model_loading import BUNDLED_DIR

    hf = AutoTokenizer.from_pretrained(BUNDLED_DIR)
    lltok = llguidance.hf.from_tokenizer(hf)

    def accepts(constraint, text: str) -> bool:
        m = LLMatcher(lltok, LLMatcher.grammar_from_json_schema(constraint.value))
        assert not m.is_error(), m.get_error()
        ids = hf.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


def _call(name, args) -> str:
    return json.dumps({"name": name, "arguments": args})


def test_no_tools_or_choice_none_is_no_plan():
    assert plan_tools(None, None) is None
    assert plan_tools([], None) is None
    assert plan_tools(None, "none") is None
    assert plan_tools([WEATHER], "none") is None


def test_default_choice_is_auto_and_tools_are_normalized():
    junk = {**WEATHER, "function": {**WEATHER["function"], "x_extra": 1}, "extra": 2}
    plan = plan_tools([junk, TIME], None)
    assert plan.mode == "auto" and not plan.forced and plan.constraint() is None
    assert plan.tools == (WEATHER, TIME)  # unknown keys are not handed to the template


def test_named_choice_constrains_to_that_function(matcher_for):
    plan = plan_tools([WEATHER, TIME], {"type": "function",
                                        "function": {"name": "get_weather"}})
    assert plan.mode == "named" and plan.name == "get_weather"
    c = plan.constraint()
    assert c.kind == "json_schema" and c.field == "tool_choice"
    assert matcher_for(c, _call("get_weather", {"city": "Oslo", "unit": "c"}))
    assert not matcher_for(c, _call("get_time", {}))
    assert not matcher_for(c, _call("get_weather", {"city": "Oslo", "unit": "k"}))
    assert not matcher_for(c, _call("get_weather", {"city": "Oslo"}))  # unit is required
    # The layout is json.dumps's (what the template shows): no other whitespace allowed.
    assert not matcher_for(c, '{"name":"get_weather","arguments":{"city":"a","unit":"c"}}')


def test_required_is_any_listed_function(matcher_for):
    c = plan_tools([WEATHER, TIME, ORDER], "required", False).constraint()
    assert matcher_for(c, _call("get_weather", {"city": "Oslo", "unit": "f"}))
    assert matcher_for(c, _call("get_time", {}))  # no parameters: arguments {}
    assert not matcher_for(c, _call("get_time", {"x": 1}))
    assert matcher_for(c, _call("order", {"item": {"qty": 3}}))  # its $ref still resolves
    assert not matcher_for(c, _call("order", {"item": {"qty": "3"}}))
    assert not matcher_for(c, _call("other", {}))
    assert not matcher_for(c, "Sure! " + _call("get_time", {}))


def test_constraint_leaves_the_request_tools_unchanged():
    tools = json.loads(json.dumps([ORDER]))
    plan_tools(tools, "required").constraint()
    assert tools == [ORDER]


@pytest.mark.parametrize("tools, choice, field", [
    ("get_weather", None, "tools"),
    ([WEATHER] * 2, None, "tools[1].function.name"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools[0].type"),
    (["get_weather"], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], None,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None,
     "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": f"f{i}"}}
      for i in range(tool_calls.MAX_TOOLS + 1)], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
    # A schema that cannot be enforced is refused when the call is forced.
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
     "required", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}],
     {"type": "function", "function": {"name": "f"}}, "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(InvalidArgument) as e:
        plan_tools(tools, choice)
    assert e.value.field == field and field in str(e.value)


def test_unknown_named_tool_is_named_in_the_error():
    with pytest.raises(InvalidArgument) as e:
        plan_tools([WEATHER], {"type": "function", "function": {"name": "launch_rocket"}})
    assert "launch_rocket" in str(e.value) and "get_weather" in str(e.value)


def test_plan_checks_its_own_fields():
    with pytest.raises(ValueError, match="mode"):
        ToolPlan(tools=(WEATHER,), mode="sometimes")
    with pytest.raises(ValueError, match="name"):
        ToolPlan(tools=(WEATHER,), mode="named")


def test_history_calls_get_dict_arguments_and_tool_messages_keep_their_ids():
    m = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "not json"}}]}
    got = tool_calls.message_fields(m, "assistant", "messages[1]")
    assert got["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert got["tool_calls"][1]["function"]["arguments"] == "not json"  # kept as written
    assert [c["id"] for c in got["tool_calls"]] == ["call_1", "call_2"]
    tool = {"role": "tool", "content": "12C", "tool_call_id": "call_1"}
    assert tool_calls.message_fields(tool, "tool", "messages[2]") == {"tool_call_id": "call_1"}
    assert tool_calls.message_fields({"role": "user", "content": "x"}, "user", "m") == {}


@pytest.mark.parametrize("message, field", [
    ({"tool_calls": "get_weather"}, "messages[1].tool_calls"),
    ({"tool_calls": [{"type": "function"}]}, "messages[1].tool_calls[0]"),
    ({"tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_history_calls_name_the_field(message, field):
    with pytest.raises(InvalidArgument) as e:
        tool_calls.message_fields({"role": "assistant", **message}, "assistant", "messages[1]")
    assert e.value.field == field


def test_as_text_writes_tools_and_calls_in_the_documented_format():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_time", "arguments": {}}}]}]
    out = tool_calls.as_text(msgs, [TIME])
    assert len(out) == 2 and out[0]["role"] == "system"  # one system message, tools added
    assert out[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(TIME) in out[0]["content"] and tool_calls.HOWTO in out[0]["content"]
    assert out[1]["content"] == '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert tool_calls.as_text([{"role": "user", "content": "hi"}], [TIME])[0]["role"] == "system"


def test_output_constraint_is_the_forced_call_or_the_other_never_both():
    from jetserve.structured import Constraint

    other = Constraint(kind="json_object", field="response_format")
    assert tool_calls.output_constraint(None, other) is other
    assert tool_calls.output_constraint(plan_tools([WEATHER], "auto"), other) is other
    forced = plan_tools([WEATHER], "required")
    assert tool_calls.output_constraint(forced, None) == forced.constraint()
    with pytest.raises(InvalidArgument) as e:
        tool_calls.output_constraint(forced, other)
    assert e.value.field == "tool_choice" and "response_format" in str(e.value)


def test_required_with_parallel_calls_is_a_list_of_one_or_more(matcher_for):
    plan = plan_tools([WEATHER, TIME, ORDER], "required")  # parallel_tool_calls: true
    assert plan.parallel
    c = plan.constraint()
    one, two = _call("get_time", {}), _call("order", {"item": {"qty": 3}})
    assert matcher_for(c, f"[{one}]") and matcher_for(c, f"[{one}, {two}]")
    assert not matcher_for(c, "[]") and not matcher_for(c, one)
    assert not matcher_for(c, f'[{_call("order", {"item": {"qty": "3"}})}]')  # $ref resolves
    # Named stays one call, whatever parallel_tool_calls says; off, required is one too.
    named = {"type": "function", "function": {"name": "get_time"}}
    assert matcher_for(plan_tools([WEATHER, TIME], named, True).constraint(), one)
    off = plan_tools([WEATHER, TIME], "required", False)
    assert not off.parallel and matcher_for(off.constraint(), one)
    assert not matcher_for(off.constraint(), f"[{one}]")


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(InvalidArgument) as e:
        plan_tools([WEATHER], "auto", "yes")
    assert e.value.field == "parallel_tool_calls" and "'yes'" in e.value.message
    assert plan_tools([WEATHER], "auto", None, "llama3_json").parser == "llama3_json"
