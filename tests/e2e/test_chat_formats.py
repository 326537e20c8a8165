"""--reasoning-parser and the tool-call formats of today's models, through the openai SDK.

One random-weight Llama whose byte-level BPE tokenizer holds the formats' markers as
tokens of its vocabulary (as the real models' tokenizers do; DeepSeek's in a few pieces)
and whose chat template lists the tools and,
Qwen3's way, writes an empty `<think></think>` when `enable_thinking` is false. A regex
(structured_outputs) makes the model write a given answer in each format; several HTTP
servers over the one orchestrator read it with different parsers. What the SDK returns,
whole and streamed, must be what the written answer holds.
"""

import json
import re

import openai
import pytest

from tests.e2e.conftest import local_config, random_llama_orch

MODEL = "formats"
DS = dict(calls="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>",
          call="<｜tool▁call▁begin｜>", sep="<｜tool▁sep｜>", call_end="<｜tool▁call▁end｜>")
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", *DS.values()]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}{% if reasoning_effort is defined %}<|effort|>{{ reasoning_effort }}\n"
    "{% endif %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, for some days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"tz": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days, and the time?"}]
PARIS, UTC = ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})

# server: (--reasoning-parser, --tool-call-parser, the answer written, what it holds:
# reasoning_content, content, calls)
CASES = {
    "qwen3": ("qwen3", "qwen3_coder",
              "<think>\nA call like <tool_call> here is only thought.\n</think>\n\nSure.\n"
              "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
              "<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n"
              "</tool_call>",
              "\nA call like <tool_call> here is only thought.\n", "Sure.", [PARIS, UTC]),
    "deepseek_r1": ("deepseek_r1", "deepseek_v3",
                    f"The user wants two things.</think>\n\nChecking.{DS['calls']}"
                    f"{DS['call']}function{DS['sep']}get_weather\n```json\n"
                    f'{{"city": "Paris", "days": 3}}\n```{DS["call_end"]}'
                    f"{DS['call']}function{DS['sep']}get_time\n```json\n"
                    f'{{"tz": "UTC"}}\n```{DS["call_end"]}{DS["end"]}',
                    "The user wants two things.", "Checking.", [PARIS, UTC]),
    "glm45": ("glm45", "glm45",
              "<think>Two tools.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
              "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3"
              "</arg_value>\n</tool_call><tool_call>get_time\n<arg_key>tz</arg_key>\n"
              "<arg_value>UTC</arg_value>\n</tool_call>",
              "Two tools.", None, [PARIS, UTC]),
    "pythonic": (None, "pythonic", "[get_weather(city='Paris', days=3), get_time(tz=\"UTC\")]",
                 None, None, [PARIS, UTC]),
}


def literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


