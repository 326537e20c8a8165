"""What OpenAI and vLLM clients expect beyond completions, on the bundled model: OpenAI
error objects for every refusal (unknown routes and methods too), GET /v1/models/{id},
and vLLM's /tokenize, /detokenize and /tokenizer_info."""

import httpx
import openai
import pytest

from jetserve.model_loading import BUNDLED_DIR

MODEL = "bundled"
PROMPT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n        x = '東京 🙂'\n"
MESSAGES = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def base(bundled_servers):
    return f"http://127.0.0.1:{bundled_servers.http_port}"


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body  # not FastAPI's {"detail": ...}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing-here", 404), ("POST", "/v1/embeddings", 404), ("GET", "/", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("PUT", "/tokenize", 405),
])
def test_unknown_routes_and_methods_answer_openai_errors(base, method, path, status):
    r = httpx.request(method, base + path, timeout=60)
    err = _openai_error(r, status)
    assert err["type"] == "invalid_request_error" and path in err["message"]
    if status == 405:
        assert "POST" in r.headers["allow"] or "GET" in r.headers["allow"]


def test_model_by_id(client, base):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    listed = httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]
    assert httpx.get(f"{base}/v1/models/{MODEL}", timeout=60).json() == listed
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found" and "gpt-4" in e.value.message


def test_tokenize_matches_transformers_and_the_completion_route(client, base):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(BUNDLED_DIR)
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                            "return_token_strs": True}, timeout=60).json()
    assert r["tokens"] == ref(PROMPT)["input_ids"]
    assert r["count"] == len(r["tokens"]) and r["token_strs"][0] == "<s>"
    assert r["token_strs"] == ref.convert_ids_to_tokens(r["tokens"])
    models = httpx.get(f"{base}/v1/models", timeout=60).json()["data"][0]
    assert r["max_model_len"] == models["max_model_len"]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"]
    bare = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                      timeout=60).json()
    assert bare["tokens"] == r["tokens"][1:] and bare["token_strs"] is None
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": r["tokens"]},
                      timeout=60).json()
    assert back == {"prompt": PROMPT}


def test_tokenize_chat_counts_what_chat_completions_sends(client, base):
    r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"] == len(r["tokens"])


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenizer_routes_refuse_bad_bodies_naming_the_field(base, path, body, field):
    err = _openai_error(httpx.post(base + path, json=body, timeout=60), 400)
    assert err["param"] == field and field in err["message"]


def test_tokenizer_info_is_the_tokenizer_config(base):
    info = httpx.get(f"{base}/tokenizer_info", timeout=60).json()
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>"
    assert info["chat_template"].startswith("{{ bos_token }}")
    assert info["tokenizer_class"] == "LlamaTokenizer" and info["add_bos_token"] is True


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_count_every_chunk(client, chat):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=MODEL, max_tokens=12, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    if chat:
        make = client.chat.completions.create
        kw.update(messages=MESSAGES)
    else:
        make = client.completions.create
        kw.update(prompt=PROMPT)
    chunks = list(make(stream_options=opts, **kw))
    final = chunks[-1].usage
    assert not chunks[-1].choices and final.completion_tokens == 12
    counted = [c.usage.completion_tokens for c in chunks[:-1] if c.choices]
    assert counted == sorted(counted) and counted[-1] == 12 and len(set(counted)) > 1
    assert {c.usage.prompt_tokens for c in chunks} == {final.prompt_tokens}
    plain = list(make(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in plain if c.choices)  # only when asked for
