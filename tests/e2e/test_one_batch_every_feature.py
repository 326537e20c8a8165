"""One served batch with every request-level feature at once, on one `jetserve serve`:
LoRA (two adapters beside the base model), an int8 KV cache, the prefix cache, n-gram
speculative decoding, chunked prefill of a long prompt and a grammar on some rows; on the
contiguous and the paged KV layouts, and with mixed steps (`--scheduling mixed`: the
chunks and the verify rows in one ragged step).

The model is a Llama written by transformers (random weights, the bundled model's
sentencepiece tokenizer beside it, so grammars compile over real token strings), and the
adapters are PEFT's. Every request sent in one batch gets the greedy tokens it gets when
sent alone to the same server (the shared-prefix rows then hit the blocks the first round
cached); the adapter and base rows without a grammar get the greedy tokens of transformers
(with peft's merged adapter); the prefix-cache hits and the drafts kept are read from
/metrics. With mixed steps the rows without a grammar are held to transformers up to
near-ties (NEAR_TIE).
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from jetserve.model_loading import BUNDLED_DIR
from tests.e2e.serve_process import spawn, wait_listening
from tests.parity.hf_models import assert_near_greedy, hf_greedy, make_hf_model
from tests.parity.lora_adapters import base_model, make_adapter, merged_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
ADAPTERS = {"a1": (4, 8, ["q_proj", "v_proj", "down_proj"], 1),
            "a2": (8, 16, ["k_proj", "o_proj", "up_proj"], 2)}
REGEX = "(yes|no), [a-z]{3,8}"
# Mixed steps' chunks attend over the prompt's keys read back from the int8 pages (the
# turns' prefill attends over its own float keys, and only decode reads int8): a token
# may then be any whose transformers logit is this close to the top one.
NEAR_TIE = 0.05
_rng = np.random.default_rng(11)
SHORT = [1, *_rng.integers(3, 4096, size=6).tolist()]
LONG = [1, *_rng.integers(3, 4096, size=47).tolist()]  # 48: six chunks of 8
SHARED = [1, *_rng.integers(3, 4096, size=31).tolist()]  # two cache blocks of 16
# name -> (prompt, adapter or None, with the grammar)
REQUESTS = {
    "base short": (SHORT, None, False),
    "base long": (LONG, None, False),
    "a1 short": (SHORT, "a1", False),
    "a1 long": (LONG, "a1", False),
    "a2 short": (SHORT, "a2", False),
    "a2 long": (LONG, "a2", False),
    "base grammar": (SHORT, None, True),
    "a1 grammar": (LONG, "a1", True),
    "base shared 1": (SHARED + [7, 8, 9], None, False),
    "base shared 2": (SHARED + [12, 13], None, False),  # alone, a hit on the first's blocks
    "a2 shared": (SHARED + [10, 11], "a2", False),  # an adapter's KV: never the base's
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A transformers Llama of the bundled model's vocabulary, its tokenizer beside it,
    and two PEFT adapters of it: (dir, {adapter: dir})."""
    d = str(tmp_path_factory.mktemp("llama"))
    make_hf_model("llama", d, vocab_size=4096, max_position_embeddings=256)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(BUNDLED_DIR, f), d)
    adapters = {}
    for name, (rank, alpha, targets, seed) in ADAPTERS.items():
        adapters[name] = str(tmp_path_factory.mktemp(name))
        make_adapter(d, adapters[name], rank, alpha, targets, False, seed)
    return d, adapters


@pytest.fixture(scope="module", params=["contiguous", "paged", "mixed"])
def server(request, model_dir):
    """The server, on each KV layout (paged: the prefix cache links the KV pages), and
    with mixed steps (paged: prompt chunks beside verify rows in one step)."""
    d, adapters = model_dir
    layout = ["--kv-layout", "paged" if request.param == "mixed" else request.param,
              "--page-size", "8", *(["--scheduling", "mixed"] if request.param == "mixed"
                                    else [])]
    proc = spawn([*layout, "--model", d, "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                  "--max-loras", "2", "--max-lora-rank", "8", "--kv-dtype", "int8",
                  "--prefix-cache-hbm-mb", "4", "--speculative", "ngram:3",
                  "--max-prefill-length", "16", "--prefill-chunk", "8", "--max-seq-len", "128",
                  "--max-concurrent-decodes", "8", "--devices", "1", "--no-warmup",
                  "--interleaved", "--host", "127.0.0.1", "--grpc-port", "-1",
                  "--http-port", "0"])
    try:
        ports = wait_listening(proc, 1)
        yield f"http://127.0.0.1:{ports['HTTP']}", request.param
    finally:
        proc.kill()
        proc.wait()


def _ask(url: str, name: str) -> list[int]:
    prompt, adapter, grammar = REQUESTS[name]
    body = {"model": adapter or "model", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
            "logprobs": 0}
    if adapter is None:
        body.pop("model")
    if grammar:
        body["structured_outputs"] = {"regex": REGEX}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, (name, r.text)
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in toks]


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                            text, re.M))


def test_one_batch_gives_every_request_its_tokens_alone(server, model_dir):
    server, layout = server
    names = list(REQUESTS)
    alone = {n: _ask(server, n) for n in names}  # one at a time; the shared pair in order
    hits_alone = _metric(server, "vllm:prefix_cache_hits_total")
    # Whole blocks leaving a token to prefill: "base shared 2" on "base shared 1"'s (the
    # 32 of SHARED), "a1 grammar" on "a1 long"'s. A block is 16 tokens in arrays, a page
    # of 8 in the paged pool.
    block = 16 if layout == "contiguous" else 8
    assert hits_alone == 32 + (len(LONG) - 1) // block * block, hits_alone
    with ThreadPoolExecutor(len(names)) as pool:
        batch = dict(zip(names, pool.map(lambda n: _ask(server, n), names), strict=True))
    for n in names:
        assert batch[n] == alone[n], n
    # The prefix cache served the batch's prompts from the blocks the first round left.
    assert _metric(server, "vllm:prefix_cache_hits_total") > hits_alone
    assert _metric(server, "jetserve_spec_accepted_tokens_total") > 0
    d, adapters = model_dir
    refs = {None: base_model(d), **{a: merged_model(d, p) for a, p in adapters.items()}}
    for n, (prompt, adapter, grammar) in REQUESTS.items():
        if grammar:
            continue
        if layout == "mixed":  # the chunks attend over the int8 pages: near-ties may turn
            assert_near_greedy(refs[adapter], prompt, alone[n], NEAR_TIE, n)
        else:
            assert alone[n] == hf_greedy(refs[adapter], prompt, MAX_TOKENS), n
    # The adapters change the tokens.
    assert alone["a1 long"] != alone["base long"] != alone["a2 long"]
