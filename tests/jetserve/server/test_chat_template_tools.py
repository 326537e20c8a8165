"""Tools through the chat template: the bundled model's template renders tools, calls and
tool results as transformers' apply_chat_template does; a template that knows tools gets
them as `tools`; one that does not gets them written as text."""

import json

import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.server import chat_template, tool_calls
from jetserve.server.validation import ModelLimits
from jetserve.tokenizer import load_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city, now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]
# As an OpenAI client sends them: arguments as JSON text, content null beside calls.
HISTORY = [
    {"role": "system", "content": "Answer with tools."},
    {"role": "user", "content": "Weather in Oslo and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12C, rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": "09:30"},
]


def _hf_history():
    """The same conversation as transformers' templates take it: arguments as dicts."""
    out = json.loads(json.dumps(HISTORY))
    for call in out[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def _limits(tok) -> ModelLimits:
    return ModelLimits(vocab_size=tok.vocab_size, max_prefill_length=1024, max_seq_len=1024,
                       bos_id=tok.bos_id, eos_ids=tuple(tok.eos_ids), top_logprobs=0,
                       tokenizer=tok)


@pytest.fixture(scope="module")
def bundled():
    return load_tokenizer(BUNDLED_DIR)


@pytest.mark.parametrize("with_tools", [True, False])
def test_bundled_template_matches_transformers(bundled, with_tools):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(BUNDLED_DIR)
    tools = TOOLS if with_tools else None
    want = ref.apply_chat_template(_hf_history(), tools=tools, add_generation_prompt=True,
                                   tokenize=True)
    if not isinstance(want, list):  # newer transformers return a BatchEncoding
        want = want["input_ids"]
    got = chat_template.chat_prompt_ids(_limits(bundled), HISTORY, tools=tools)
    assert got == list(want)
    text = bundled.decode(got)
    # The documented format: tools as JSON comment lines, calls as tagged JSON objects.
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n') in text
    assert "# tool:\n12C, rain\n# tool:\n09:30\n# assistant:\n" in text
    assert (f"# {json.dumps(TOOLS[0])}\n" in text) == with_tools
    assert (tool_calls.HOWTO in text) == with_tools


def test_bundled_template_without_tools_renders_as_before(bundled):
    msgs = [{"role": "user", "content": "add two numbers"}]
    text = chat_template.render(msgs, template=bundled.chat_template, bos_token="<s>",
                                eos_token="</s>")
    assert text == "<s># user:\nadd two numbers\n# assistant:\n"


def test_training_script_writes_the_shipped_template(bundled):
    from tests.jetserve.test_bundled_model import _training_script

    assert _training_script().CHAT_TEMPLATE == bundled.chat_template


# A Hermes-style template that reads `tools` itself.
KNOWS_TOOLS = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "</tools>{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<call>{{ c['function']['arguments'] | tojson }}"
    "</call>{% endfor %}{% endfor %}"
)


def test_a_template_that_knows_tools_gets_them():
    msgs = chat_template.normalize_messages(HISTORY[1:3])
    text = chat_template.render(msgs, template=KNOWS_TOOLS, bos_token="", eos_token="",
                                tools=TOOLS)
    assert text == ('<tools>get_weather;get_time;</tools>[user]Weather in Oslo and the time?'
                    '[assistant]<call>{"city": "Oslo"}</call><call>{}</call>')


def test_a_template_without_tools_gets_them_as_text():
    msgs = chat_template.normalize_messages(HISTORY)
    text = chat_template.render(msgs, template=None, bos_token="", eos_token="",
                                add_generation_prompt=False, tools=TOOLS[1:])
    assert text.startswith("<|system|>\nAnswer with tools.\n\nYou can call these tools:\n"
                           + json.dumps(TOOLS[1]) + "\n" + tool_calls.HOWTO + "\n")
    assert ('<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}</tool_call>\n') in text
    assert "<|tool|>\n12C, rain\n" in text
