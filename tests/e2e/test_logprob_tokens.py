"""Log-prob tokens as OpenAI and vLLM clients expect them, on the bundled model through
the `openai` package: each token's decoded text (joining to the choice's text), its exact
bytes, and top alternatives that never merge two ids."""

import openai
import pytest

MODEL = "bundled"
# Python with characters the model has no piece for (byte-fallback pieces).
PROMPT = "def greet(name):\n    # 東京 🙂\n    "


@pytest.fixture(scope="module")
def client(bundled_servers):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{bundled_servers.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=120)


def test_completion_tokens_are_text_joining_to_the_output(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=5)
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and choice.text
    assert not any("▁" in t for t in lp.tokens)  # text, not sentencepiece pieces
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    for top, got in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) >= 5  # five distinct alternatives, none merged (+ the sampled one)
        assert max(top.values()) == pytest.approx(got, abs=1e-5)  # greedy
    # Streamed, the tokens of the chunks join to the same text, chunk by chunk.
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert all("".join(c.logprobs.tokens) == c.text for c in chunks)


def test_echo_scores_the_prompt_as_text(client):
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0).choices[0]
    assert choice.text == PROMPT
    assert "".join(choice.logprobs.tokens) == PROMPT
    assert choice.logprobs.tokens[0] == ""  # BOS: no text
    assert "    " in choice.logprobs.tokens  # the indent, one token


def test_chat_tokens_and_exact_bytes(client):
    messages = [{"role": "user", "content": "Write 東京 🙂 in a comment."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True,
              top_logprobs=4)
    choice = client.chat.completions.create(**kw).choices[0]
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content
    assert b"".join(bytes(c.bytes) for c in content) == choice.message.content.encode()
    for c in content:
        labels = [a.token for a in c.top_logprobs]
        assert len(labels) == len(set(labels)) == 4
        if c.token and "\ufffd" not in c.token:
            assert bytes(c.bytes).decode() == c.token
    stream = client.chat.completions.create(stream=True, **kw)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(c.token, c.bytes) for c in content]
