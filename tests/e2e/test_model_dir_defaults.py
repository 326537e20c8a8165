"""What transformers 5 writes into a model directory, served: generation_config.json's
sampling fields as the defaults of requests that set none (`--generation-config auto`,
vLLM's rule) or ignored (`vllm`), and chat_template.jinja rendered as transformers renders
it, through the openai SDK and JetStream's gRPC.

One random-weight Qwen3 directory: a byte-level BPE tokenizer with a Qwen3-style template
(tests/jetserve/server/family_templates.py), saved by transformers, and a
generation_config.json of `top_k: 1, temperature: 1.0, max_new_tokens: 5`: sampling that
can only pick the top token, so requests that set nothing answer alike whatever their
seed, and five tokens long. One orchestrator; HTTP servers configured from `jetserve
serve`'s own flags (auto, and vllm), and one `jetserve serve` process for what it says at
start.
"""

import argparse
import json
import subprocess

import grpc
import openai
import pytest
import requests

from jetserve.commands import serve
from jetserve.generation_config import FILE
from tests.e2e.conftest import local_config
from tests.e2e.serve_process import spawn
from tests.jetserve.server.family_templates import write_tokenizer_dir

MODEL = "qwen3-style"
GENERATION = {"do_sample": True, "top_k": 1, "temperature": 1.0, "max_new_tokens": 5,
              "eos_token_id": [2], "transformers_version": "5.25.0"}
SEEDS = range(4)
ASK = [{"role": "user", "content": "The weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch

    from tests.parity.hf_models import make_hf_model

    d = tmp_path_factory.mktemp("qwen3_dir")
    hf = write_tokenizer_dir(d, "qwen3")
    torch.manual_seed(0)
    make_hf_model("qwen3", str(d), vocab_size=len(hf))
    (d / FILE).write_text(json.dumps(GENERATION))
    return d


def _config(model_dir, mode: str, **kw):
    """The ServerConfig `jetserve serve --generation-config MODE` builds, on test ports."""
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model", str(model_dir), "--generation-config", mode])
    return local_config(model_name=MODEL,
                        generation_defaults=serve.server_config(args).generation_defaults, **kw)


@pytest.fixture(scope="module")
def servers(model_dir):
    import jax

    from engines import EngineConfig
    from jetserve import orchestrator
    from jetserve.server.runner import BackgroundServers

    orch = orchestrator.build(str(model_dir), interleaved=True, devices=jax.devices()[:1],
                              engine_config=EngineConfig(max_concurrent_decodes=4,
                                                         max_prefill_length=256,
                                                         max_seq_len=512))
    orch.start()
    started = []
    try:
        for mode, kw in (("auto", {}), ("vllm", {"grpc_port": None})):
            started.append(BackgroundServers(orch, _config(model_dir, mode, **kw)).start())
        yield dict(zip(("auto", "vllm"), started, strict=True))
    finally:
        for s in started:
            s.stop()
        orch.stop(drain=False, timeout=30)


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=300)


def _chat(s, **kw):
    kw.setdefault("extra_body", {})["ignore_eos"] = True
    return _client(s).chat.completions.create(model=MODEL, messages=ASK, **kw).choices[0]


def _completion(s, **kw):
    return _client(s).completions.create(model=MODEL, prompt="The weather",
                                         extra_body={"ignore_eos": True}, **kw)


def test_unset_fields_take_the_model_defaults(servers):
    auto = servers["auto"]
    answers = [_chat(auto, seed=seed) for seed in SEEDS]
    assert len({a.message.content for a in answers}) == 1  # top_k 1: the top token
    assert all(a.finish_reason == "length" for a in answers)
    greedy = _chat(auto, temperature=0.0)  # temperature 0 asked for: the same tokens
    assert greedy.message.content == answers[0].message.content
    # max_new_tokens is max_tokens where a request gives none: chat and completions.
    usage = [_client(auto).chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"ignore_eos": True}).usage,
             _completion(auto).usage]
    assert [u.completion_tokens for u in usage] == [5, 5]
    texts = {_completion(auto, seed=seed).choices[0].text for seed in SEEDS}
    assert len(texts) == 1


def test_a_requests_own_values_win(servers):
    auto = servers["auto"]
    # top_k 0 (off) at temperature 1 over random weights: seeds sample apart.
    answers = {_chat(auto, seed=seed, temperature=1.0, max_tokens=8,
                     extra_body={"top_k": 0}).message.content for seed in SEEDS}
    assert len(answers) > 1
    assert _completion(auto, max_tokens=8).usage.completion_tokens == 8


def test_generation_config_vllm_ignores_the_file(servers):
    vllm = servers["vllm"]
    # OpenAI's defaults: temperature 1 and no top-k, 16 tokens for a completion.
    answers = {_chat(vllm, seed=seed, max_tokens=8).message.content for seed in SEEDS}
    assert len(answers) > 1
    assert _completion(vllm).usage.completion_tokens == 16


