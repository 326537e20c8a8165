"""Qwen3-style and Gemma-3-style chat templates in directories saved by transformers 5
(chat_template.jinja beside tokenizer_config.json) render in jetserve as transformers'
`apply_chat_template` renders them: the same text and the same token ids, for system
messages, multi-turn conversations with thinking, tools and tool results, with and
without the generation prompt, and `enable_thinking` true, false or absent (passed as
chat_template_kwargs)."""

import copy
import json

import pytest

from jetserve.request import ModelLimits
from jetserve.server import chat_template
from jetserve.server.validation import InvalidArgument
from jetserve.tokenizer import load_tokenizer
from tests.jetserve.server.family_templates import write_tokenizer_dir

pytest.importorskip("transformers")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}

SYSTEM = [{"role": "system", "content": "You are brief."},
          {"role": "user", "content": "Hello!"}]
MULTI = [{"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
         {"role": "user", "content": "And the weather in Paris?"},
         {"role": "assistant", "content": "Mild.", "reasoning_content": "I guess."},
         {"role": "user", "content": "Thanks. Ça va?"}]
ENDS_ASSISTANT = [{"role": "system", "content": "Think first."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"}]
REASONED = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning": "A greeting."}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "  Hello, model.  "}]},
         {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "The time?"}]
# OpenAI's form: call arguments as JSON text (transformers' callers pass a dict; the
# server turns the text into one, as vLLM does, so both render alike).
TOOLS_CALLED = [{"role": "system", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris, and the time?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]

CASES = {  # name: (family, messages, tools)
    "qwen3-system": ("qwen3", SYSTEM, None),
    "qwen3-multi": ("qwen3", MULTI, None),
    "qwen3-ends-assistant": ("qwen3", ENDS_ASSISTANT, None),
    "qwen3-reasoning-field": ("qwen3", REASONED, None),
    "qwen3-tools": ("qwen3", SYSTEM, [WEATHER, TIME]),
    "qwen3-tool-results": ("qwen3", TOOLS_CALLED, [WEATHER, TIME]),
    "gemma3-system": ("gemma3", SYSTEM, None),
    "gemma3-multi": ("gemma3", MULTI, None),
    "gemma3-parts": ("gemma3", PARTS, None),
    "gemma3-ends-assistant": ("gemma3", ENDS_ASSISTANT, None),
}
THINKING = {"absent": {}, "on": {"enable_thinking": True}, "off": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import AutoTokenizer

    out = {}
    for family in ("qwen3", "gemma3"):
        d = tmp_path_factory.mktemp(family)
        write_tokenizer_dir(d, family)
        tok = load_tokenizer(str(d))
        limits = ModelLimits(vocab_size=tok.vocab_size, max_prefill_length=1024,
                             max_seq_len=2048, bos_id=tok.bos_id, eos_ids=tok.eos_ids,
                             top_logprobs=0, tokenizer=tok)
        out[family] = (AutoTokenizer.from_pretrained(str(d)), limits)
    return out


def _for_transformers(messages):
    """The messages as transformers' callers write them: call arguments as dicts."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.mark.parametrize("thinking", list(THINKING))
@pytest.mark.parametrize("case", list(CASES))
def test_rendering_matches_transformers(dirs, case, thinking):
    family, messages, tools = CASES[case]
    hf, limits = dirs[family]
    kwargs = THINKING[thinking]
    add_gen = messages[-1]["role"] != "assistant"
    want_text = hf.apply_chat_template(_for_transformers(messages), tools=tools,
                                       add_generation_prompt=add_gen, tokenize=False,
                                       **kwargs)
    want_ids = hf.apply_chat_template(_for_transformers(messages), tools=tools,
                                      add_generation_prompt=add_gen, tokenize=True,
                                      return_dict=False, **kwargs)
    extra = chat_template.check_template_kwargs(kwargs)
    got_text = chat_template.chat_prompt_text(limits, messages, add_gen, tools, extra)
    assert got_text == want_text
    ids = chat_template.chat_prompt_ids(limits, messages, add_gen, tools=tools, extra=extra)
    assert ids == list(want_ids)
    if family == "qwen3" and add_gen:  # the cases differ where they should
        assert want_text.endswith("<think>\n\n</think>\n\n") == (thinking == "off")


def test_gemma3_refuses_roles_out_of_turn_as_transformers_does(dirs):
    import jinja2

    hf, limits = dirs["gemma3"]
    twice = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        hf.apply_chat_template(twice, tokenize=False)
    with pytest.raises(InvalidArgument, match="roles must alternate") as e:
        chat_template.chat_prompt_ids(limits, twice)
    assert e.value.field == "messages"


def test_the_variables_and_tags_transformers_gives_a_template(dirs):
    """Every special token the tokenizer names, `documents`, `{% generation %}`, tojson's
    options, loop controls and an assistant's thinking under each of its names."""
    hf, limits = dirs["gemma3"]
    template = (
        "{{ pad_token }}|{{ bos_token }}|{{ documents is none }}|{{ tools is none }}|"
        "{% for m in messages %}{% if loop.index0 > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}:{{ m.content }}:{{ m.reasoning_content }}:"
        "{{ m.thinking }}{% endgeneration %}|{% endfor %}"
        "{{ messages[0] | tojson(indent=1, sort_keys=True) }}")
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "y", "thinking": "t"},
                {"role": "assistant", "content": "z", "reasoning_content": "r"},
                {"role": "user", "content": "never shown"}]
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    got = chat_template.render(chat_template.normalize_messages(messages), template=template,
                               bos_token="<bos>", eos_token="<eos>",
                               specials=limits.tokenizer.special_tokens)
    assert got == want
    assert want.startswith("<pad>|<bos>|True|True|user:x:") and "assistant:y:t:t|" in want
