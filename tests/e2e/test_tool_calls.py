"""Chat tools against a real `jetserve serve` on the bundled model, with the openai SDK.

The bundled model never saw a tool call: a forced one (tool_choice "required" or a named
function) comes out well-formed only because decoding is constrained to its JSON schema,
which is what these tests check, at temperature 1, whole and through the SDK's stream
helper; with parallel calls allowed the list of calls closes within max_tokens 20/20.
Bad tools / tool_choice are refused with 400 naming the field.
"""

import json
import os
import subprocess
import sys
import threading
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.serve_process import wait_listening
from tests.xla import xla_flags

RUNS = 20


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The time in a timezone."""

    timezone: Literal["UTC", "CET", "PST"]
    seconds: bool


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME = openai.pydantic_function_tool(GetTime, name="get_time")
MODELS = {"get_weather": GetWeather, "get_time": GetTime}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
SIZES = ["--max-seq-len", "520", "--max-prefill-length", "256", "--max-concurrent-decodes", "4"]


def serve(*extra: str):
    """An openai client of a `jetserve serve` on the bundled model (a generator: the
    server stops when it is closed)."""
    cmd = [sys.executable, "-m", "jetserve", "serve", "--host", "127.0.0.1",
           "--grpc-port", "0", "--http-port", "0", "--interleaved", *SIZES, *extra]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        ports = wait_listening(proc, 2)
        threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()  # keep it read
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1",
                            api_key="unused", max_retries=0, timeout=300)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client():
    yield from serve()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _check_calls(choice, names: set[str]) -> None:
    """One call to one of `names`, whose arguments validate against its pydantic model."""
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    MODELS[call.function.name].model_validate_json(call.function.arguments)


def test_required_returns_a_call_20_of_20(client, model):
    names = set()
    for seed in range(RUNS // 4):
        r = client.chat.completions.create(model=model, messages=MESSAGES,
                                           tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False,  # exactly one call
                                           temperature=1.0, n=4, seed=seed)
        assert len(r.choices) == 4
        for choice in r.choices:
            _check_calls(choice, {"get_weather", "get_time"})
            names.add(choice.message.tool_calls[0].function.name)
    assert names  # at least one tool was chosen; which one is the model's affair


def test_required_streamed_through_the_sdk_helper_20_of_20(client, model):
    for seed in range(RUNS):
        with client.chat.completions.stream(model=model, messages=MESSAGES,
                                            tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False,
                                            temperature=1.0, seed=seed) as stream:
            final = stream.get_final_completion()
        choice = final.choices[0]
        _check_calls(choice, {"get_weather"})
        # The SDK parsed the arguments of a strict pydantic tool itself.
        assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)


def test_required_parallel_calls_close_within_max_tokens_20_of_20(client, model):
    """Parallel calls allowed (a list of one or more calls): the list closes before
    max_tokens ends (jetserve/structured/closing.py), so every answer ends "tool_calls"."""
    for seed in range(RUNS // 4):
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120,
                                           tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1.0, n=4, seed=100 + seed)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls and choice.message.content is None
            for call in choice.message.tool_calls:
                MODELS[call.function.name].model_validate_json(call.function.arguments)


def test_named_choice_calls_that_function(client, model):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=model, messages=MESSAGES,
                                       tools=[WEATHER, TIME], tool_choice=named,
                                       temperature=1.0, n=4, seed=7)
    for choice in r.choices:
        _check_calls(choice, {"get_time"})
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=named,
        temperature=1.0, seed=8, stream=True))
    entries = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert entries[0].id.startswith("call_") and entries[0].function.name == "get_time"
    assert len(entries) > 2  # the arguments in fragments, as they were generated
    assert all(e.index == 0 and e.id is None for e in entries[1:])
    GetTime.model_validate_json("".join(e.function.arguments for e in entries))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_none_run_with_tools_in_the_prompt(client, model):
    kw = dict(model=model, temperature=0.0, max_tokens=8)
    plain = client.chat.completions.create(messages=MESSAGES, **kw)
    none = client.chat.completions.create(messages=MESSAGES, tools=[WEATHER],
                                          tool_choice="none", **kw)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # as without tools
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    auto = client.chat.completions.create(messages=history, tools=[WEATHER], **kw)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt held the tool listing and the call: vLLM's /tokenize renders the same.
    root = str(client.base_url).removesuffix("/v1/")
    shown = httpx.post(f"{root}/tokenize", json={"messages": history, "tools": [WEATHER],
                                                 "return_token_strs": False}).json()
    assert auto.usage.prompt_tokens == shown["count"]
    text = httpx.post(f"{root}/detokenize", json={"tokens": shown["tokens"]}).json()["prompt"]
    assert '# {"type": "function", "function": {"name": "get_weather"' in text
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}</tool_call>\n# tool:\n18 degrees\n') in text


@pytest.mark.parametrize("extra, param, named", [
    (dict(tools=[WEATHER], tool_choice={"type": "function",
                                        "function": {"name": "launch_rocket"}}),
     "tool_choice", "launch_rocket"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
     "tools[0].function.name", "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}]),
     "tools[0].function.parameters", "tools[0].function.parameters"),
    (dict(tools=[{"type": "code_interpreter"}]), "tools[0].type", "tools[0].type"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(client, model, extra, param, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                       **extra)
    err = e.value.response.json()["error"]
    assert err["param"] == param and named in err["message"]


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def test_required_with_parallel_calls_returns_one_or_more(client, model):
    """parallel_tool_calls (the default): the output is a list of calls, each validated,
    and the SDK's stream helper assembles what the whole response has."""
    kw = dict(model=model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
              temperature=1.0)  # max_tokens: the room left (121 tokens)
    counts = []
    for seed in range(3):
        choice = client.chat.completions.create(seed=seed, **kw).choices[0]
        calls = _calls(choice.message)
        assert calls and choice.message.content is None
        whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert choice.finish_reason in ("tool_calls", "length")  # the toy model may go on
        for name, args in whole:
            MODELS[name].model_validate_json(args)
        try:
            with client.chat.completions.stream(seed=seed, **kw) as stream:
                final = stream.get_final_completion().choices[0]
        except openai.LengthFinishReasonError as e:  # what it assembled is kept on it
            final = e.completion.choices[0]
        assert _calls(final.message) == calls and final.finish_reason == choice.finish_reason
        counts.append(len(calls))
    assert max(counts) >= 2  # several calls in one answer


