"""Structured output end to end: `jetserve serve` on the bundled model as a process, called
with the `openai` SDK (and gRPC) at temperature 1. A strict json_schema from a pydantic
model validates 20/20, regex and choice match 20/20, streamed too; json_object output
parses 20/20 (streamed too, and at a short max_tokens); a strict schema whose strings and
lists nothing bounds and a choice of a long and a short answer close within max_tokens
20/20 (jetserve/structured/closing.py), and a max_tokens below the shortest answer is
refused with 400 naming it and the minimum, which then suffices; bad constraints get 400 /
INVALID_ARGUMENT naming the field, and OpenAI fields jetserve does not implement are
refused by name."""

import json
import os
import re
import subprocess
import sys
import threading
from typing import Annotated

import grpc
import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.serve_process import wait_listening
from tests.xla import xla_flags

N = 20
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    likes: list[Annotated[str, Field(max_length=10)]] = Field(max_length=2)


class Note(BaseModel):  # nothing bounds its strings or its list
    model_config = ConfigDict(extra="forbid")
    title: str
    body: str
    tags: list[str]
    score: float


NOTE_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "note", "strict": True, "schema": Note.model_json_schema()}}


def person_format(strict=True):
    return {"type": "json_schema", "json_schema": {
        "name": "person", "strict": strict, "schema": Person.model_json_schema()}}


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    cmd = [sys.executable, "-m", "jetserve", "serve", "--host", "127.0.0.1", "--grpc-port",
           "0", "--http-port", "0", "--interleaved", "--max-seq-len", "512",
           "--max-prefill-length", "64", "--served-model-name", "bundled"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ports = wait_listening(proc, 2)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    yield ports
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served['HTTP']}/v1", api_key="unused",
                         max_retries=0, timeout=600)


def hot(**kw):
    return dict(model="bundled", temperature=1.0, n=N // 2, **kw)


def twenty(create, **kw):
    """N choices: two requests of N / 2 samples (at most 16 per request), seeds 7 and 8."""
    return [c for seed in (7, 8) for c in create(seed=seed, **hot(), **kw).choices]


def test_strict_json_schema_validates_every_time(client):
    choices = twenty(client.chat.completions.create, messages=MESSAGES, max_tokens=120,
                     response_format=person_format())
    assert len(choices) == N
    for c in choices:
        Person.model_validate_json(c.message.content)
        assert c.finish_reason == "stop"


def test_parse_helper_of_the_sdk(client):
    choices = twenty(client.chat.completions.parse, messages=MESSAGES, max_tokens=120,
                     response_format=Person)
    assert all(isinstance(c.message.parsed, Person) for c in choices)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_json": Person.model_json_schema()}, Person.model_validate_json),
    ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")~1..5 "!"'}},
     lambda t: re.fullmatch(r"a[bc]{1,5}!", t)),
])
def test_vllm_fields_on_completions(client, extra, check):
    choices = twenty(client.completions.create, prompt="Answer: ", max_tokens=120,
                     extra_body=extra)
    assert len(choices) == N
    for c in choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_streamed_chat_matches_too(client):
    for fmt, check in ((person_format(), Person.model_validate_json),
                       (None, lambda t: re.fullmatch(REGEX, t))):
        kw = {"response_format": fmt} if fmt else {"extra_body": {"guided_regex": REGEX}}
        texts = [""] * N
        finish = [None] * N
        for k, seed in enumerate((7, 8)):
            for chunk in client.chat.completions.create(messages=MESSAGES, max_tokens=120,
                                                        stream=True, seed=seed, **hot(), **kw):
                for c in chunk.choices:
                    i = k * N // 2 + c.index
                    texts[i] += c.delta.content or ""
                    finish[i] = c.finish_reason or finish[i]
        for t, f in zip(texts, finish, strict=True):
            assert f == "stop" and check(t), t


def test_unbounded_strict_schema_closes_within_max_tokens(client):
    choices = twenty(client.chat.completions.create, messages=MESSAGES, max_tokens=160,
                     response_format=NOTE_FORMAT)
    for c in choices:
        Note.model_validate_json(c.message.content)
        assert c.finish_reason == "stop"