def write_tokenizer(d, texts: list[str]):
    """A byte-level BPE trained on `texts`, each marker one token of its vocabulary (text
    is split into markers, words, spaces and punctuation before the bytes are merged, so
    the merges learn the markers whole, and no token spans a word)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    markers = Regex("|".join(map(re.escape, MARKERS)) + r"|\w+|\s+|[^\w\s]+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(markers, "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # DeepSeek's long markers (with U+2581 in them) the trainer leaves in a few pieces.
    assert all(len(tok.encode(m).ids) == 1 for m in MARKERS if m not in DS.values())
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True,
        "chat_template": TEMPLATE}))
    return tok


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    from jetserve.server.runner import BackgroundServers

    d = tmp_path_factory.mktemp("formats_model")
    corpus = [c[2] for c in CASES.values()] + [TEMPLATE, json.dumps([WEATHER, TIME]),
                                               MESSAGES[0]["content"]]
    tok = write_tokenizer(d, corpus * 10)
    orch = random_llama_orch(d, tok.get_vocab_size(with_added_tokens=True), 512)
    servers = []
    try:
        out = {}
        for name, (think, calls, *_) in CASES.items():
            s = BackgroundServers(orch, local_config(model_name=MODEL, grpc_port=None,
                                                     reasoning_parser=think,
                                                     tool_call_parser=calls)).start()
            servers.append(s)
            out[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1",
                                      api_key="unused", max_retries=0, timeout=300)
        yield out
    finally:
        for s in servers:
            s.stop()
        orch.stop(drain=False, timeout=30)


def _ask(client, text: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0.0,
        max_tokens=400, extra_body={"structured_outputs": {"regex": literal(text)},
                                    **kw.pop("extra_body", {})}, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or ()]


@pytest.mark.parametrize("name", list(CASES))
def test_the_sdk_returns_what_the_format_holds(clients, name):
    think, _, text, reasoning, content, calls = CASES[name]
    client = clients[name]
    whole = _ask(client, text).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert getattr(whole.message, "reasoning_content", None) == reasoning
    assert whole.message.content == content
    assert _calls(whole.message) == calls
    assert len({c.id for c in whole.message.tool_calls}) == len(calls)

    chunks = [c for c in _ask(client, text, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        (reasoning or "")
    assert ("".join(d.content or "" for d in deltas) or None) == content
    entries = [e for d in deltas for e in d.tool_calls or ()]
    heads = [e for e in entries if e.id is not None]
    assert [(h.index, h.function.name) for h in heads] == \
        [(k, n) for k, (n, _) in enumerate(calls)]
    args = ["".join(e.function.arguments or "" for e in entries if e.index == k)
            for k in range(len(calls))]
    assert [json.loads(a) for a in args] == [a for _, a in calls]
    assert [a for a in args] == [c.function.arguments for c in whole.message.tool_calls]
    assert len([e for e in entries if e.index == 0]) >= 2  # arguments as written
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Reasoning streams before the answer, never after it.
    kinds = ["r" if getattr(d, "reasoning_content", None) else "a" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content or d.tool_calls]
    assert kinds == sorted(kinds, key=lambda k: k == "a")

    first = _ask(client, text, parallel_tool_calls=False).choices[0]
    assert _calls(first.message) == calls[:1] and first.finish_reason == "tool_calls"


def test_thinking_off_through_chat_template_kwargs(clients):
    client = clients["qwen3"]
    text = "<think>x</think>Plain."
    on = _ask(client, text).choices[0]
    assert on.message.reasoning_content == "x" and on.message.content == "Plain."
    off = _ask(client, text, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == text  # no thinking read out of it
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    # The template saw enable_thinking: it wrote the empty <think></think> into the prompt.
    plain = _ask(client, text)
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, text, extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.response.json()["error"]["param"] == "chat_template_kwargs"


def test_deepseek_r1_output_cut_inside_thinking_is_reasoning(clients):
    r = _ask(clients["deepseek_r1"], "Still thinking about it")
    message = r.choices[0].message
    assert message.reasoning_content == "Still thinking about it" and message.content is None


def test_pythonic_is_read_never_run(clients):
    text = "[get_weather(city=__import__('os').getcwd(), days=3)]"
    r = _ask(clients["pythonic"], text).choices[0]
    assert r.message.tool_calls is None and r.message.content == text
    assert r.finish_reason == "stop"


def _flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it."""
    return {"type": "function", **tool["function"]}


def test_responses_create_and_stream_through_the_sdk(clients):
    """/v1/responses over the chat path: instructions, input messages with an earlier
    call and its output, function tools, reasoning.effort; reasoning, message and calls
    come back as output items, whole and through the SDK's stream helper."""
    _, _, text, reasoning, content, calls = CASES["qwen3"]
    client = clients["qwen3"]
    kw = dict(model=MODEL, instructions="Be brief.", tools=[_flat(WEATHER), _flat(TIME)],
              reasoning={"effort": "low"}, temperature=0.0, max_output_tokens=400,
              input=[{"role": "user", "content": "Weather in Oslo?"},
                     {"type": "function_call", "call_id": "call_0", "name": "get_weather",
                      "arguments": '{"city": "Oslo", "days": 1}'},
                     {"type": "function_call_output", "call_id": "call_0", "output": "Rain"},
                     {"role": "user", "content": [{"type": "input_text",
                                                   "text": MESSAGES[0]["content"]}]}],
              extra_body={"structured_outputs": {"regex": literal(text)}})
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.output_text == content
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == reasoning
    got = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    assert got == calls
    assert all(i.call_id.startswith("call_") for i in r.output if i.type == "function_call")
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [i.type for i in final.output] == kinds and final.output_text == content
    assert [(i.name, json.loads(i.arguments)) for i in final.output
            if i.type == "function_call"] == calls
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 2  # arguments as they are written
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == reasoning

    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert plain.status == "incomplete"
    # reasoning.effort reached the template as reasoning_effort ("<|effort|>high\n").
    effort = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                     reasoning={"effort": "high"}, temperature=0.0)
    assert effort.usage.input_tokens > plain.usage.input_tokens
    assert plain.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "huge"})
    assert e.value.response.json()["error"]["param"] == "reasoning.effort"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[], max_output_tokens=3)
    assert e.value.response.json()["error"]["param"] == "input"