# tool_choice "auto" reads the calls the model writes itself. The bundled model was never
# taught to, so a regex (structured_outputs, allowed with auto) makes it write them, in
# the bundled template's <tool_call> format, after a sentence of content.
AUTO_TEXT = (r'Let me check\.\n<tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Oslo)", "unit": "celsius"\}\}</tool_call>')
TWO_CALLS = AUTO_TEXT + (r'\n<tool_call>\{"name": "get_time", "arguments": '
                         r'\{"timezone": "UTC", "seconds": (true|false)\}\}</tool_call>')


def _auto(client, model, regex, **kw):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0.0,
        extra_body={"structured_outputs": {"regex": regex}}, **kw)


def test_auto_call_streams_as_openai_does(client, model):
    whole = _auto(client, model, AUTO_TEXT).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [(name, args)] = _calls(whole.message)
    assert name == "get_weather"
    GetWeather.model_validate_json(args)
    chunks = list(_auto(client, model, AUTO_TEXT, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    entries = [(k, e) for k, d in enumerate(deltas) for e in d.tool_calls or ()]
    text_at = [k for k, d in enumerate(deltas) if d.content]
    assert "".join(deltas[k].content for k in text_at) == "Let me check."
    (k0, head), rest = entries[0], [e for _, e in entries[1:]]
    assert max(text_at) < k0  # the content went out before the call
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather"
    assert len(rest) > 5  # the arguments in fragments, as they were generated
    assert all(e.index == 0 and e.id is None and e.function.name is None for e in rest)
    assert (head.function.arguments or "") + "".join(e.function.arguments for e in rest) \
        == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Nothing empty is sent while text is held back (it might have been a call's start).
    assert all(d.role or d.content or d.tool_calls for d in deltas[:-1])
    with client.chat.completions.stream(
            model=model, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0.0,
            extra_body={"structured_outputs": {"regex": AUTO_TEXT}}) as stream:
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message) == _calls(whole.message)
    assert final.message.content == "Let me check." and final.finish_reason == "tool_calls"


def test_auto_parallel_calls_on_and_off(client, model):
    both = _auto(client, model, TWO_CALLS).choices[0]
    assert [n for n, _ in _calls(both.message)] == ["get_weather", "get_time"]
    assert len({c.id for c in both.message.tool_calls}) == 2
    for stream in (False, True):
        r = _auto(client, model, TWO_CALLS, parallel_tool_calls=False, stream=stream)
        if stream:
            entries = [e for c in r if c.choices for e in c.choices[0].delta.tool_calls or ()]
            assert {e.index for e in entries} == {0}
            assert entries[0].function.name == "get_weather"
        else:
            assert _calls(r.choices[0].message) == _calls(both.message)[:1]
            assert r.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        _auto(client, model, TWO_CALLS, parallel_tool_calls="yes")
    assert e.value.response.json()["error"]["param"] == "parallel_tool_calls"


def test_batch_rows_carry_the_calls_the_http_api_returns(client, model, tmp_path):
    """`jetserve batch` chat rows with tools: content, tool_calls and finish_reason as
    /v1/chat/completions answers the same request (greedy, so the same tokens)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    forced_text = {"structured_outputs": {"regex": TWO_CALLS}}
    rows = {"auto": dict(extra_body=forced_text),
            "first": dict(extra_body=forced_text, parallel_tool_calls=False),
            "named": dict(tool_choice=named),
            "none": dict(tool_choice="none")}
    base = dict(messages=MESSAGES, tools=[WEATHER, TIME], temperature=0.0, max_tokens=110)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(
        json.dumps({"id": k, **base, **{f: x for f, x in kw.items() if f != "extra_body"},
                    **kw.get("extra_body", {})}) + "\n" for k, kw in rows.items()))
    done = subprocess.run([sys.executable, "-m", "jetserve", "batch", "--input", str(inp),
                           "--output", str(out), *SIZES, "--no-progress"], env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for k, kw in rows.items():
        choice = client.chat.completions.create(model=model, **base, **kw).choices[0]
        row = got[k]
        assert row["finish_reason"] == choice.finish_reason, k
        assert row.get("content", row["text"]) == choice.message.content, k
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in row.get("tool_calls", ())] == _calls(choice.message), k
        assert all(c["id"].startswith("call_") for c in row.get("tool_calls", ()))
    assert [c["function"]["name"] for c in got["auto"]["tool_calls"]] == ["get_weather",
                                                                         "get_time"]
    assert len(got["first"]["tool_calls"]) == 1 and got["named"]["finish_reason"] == \
        "tool_calls"
    assert "tool_calls" not in got["none"] and "content" not in got["none"]  # no tools
