"""Chat tools against a real `jetserve serve` on the bundled model, with the openai SDK.

The bundled model never saw a tool call: a forced one (tool_choice "required" or a named
function) comes out well-formed only because decoding is constrained to its JSON schema,
which is what these tests check, at temperature 1, whole and through the SDK's stream
helper. Bad tools / tool_choice are refused with 400 naming the field.
"""

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


@pytest.fixture(scope="module")
def client():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "jetserve", "serve", "--host", "127.0.0.1",
           "--grpc-port", "0", "--http-port", "0", "--interleaved",
           "--max-seq-len", "512", "--max-prefill-length", "256",
           "--max-concurrent-decodes", "4"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ports = wait_listening(proc, 2)
    threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()  # keep it read
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                        max_retries=0, timeout=300)
    proc.kill()
    proc.wait()


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
                                            temperature=1.0, seed=seed) as stream:
            final = stream.get_final_completion()
        choice = final.choices[0]
        _check_calls(choice, {"get_weather"})
        # The SDK parsed the arguments of a strict pydantic tool itself.
        assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)


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