def test_max_tokens_below_the_shortest_answer_is_refused_naming_the_minimum(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="bundled", messages=MESSAGES, max_tokens=5,
                                       response_format=NOTE_FORMAT)
    err = e.value.body
    assert err["param"] == "max_tokens", err
    least = int(re.search(r"at least (\d+)", err["message"]).group(1))
    assert least > 5
    # The minimum is enough: every answer at exactly that budget is a whole note.
    for c in twenty(client.chat.completions.create, messages=MESSAGES, max_tokens=least,
                    response_format=NOTE_FORMAT):
        Note.model_validate_json(c.message.content)
        assert c.finish_reason == "stop"


def test_choice_closes_within_max_tokens(client):
    long_and_short = ["an answer of a great many words that takes far more than four tokens",
                      "no"]
    choices = twenty(client.completions.create, prompt="Answer: ", max_tokens=4,
                     extra_body={"structured_outputs": {"choice": long_and_short}})
    for c in choices:
        assert c.text in long_and_short and c.finish_reason == "stop", c


JSON_OBJECT = dict(max_tokens=300, response_format={"type": "json_object"}, messages=[
    {"role": "user", "content": 'Reply with a short JSON object like {"ok": 1}.'}])


def test_json_object_parses_every_time(client):
    # The model writes long strings at temperature 1; the object still closes within
    # max_tokens (jetserve/structured/json_budget.py), so every answer parses.
    choices = twenty(client.chat.completions.create, **JSON_OBJECT)
    assert len(choices) == N
    for c in choices:
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.message.content), dict)
    short = twenty(client.chat.completions.create, **{**JSON_OBJECT, "max_tokens": 12})
    for c in short:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_json_object_streamed_parses_every_time(client):
    texts, finish = [""] * N, [None] * N
    for k, seed in enumerate((7, 8)):
        for chunk in client.chat.completions.create(stream=True, seed=seed, **hot(),
                                                    **JSON_OBJECT):
            for c in chunk.choices:
                i = k * N // 2 + c.index
                texts[i] += c.delta.content or ""
                finish[i] = c.finish_reason or finish[i]
    for t, f in zip(texts, finish, strict=True):
        assert f == "stop" and isinstance(json.loads(t), dict), t


def test_greedy_constrained_equals_free_when_the_free_output_matches(client):
    free = client.completions.create(model="bundled", prompt="def main", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    shaped = client.completions.create(
        model="bundled", prompt="def main", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "guided_regex": "(?s:.{0,400})"})
    assert shaped.choices[0].text == text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "start: foo("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
])
def test_bad_http_inputs_are_400_naming_the_field(served, body, param):
    url = f"http://127.0.0.1:{served['HTTP']}/v1/chat/completions"
    r = httpx.post(url, json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param)


def test_grpc_constraint_fields(served):
    with grpc.insecure_channel(f"127.0.0.1:{served['gRPC']}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)

        def decode(**kw):
            req = pb.DecodeRequest(max_tokens=120, temperature=1.0, seed=3, num_samples=4,
                                   text_content=pb.DecodeRequest.TextContent(text="Answer: "),
                                   **kw)
            texts = [""] * 4
            for m in stub.Decode(req, timeout=600):
                for i, s in enumerate(m.stream_content.samples):
                    texts[i] += s.text
            return texts

        assert all(re.fullmatch(REGEX, t) for t in decode(regex=REGEX))
        assert all(t in CHOICES for t in decode(choice=pb.DecodeRequest.Choices(choices=CHOICES)))
        for t in decode(json_schema=json.dumps(Person.model_json_schema())):
            Person.model_validate_json(t)
        for kw, field in ((dict(regex="(ab"), "regex"), (dict(json_schema="{"), "json_schema"),
                          (dict(grammar="start: foo("), "grammar"),
                          (dict(json_object=False), "json_object")):
            with pytest.raises(grpc.RpcError) as e:
                decode(**kw)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(field), e.value.details()
