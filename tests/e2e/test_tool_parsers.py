"""--tool-call-parser on a real `jetserve serve`: calls written in Llama 3.x's bare JSON
and in Mistral's [TOOL_CALLS] list are read with tool_choice auto, whole and through the
openai SDK's stream helper, parallel_tool_calls false keeping the first; an unknown
parser name stops `jetserve serve` at startup, naming the flag and the choices.

As in test_tool_calls, a regex (structured_outputs) makes the bundled model, which was
never taught any call format, write the calls.
"""

import subprocess
import sys

import pytest

from tests.e2e.test_tool_calls import ENV, MESSAGES, MODELS, TIME, WEATHER, _calls, serve

WEATHER_ARGS = r'\{"city": "(Paris|Oslo)", "unit": "celsius"\}'
TIME_ARGS = r'\{"timezone": "UTC", "seconds": (true|false)\}'
WRITTEN = {  # parser: (the text the model is made to write, the content read out of it)
    "llama3_json": (rf'\{{"name": "get_weather", "parameters": {WEATHER_ARGS}\}}; '
                    rf'\{{"name": "get_time", "parameters": {TIME_ARGS}\}}', None),
    "mistral": (rf'One moment\. \[TOOL_CALLS\]\[\{{"name": "get_weather", "arguments": '
                rf'{WEATHER_ARGS}\}}, \{{"name": "get_time", "arguments": {TIME_ARGS}\}}\]',
                "One moment."),
}


@pytest.fixture(scope="module", params=list(WRITTEN))
def parser_client(request):
    server = serve("--tool-call-parser", request.param)
    yield request.param, next(server)
    server.close()


def test_auto_reads_calls_in_the_parsers_format(parser_client):
    parser, client = parser_client
    regex, content = WRITTEN[parser]
    kw = dict(model=client.models.list().data[0].id, messages=MESSAGES,
              tools=[WEATHER, TIME], temperature=0.0,
              extra_body={"structured_outputs": {"regex": regex}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    calls = _calls(whole.message)
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    for name, args in calls:
        MODELS[name].model_validate_json(args)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message) == calls and final.message.content == content
    first = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
    assert _calls(first.message) == calls[:1] and first.finish_reason == "tool_calls"


def test_an_unknown_parser_stops_serve_at_startup():
    done = subprocess.run([sys.executable, "-m", "jetserve", "serve", "--tool-call-parser",
                           "granite"], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "--tool-call-parser" in done.stderr and "'granite'" in done.stderr
    assert all(name in done.stderr for name in ("hermes", "llama3_json", "mistral",
                                                "qwen3_coder", "pythonic", "deepseek_v3",
                                                "glm45", "openai"))
