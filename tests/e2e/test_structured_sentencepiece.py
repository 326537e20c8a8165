"""Structured output on a model the way Llama 2 / Mistral ship one: a random-weight Llama
directory whose tokenizer is a sentencepiece BPE with byte fallback and the dummy "▁"
prefix (trained here on stdlib files), `tokenizer.model` and a LlamaTokenizer config, no
tokenizer.json. `jetserve serve` as a process, the `openai` SDK on /v1/completions: a
regex, a choice and a json_schema at temperature 1 match 20/20, and the regex at
temperature 0 for the prompts that once answered `dentnotaa` (9 letters, no parenthesis,
"stop" after 4 tokens)."""

import json
import os
import re
import subprocess
import sys
import threading

import jsonschema
import openai
import pytest

from tests.e2e.serve_process import wait_listening
from tests.jetserve.structured.test_vocabulary_bytes import CHOICES, REGEX, SCHEMA
from tests.jetserve.structured.tokenizer_kinds import VOCAB, write_sentencepiece
from tests.parity.hf_models import make_hf_model
from tests.xla import xla_flags

N = 20


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


CHECKS = {
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES),
    "json": ({"json": SCHEMA}, _valid),
}


@pytest.fixture(scope="module")
def llama2_style_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp_llama")
    write_sentencepiece(d)
    make_hf_model("llama", str(d), vocab_size=VOCAB)
    assert not (d / "tokenizer.json").exists()
    return d


@pytest.fixture(scope="module")
def client(llama2_style_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    cmd = [sys.executable, "-m", "jetserve", "serve", "--model", str(llama2_style_dir),
           "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--interleaved",
           "--max-seq-len", "256", "--max-prefill-length", "64",
           "--served-model-name", "sp"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ports = wait_listening(proc, 2)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                        max_retries=0, timeout=600)
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("prompt", ["def add(a, b):\n    ", "x = "])
def test_greedy_regex_matches(client, prompt):
    r = client.completions.create(model="sp", prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    c = r.choices[0]
    assert CHECKS["regex"][1](c.text) and c.finish_reason == "stop", c.text


@pytest.mark.parametrize("which", list(CHECKS))
def test_sampled_answers_match_every_time(client, which):
    field, ok = CHECKS[which]
    choices = [c for seed in (7, 8) for c in client.completions.create(
        model="sp", prompt="x = ", max_tokens=80, temperature=1.0, n=N // 2, seed=seed,
        extra_body={"structured_outputs": field}).choices]
    assert len(choices) == N
    bad = [c.text for c in choices if c.finish_reason != "stop" or not ok(c.text)]
    assert bad == [], which
