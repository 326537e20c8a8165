"""Prompts past the prefill bucket over HTTP (the session servers: max_prefill_length 64,
max_seq_len 256): generation and echo scoring both go in chunks, /v1/models advertises
exactly the limit that is enforced, and one token past it is a 400 naming --max-seq-len."""

import math

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY_ENGINE, TINY_MODEL
from tests.e2e.test_openai_http import _id_of

S = TINY_ENGINE.max_seq_len


@pytest.fixture(scope="module")
def client(tiny_servers):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{tiny_servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def _prompt(n):
    return [32 + (7 * i) % 90 for i in range(n)]


def test_models_advertise_the_enforced_limit(client, tiny_servers):
    models = httpx.get(f"http://127.0.0.1:{tiny_servers.http_port}/v1/models").json()
    assert models["data"][0]["max_model_len"] == S
    ok = client.completions.create(model=TINY_MODEL, prompt=_prompt(S - 1), max_tokens=1,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.prompt_tokens == S - 1 and ok.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match=rf"{S} tokens.*--max-seq-len"):
        client.completions.create(model=TINY_MODEL, prompt=_prompt(S), max_tokens=1)


def test_echo_scores_a_chunked_prompt_like_chunked_generation(client):
    """A 150-token prompt (3 prefill chunks) generates 6 greedy tokens; scoring prompt +
    continuation (3 scoring chunks) gives the log-probs generation reported, and every
    continuation token is the argmax."""
    ids = _prompt(150)
    as_ids = {"return_tokens_as_token_ids": True}
    gen = client.completions.create(model=TINY_MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    logprobs=1, extra_body={"ignore_eos": True, **as_ids}
                                    ).choices[0]
    cont = [_id_of(token) for token in gen.logprobs.tokens]
    scored = client.completions.create(model=TINY_MODEL, prompt=ids + cont, max_tokens=0,
                                       echo=True, logprobs=1, extra_body=as_ids
                                       ).choices[0].logprobs
    assert len(scored.token_logprobs) == 156 and scored.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in scored.token_logprobs[1:])
    for got, want in zip(scored.token_logprobs[150:], gen.logprobs.token_logprobs, strict=True):
        assert math.isclose(got, want, abs_tol=2e-4)
    for pos in range(150, 156):
        top = scored.top_logprobs[pos]
        assert max(top, key=top.get) == scored.tokens[pos]