def test_grpc_unset_fields_take_the_model_defaults(servers):
    from protos import jetstream_pb2 as pb
    from protos import jetstream_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{servers['auto'].grpc_port}")
    stub = pb_grpc.OrchestratorStub(channel)

    def decode(**kw) -> list[int]:
        req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
            token_ids=[10, 11, 12]), max_tokens=6, ignore_eos=True, **kw)
        return [t for r in stub.Decode(req, timeout=300)
                for s in r.stream_content.samples for t in s.token_ids]

    try:
        plain = {tuple(decode(seed=seed)) for seed in SEEDS}
        assert len(plain) == 1 and len(next(iter(plain))) == 6
        assert list(next(iter(plain))) == decode(temperature=0.0)
        sampled = {tuple(decode(seed=seed, temperature=1.0, top_k=0)) for seed in SEEDS}
        assert len(sampled) > 1
    finally:
        channel.close()


def test_the_chat_template_renders_as_transformers_does(servers, model_dir):
    """/tokenize with messages (what /v1/chat/completions renders) against transformers'
    apply_chat_template, with tools and enable_thinking in chat_template_kwargs; the
    chat endpoint's prompt is those tokens."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    url = f"http://127.0.0.1:{servers['auto'].http_port}"
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": "<think>\nSunny?\n</think>\n\nSunny."},
               {"role": "user", "content": "And tomorrow?"}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        for tools in (None, [WEATHER]):
            want = hf.apply_chat_template(history, tools=tools, add_generation_prompt=True,
                                          tokenize=True, return_dict=False, **kwargs)
            body = {"model": MODEL, "messages": history, "chat_template_kwargs": kwargs}
            if tools:
                body["tools"] = tools
            got = requests.post(f"{url}/tokenize", json=body, timeout=60).json()
            assert got["tokens"] == list(want)
            chat = _client(servers["auto"]).chat.completions.create(
                model=MODEL, messages=history, tools=tools or openai.NOT_GIVEN,
                max_tokens=1, extra_body={"chat_template_kwargs": kwargs})
            assert chat.usage.prompt_tokens == len(want)


def test_serve_says_which_defaults_it_took_and_refuses_a_bad_file(model_dir, tmp_path):
    """Both before the model loads: one line naming the fields taken from the file; a
    field of the wrong type stops the start, naming the file and the field."""
    proc = spawn(["--model", str(model_dir), "--host", "127.0.0.1", "--grpc-port", "0",
                  "--http-port", "0"])
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "default sampling parameters" in line or "listening" in line:
                break
        said = "".join(lines)
        assert (f"jetserve serve: default sampling parameters overridden by the model's "
                f"{model_dir / FILE}: temperature=1.0, top_k=1, max_new_tokens=5") in said
    finally:
        proc.kill()
        proc.wait()
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_text((model_dir / name).read_text())
    (bad / FILE).write_text(json.dumps({"top_p": "0.9"}))
    proc = spawn(["--model", str(bad), "--host", "127.0.0.1", "--grpc-port", "0",
                  "--http-port", "0"])
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode != 0
    assert f"{bad / FILE}: top_p must be a number in (0.0, 1.0], got '0.9'" in out


def test_generate_and_batch_take_the_model_defaults(model_dir, tmp_path, capsys):
    """`jetserve generate` and `jetserve batch` rows: max_new_tokens is their max_tokens
    where none is given, the file's sampling theirs (top_k 1: greedy's tokens), and
    --generation-config vllm their own (32 and 16 tokens)."""
    from jetserve import cli

    common = ["--model", str(model_dir), "--max-seq-len", "128", "--max-concurrent-decodes",
              "2", "--compile-cache", "off"]

    def generate(*flags) -> tuple[list[int], str]:
        assert cli.main(["generate", *common, "--prompt-ids", "10,11,12", "--ignore-eos",
                         "--json", *flags]) == 0
        said = capsys.readouterr()
        return json.loads(said.out.splitlines()[-1])["token_ids"], said.err

    sampled, err = generate("--seed", "3")
    assert "jetserve generate: default sampling parameters overridden" in err
    assert len(sampled) == 5 and sampled == generate("--temperature", "0")[0]
    ignored, err = generate("--generation-config", "vllm")
    assert len(ignored) == 32 and "default sampling parameters" not in err

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in (
        {"id": "default", "prompt_ids": [10, 11, 12], "ignore_eos": True, "seed": 1},
        {"id": "own", "prompt_ids": [10, 11, 12], "ignore_eos": True, "max_tokens": 7})))
    out = tmp_path / "out.jsonl"
    assert cli.main(["batch", *common, "--input", str(rows), "--output", str(out),
                     "--no-progress"]) == 0
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert got["default"] == sampled and len(got["own"]) == 7
