"""The OpenAI-compatible HTTP server, called with the `openai` package (and httpx)."""

import math

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY_MODEL

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(tiny_servers):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{tiny_servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base(tiny_servers):
    return f"http://127.0.0.1:{tiny_servers.http_port}"


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [TINY_MODEL]


def test_completion_streamed_equals_non_streamed_greedy(client):
    whole = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(PROMPT.encode())  # byte tokenizer, no BOS
    assert whole.usage.completion_tokens == 24
    chunks = list(client.completions.create(
        model=TINY_MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_token_id_prompt_equals_string_prompt(client):
    kw = dict(model=TINY_MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    by_ids = client.completions.create(prompt=list(PROMPT.encode()), **kw).choices[0].text
    assert by_ids == by_text


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=16,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=TINY_MODEL, messages=messages,
                                            max_tokens=16, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client):
    kw = dict(model=TINY_MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    greedy = client.completions.create(**{**kw, "temperature": 0}).choices[0].text
    assert a == b
    # 20 draws from a near-uniform 256-way distribution: another seed, or greedy, agreeing
    # on all of them is (1/256)^20-unlikely.
    assert a != c and a != greedy


def test_n_samples_and_several_prompts(client):
    r = client.completions.create(model=TINY_MODEL, prompt=["ab", "cd"], n=2, max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: samples agree
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 20


def test_stop_string_is_cut_and_reported(client):
    kw = dict(model=TINY_MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next((ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd"), None)
    if stop is None:
        pytest.skip("the random model produced no printable character to stop on")
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def _id_of(token: str) -> int:
    """A token as `return_tokens_as_token_ids` (vLLM's) shows it: 'token_id:N'."""
    assert token.startswith("token_id:")
    return int(token.removeprefix("token_id:"))


def test_echo_logprobs_scores_the_prompt_like_generation(client):
    """Scoring prompt + greedy continuation gives the log-probs generation reported, and
    the continuation is the argmax at each position (how harnesses check is_greedy)."""
    gen = client.completions.create(model=TINY_MODEL, prompt=list(PROMPT.encode()),
                                    max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True}).choices[0]
    gen_lps = gen.logprobs.token_logprobs
    cont_ids = [_id_of(token) for token in gen.logprobs.tokens]
    ids = list(PROMPT.encode()) + cont_ids
    scored = client.completions.create(model=TINY_MODEL, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0,
                                       extra_body={"return_tokens_as_token_ids": True}
                                       ).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    for got, want in zip(lp.token_logprobs[len(PROMPT):], gen_lps, strict=True):
        assert math.isclose(got, want, abs_tol=2e-4)
    for pos in range(len(PROMPT), len(ids)):
        top = lp.top_logprobs[pos]
        assert max(top, key=top.get) == lp.tokens[pos]  # greedy continuation
    assert scored.text == PROMPT + gen.text
    assert scored.finish_reason == "length"
    # As text (the default), the same scoring's tokens join to its text.
    as_text = client.completions.create(model=TINY_MODEL, prompt=ids, max_tokens=0, echo=True,
                                        logprobs=1, temperature=0).choices[0]
    assert "".join(as_text.logprobs.tokens) == as_text.text == scored.text
    assert as_text.logprobs.token_logprobs == lp.token_logprobs


def test_echo_without_logprobs_and_zero_tokens(client):
    r = client.completions.create(model=TINY_MODEL, prompt="hello", max_tokens=0, echo=True)
    assert r.choices[0].text == "hello" and r.usage.completion_tokens == 0


def test_health_and_metrics(base, client):
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{base}/metrics").text
    for name in ("jetserve_time_to_first_token_seconds_bucket",
                 "jetserve_time_per_output_token_seconds_bucket",
                 "jetserve_e2e_request_latency_seconds_bucket", "jetserve_queue_depth",
                 "jetserve_slots_in_use", "jetserve_prompt_tokens_total",
                 "jetserve_generation_tokens_total",
                 'jetserve_requests_total{finish_reason="length"}'):
        assert name in text, name
    finished = [line for line in text.splitlines()
                if line.startswith('jetserve_requests_total{finish_reason="length"}')]
    assert float(finished[0].split()[-1]) >= 1
